"""TrainConfig: everything a training run needs, validated once when it is created.

Its fields are the run's own (model, data, optimizer, schedule, what it writes) and one per
parallel mode the binary offers, taken from tfdist.parallel.registry: a new mode's entry
adds its field here (with its default, its docstring line and its check) and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tfdist.errors import TfdistError
from tfdist.parallel import registry

OPTIMIZERS = ("sgd", "adam", "lamb")
LR_SCALING = ("none", "linear")
LR_SCHEDULES = ("constant", "cosine")
MIXED_PRECISION = ("mixed_float16", "mixed_bfloat16")


class ConfigError(TfdistError, ValueError):
    """A training configuration that cannot run; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RunConfig:
    """A training run, independent of the strategy that executes it.

    Args:
      model: 'mlp', 'cnn' or 'resnet'; `model_options` go to its builder (e.g. depth).
      dataset: 'digits', 'synthetic', 'tfds:NAME' or 'tfrecord:DIR' (the train and test
        splits tools.make_tfrecords wrote to DIR); `data_dir` is where the named ones live and
        `dataset_options` go to its preparer (synthetic: image_shape, num_examples, ...).
      skip_corrupt: drop unreadable TFRecords (counted in a warning) instead of stopping.
      global_batch_size: examples per step across all replicas (the per-replica batch is
        derived from it).
      epochs: how many epochs to train.
      steps_per_epoch: steps in an epoch; None = training examples // global batch. Any
        value gives "virtual epochs": the data simply keeps streaming.
      optimizer: 'sgd' (with `momentum`), 'adam' or 'lamb'.
      learning_rate: the base learning rate.
      lr_scaling: 'linear' multiplies it by global_batch_size / base_batch_size (the linear
        scaling rule, Goyal et al. 2017); 'none' keeps it.
      warmup_epochs: ramp the learning rate linearly from ~0 to its peak over this many
        epochs (may be fractional).
      lr_schedule: after warmup, 'constant' or 'cosine' decay to 0 at the last step.
      mixed_precision: None, 'mixed_float16' or 'mixed_bfloat16'.
      steps_per_execution: training steps run by one tf.function call, or 'auto': tfdist.fit
        measures the first calls and chooses (tfdist.training.auto_steps_per_execution).
      seed: seeds the initial weights and the data order.
      shuffle_buffer: examples in the shuffle buffer; 0 = no shuffle, a fixed data order.
      eval_every: evaluate every this many epochs (0: only at the end).
      model_dir: where checkpoints, TensorBoard logs, summary.json and the exported model go
        (None: nothing is written).
      checkpoint_every: also checkpoint every this many steps (0: at epoch ends only).
      max_checkpoints: checkpoints to keep.
      {modes}
    """

    model: str = "cnn"
    model_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dataset: str = "digits"
    dataset_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    data_dir: str | None = None
    skip_corrupt: bool = False
    global_batch_size: int = 64
    epochs: int = 10
    steps_per_epoch: int | None = None
    optimizer: str = "adam"
    learning_rate: float = 0.003
    momentum: float = 0.9
    lr_scaling: str = "none"
    base_batch_size: int = 256
    warmup_epochs: float = 0.0
    lr_schedule: str = "constant"
    mixed_precision: str | None = None
    steps_per_execution: int | str = 1
    seed: int = 0
    shuffle_buffer: int = 10_000
    eval_every: int = 1
    model_dir: str | None = None
    checkpoint_every: int = 0
    max_checkpoints: int = 3

    def __post_init__(self):
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("lr_scaling", self.lr_scaling, LR_SCALING)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if self.mixed_precision is not None:
            _choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        for problem in registry.problems(self.mode_options()):
            raise ConfigError(problem)
        names = ["global_batch_size", "epochs", "base_batch_size", "max_checkpoints"]
        if self.steps_per_execution != "auto":
            names.append("steps_per_execution")
        for name in names:
            _positive_int(name, getattr(self, name))
        if self.steps_per_epoch is not None:
            _positive_int("steps_per_epoch", self.steps_per_epoch)
        for name in ("shuffle_buffer", "eval_every", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a whole number >= 0. Received: {name}={value!r}")
        if not self.learning_rate > 0:
            raise ConfigError(
                f"learning_rate must be positive. Received: learning_rate={self.learning_rate!r}"
            )
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1). Received: momentum={self.momentum!r}")
        if self.warmup_epochs < 0 or self.warmup_epochs > self.epochs:
            raise ConfigError(
                f"warmup_epochs must be between 0 and epochs ({self.epochs}). "
                f"Received: warmup_epochs={self.warmup_epochs!r}"
            )

    def mode_options(self) -> dict[str, Any]:
        """The parallel modes' fields, as tfdist.fit's keywords."""
        return {m.keyword: getattr(self, m.keyword) for m in registry.flagged()}

    @property
    def peak_learning_rate(self) -> float:
        """The learning rate after warmup, with the linear scaling rule applied if asked."""
        if self.lr_scaling == "linear":
            return self.learning_rate * self.global_batch_size / self.base_batch_size
        return self.learning_rate


# The run's fields, then one per mode the binary offers (the registry's keyword and default).
TrainConfig = dataclasses.make_dataclass(
    "TrainConfig",
    [(m.keyword, Any, dataclasses.field(default=m.default)) for m in registry.flagged()],
    bases=(_RunConfig,),
    frozen=True,
    kw_only=True,
)
TrainConfig.__module__ = __name__
TrainConfig.__doc__ = registry.fill_docstring(_RunConfig.__doc__, modes=registry.flagged())


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}. Received: {name}={value!r}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive whole number. Received: {name}={value!r}")

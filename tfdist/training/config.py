"""TrainConfig: everything a training run needs, validated once when it is created."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tfdist.errors import TfdistError

OPTIMIZERS = ("sgd", "adam", "lamb")
LR_SCALING = ("none", "linear")
LR_SCHEDULES = ("constant", "cosine")
MIXED_PRECISION = ("mixed_float16", "mixed_bfloat16")
SHARD_CHOICES = ("zero1", "zero2")
ASYNC_CORRECTION_CHOICES = ("dc", "momentum")
GOSSIP_CHOICES = ("ring", "exponential")


class ConfigError(TfdistError, ValueError):
    """A training configuration that cannot run; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
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
      steps_per_execution: training steps run by one tf.function call.
      seed: seeds the initial weights and the data order.
      shuffle_buffer: examples in the shuffle buffer; 0 = no shuffle, a fixed data order.
      eval_every: evaluate every this many epochs (0: only at the end).
      model_dir: where checkpoints, TensorBoard logs, summary.json and the exported model go
        (None: nothing is written).
      checkpoint_every: also checkpoint every this many steps (0: at epoch ends only).
      max_checkpoints: checkpoints to keep.
      staleness_aware_lr: parameter-server training only: divide each update's learning
        rate by max(1, its staleness), the number of updates that reached the parameters
        between the worker's read and its write (Zhang et al., 2016).
      shard_optimizer: None, 'zero1' or 'zero2': shard the optimizer's state (and with
        zero2 the gradients) over the replicas (tfdist.parallel.zero).
      accumulate_steps: split each replica's batch into this many micro-batches, one
        exchange per step (tfdist.parallel.accumulate).
      async_correction: parameter-server training only: None, 'dc' (delay-compensated
        gradients) or 'momentum' (SGD's momentum lowered by asynchrony's own).
      max_staleness: parameter-server training only: no update more than this many updates
        stale (None: unbounded).
      average_every: synchronous strategies: local SGD, the replicas' weights averaged
        every this many local steps (None: every step's gradients are all-reduced).
      gossip: synchronous strategies: None, 'ring' or 'exponential': gossip SGD.
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
    steps_per_execution: int = 1
    seed: int = 0
    shuffle_buffer: int = 10_000
    eval_every: int = 1
    model_dir: str | None = None
    checkpoint_every: int = 0
    max_checkpoints: int = 3
    staleness_aware_lr: bool = False
    shard_optimizer: str | None = None
    accumulate_steps: int = 1
    async_correction: str | None = None
    max_staleness: int | None = None
    average_every: int | None = None
    gossip: str | None = None

    def __post_init__(self):
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("lr_scaling", self.lr_scaling, LR_SCALING)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if self.mixed_precision is not None:
            _choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        for name, choices in (
            ("shard_optimizer", SHARD_CHOICES),
            ("async_correction", ASYNC_CORRECTION_CHOICES),
            ("gossip", GOSSIP_CHOICES),
        ):
            if getattr(self, name) is not None:
                _choice(name, getattr(self, name), choices)
        if self.average_every is not None:
            _positive_int("average_every", self.average_every)
        if self.max_staleness is not None and (
            not isinstance(self.max_staleness, int) or self.max_staleness < 0
        ):
            raise ConfigError(
                f"max_staleness must be a whole number >= 0. Received: {self.max_staleness!r}"
            )
        for name in (
            "global_batch_size",
            "epochs",
            "steps_per_execution",
            "base_batch_size",
            "max_checkpoints",
            "accumulate_steps",
        ):
            _positive_int(name, getattr(self, name))
        if self.steps_per_epoch is not None:
            _positive_int("steps_per_epoch", self.steps_per_epoch)
        for name in ("shuffle_buffer", "eval_every", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a whole number >= 0. Received: {name}={value!r}")
        if not isinstance(self.staleness_aware_lr, bool):
            raise ConfigError(
                "staleness_aware_lr must be True or False. "
                f"Received: staleness_aware_lr={self.staleness_aware_lr!r}"
            )
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

    @property
    def peak_learning_rate(self) -> float:
        """The learning rate after warmup, with the linear scaling rule applied if asked."""
        if self.lr_scaling == "linear":
            return self.learning_rate * self.global_batch_size / self.base_batch_size
        return self.learning_rate


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}. Received: {name}={value!r}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive whole number. Received: {name}={value!r}")

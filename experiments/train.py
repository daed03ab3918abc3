"""Train a Keras model under any tf.distribute strategy: the tfdist training binary.

  # the README's main job: 2 worker processes, synchronous, digits TFRecords
  tfdist-launch --workers 2 -- python -m experiments.train --strategy=multi_worker_mirrored

  # one host, 2 logical CPUs; parameter-server training with a chief, 2 workers and a ps
  python -m experiments.train --strategy=mirrored --num_cpu_devices=2
  tfdist-launch --chief --workers 2 --ps 1 -- python -m experiments.train --strategy=parameter_server

  # with an evaluator task that evaluates each checkpoint beside training (model_dir/eval.jsonl)
  tfdist-launch --workers 2 --evaluator -- python -m experiments.train --model_dir=/tmp/run

  # a recipe from experiments/configs/ (flags given on the command line still win)
  python -m experiments.train --config=digits_cnn

Run on every task of a job with the same command: in a parameter-server cluster the worker
and ps tasks serve until the chief is done. The chief prints the final line
"final: ... test accuracy 0.9xx" and writes model_dir/summary.json.
"""

from __future__ import annotations

from tfdist import signals

if __name__ == "__main__":
    # Before TensorFlow starts a thread, so SIGTERM ends this task at any moment (tfdist/signals.py).
    signals.route_stop_signals()

import dataclasses  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import tfdist  # noqa: E402
from experiments import common  # noqa: E402
from experiments.configs import CONFIGS  # noqa: E402
from tfdist import strategy_kinds as kinds  # noqa: E402
from tfdist.app import TrainConfig, Trainer  # noqa: E402
from tfdist.app.config import (  # noqa: E402
    LR_SCALING,
    LR_SCHEDULES,
    MIXED_PRECISION,
    OPTIMIZERS,
)
from tfdist.app.evaluator import EvaluatorTimeoutError, evaluate_checkpoints  # noqa: E402
from tfdist.data import dataset_names  # noqa: E402
from tfdist.models import model_names  # noqa: E402
from tfdist.parallel import registry  # noqa: E402
from tfdist.peers import lost_peers_explained  # noqa: E402
from tfdist.strategies.defaults import (  # noqa: E402
    AUTO,
    TPU_STEPS_PER_EXECUTION,
    auto_mixed_precision,
    auto_steps_per_execution,
)
from tfdist.strategies.tpu import runs_on_tpu  # noqa: E402
from tfdist.training.runners import describe_mode_default, mode_defaults  # noqa: E402

log = logging.getLogger("tfdist.train")
_STRATEGY_NAMES = [kinds.AUTO, *kinds.NAMES]
_DEFAULTS = TrainConfig()

# What it trains.
flags.DEFINE_string(
    "config",
    None,
    f"An experiment recipe from experiments/configs: {', '.join(CONFIGS)}. Flags given explicitly override it.",
)
flags.DEFINE_string("dataset", _DEFAULTS.dataset, f"Dataset: {', '.join(dataset_names())}.")
flags.DEFINE_string(
    "data_dir",
    None,
    "Where datasets live (the digits and images:DIR folders are written there as TFRecords on first use; TFDS data must be prepared there). Default: $TFDIST_DATA_DIR or ~/.cache/tfdist.",
)
flags.DEFINE_bool(
    "skip_corrupt",
    False,
    "Train on the readable records of a damaged TFRecord file (the unreadable ones are "
    "counted in a warning) instead of stopping with an error.",
)
flags.DEFINE_list(
    "synthetic_shape",
    ["32", "32", "3"],
    "Image shape of --dataset=synthetic: height,width,channels.",
)
flags.DEFINE_integer(
    "synthetic_examples", 4096, "Training examples of --dataset=synthetic.", lower_bound=1
)
flags.DEFINE_enum(
    "model", _DEFAULTS.model, model_names(), "Model: mlp, cnn, or a CIFAR-style resnet."
)
flags.DEFINE_integer("resnet_depth", 20, "Depth of --model=resnet (6n+2: 20, 32, 44, 56, 110).")
# How it trains.
flags.DEFINE_integer(
    "global_batch_size",
    _DEFAULTS.global_batch_size,
    "Examples per step across all replicas; must divide by the replicas.",
    lower_bound=1,
)
flags.DEFINE_integer("epochs", _DEFAULTS.epochs, "Epochs to train.", lower_bound=1)
flags.DEFINE_integer(
    "steps_per_epoch",
    None,
    "Steps per (virtual) epoch. Default: training examples // global batch.",
    lower_bound=1,
)
flags.DEFINE_enum(
    "optimizer",
    _DEFAULTS.optimizer,
    list(OPTIMIZERS),
    "Optimizer: sgd (with --momentum), adam, or lamb for very large batches.",
)
flags.DEFINE_float("learning_rate", _DEFAULTS.learning_rate, "Base learning rate.")
flags.DEFINE_float("momentum", _DEFAULTS.momentum, "Momentum of --optimizer=sgd.")
flags.DEFINE_enum(
    "lr_scaling",
    _DEFAULTS.lr_scaling,
    list(LR_SCALING),
    "'linear': multiply the learning rate by global_batch_size / --base_batch_size (Goyal et al., 2017).",
)
flags.DEFINE_integer(
    "base_batch_size",
    _DEFAULTS.base_batch_size,
    "The batch size --learning_rate is meant for, under --lr_scaling=linear.",
    lower_bound=1,
)
flags.DEFINE_float(
    "warmup_epochs",
    _DEFAULTS.warmup_epochs,
    "Ramp the learning rate up linearly over this many epochs.",
)
flags.DEFINE_enum(
    "lr_schedule",
    _DEFAULTS.lr_schedule,
    list(LR_SCHEDULES),
    "After warmup: constant, or cosine decay to 0.",
)
flags.DEFINE_enum(
    "mixed_precision",
    AUTO,
    [AUTO, "none", *MIXED_PRECISION],
    "Compute in float16 or bfloat16, keep float32 variables. 'auto': mixed_bfloat16 on a "
    "TPU, none (float32) elsewhere.",
)
flags.DEFINE_string(
    "steps_per_execution",
    AUTO,
    f"Training steps per tf.function call. 'auto': {TPU_STEPS_PER_EXECUTION} on a TPU (each "
    "call is a round trip to the TPU's host); elsewhere measured on the first calls, then "
    "the count that keeps a call's fixed cost near 5% of it (1 under parameter_server).",
)
flags.register_validator(
    "steps_per_execution",
    lambda value: value == AUTO or (value.isdigit() and int(value) >= 1),
    message="--steps_per_execution must be 'auto' or a positive whole number.",
)


# The parallel modes, one flag per entry of tfdist/parallel/registry.py ("Which exchange for
# which cluster" in the README compares them).
def _define_mode_flags() -> None:
    for mode in registry.flagged():
        name, value = mode.keyword, mode.value
        text = (mode.help or mode.summary).replace("{auto}", describe_mode_default(name))
        if isinstance(value, registry.Switch):
            flags.DEFINE_bool(name, mode.default, text)
        elif isinstance(value, registry.Choice):
            words = ["none", *value.choices, *([AUTO] if mode.auto else [])]
            default = AUTO if mode.auto else (mode.default or "none")
            flags.DEFINE_enum(name, default, words, text)
        elif isinstance(value, registry.Options):  # "name=value,name=value"
            flags.DEFINE_string(name, None, f"{text} Takes {value.describe()}, as name=value,...")
            flags.register_validator(
                name,
                lambda raw, mode=mode: raw is None or mode.value.problem(mode.keyword, raw) is None,
                message=f"--{name} takes {value.describe()}, as name=value,... (e.g. "
                f"--{name}={','.join(f'{k}=1' for k in value.fields)}).",
            )
        elif mode.auto:  # a number, 'none' or 'auto': resolved once the strategy is built
            flags.DEFINE_string(name, AUTO, text)
            flags.register_validator(
                name,
                lambda raw, mode=mode: (
                    raw in (AUTO, "none") or mode.value.problem(mode.keyword, _number(raw)) is None
                ),
                message=f"--{name} must be 'auto', 'none' or {value.describe()}.",
            )
        elif value.whole:
            flags.DEFINE_integer(name, mode.default, text, lower_bound=int(value.minimum))
        else:
            flags.DEFINE_float(name, mode.default, text, lower_bound=value.minimum)


def _number(raw: str) -> int | float | str:
    """A flag's text as the number it spells (the text itself if none)."""
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


_define_mode_flags()
flags.DEFINE_integer("seed", _DEFAULTS.seed, "Seed of the initial weights and the data order.")
flags.DEFINE_integer(
    "shuffle_buffer",
    _DEFAULTS.shuffle_buffer,
    "Shuffle buffer in examples; 0 = no shuffle, a fully deterministic order.",
    lower_bound=0,
)
flags.DEFINE_integer(
    "eval_every",
    _DEFAULTS.eval_every,
    "Evaluate on the test split every N epochs (0: only at the end).",
    lower_bound=0,
)
# What it writes.
flags.DEFINE_string(
    "model_dir",
    None,
    "Checkpoints, TensorBoard logs, summary.json and export/model.keras go here; a re-run resumes from its last checkpoint. Default: write nothing.",
)
flags.DEFINE_integer(
    "checkpoint_every",
    _DEFAULTS.checkpoint_every,
    "Also checkpoint every N steps (0: at epoch ends only).",
    lower_bound=0,
)
# The evaluator task (tfdist-launch --evaluator).
flags.DEFINE_float(
    "eval_poll_seconds",
    2.0,
    "Evaluator task: seconds between looks for a new checkpoint.",
    lower_bound=0.01,
)
flags.DEFINE_float(
    "eval_timeout",
    3600.0,
    "Evaluator task: fail (exit 1) after this many seconds without a new checkpoint.",
    lower_bound=0.01,
)
flags.DEFINE_string(
    "save_weights_to",
    None,
    "Every training task writes its final weights to DIR/<task>.npz, e.g. to check that all workers agree.",
)

FLAGS = flags.FLAGS
# Flags whose 'auto' depends on the hardware, resolved once the strategy is built (a mode's
# 'auto' is its runner's default: mode_defaults).
_AUTO_RESOLVERS = {
    # Off a TPU, 'auto' is tfdist.fit's: it measures the first calls, then chooses.
    "steps_per_execution": lambda strategy: (
        auto_steps_per_execution(strategy) if runs_on_tpu(strategy) else AUTO
    ),
    "mixed_precision": auto_mixed_precision,
}
# Flags that map one to one onto TrainConfig fields.
_CONFIG_FLAGS = [
    "dataset", "data_dir", "model", "global_batch_size", "epochs", "steps_per_epoch", "optimizer",
    "learning_rate", "momentum", "lr_scaling", "base_batch_size", "warmup_epochs", "lr_schedule",
    "mixed_precision", "steps_per_execution", "seed", "shuffle_buffer", "eval_every", "model_dir",
    "checkpoint_every", "skip_corrupt",
    *(mode.keyword for mode in registry.flagged()),
]  # fmt: skip


def train_config(strategy: tf.distribute.Strategy | None = None) -> TrainConfig:
    """The TrainConfig the flags (over an optional --config recipe) describe.

    'auto' values are resolved for `strategy`; without one (to validate the flags before the
    strategy exists) they take TrainConfig's defaults.
    """
    values = dict(CONFIGS[FLAGS.config].get_config()) if FLAGS.config else {}
    for name in _CONFIG_FLAGS:
        if FLAGS[name].present or name not in values:
            values[name] = FLAGS[name].value
    for name, resolve in _AUTO_RESOLVERS.items():
        if values[name] == AUTO:
            values[name] = getattr(_DEFAULTS, name) if strategy is None else resolve(strategy)
    if values["mixed_precision"] == "none":
        values["mixed_precision"] = None
    if values["steps_per_execution"] != AUTO:
        values["steps_per_execution"] = int(values["steps_per_execution"])
    defaults = {} if strategy is None else mode_defaults(strategy)
    for mode in registry.flagged():
        raw = values[mode.keyword]
        if raw == AUTO:
            continue  # resolved below, once every mode's value is known
        if raw == "none":
            values[mode.keyword] = None
        elif isinstance(raw, str) and isinstance(mode.value, registry.Options):
            values[mode.keyword] = mode.value.parse(raw)
        elif isinstance(raw, str) and not isinstance(mode.value, registry.Choice):
            values[mode.keyword] = _number(raw)
    values.update(registry.resolve_auto(values, defaults))
    if values["model"] == "resnet":
        values.setdefault("model_options", {"depth": FLAGS.resnet_depth})
    if values["dataset"] == "synthetic":
        shape = tuple(int(d) for d in FLAGS.synthetic_shape)
        values.setdefault(
            "dataset_options", {"image_shape": shape, "num_examples": FLAGS.synthetic_examples}
        )
    return TrainConfig(**values)


def save_weights(model, directory: str, name: str) -> None:
    os.makedirs(directory, exist_ok=True)
    np.savez(os.path.join(directory, f"{name}.npz"), *model.get_weights())


EXIT_EVAL_TIMEOUT = 1


def evaluate_beside_training(config: TrainConfig, argv: list[str]) -> None:
    """The evaluator task: evaluates the training tasks' checkpoints until their last one.

    It builds no strategy from --strategy: the evaluator never joins the training cluster.
    """
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    common.setup_logging()
    try:
        records = evaluate_checkpoints(
            config, poll_seconds=FLAGS.eval_poll_seconds, timeout_seconds=FLAGS.eval_timeout
        )
    except EvaluatorTimeoutError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_EVAL_TIMEOUT)
    if records:
        print(
            f"evaluated {len(records)} checkpoint(s); the last, step {records[-1].step}: "
            f"test accuracy {records[-1].eval_accuracy:.4f}",
            flush=True,
        )


def main(argv: list[str]) -> None:
    if FLAGS.config and FLAGS.config not in CONFIGS:
        raise app.UsageError(f"Unknown --config={FLAGS.config}. Valid: {', '.join(CONFIGS)}")
    config = train_config()  # validated before anything slow happens
    cluster = tfdist.cluster_from_environment()
    if cluster is not None:
        signals.set_name(cluster.task_name)
    if cluster is not None and cluster.is_evaluator:
        evaluate_beside_training(config, argv)
        return
    started = common.start_task(argv)
    if started is None:
        return
    cluster, strategy = started
    config = train_config(strategy)
    log.info(
        "steps_per_execution %s, mixed precision %s",
        config.steps_per_execution, config.mixed_precision or "none (float32)",
    )  # fmt: skip
    with (
        signals.doing("preparing the data and the model"),
        # The chief may stop here (a model_dir it cannot write): its peers say so in a line.
        lost_peers_explained(cluster, when="while this task prepared the data and the model"),
    ):
        trainer = Trainer(config, strategy=strategy, cluster=cluster)
    result = trainer.fit()
    if FLAGS.save_weights_to:
        save_weights(
            trainer.model,
            FLAGS.save_weights_to,
            cluster.task_name.replace(":", "_") if cluster else "local",
        )
    if cluster is None or cluster.is_chief:
        figure = lambda value, spec: "n/a" if value is None else format(value, spec)  # noqa: E731
        print(
            f"final: {result.strategy}, {result.replicas} replica(s), {result.steps} steps of "
            f"{result.global_batch_size}: train loss {figure(result.train_loss, '.4f')}, test "
            f"accuracy {figure(result.eval_accuracy, '.4f')}, "
            f"{figure(result.examples_per_second, '.0f')} examples/s, "
            f"{result.wall_seconds:.1f} s",
            flush=True,
        )
        log.debug("%s", dataclasses.asdict(result))
    sys.stdout.flush()


if __name__ == "__main__":
    common.run(main)

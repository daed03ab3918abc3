"""Smoke job: build a strategy and run a few real distributed training steps with it.

It proves a strategy works on the hardware present, end to end, in seconds. Run it alone for
the strategies of one host, or on every task of a cluster through the launcher:

  python -m experiments.smoke --strategy=mirrored --num_cpu_devices=2
  python -m tools.launch --workers 2 -- python -m experiments.smoke --strategy=multi_worker_mirrored
  python -m tools.launch --chief --workers 2 --ps 1 -- python -m experiments.smoke --strategy=parameter_server

Each training task prints one line "SMOKE_RESULT {json}" with its losses and final weights;
with the same --seed every synchronous strategy ends with the weights of one_device.
"""

from __future__ import annotations

import dataclasses
import json

from absl import app, flags

import tfdist
from experiments import common
from tfdist.strategies import ALL_REDUCE_CHOICES, COLLECTIVE_CHOICES
from tfdist.training import run_smoke_steps

_STRATEGY = flags.DEFINE_string(
    "strategy", "auto", f"Strategy to build: {', '.join(tfdist.strategy_names())}."
)
_NUM_CPU_DEVICES = flags.DEFINE_integer(
    "num_cpu_devices", 1, "Split the host CPU into this many logical devices (1 = whole CPU)."
)
_ALL_REDUCE = flags.DEFINE_enum(
    "all_reduce", None, list(ALL_REDUCE_CHOICES), "Gradient all-reduce of 'mirrored'."
)
_COLLECTIVE = flags.DEFINE_enum(
    "collective", "auto", list(COLLECTIVE_CHOICES), "Collective implementation of multi-worker."
)
_COLLECTIVE_TIMEOUT = flags.DEFINE_float(
    "collective_timeout",
    None,
    "Seconds a multi-worker collective waits for peers (default: forever).",
)
_TPU = flags.DEFINE_string("tpu", None, "TPU to use: 'local', a TPU name or grpc://host:8470.")
_STEPS = flags.DEFINE_integer("steps", 3, "Training steps to run.", lower_bound=1)
_GLOBAL_BATCH_SIZE = flags.DEFINE_integer(
    "global_batch_size", 16, "Examples per step across all replicas.", lower_bound=1
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data and the initial weights.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    common.setup_logging()
    cluster = tfdist.parse_tf_config()
    if tfdist.serve_if_needed(cluster):
        return
    if _NUM_CPU_DEVICES.value > 1:
        tfdist.configure_cpu_devices(_NUM_CPU_DEVICES.value)
    # Only the options the user set, so build_strategy can flag those that don't apply.
    options = {
        "all_reduce": _ALL_REDUCE.value,
        "collective": _COLLECTIVE.value if _COLLECTIVE.present else None,
        "collective_timeout": _COLLECTIVE_TIMEOUT.value,
        "tpu": _TPU.value,
    }
    strategy = tfdist.build_strategy(
        _STRATEGY.value, cluster=cluster, **{k: v for k, v in options.items() if v is not None}
    )
    result = run_smoke_steps(
        strategy, steps=_STEPS.value, global_batch_size=_GLOBAL_BATCH_SIZE.value, seed=_SEED.value
    )
    losses = ", ".join(f"{loss:.4f}" for loss in result.losses)
    print(
        f"{result.strategy}: {result.replicas} replica(s), {len(result.losses)} steps of "
        f"{result.global_batch_size} examples in {result.seconds:.2f} s; losses {losses}",
        flush=True,
    )
    print("SMOKE_RESULT " + json.dumps(dataclasses.asdict(result)), flush=True)


if __name__ == "__main__":
    app.run(common.friendly_errors(main))

"""Smoke job: build a strategy and run a few real distributed training steps with it.

It proves a strategy works on the hardware present, end to end, in seconds. Run it alone for
the strategies of one host, or on every task of a cluster through the launcher:

  python -m experiments.smoke --strategy=mirrored --num_cpu_devices=2
  tfdist-launch --workers 2 -- python -m experiments.smoke --strategy=multi_worker_mirrored
  tfdist-launch --chief --workers 2 --ps 1 -- python -m experiments.smoke --strategy=parameter_server

Each training task prints one line "SMOKE_RESULT {json}" with its losses and final weights;
with the same --seed every synchronous strategy ends with the weights of one_device.
"""

from __future__ import annotations

from tfdist.signals import route_stop_signals

if __name__ == "__main__":
    # Before TensorFlow starts a thread, so SIGTERM ends this task at any moment (tfdist/signals.py).
    route_stop_signals()

import dataclasses  # noqa: E402
import json  # noqa: E402

from absl import flags  # noqa: E402

from experiments import common  # noqa: E402
from tfdist.strategies.smoke import run_smoke_steps  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 3, "Training steps to run.", lower_bound=1)
_GLOBAL_BATCH_SIZE = flags.DEFINE_integer(
    "global_batch_size", 16, "Examples per step across all replicas.", lower_bound=1
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data and the initial weights.")


def main(argv: list[str]) -> None:
    started = common.start_task(argv)
    if started is None:
        return
    _, strategy = started
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
    common.run(main)

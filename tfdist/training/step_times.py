"""Where a training step's time goes: waiting for input, compute, and gradient exchange.

The runners mark each training step's phases in its graph with `tf.timestamp()` (see
runners/sync.py and steps.StepClock; runners/stateless.py's StepMarks for central_storage
and parameter_server), so these are measured as the steps ran:

  input     from asking for the batch to having it on the replica (the input pipeline, and
            the copy to the device; with data of unknown length, the workers' agreement on
            whether there is one more batch; under parameter_server, the worker's own copy
            of the data);
  compute   the forward and backward passes, and the metric updates;
  exchange  from the gradients being ready to the weights having their new values: the
            all-reduce across replicas and workers (waiting for the slowest one included),
            then the optimizer's update; under central_storage, the reduction to the
            variables' device and the update there; under parameter_server, the push of a
            worker's gradients to the ps and the update there (no waiting on other workers).

A model's own train_step is timed too, except where it runs a step a call: on data of unknown
length under a synchronous strategy, and always under central_storage.

With several steps a call (steps_per_execution) on data of known length, a synchronous
strategy times each call's last step: the breakdown is a sample of one step a call, and the
other steps run without the marks (their control edges cost a small step more than they tell).

If adding workers makes `exchange` grow faster than `compute` shrinks, they do not help.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

PHASES = ("input", "compute", "exchange")


class StepTimes:
    """Seconds spent in each phase, summed over an epoch's timed steps."""

    def __init__(self):
        self.steps = 0
        self.seconds = np.zeros(len(PHASES))

    def add(self, steps: int, seconds) -> None:
        self.steps += int(steps)
        self.seconds += np.asarray(seconds, dtype=np.float64)

    def per_step(self) -> dict[str, float] | None:
        """Milliseconds per step in each phase, or None when no step was timed."""
        if not self.steps:
            return None
        return {
            phase: 1e3 * float(value) / self.steps
            for phase, value in zip(PHASES, self.seconds, strict=True)
        }


def describe(times: dict[str, float]) -> str:
    """'step 12.1 ms: input 0.3 ms (2%), compute 8.0 ms (66%), exchange 3.8 ms (31%)'."""
    total = sum(times.values())
    parts = ", ".join(
        f"{phase} {times[phase]:.2f} ms ({100 * times[phase] / max(total, 1e-12):.0f}%)"
        for phase in PHASES
    )
    return f"step {total:.2f} ms: {parts}"

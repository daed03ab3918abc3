"""steps_per_execution='auto': as many steps per call as make a call's fixed cost small.

A call of `tfdist.fit` runs k steps in one traced loop, then returns to Python for the
callbacks, the logs and, about once a second across processes, a preemption vote. That
return costs about the same whatever k is; for a small model it can cost as much as a step.
`AutoStepsPerExecution` measures both on the run's first calls, which train as usual: calls
of `PROBE` and `LONG` steps in turn (the first traces the loop and is not counted; an
epoch's end or a checkpoint may cut a call shorter, and it still counts). A call is timed
from its start to the next one's, so that whatever the loop does between calls (callbacks,
votes, the logs) is in its fixed cost. A line through the fastest call of each length,
t(n) = c + n s, gives the fixed cost c and a step's time s; the chosen k makes c at most
`TARGET_OVERHEAD` of a call (a fixed cost too small to measure takes `PROBE`):

    k = ceil(c / (TARGET_OVERHEAD * s)), between 1 and `LIMIT`

Every lockstep worker must run calls of the same length (a call's steps are collectives), so
the chief's choice is every worker's (one tally at the choice).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

AUTO = "auto"
PROBE = 16
# The other probe, longer: a call's time grows less than linearly with its steps where
# workers step in lockstep (2 processes on this machine: 5.8 ms a step between 2 and 8
# steps, 4.2 between 8 and 16, 3.9 beyond), so the line is drawn where the chosen count
# will run, not below it: probing 8 and 16, the fixed cost read 1-10 ms where 13 ms holds,
# and the count chosen ran at 0.85 of a compiled loop's 16 (tools/train_bench.py).
LONG = 2 * PROBE
# The probing calls' lengths, in turn; the first traces the loop and is not counted. 112
# steps in all: an epoch of 128 ends its probing (more pairs measured no better across
# processes, and ran the probe's short calls into the epochs after).
SCHEDULE = (PROBE, *(LONG, PROBE) * 2)
TARGET_OVERHEAD = 0.05
LIMIT = 512


@dataclasses.dataclass
class AutoStepsPerExecution:
    """The next call's length while probing, then the chosen one (see the module).

    Args:
      agree: sums a list of ints over the lockstep workers (the runner's `tally`).
      is_chief: whether this process's measurements decide.
      say: logs the length chosen (log.info; fit's verbose=0 passes log.debug).
    """

    agree: Callable[[list[int]], list[int]]
    is_chief: bool
    say: Callable[..., None] = log.info
    chosen: int | None = None
    _calls: list[tuple[int, float]] = dataclasses.field(default_factory=list)

    def length(self) -> int:
        if self.chosen is not None:
            return self.chosen
        return SCHEDULE[min(len(self._calls), len(SCHEDULE) - 1)]

    def observe(self, steps: int, seconds: float) -> None:
        """What the last call ran (`steps` of them) in `seconds`."""
        if self.chosen is not None:
            return
        self._calls.append((steps, seconds))
        if len(self._calls) >= len(SCHEDULE):
            self._choose()

    def _choose(self) -> None:
        by_length: dict[int, list[float]] = {}
        for steps, seconds in self._calls[1:]:  # the first traced the loop
            by_length.setdefault(steps, []).append(seconds)
        # The fastest call of each length: another process's burst only ever slows one.
        points = sorted((n, min(t)) for n, t in by_length.items())
        if len(points) < 2:  # every call cut to one length: longer ones never run here
            fixed, step, mine = 0.0, 0.0, points[0][0]
        else:
            lengths, times = zip(*points, strict=True)
            step, fixed = (float(v) for v in np.polyfit(lengths, times, 1))
            step = max(step, 1e-9)
            if fixed <= 0:  # too small to measure here: a probe's length costs nothing
                fixed, mine = 0.0, PROBE
            else:
                ratio = round(fixed / (TARGET_OVERHEAD * step), 6)  # a fit's rounding
                mine = min(LIMIT, max(1, math.ceil(ratio)))
        self.chosen = self.agree([mine if self.is_chief else 0])[0]
        if self.is_chief:
            self.say(
                "steps_per_execution='auto': a call costs %.2f ms beyond its steps of %.2f ms "
                "each; running %d step(s) a call (the fixed cost %.1f%% of a call)",
                1e3 * fixed, 1e3 * step, self.chosen,
                100 * fixed / max(fixed + self.chosen * step, 1e-12),
            )  # fmt: skip


def every_step_needed(callbacks: Sequence) -> list[str]:
    """The callbacks whose batch hooks need every step (names): 'auto' keeps one step a call
    for them. tfdist's own callbacks say when a call must end (`steps_until_due`)."""
    from tfdist.training.fit_callbacks import hooks_batches  # keras: imported when used

    return [
        type(c).__name__
        for c in callbacks
        if hooks_batches(c) and not callable(getattr(c, "steps_until_due", None))
    ]

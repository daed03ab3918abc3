"""steps_per_execution='auto': as many steps per call as make a call's fixed cost small.

A call of `tfdist.fit` runs k steps in one traced loop, then returns to Python for the
callbacks, the logs and a preemption vote. That return costs about the same whatever k is;
for a small model it can cost as much as a step. `AutoCallLength` measures both on the run's
first steps, which train as usual: calls of one step (the first traces it), then two calls of
up to `PROBE` steps (the first traces the loop; an epoch's end or a checkpoint may cut them
to P steps), and then chooses the k that makes the fixed cost at most `TARGET_OVERHEAD` of a
call:

    t1 = c + s,   tP = c + P s   =>   c = (P t1 - tP) / (P - 1),   s = t1 - c
    k  = ceil(c / (TARGET_OVERHEAD * s)), between 1 and `LIMIT`

Every lockstep worker must run calls of the same length (a call's steps are collectives), so
the chief's choice is every worker's (one tally at the choice).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

AUTO = "auto"
PROBE = 16  # steps in each of the two probing calls
SINGLE_CALLS = 4  # calls of one step first (the first traces the step)
TARGET_OVERHEAD = 0.05
LIMIT = 512


@dataclasses.dataclass
class AutoCallLength:
    """The next call's length while probing, then the chosen one (see the module).

    Args:
      agree: sums a list of ints over the lockstep workers (the runner's `tally`).
      is_chief: whether this process's measurements decide.
    """

    agree: Callable[[list[int]], list[int]]
    is_chief: bool
    chosen: int | None = None
    _singles: list[float] = dataclasses.field(default_factory=list)
    _probes: list[tuple[int, float]] = dataclasses.field(default_factory=list)

    def length(self) -> int:
        if self.chosen is not None:
            return self.chosen
        return 1 if len(self._singles) < SINGLE_CALLS else PROBE

    def observe(self, steps: int, seconds: float) -> None:
        """What the last call ran (`steps` of them, fewer at an epoch's end) in `seconds`."""
        if self.chosen is not None:
            return
        if len(self._singles) < SINGLE_CALLS:
            if steps == 1:
                self._singles.append(seconds)
            return
        if steps > 1:  # a probe (cut short at an epoch's end or a checkpoint, it still counts)
            self._probes.append((steps, seconds))
        if len(self._probes) == 2:
            self._choose()

    def _choose(self) -> None:
        one = statistics.median(self._singles[1:])  # the first traced the step
        steps, probe = self._probes[1]  # the first traced the loop
        fixed = max(0.0, (steps * one - probe) / (steps - 1))
        step = max(one - fixed, 1e-9)
        mine = min(LIMIT, max(1, math.ceil(fixed / (TARGET_OVERHEAD * step))))
        self.chosen = self.agree([mine if self.is_chief else 0])[0]
        if self.is_chief:
            log.info(
                "steps_per_execution='auto': a call costs %.2f ms beyond its steps of %.2f ms "
                "each; running %d step(s) a call (the fixed cost %.1f%% of a call)",
                1e3 * fixed, 1e3 * step, self.chosen,
                100 * fixed / (fixed + self.chosen * step),
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

"""Pipeline schedules: the order in which each stage runs its micro-batches' passes.

A model cut into S stages trains a batch as M micro-batches. Stage s runs the forward pass
of micro-batch m after stage s-1 has (its input is their output) and the backward pass after
stage s+1 has (its gradient comes back from there); the last stage's backward follows its
own forward. A schedule gives each stage the order of its 2M passes:

- GPipe (Huang et al., 2019): every forward, then every backward. Each stage holds all M
  micro-batches' activations at once, and the idle share of a step, the bubble, is
  (S-1)/(M+S-1) when a backward takes as long as a forward.
- 1F1B (PipeDream-Flush; Narayanan et al., 2021): stage s runs S-s-1 forwards to fill the
  pipe, then alternates one forward and one backward, then drains the backwards. The
  bubble is the same, but a stage holds at most S-s micro-batches' activations, not M.
- Interleaved 1F1B (the same paper, section 2.2): the model is cut into S*v stages and
  device d holds v of them, the chunks d, d+S, d+2S, ... A pass of chunk c on device d is
  the pass of stage c*S + d. Each device runs its chunks' passes in 1F1B order, S
  micro-batches of one chunk before moving to the next, so the pipe fills v times faster:
  the bubble falls to (S-1)/(v*M + S-1) of the step, (S-1)/(v*M) of the work, for M a
  multiple of S (as Megatron-LM requires), at the cost of v times the sends.

`simulate` runs a schedule against the dependencies with given pass times and reports
the step's length, the bubble and the activations each stage held at most: the numbers a
pipeline runner is measured against, and a cost model's building block.

Example:

    >>> plan = schedule("1f1b", stages=4, micro_batches=8)
    >>> [str(p) for p in plan[3][:4]]
    ['F0', 'B0', 'F1', 'B1']
    >>> round(simulate(plan).bubble, 4) == round(bubble_formula(4, 8), 4)
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass of one micro-batch on a device: forward ('F') or backward ('B'), of its
    chunk `chunk` (0 but in the interleaved schedule: the stage chunk * S + device)."""

    kind: str
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f"c{self.chunk}" if self.chunk else "")


def gpipe(stages: int, micro_batches: int) -> list[list[Pass]]:
    """Every stage: all forwards in order, then all backwards in reverse order."""
    _check(stages, micro_batches)
    forwards = [Pass("F", m) for m in range(micro_batches)]
    backwards = [Pass("B", m) for m in reversed(range(micro_batches))]
    return [forwards + backwards for _ in range(stages)]


def one_f_one_b(stages: int, micro_batches: int) -> list[list[Pass]]:
    """Stage s: S-s-1 warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards; micro-batches in order in both directions."""
    _check(stages, micro_batches)
    plans = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, micro_batches)
        plan = [Pass("F", m) for m in range(warmup)]
        forward, backward = warmup, 0
        while forward < micro_batches:
            plan += [Pass("F", forward), Pass("B", backward)]
            forward, backward = forward + 1, backward + 1
        plan += [Pass("B", m) for m in range(backward, micro_batches)]
        plans.append(plan)
    return plans


def interleaved(stages: int, micro_batches: int, chunks: int) -> list[list[Pass]]:
    """Device d (of S): its v chunks' passes in 1F1B order (Megatron-LM's interleaved
    schedule). The k-th forward is of chunk (k // S) % v and micro-batch
    (k // (S v)) S + k % S; the k-th backward of the chunks in reverse. The warm-up is
    (S - d - 1) 2 + (v - 1) S forwards."""
    _check(stages, micro_batches, chunks)
    if micro_batches % stages:
        raise ValueError(
            f"the interleaved schedule takes micro-batches in groups of the {stages} devices "
            f"of a pipeline: micro_batches must be a multiple of {stages}. Received: "
            f"micro_batches={micro_batches}"
        )
    total = micro_batches * chunks

    def nth(kind: str, k: int) -> Pass:
        chunk = (k // stages) % chunks
        if kind == "B":
            chunk = chunks - 1 - chunk
        return Pass(kind, (k // (stages * chunks)) * stages + k % stages, chunk)

    plans = []
    for device in range(stages):
        warmup = min((stages - device - 1) * 2 + (chunks - 1) * stages, total)
        if chunks == 1:
            warmup = min(stages - device - 1, total)
        plan = [nth("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            plan += [nth("F", warmup + k), nth("B", k)]
        plan += [nth("B", k) for k in range(total - warmup, total)]
        plans.append(plan)
    return plans


def schedule(name: str, stages: int, micro_batches: int, chunks: int = 1) -> list[list[Pass]]:
    """The schedule called `name` ('gpipe', '1f1b' or 'interleaved', whose devices hold
    `chunks` stages each), one pass order per device."""
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b}
    if name == "interleaved":
        return interleaved(stages, micro_batches, chunks)
    if name not in builders:
        raise ValueError(
            f"schedule must be one of {', '.join(SCHEDULES)}. Received: schedule={name!r}"
        )
    if chunks != 1:
        raise ValueError(
            f"chunks apply to the interleaved schedule; {name!r} holds one stage per device. "
            f"Received: chunks={chunks!r}"
        )
    return builders[name](stages, micro_batches)


def bubble_formula(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle share of a pipelined step, (S-1)/(v M + S-1) with v chunks per device
    ((S-1)/(M+S-1) for GPipe and 1F1B), for backward = forward time."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A schedule run against its dependencies.

    Attributes:
      length: when the last pass ends.
      busy: each device's time spent in passes.
      bubble: the idle share of all devices' time, 1 - sum(busy) / (S * length).
      peak_activations: each device's most micro-batch chunks held at once (forward done,
        backward not yet).
      starts: when each device's passes started, in its schedule's order.
    """

    length: float
    busy: tuple[float, ...]
    bubble: float
    peak_activations: tuple[int, ...]
    starts: tuple[tuple[float, ...], ...]


def simulate(
    plans: list[list[Pass]],
    forward_time: Callable[[int], float] | float = 1.0,
    backward_time: Callable[[int], float] | float = 1.0,
) -> Timeline:
    """Runs `plans` (one pass order per device) as early as the dependencies allow.

    Args:
      plans: from `schedule`.
      forward_time: a forward pass's time, or a function of the stage giving it (the
        stage chunk * S + device, the device itself but in the interleaved schedule).
      backward_time: the same for a backward pass.

    Raises:
      ValueError: the schedule deadlocks (a stage waits for a pass that never comes first).
    """
    stages = len(plans)
    chunks = 1 + max((p.chunk for plan in plans for p in plan), default=0)
    times = {"F": _per_stage(forward_time), "B": _per_stage(backward_time)}
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> end
    clock = [0.0] * stages
    cursor = [0] * stages
    starts: list[list[float]] = [[] for _ in range(stages)]
    held, peak = [0] * stages, [0] * stages
    remaining = sum(len(p) for p in plans)
    while remaining:
        progressed = False
        for stage in range(stages):
            if cursor[stage] == len(plans[stage]):
                continue
            step = plans[stage][cursor[stage]]
            virtual = step.chunk * stages + stage
            ready = _ready(step, virtual, stages * chunks, done)
            if ready is None:
                continue
            start = max(clock[stage], ready)
            end = start + times[step.kind](virtual)
            done[step.kind, virtual, step.micro_batch] = end
            starts[stage].append(start)
            clock[stage], cursor[stage] = end, cursor[stage] + 1
            held[stage] += 1 if step.kind == "F" else -1
            peak[stage] = max(peak[stage], held[stage])
            remaining -= 1
            progressed = True
        if not progressed:
            waiting = [str(plans[s][cursor[s]]) for s in range(stages) if cursor[s] < len(plans[s])]
            raise ValueError(f"the schedule deadlocks: stages wait on {', '.join(waiting)}")
    length = max(clock)
    busy = tuple(
        sum(times[p.kind](p.chunk * stages + stage) for p in plans[stage])
        for stage in range(stages)
    )
    bubble = 1.0 - sum(busy) / (stages * length) if length else 0.0
    return Timeline(length, busy, bubble, tuple(peak), tuple(tuple(s) for s in starts))


def _ready(step: Pass, stage: int, stages: int, done) -> float | None:
    """When `step`'s inputs exist on `stage` (None: not yet)."""
    needs = []
    if step.kind == "F":
        if stage > 0:
            needs.append(("F", stage - 1, step.micro_batch))
    else:
        needs.append(("F", stage, step.micro_batch))
        if stage < stages - 1:
            needs.append(("B", stage + 1, step.micro_batch))
    if any(n not in done for n in needs):
        return None
    return max((done[n] for n in needs), default=0.0)


def _per_stage(time: Callable[[int], float] | float) -> Callable[[int], float]:
    return time if callable(time) else (lambda stage: float(time))


def _check(stages: int, micro_batches: int, chunks: int = 1) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1. Received: {name}={value!r}")

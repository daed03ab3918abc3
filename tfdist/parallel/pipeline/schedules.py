"""Pipeline schedules as typed actions: what each device does, in order, in one step.

A model cut into S stages trains a batch as M micro-batches. Stage s runs the forward pass
of micro-batch m after stage s-1 has (its input is their output) and the backward pass after
stage s+1 has (its gradient comes back from there); the last stage's backward follows its
own forward. A schedule gives each device the order of its passes:

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
- Zero bubble, ZB-H1 (Qi et al., 2023): a backward is cut in two, the input's gradient (I),
  which the stage before waits for, and the weights' gradient (W), which nobody waits for.
  Each stage runs its forwards and I passes in 1F1B order and puts off each W by S-s-1
  micro-batches, so the W passes fill the drain where 1F1B's stages wait. Its activations
  are held until their W.

A plan is a list of `Action`s per device: the compute passes (F, B; or F, I, W) that the
plans below give, and, from `lowered`, what every plan needs beside them, derived from its
compute order: the receive of a pass's input just before it, the send of its output just
after it, and each stage's update at the end. The executor (executor.py) runs the lowered
lists; `simulate` reads the same lists with given pass times and reports the step's length,
the bubble and the activations each stage held at most: the numbers a pipeline runner is
measured against, and a cost model's building block.

Example:

    >>> plan = schedule("1f1b", stages=4, micro_batches=8)
    >>> [str(p) for p in plan[3][:4]]
    ['F0', 'B0', 'F1', 'B1']
    >>> [str(a) for a in lowered(plan)[1][:4]]
    ['RF0', 'F0', 'SF0', 'RF1']
    >>> round(simulate(plan).bubble, 4) == round(bubble_formula(4, 8), 4)
    True
    >>> simulate(schedule("zero_bubble", 4, 8)).bubble < simulate(plan).bubble
    True
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


class Kind(enum.StrEnum):
    """What an action does (its value is how it prints: 'F0', 'SB3c1')."""

    FORWARD = "F"
    BACKWARD = "B"  # the input's and the weights' gradients at once
    BACKWARD_INPUT = "I"  # the input's gradient only (zero bubble)
    BACKWARD_WEIGHT = "W"  # the weights' gradient only, after the stage's I (zero bubble)
    SEND_ACTIVATION = "SF"
    RECV_ACTIVATION = "RF"
    SEND_GRADIENT = "SB"
    RECV_GRADIENT = "RB"
    UPDATE = "U"


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})


@dataclasses.dataclass(frozen=True)
class Action:
    """One action of a device: its `kind`, on micro-batch `micro_batch` (None for an
    update), of its chunk `chunk`: the stage chunk * S + device, S the devices of a
    pipeline (0 but in the interleaved schedule, where a device holds several stages).
    `kind` may be given as its letter: Action("F", 0) == Action(Kind.FORWARD, 0)."""

    kind: Kind
    micro_batch: int | None
    chunk: int = 0

    def __post_init__(self):
        object.__setattr__(self, "kind", Kind(self.kind))

    def __str__(self) -> str:
        m = "" if self.micro_batch is None else self.micro_batch
        return f"{self.kind}{m}" + (f"c{self.chunk}" if self.chunk else "")

    def stage(self, device: int, devices: int) -> int:
        """The stage it acts for, on `device` of a pipeline of `devices` devices."""
        return self.chunk * devices + device


Plan = list[list[Action]]  # one list per device of a pipeline


def gpipe(stages: int, micro_batches: int) -> Plan:
    """Every stage: all forwards in order, then all backwards in reverse order."""
    _check(stages, micro_batches)
    forwards = [Action(Kind.FORWARD, m) for m in range(micro_batches)]
    backwards = [Action(Kind.BACKWARD, m) for m in reversed(range(micro_batches))]
    return [forwards + backwards for _ in range(stages)]


def one_f_one_b(stages: int, micro_batches: int) -> Plan:
    """Stage s: S-s-1 warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards; micro-batches in order in both directions."""
    _check(stages, micro_batches)
    plans = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, micro_batches)
        plan = [Action(Kind.FORWARD, m) for m in range(warmup)]
        forward, backward = warmup, 0
        while forward < micro_batches:
            plan += [Action(Kind.FORWARD, forward), Action(Kind.BACKWARD, backward)]
            forward, backward = forward + 1, backward + 1
        plan += [Action(Kind.BACKWARD, m) for m in range(backward, micro_batches)]
        plans.append(plan)
    return plans


def interleaved(stages: int, micro_batches: int, chunks: int) -> Plan:
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

    def nth(kind: Kind, k: int) -> Action:
        chunk = (k // stages) % chunks
        if kind == Kind.BACKWARD:
            chunk = chunks - 1 - chunk
        return Action(kind, (k // (stages * chunks)) * stages + k % stages, chunk)

    plans = []
    for device in range(stages):
        warmup = min((stages - device - 1) * 2 + (chunks - 1) * stages, total)
        if chunks == 1:
            warmup = min(stages - device - 1, total)
        plan = [nth(Kind.FORWARD, k) for k in range(warmup)]
        for k in range(total - warmup):
            plan += [nth(Kind.FORWARD, warmup + k), nth(Kind.BACKWARD, k)]
        plan += [nth(Kind.BACKWARD, k) for k in range(total - warmup, total)]
        plans.append(plan)
    return plans


def zero_bubble(stages: int, micro_batches: int) -> Plan:
    """ZB-H1: each backward cut into I (the input's gradient, which the stage before waits
    for) and W (the weights'). The order is list scheduling with a forward as long as a
    whole backward, I and W half of it each: whenever a stage is free it starts the earliest
    pass it can, an I before an F before a W at the same time, and at most S-s micro-batches
    between their F and their W on stage s (1F1B's most held): so the W passes fill the
    time 1F1B's stages wait for gradients, and no stage holds more than under 1F1B."""
    _check(stages, micro_batches)
    plans: Plan = [[] for _ in range(stages)]
    clock = [0.0] * stages
    ends: dict[tuple[Kind, int, int], float] = {}  # (F or I, stage, micro-batch): its end
    fwd, inp, wgt = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
    length, rank = {fwd: 1.0, inp: 0.5, wgt: 0.5}, {inp: 0, fwd: 1, wgt: 2}
    done = {kind: [0] * stages for kind in rank}  # passes of each kind each stage has run
    while any(n < micro_batches for n in done[wgt]):
        chosen = None  # (start, rank, stage, kind): the earliest; at once, I, F, then W
        for s in range(stages):
            ready = {}  # kind -> when its input exists (None: not yet)
            if done[inp][s] < done[fwd][s]:  # its gradient: the next stage's I, or its loss
                m = done[inp][s]
                ready[inp] = ends.get((fwd, s, m) if s == stages - 1 else (inp, s + 1, m))
            if done[fwd][s] < micro_batches and done[fwd][s] - done[wgt][s] < stages - s:
                ready[fwd] = 0.0 if s == 0 else ends.get((fwd, s - 1, done[fwd][s]))
            if done[wgt][s] < done[inp][s]:
                ready[wgt] = 0.0
            for kind, at in ready.items():
                if at is not None:
                    option = (max(clock[s], at), rank[kind], s, kind)
                    chosen = option if chosen is None else min(chosen, option)
        start, _, s, kind = chosen
        m = done[kind][s]
        done[kind][s] += 1
        clock[s] = ends[kind, s, m] = start + length[kind]
        plans[s].append(Action(kind, m))
    return plans


def schedule(name: str, stages: int, micro_batches: int, chunks: int = 1) -> Plan:
    """The schedule called `name` (one of SCHEDULES; the interleaved one's devices hold
    `chunks` stages each): each device's compute actions in order (`lowered` adds the
    transfers and updates)."""
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "zero_bubble": zero_bubble}
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


def lowered(plans: Sequence[Sequence[Action]]) -> Plan:
    """Each device's compute actions with the transfers and updates they need: a receive
    just before each pass whose input comes from another stage, a send just after each pass
    whose output another stage takes, and each of its stages' update at the end. A device's
    list that has any action but a compute one is taken as lowered already."""
    devices, chunks = len(plans), _chunks(plans)
    last = devices * chunks - 1
    out = []
    for device, plan in enumerate(plans):
        if any(a.kind not in COMPUTE for a in plan):
            out.append(list(plan))
            continue
        actions = []
        for a in plan:
            stage, m = a.stage(device, devices), a.micro_batch
            receives, sends = _transfers(a.kind, first=stage == 0, last=stage == last)
            actions += [Action(k, m, a.chunk) for k in receives]
            actions.append(a)
            actions += [Action(k, m, a.chunk) for k in sends]
        actions += [Action(Kind.UPDATE, None, c) for c in sorted({a.chunk for a in plan})]
        out.append(actions)
    return out


def _transfers(kind: Kind, *, first: bool, last: bool) -> tuple[list[Kind], list[Kind]]:
    """(what a pass of `kind` receives before it, what it sends after it) on a stage."""
    if kind == Kind.FORWARD:
        return ([] if first else [Kind.RECV_ACTIVATION]), ([] if last else [Kind.SEND_ACTIVATION])
    if kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        return ([] if last else [Kind.RECV_GRADIENT]), ([] if first else [Kind.SEND_GRADIENT])
    return [], []


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
        the weights' gradient not yet: its B, or its W).
      starts: when each device's actions started, in the order of the lists given.
      ran: (device, position in its lowered list) of every action, in an order the
        simulation ran them: each after the actions it needs (an order to build them in).
    """

    length: float
    busy: tuple[float, ...]
    bubble: float
    peak_activations: tuple[int, ...]
    starts: tuple[tuple[float, ...], ...]
    ran: tuple[tuple[int, int], ...] = ()


def simulate(
    plans: Sequence[Sequence[Action]],
    forward_time: Callable[[int], float] | float = 1.0,
    backward_time: Callable[[int], float] | float = 1.0,
) -> Timeline:
    """Runs `plans` (one action list per device, compute actions only or `lowered`) as
    early as the dependencies allow: a receive waits for its send, a pass for its input,
    a stage's update for its every gradient. Sends, receives and updates take no time.

    Args:
      plans: from `schedule`, or `lowered`.
      forward_time: a forward pass's time, or a function of the stage giving it (the
        stage chunk * S + device, the device itself but in the interleaved schedule).
      backward_time: the same for a backward pass (a zero-bubble schedule's I and W take
        half of it each).

    Raises:
      ValueError: the schedule deadlocks (a stage waits for a pass that never comes first).
    """
    devices = len(plans)
    stages = devices * _chunks(plans)
    actions = lowered(plans)
    times = _pass_times(forward_time, backward_time)
    micro_batches: dict[int, set[int]] = {}  # stage -> the micro-batches of its forwards
    for device, plan in enumerate(actions):
        for a in plan:
            if a.kind == Kind.FORWARD:
                micro_batches.setdefault(a.stage(device, devices), set()).add(a.micro_batch)
    done: dict[tuple[Kind, int, int | None], float] = {}  # (kind, stage, micro-batch) -> end
    clock = [0.0] * devices
    cursor = [0] * devices
    starts: list[list[float]] = [[] for _ in range(devices)]
    held, peak = [0] * devices, [0] * devices
    busy = [0.0] * devices
    ran = []
    remaining = sum(len(p) for p in actions)
    while remaining:
        progressed = False
        for device in range(devices):
            if cursor[device] == len(actions[device]):
                continue
            a = actions[device][cursor[device]]
            stage = a.stage(device, devices)
            needs = _needs(a, stage, stages, micro_batches.get(stage, ()))
            if any(n not in done for n in needs):
                continue
            start = max([clock[device], *(done[n] for n in needs)])
            end = start + (times[a.kind](stage) if a.kind in COMPUTE else 0.0)
            for kind in _completes(a.kind):
                done[kind, stage, a.micro_batch] = end
            starts[device].append(start)
            ran.append((device, cursor[device]))
            busy[device] += end - start
            clock[device], cursor[device] = end, cursor[device] + 1
            held[device] += _HELD.get(a.kind, 0)
            peak[device] = max(peak[device], held[device])
            remaining -= 1
            progressed = True
        if not progressed:
            waiting = [
                str(actions[d][cursor[d]]) for d in range(devices) if cursor[d] < len(actions[d])
            ]
            raise ValueError(f"the schedule deadlocks: stages wait on {', '.join(waiting)}")
    length = max(clock, default=0.0)
    bubble = 1.0 - sum(busy) / (devices * length) if length else 0.0
    # The starts of the actions given: without those `lowered` added to a compute-only list.
    given = tuple(
        tuple(t for a, t in zip(done, at, strict=True) if len(done) == len(p) or a.kind in COMPUTE)
        for p, done, at in zip(plans, actions, starts, strict=True)
    )
    return Timeline(length, tuple(busy), bubble, tuple(peak), given, tuple(ran))


def _pass_times(forward_time, backward_time) -> dict[Kind, Callable[[int], float]]:
    """Each compute kind's time as a function of the stage: I and W half a backward."""
    backward = _per_stage(backward_time)
    forward = _per_stage(forward_time)

    def half(stage: int) -> float:
        return backward(stage) / 2

    return {Kind.FORWARD: forward, Kind.BACKWARD: backward, Kind.BACKWARD_INPUT: half,
            Kind.BACKWARD_WEIGHT: half}  # fmt: skip


def _needs(a: Action, stage: int, stages: int, micro_batches) -> list[tuple]:
    """What action `a` of `stage` waits for, as (kind, stage, micro-batch) keys of what
    has ended: a pass's input (received, or its own forward), a transfer's other end."""
    m = a.micro_batch
    if a.kind == Kind.FORWARD:
        return [(Kind.RECV_ACTIVATION, stage, m)] if stage > 0 else []
    if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        needs = [(Kind.FORWARD, stage, m)]
        return needs + ([(Kind.RECV_GRADIENT, stage, m)] if stage < stages - 1 else [])
    return {
        Kind.BACKWARD_WEIGHT: lambda: [(Kind.BACKWARD_INPUT, stage, m)],
        Kind.SEND_ACTIVATION: lambda: [(Kind.FORWARD, stage, m)],
        Kind.RECV_ACTIVATION: lambda: [(Kind.SEND_ACTIVATION, stage - 1, m)],
        Kind.SEND_GRADIENT: lambda: [(Kind.BACKWARD_INPUT, stage, m)],
        Kind.RECV_GRADIENT: lambda: [(Kind.SEND_GRADIENT, stage + 1, m)],
        Kind.UPDATE: lambda: [(Kind.BACKWARD_WEIGHT, stage, k) for k in sorted(micro_batches)],
    }[a.kind]()


# What a pass does to the activations its device holds: a forward's until its weights'
# gradient (its B, or its W) is taken.
_HELD = {Kind.FORWARD: 1, Kind.BACKWARD: -1, Kind.BACKWARD_WEIGHT: -1}


def _completes(kind: Kind) -> tuple[Kind, ...]:
    """What an action's end makes available: a whole backward both gradients."""
    if kind == Kind.BACKWARD:
        return (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
    return (kind,)


def _chunks(plans: Sequence[Sequence[Action]]) -> int:
    return 1 + max((a.chunk for plan in plans for a in plan), default=0)


def _per_stage(time: Callable[[int], float] | float) -> Callable[[int], float]:
    return time if callable(time) else (lambda stage: float(time))


def _check(stages: int, micro_batches: int, chunks: int = 1) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1. Received: {name}={value!r}")

"""The rules a job's layout (how many chief, worker, ps and evaluator tasks) must follow.

Every place that accepts a layout checks it here, so each rule and its message exist once:
`tfdist-launch` (its flags), `tfdist-k8s` (the manifests it writes), and the strategy
builders (the TF_CONFIG they are given). A caller passes `spell`, which writes an example
layout the way its user types one (launcher flags, manifest options), so every message ends
in a fix the reader can paste.

    validate_layout(Layout(chief=1, workers=2, ps=1), strategy="parameter_server")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Any

from tfdist import strategy_kinds as kinds
from tfdist.errors import TfdistError

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
MULTI_WORKER_STRATEGIES = kinds.MULTI_WORKER
# TensorFlow knows one task of each of these types; more must be workers.
SINGLE_TASK_TYPES = ("chief", "evaluator")


class LayoutError(TfdistError, ValueError):
    """A layout no TensorFlow job can run; the message names the mistake and a fix."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """How many tasks of each type a job has."""

    chief: int = 0
    workers: int = 0
    ps: int = 0
    evaluator: int = 0

    @classmethod
    def of_cluster(cls, cluster: Mapping[str, Sized]) -> Layout:
        """The layout of a TF_CONFIG "cluster" (task type -> addresses; 'master' is the chief)."""
        count = {t: len(a) for t, a in cluster.items()}
        return cls(
            chief=count.get("chief", 0) + count.get("master", 0),
            workers=count.get("worker", 0),
            ps=count.get("ps", 0),
            evaluator=count.get("evaluator", 0),
        )

    def counts(self) -> dict[str, int]:
        """Task type -> tasks, for the types present, in TASK_TYPES order."""
        values = (self.chief, self.workers, self.ps, self.evaluator)
        return {t: n for t, n in zip(TASK_TYPES, values, strict=True) if n}

    @property
    def strategy(self) -> str | None:
        """The multi-worker strategy this layout calls for, or None for a one-worker job.

        Parameter-server training where there are ps tasks; synchronous multi-worker
        training where two or more tasks compute (the chief counts, the evaluator not).
        """
        if self.ps:
            return kinds.PARAMETER_SERVER
        if self.chief + self.workers > 1:
            return kinds.MULTI_WORKER_MIRRORED
        return None

    def describe(self) -> str:
        """The layout in words, e.g. '1 chief, 2 workers, 1 ps'."""
        words = {"chief": "chief", "worker": "worker", "ps": "ps", "evaluator": "evaluator"}
        return (
            ", ".join(
                f"{n} {words[t]}{'s' if n != 1 and t == 'worker' else ''}"
                for t, n in self.counts().items()
            )
            or "no tasks"
        )


def too_many(layout: Layout) -> list[str]:
    """The task types of SINGLE_TASK_TYPES that `layout` has more than one of."""
    return [t for t in SINGLE_TASK_TYPES if layout.counts().get(t, 0) > 1]


def single_task_rule(task_type: str) -> str:
    """The rule (and its fix) that `too_many` checks, in words."""
    return (
        f"A job has at most one {task_type} (TensorFlow knows one; a 'master' counts as the "
        "chief); make the others workers."
    )


def launch_flags(layout: Layout) -> str:
    """`layout` as tfdist-launch's flags, e.g. '--chief --workers 2 --ps 1'."""
    flags = ["--chief"] if layout.chief else []
    flags += [f"--workers {layout.workers}"]
    flags += [f"--ps {layout.ps}"] if layout.ps else []
    flags += ["--evaluator"] if layout.evaluator else []
    return " ".join(flags)


def example_layout(strategy: str | None) -> Layout:
    """The smallest layout that runs `strategy` across processes, for messages."""
    if strategy == kinds.PARAMETER_SERVER:
        return Layout(chief=1, workers=2, ps=1)
    return Layout(workers=2)


def validate_layout(
    layout: Layout,
    *,
    strategy: str | None = None,
    spell: Callable[[Layout], str] = Layout.describe,
) -> Layout:
    """Checks that `layout` can run (and can run `strategy`, when one is named).

    Args:
      layout: the task counts.
      strategy: the strategy the job asks for; None or 'auto' means "whatever the layout
        calls for" (`Layout.strategy`).
      spell: writes a layout the way the caller's user asks for one, e.g.
        ``--chief --workers 2 --ps 1``; used in the fix each message offers.

    Returns:
      `layout`, unchanged.

    Raises:
      LayoutError: the first mistake found, one message per mistake.
    """
    for field in ("chief", "workers", "ps", "evaluator"):
        _check_count(field, getattr(layout, field))
    for task_type in too_many(layout):
        raise LayoutError(f"{single_task_rule(task_type)} Received: {layout.describe()}")
    if not layout.chief and not layout.workers:
        raise LayoutError(
            "the job has no chief and no worker, so nothing would train: add workers, e.g. "
            f"`{spell(Layout(workers=2))}`. Received: {layout.describe()}"
        )
    if layout.ps and not layout.chief:
        raise LayoutError(
            "parameter-server training needs a chief to coordinate the workers: add one, "
            f"e.g. `{spell(Layout(chief=1, workers=max(layout.workers, 2), ps=layout.ps))}`. "
            f"Received: {layout.describe()}"
        )
    if layout.ps and not layout.workers:
        raise LayoutError(
            "parameter-server training needs workers to run the steps the chief schedules: "
            f"add workers, e.g. `{spell(Layout(chief=1, workers=2, ps=layout.ps))}`. "
            f"Received: {layout.describe()}"
        )
    if strategy not in (None, "auto"):
        _check_strategy(layout, strategy, spell)
    return layout


def _check_strategy(layout: Layout, strategy: str, spell: Callable[[Layout], str]) -> None:
    calls_for = layout.strategy
    if strategy == calls_for:
        return
    if calls_for is None and strategy != kinds.PARAMETER_SERVER:
        return  # one task trains: any single-host strategy, or a collective of one
    received = f"Received: strategy={strategy!r}, {layout.describe()}"
    if strategy in MULTI_WORKER_STRATEGIES:
        fit = spell(example_layout(strategy))
        if strategy == kinds.PARAMETER_SERVER:
            raise LayoutError(
                f"'parameter_server' needs a chief, workers and ps tasks: use e.g. `{fit}`, "
                f"or {_calls_for(calls_for)} for this layout. {received}"
            )
        raise LayoutError(
            f"the job has {layout.ps} ps task(s), which 'multi_worker_mirrored' does not use: "
            f"use 'parameter_server' for this layout, or remove the ps tasks (e.g. `{fit}`). "
            f"{received}"
        )
    raise LayoutError(
        f"{strategy!r} trains within one process, but this layout starts several that would "
        f"train apart: use {_calls_for(calls_for)}, or start one task "
        f"(e.g. `{spell(Layout(workers=1))}`). {received}"
    )


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value given to an absl/argparse flag in `args` (--flag=v, --flag v, -flag=v)."""
    value = None
    for i, arg in enumerate(args):
        if arg == "--":
            break  # the program stops reading flags here
        for prefix in (f"--{flag}", f"-{flag}"):
            if arg.startswith(prefix + "="):
                value = arg[len(prefix) + 1 :]
            elif arg == prefix and i + 1 < len(args):
                value = args[i + 1]
    return value


# tfdist's strategy names and alias: a --strategy flag with another value belongs to some
# other program.
STRATEGY_NAMES = (kinds.AUTO, *kinds.NAMES)
STRATEGY_ALIASES = kinds.ALIASES


def command_strategy(command: Sequence[str]) -> str | None:
    """The tfdist strategy a command's --strategy flag names, if it names one."""
    value = flag_value(command, "strategy")
    value = STRATEGY_ALIASES.get(value, value)
    return value if value in STRATEGY_NAMES else None


def _calls_for(strategy: str | None) -> str:
    return f"{strategy!r} (or 'auto')" if strategy else "'auto' or a single-host strategy"


def _check_count(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{field} must be a whole number. Received: {field}={value!r}")
    if value < 0:
        raise LayoutError(f"{field} must be 0 or more. Received: {field}={value}")


__all__ = [
    "MULTI_WORKER_STRATEGIES",
    "flag_value",
    "SINGLE_TASK_TYPES",
    "TASK_TYPES",
    "Layout",
    "LayoutError",
    "example_layout",
    "launch_flags",
    "single_task_rule",
    "too_many",
    "validate_layout",
]

"""The runners behind tfdist.fit, one per kind of strategy, in a registry keyed by kind.

runner = runner_for(model, strategy)   # by tfdist.strategy_kind(strategy)
runner = runner_for(model, strategy, layout=tfdist.parallel.Pipeline(...))  # a RunnerFactory

What 'auto' means for a parallel mode's keyword is the runner's to say (`mode_defaults`):
parameter-server training bounds its staleness, the synchronous runners have nothing stale.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfdist.errors import FitError
from tfdist.strategies import strategy_kind
from tfdist.training.runner import Runner, RunnerFactory
from tfdist.training.runners.central_storage import CentralStorageRunner
from tfdist.training.runners.parameter_server import ParameterServerRunner
from tfdist.training.runners.sync import SyncRunner

RUNNERS: dict[str, type[Runner]] = {
    kind: runner
    for runner in (SyncRunner, CentralStorageRunner, ParameterServerRunner)
    for kind in runner.kinds
}


def runner_class(strategy: tf.distribute.Strategy | str) -> type[Runner]:
    """The runner class for `strategy` (or its kind, e.g. 'parameter_server')."""
    kind = strategy if isinstance(strategy, str) else strategy_kind(strategy)
    if kind not in RUNNERS:
        raise FitError(
            f"tfdist.fit has no runner for a {type(strategy).__name__} (kind {kind!r}). "
            f"It trains under: {', '.join(sorted(RUNNERS))}. Received: strategy={strategy!r}"
        )
    return RUNNERS[kind]


def runner_for(
    model: keras.Model,
    strategy: tf.distribute.Strategy,
    *,
    layout: RunnerFactory | None = None,
    settings: dict[str, Any] | None = None,
) -> Runner:
    """The runner that trains `model` under `strategy` (not yet built).

    Args:
      layout: None (the strategy's kind decides), or a RunnerFactory whose `runner(model,
        strategy)` makes a runner of its own (tfdist.parallel.Pipeline).
      settings: the modes the layout takes over (registry.factory_settings: a pipeline's
        shard_optimizer), passed to its `runner` as keyword arguments.
    """
    if layout is not None:
        if not isinstance(layout, RunnerFactory):
            raise FitError(
                "A layout makes the runner that trains: an object with a runner(model, "
                f"strategy) method. Received: {type(layout).__name__}"
            )
        return layout.runner(model, strategy, **(settings or {}))
    return runner_class(strategy)(model, strategy)


def mode_defaults(strategy: tf.distribute.Strategy | str) -> dict[str, Any]:
    """What 'auto' means for each parallel mode's keyword under `strategy`'s runner
    (a keyword not listed: off)."""
    return dict(runner_class(strategy).mode_defaults)


def describe_mode_default(keyword: str) -> str:
    """'auto' of `keyword` in words, runner by runner ("0 under parameter_server; none
    elsewhere"), for a binary's help."""
    kinds = sorted(kind for kind, r in RUNNERS.items() if keyword in r.mode_defaults)
    said = [f"{RUNNERS[kind].mode_defaults[keyword]} under {kind}" for kind in kinds]
    return "; ".join([*said, "none elsewhere"])


__all__ = [
    "RUNNERS",
    "Runner",
    "describe_mode_default",
    "mode_defaults",
    "runner_class",
    "runner_for",
]

"""The engines behind tfdist.fit, one per kind of strategy, in a table keyed by kind.

runner = runner_for(model, strategy)   # by tfdist.strategy_kind(strategy)
runner = runner_for(model, strategy, layout=tfdist.parallel.Pipeline(...))  # a RunnerFactory

What 'auto' means for a parallel mode's keyword is said here too, by kind (`MODE_DEFAULTS`):
parameter-server training bounds its staleness, the synchronous engines have nothing stale.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfdist import strategy_kinds as kinds
from tfdist.errors import FitError
from tfdist.strategies import strategy_kind
from tfdist.training.engine import Engine, RunnerFactory
from tfdist.training.runners.central_storage import CentralStorageRunner
from tfdist.training.runners.parameter_server import PS_MAX_STALENESS, ParameterServerRunner
from tfdist.training.runners.sync import SyncRunner

RUNNERS: dict[str, type[Engine]] = {
    kind: runner
    for runner in (SyncRunner, CentralStorageRunner, ParameterServerRunner)
    for kind in runner.kinds
}
# What 'auto' means for a mode's keyword under each kind (registry keyword -> value); a kind
# or keyword not listed means off.
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    kinds.PARAMETER_SERVER: {"max_staleness": PS_MAX_STALENESS},
}


def runner_class(strategy: tf.distribute.Strategy | str) -> type[Engine]:
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
) -> Engine:
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
    kind = strategy if isinstance(strategy, str) else strategy_kind(strategy)
    runner_class(kind)  # refuses a kind nothing trains under
    return dict(MODE_DEFAULTS.get(kind, {}))


def describe_mode_default(keyword: str) -> str:
    """'auto' of `keyword` in words, runner by runner ("0 under parameter_server; none
    elsewhere"), for a binary's help."""
    said = [
        f"{defaults[keyword]} under {kind}"
        for kind, defaults in sorted(MODE_DEFAULTS.items())
        if keyword in defaults
    ]
    return "; ".join([*said, "none elsewhere"])


__all__ = [
    "MODE_DEFAULTS",
    "RUNNERS",
    "describe_mode_default",
    "mode_defaults",
    "runner_class",
    "runner_for",
]

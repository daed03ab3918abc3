"""The runners behind tfdist.fit, one per kind of strategy, in a registry keyed by kind.

runner = runner_for(model, strategy)   # by tfdist.strategy_kind(strategy)
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist.strategies import strategy_kind
from tfdist.training.fit_data import FitError
from tfdist.training.runner import Runner
from tfdist.training.runners.central_storage import CentralStorageRunner
from tfdist.training.runners.parameter_server import ParameterServerRunner
from tfdist.training.runners.sync import SyncRunner

RUNNERS: dict[str, type[Runner]] = {
    kind: runner
    for runner in (SyncRunner, CentralStorageRunner, ParameterServerRunner)
    for kind in runner.kinds
}


def runner_for(model: keras.Model, strategy: tf.distribute.Strategy, *, layout=None) -> Runner:
    """The runner that trains `model` under `strategy` (not yet built).

    Args:
      layout: None (the strategy's kind decides), or an object whose `runner(model,
        strategy)` makes a runner of its own (tfdist.parallel.Pipeline).
    """
    if layout is not None:
        return layout.runner(model, strategy)
    kind = strategy_kind(strategy)
    if kind not in RUNNERS:
        raise FitError(
            f"tfdist.fit has no runner for a {type(strategy).__name__} (kind {kind!r}). "
            f"It trains under: {', '.join(sorted(RUNNERS))}. Received: strategy={strategy!r}"
        )
    return RUNNERS[kind](model, strategy)


__all__ = ["RUNNERS", "Runner", "runner_for"]

"""Pieces every runner uses: reading metric state, a batch's size, who writes, and the
refusals of synchronous runners. (The loop over a call's steps is training/loop.py.)"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.strategies import strategy_kind
from tfdist.training.staleness import StalenessAwareSchedule
from tfdist.training.steps import python_logs


def logs_from_state(model: keras.Model, variables, state) -> dict[str, float]:
    """The model's metric results had its metric variables held `state`."""
    with keras.StatelessScope(state_mapping=list(zip(variables, state, strict=True))):
        return python_logs(model.get_metrics_result())


def metric_names(model: keras.Model) -> list[str]:
    """The keys of the model's metric results (read from zeros: no collective)."""
    variables = list(model.metrics_variables)
    return list(logs_from_state(model, variables, [np.zeros(v.shape, v.dtype) for v in variables]))


def batch_size(x) -> tf.Tensor:
    leaf = next(leaf for leaf in tf.nest.flatten(x) if leaf is not None)
    return tf.shape(leaf)[0]


def refuse_staleness_scaling(model: keras.Model, strategy: tf.distribute.Strategy) -> None:
    """A synchronous runner's refusal of a staleness-aware learning rate, which means nothing
    where every update is applied to the parameters it was computed from."""
    if isinstance(compat.learning_rate_schedule(model.optimizer), StalenessAwareSchedule):
        raise FitError(
            "staleness_aware_lr (a StalenessAwareSchedule) applies to parameter-server training "
            "only: synchronous strategies apply every update to the parameters it was computed "
            "from (staleness 0). Use the parameter_server strategy or drop the option. "
            f"Received: a StalenessAwareSchedule under {strategy_kind(strategy)}"
        )


def refuse_asynchronous_hooks(hooks, strategy: tf.distribute.Strategy) -> None:
    """A runner whose updates are not asynchronous refuses hooks that correct for
    asynchrony (a delay correction, a staleness bound): there is nothing to correct."""
    for hook in hooks:
        if hook.asynchronous_only:
            raise FitError(
                f"{hook.name} corrects for asynchronous updates, which only parameter_server "
                f"training makes; {strategy_kind(strategy)} applies every update to the "
                "parameters it was computed from. Use the parameter_server strategy or drop "
                f"the option. Received: {hook.name} under {strategy_kind(strategy)}"
            )

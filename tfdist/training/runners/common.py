"""Pieces every runner uses: running steps until the data ends, and reading metric state."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.strategies import strategy_kind
from tfdist.training.staleness import StalenessAwareSchedule
from tfdist.training.steps import python_logs

NO_LIMIT = 2**62  # steps: until the data ends


def logs_from_state(model: keras.Model, variables, state) -> dict[str, float]:
    """The model's metric results had its metric variables held `state`."""
    with keras.StatelessScope(state_mapping=list(zip(variables, state, strict=True))):
        return python_logs(model.get_metrics_result())


def metric_names(model: keras.Model) -> list[str]:
    """The keys of the model's metric results (read from zeros: no collective)."""
    variables = list(model.metrics_variables)
    return list(logs_from_state(model, variables, [np.zeros(v.shape, v.dtype) for v in variables]))


def repeat(n, step, state):
    """`state = step(state)`, `n` (a scalar tensor) times, in one tf.while_loop; returns
    the last state."""
    _, state = tf.while_loop(
        lambda i, _: i < n,
        lambda i, state: (i + 1, step(state)),
        (tf.zeros([], n.dtype), state),
    )
    return state


def until_end(iterator, n, step, state, *, timed: bool = False):
    """`state = step(batch, state)` on up to `n` batches, stopping where the data ends
    (every worker's distributed iterator agrees on the end), in one tf.while_loop.

    `timed`: `step(batch, asked, state)`, `asked` being when the batch was asked for.
    Returns (how many ran, the last state).
    """

    def body(done, more, state):
        asked = tf.timestamp() if timed else None
        with tf.control_dependencies([asked] if timed else []):
            batch = iterator.get_next_as_optional()
        more = batch.has_value()
        when = (asked,) if timed else ()
        state = tf.cond(more, lambda: step(batch.get_value(), *when, state), lambda: state)
        return done + tf.cast(more, done.dtype), more, state

    done, _, state = tf.while_loop(
        lambda done, more, _: tf.logical_and(more, done < n),
        body,
        (tf.zeros([], n.dtype), tf.constant(True), state),
    )
    return done, state


def run_until_end(iterator, n, step) -> tf.Tensor:
    """Runs `step(batch)` on up to `n` batches, stopping where the data ends (in a tf.function).

    Returns how many ran.
    """

    def counted(batch, ran):  # a state to carry: a cond's branches return something
        step(batch)
        return ran + 1

    done, _ = until_end(iterator, n, counted, tf.zeros([], n.dtype))
    return done


def each_batch(iterator, n: int, call):
    """Calls `call(batch)` on up to `n` batches, a call each, asking for every batch first.

    For the user's own steps on data of unknown length, whose last return value gives the
    logs. Returns (batches taken, what the last call returned).
    """
    done, result = 0, None
    while done < n:
        batch = iterator.get_next_as_optional()  # every worker agrees on the end
        if not batch.has_value():
            break
        result = call(batch.get_value())
        done += 1
    return done, result


def call_until_end(call, model: keras.Model, steps: int | None) -> None:
    """Calls `call(n)` (which runs up to n steps and returns how many ran) for `steps` steps,
    steps_per_execution at a time, or until the data ends."""
    per_call = max(1, model.steps_per_execution)
    remaining = steps
    while remaining is None or remaining > 0:
        n = per_call if remaining is None else min(per_call, remaining)
        done = call(tf.constant(n))
        if remaining is not None:
            remaining -= done
        if done < n:
            break


def batch_size(x) -> tf.Tensor:
    leaf = next(leaf for leaf in tf.nest.flatten(x) if leaf is not None)
    return tf.shape(leaf)[0]


def writes(strategy: tf.distribute.Strategy) -> bool:
    """Whether this process is the job's chief, the one that writes files and reports:
    TensorFlow's should_checkpoint (the chief, else worker 0; under parameter_server the
    coordinator)."""
    return bool(strategy.extended.should_checkpoint)


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

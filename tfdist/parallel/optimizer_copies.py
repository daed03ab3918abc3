"""Copies of the user's optimizer for the weights a replica keeps itself (local SGD's
replicas, ZeRO's slices, a pipeline's stages, tensor-parallel parts), built outside the
strategy; the checks that such a copy can stand for the user's optimizer; and one update
step through the copy's `update_step`, as Keras's `apply` takes it.

A copy is the user's optimizer's class and config, its slots built for the weights it is
given (plain variables on one device). Its step goes through `update_step` directly, not
`apply`, whose tf.distribute calls expect the strategy's variables.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError

# Optimizers whose update of each weight reads only that weight's gradient and slots (and
# scalar hyperparameters): any contiguous range of the packed weights can be updated alone.
ELEMENTWISE = (
    keras.optimizers.SGD,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.Adamax,
    keras.optimizers.RMSprop,
    keras.optimizers.Adagrad,
    keras.optimizers.Adadelta,
    keras.optimizers.Ftrl,
    keras.optimizers.Lion,
)


def outside_strategy(build: Callable):
    """Runs `build` in a thread of its own, where no strategy's scope is entered (scopes are
    per thread), so the variables it creates are plain ones on the devices it names."""
    result: list = []
    errors: list[BaseException] = []

    def run():
        try:
            result.append(build())
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="tfdist-build")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def optimizer_copy(optimizer, variables) -> keras.optimizers.Optimizer:
    """A copy of `optimizer` (same class and config) built on `variables` (call it where
    the copy's slots should live: under `tf.device`, outside the strategy)."""
    copy = type(optimizer).from_config(optimizer.get_config())
    copy.build(variables)
    return copy


def check_copyable(optimizer, *, who: str, error: type[FitError] = FitError) -> None:
    """Refuses an optimizer that copies updating parts of the weights cannot stand for.

    Args:
      optimizer: the model's.
      who: what updates the parts, for the messages ("A pipeline's stages").
      error: the FitError subclass to raise.
    """
    if optimizer is None:
        raise error(f"{who} update the model's weights with its optimizer; compile it with one.")
    name = type(optimizer).__name__
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise error(
            f"{who} update their weights apart, so a LossScaleOptimizer's one check over "
            "every gradient (mixed_float16) is not made for them. Train in float32 or "
            "mixed_bfloat16. Received: LossScaleOptimizer"
        )
    if optimizer.global_clipnorm is not None:
        raise error(
            f"{who} update their weights apart, so a norm over all the gradients "
            "(global_clipnorm) is known to none of them. Use clipvalue (or clipnorm where "
            f"whole weights are kept). Received: global_clipnorm={optimizer.global_clipnorm}"
        )
    if not compat.updates_only_through_update_step(optimizer) or optimizer.use_ema:
        raise error(
            f"{who} apply {name}'s update_step to their weights, but this optimizer keeps "
            "state outside it (Nadam's momentum schedule, moving averages with use_ema, an "
            f"optimizer of optimizers). Use Adam, AdamW, SGD, RMSprop, ... Received: {name}"
        )
    if optimizer.gradient_accumulation_steps:
        raise error(
            f"{who} take each step's gradients whole; drop the optimizer's "
            "gradient_accumulation_steps (a pipeline's micro-batches, or tfdist.fit's "
            "accumulate_steps, accumulate instead). "
            f"Received: gradient_accumulation_steps={optimizer.gradient_accumulation_steps}"
        )


def learning_rate_at(optimizer, iterations):
    """The learning rate the user's `optimizer` gives the step `iterations` counts: its
    schedule's value there (the schedule it holds now: a callback may replace it), or its
    rate as it is now (a callback may assign it). A copy's own rate is never read: it was
    the user's when the copy was made."""
    rate = compat.learning_rate_schedule(optimizer)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return rate(iterations)
    if isinstance(rate, keras.Variable):
        return rate.value
    return rate() if callable(rate) else rate


def update_step(optimizer, grads, variables, *, learning_rate, weight_decay) -> None:
    """One update of `variables` by a copy, as `apply` makes it: clipping (per gradient),
    decoupled weight decay first, then `update_step`. The caller sets the copy's step count
    (Adam's bias correction reads iterations + 1) and advances it."""
    grads = compat.clip_gradients(optimizer, grads)
    for grad, variable in zip(grads, variables, strict=True):
        lr = tf.cast(learning_rate, variable.dtype)
        if weight_decay and compat.uses_weight_decay(optimizer, variable):
            variable.assign(variable - variable * tf.cast(weight_decay, variable.dtype) * lr)
        optimizer.update_step(grad, variable, lr)


def decoupled_decays(optimizer, variables) -> list[bool]:
    """For each of `variables`, whether the optimizer decays it (weight_decay, and the
    variable not excluded): a copy built for other variables (slices, parts) cannot tell by
    their names."""
    return [
        bool(optimizer.weight_decay) and compat.uses_weight_decay(optimizer, v) for v in variables
    ]


def apply_with_copy(user, copy, grads, variables, decays, device) -> None:
    """One update of a replica's own `variables` by its `copy` of the `user`'s optimizer, as
    Keras's apply makes it (decoupled decay first, where `decays`), the copy counting the
    user's steps; then the user's optimizer counts the step (it ends the chain)."""
    done = []
    with tf.device(device):
        copy.iterations.assign(tf.cast(user.iterations, copy.iterations.dtype))
        weight_decay = user.weight_decay or 0.0
        for grad, variable, decay in zip(grads, variables, decays, strict=True):
            lr = tf.cast(user.learning_rate, variable.dtype)
            if decay:
                variable.assign(variable - variable * tf.cast(weight_decay, variable.dtype) * lr)
            copy.update_step(grad, variable, lr)
            done.append(tf.identity(variable.value))
    with tf.control_dependencies(done):
        user.iterations.assign_add(1)

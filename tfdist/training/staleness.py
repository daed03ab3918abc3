"""Staleness of asynchronous parameter-server updates, and a learning rate that allows for it.

In parameter-server training every worker reads the variables, computes a gradient and
applies it while the others do the same, so a gradient is applied to parameters that other
updates have already moved on. The staleness of an update (tau) is how many other updates
reached the parameters between this worker's read and its write. A version counter on a
parameter server measures it: a step reads the counter before it reads the weights, and
when its gradient is ready it increments the counter and takes tau = (count before its
increment) - (count it read). Synchronous strategies apply every update to the parameters
it was computed from (tau = 0 by construction) and pay nothing for any of this.

The staleness-aware learning rate (Zhang et al., 2016, "Staleness-aware Async-SGD for
distributed deep learning") divides the step's learning rate by max(1, tau), so a gradient
computed from old parameters moves them less.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import tensorflow as tf


class UpdateCounter:
    """A counter of applied updates, placed with the variables (on a ps) when built in scope.

    Example (inside a parameter-server replica step):

        counter = UpdateCounter()            # under strategy.scope()
        read = counter.read()                # before the forward pass reads the weights
        ...                                  # compute gradients
        tau = counter.claim(read, after=grads)  # updates that came in between
        optimizer.apply_gradients(...)
    """

    def __init__(self):
        self.variable = tf.Variable(
            0,
            dtype=tf.int64,
            trainable=False,
            name="applied_updates",
            # One replica per worker in parameter-server training: its assignment is the update.
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )

    def read(self) -> tf.Tensor:
        """The count of updates applied so far (the version of the parameters about to be read)."""
        return self.variable.read_value()

    def claim(self, read: tf.Tensor, *, after) -> tf.Tensor:
        """Counts this step's update and returns its staleness, a float32 scalar >= 0.

        Args:
          read: what `read()` returned at the start of the step.
          after: tensors (the gradients) that must exist before the update counts as written;
            claiming earlier would understate the staleness.
        """
        with tf.control_dependencies(tf.nest.flatten(after)):
            # assign_add's result is the count including ours, and no other increment can
            # slip in between the add and that value, as it could between a read and an add.
            count = self.variable.assign_add(1, read_value=True)
        return tf.cast(tf.maximum(count - 1 - read, 0), tf.float32)

    def value(self) -> int:
        return int(self.variable.numpy())


@keras.saving.register_keras_serializable(package="tfdist")
class StalenessAwareSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Wraps a schedule; inside `scaled(tau)` its rate is divided by max(1, tau).

    The optimizer asks its schedule for the rate while it applies gradients, so the step sets
    the factor around `apply_gradients` in the traced function. Scaling the rate, rather than
    the gradients, is what Zhang et al. describe, and the two differ for Adam and LAMB: their
    update divides the first moment by the root of the second, so a scaled gradient leaves
    the first step's update unchanged and shifts later ones unevenly. For SGD (with Keras's
    momentum, v = m*v - lr*g) both are the same.

    Args:
      base: the schedule whose rate is scaled, or a constant rate.
    """

    def __init__(self, base: keras.optimizers.schedules.LearningRateSchedule | float):
        self.base = base
        self._factor = None

    @contextlib.contextmanager
    def scaled(self, staleness: tf.Tensor) -> Iterator[None]:
        """Within this block (while tracing one step), the rate is divided by max(1, staleness)."""
        self._factor = 1.0 / tf.maximum(1.0, tf.cast(staleness, tf.float32))
        try:
            yield
        finally:
            self._factor = None

    def __call__(self, step):
        rate = self.base(step) if callable(self.base) else tf.constant(self.base, tf.float32)
        return rate if self._factor is None else rate * self._factor

    def get_config(self):
        if isinstance(self.base, (int, float)):
            return {"base": float(self.base)}
        return {"base": keras.saving.serialize_keras_object(self.base)}

    @classmethod
    def from_config(cls, config):
        base = config["base"]
        if isinstance(base, (int, float)):
            return cls(base)
        return cls(keras.saving.deserialize_keras_object(base))


# Per closure on the coordinator: [sum of tau, max of tau, updates] over its steps.
STALENESS_STATS = 3


class StalenessStats:
    """Mean and max staleness over the updates the coordinator has fetched, per epoch and run."""

    def __init__(self):
        self.run_sum, self.run_max, self.run_updates = 0.0, 0.0, 0
        self.reset_epoch()

    def reset_epoch(self) -> None:
        self.epoch_sum, self.epoch_max, self.epoch_updates = 0.0, 0.0, 0

    def add(self, total: float, largest: float, updates: float) -> None:
        self.epoch_sum += total
        self.epoch_max = max(self.epoch_max, largest)
        self.epoch_updates += int(updates)
        self.run_sum += total
        self.run_max = max(self.run_max, largest)
        self.run_updates += int(updates)

    def epoch_metrics(self) -> dict[str, float]:
        # A count: the max is whole. With no update fetched there is nothing to report.
        if not self.epoch_updates:
            return {}
        return {
            "staleness_mean": self.epoch_sum / self.epoch_updates,
            "staleness_max": int(self.epoch_max),
        }

    def run_summary(self) -> tuple[float | None, int | None]:
        """(mean, max) over every update of this run; (None, None) if none was fetched."""
        if not self.run_updates:
            return None, None
        return self.run_sum / self.run_updates, int(self.run_max)

"""BatchNormalization's moving statistics under synchronous replicas: one model, not N.

Keras's BatchNormalization (with `synchronized=False`, its default) keeps a copy of its
moving mean and variance per replica, each updated from that replica's batches only: after
a short run the copies of two workers differ by ~2e-3. The chief then saves its own copy,
evaluation averages the results of N different models, and "the same weights on every
worker" holds only for the trained weights.

tfdist makes the saved and evaluated model well defined the way timm's `distribute_bn`
does: at the end of every epoch (before validation and before callbacks save) and before
each evaluation, every moving statistic is replaced by its mean over all replicas and
workers, and the largest difference that removed is logged. `synchronized=True` goes
further (batch statistics over the global batch in every step, at an all-reduce per layer
per step); the warning says so.
"""

from __future__ import annotations

import logging
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.training.steps import traced

log = logging.getLogger(__name__)

# Models already warned about: one warning a process, however many fit/evaluate calls.
_WARNED: weakref.WeakSet = weakref.WeakSet()


def unsynchronized_batch_norm(model: keras.Model) -> list[keras.layers.BatchNormalization]:
    """The model's BatchNormalization layers that keep moving statistics per replica."""
    return [
        layer
        for layer in compat.all_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization) and not layer.synchronized
    ]


class MovingStatistics:
    """Averages the moving statistics of unsynchronised BatchNormalization over the replicas.

    Every replica (and worker) must call `average()` at the same point: it is collective.
    """

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy, *, is_chief: bool):
        self.strategy = strategy
        layers = unsynchronized_batch_norm(model)
        self.variables = [
            v for layer in layers for v in layer.non_trainable_variables if "float" in str(v.dtype)
        ]
        self.replicas = strategy.num_replicas_in_sync
        self._average = None
        self._log = is_chief  # the chief reports, once for all
        if self.active and model not in _WARNED:
            _WARNED.add(model)
            log.warning(
                "%s has %d BatchNormalization layer(s) with synchronized=False (%s): each of "
                "its %d replicas normalises with its own batch's statistics and keeps its own "
                "moving statistics. tfdist averages the moving statistics over the replicas at "
                "every epoch end and evaluation, so the model saved and evaluated is one "
                "model. For statistics over the whole global batch in every step, use "
                "BatchNormalization(synchronized=True).",
                model.name, len(layers), ", ".join(layer.name for layer in layers),
                self.replicas,
            )  # fmt: skip

    @property
    def active(self) -> bool:
        return bool(self.variables) and self.replicas > 1

    def average(self) -> float:
        """Sets every copy to the replicas' mean; returns the largest spread it removed (the
        standard deviation over the replicas of one statistic, the largest of them)."""
        if not self.active:
            return 0.0
        if self._average is None:
            self._average = traced(self._replica_average)
        change = float(self._average())
        if change > 0 and self._log:
            log.info(
                "BatchNormalization moving statistics averaged over %d replicas (largest "
                "spread between them: %.3g)",
                self.replicas, change,
            )  # fmt: skip
        return change

    def _replica_average(self) -> tf.Tensor:
        variables = self.variables

        def replica():
            context = tf.distribute.get_replica_context()
            flat = tf.concat([tf.cast(tf.reshape(v.value, [-1]), tf.float32) for v in variables], 0)
            # One all-reduce gives the mean and the mean square (ReduceOp has no MAX).
            moments = context.all_reduce(
                tf.distribute.ReduceOp.MEAN, tf.concat([flat, tf.square(flat)], 0)
            )
            mean, mean_square = tf.split(moments, 2)
            spread = tf.reduce_max(tf.sqrt(tf.maximum(mean_square - tf.square(mean), 0.0)))
            sizes = [int(np.prod(v.shape)) for v in variables]
            for v, part in zip(variables, tf.split(mean, sizes), strict=True):
                v.assign(tf.cast(tf.reshape(part, v.shape), v.dtype))
            return spread

        changes = self.strategy.run(replica)
        return self.strategy.experimental_local_results(changes)[0]

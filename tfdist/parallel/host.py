"""Where a model lives while it is built for a mode that gives each device only its share
of the weights: this host's memory.

`host_scope(strategy)` is where to build and compile such a model, in place of
`strategy.scope()`, so that no device holds the whole of it:

    with tfdist.host_scope(strategy):
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    tfdist.fit(model, data, shard_optimizer="zero3")   # or pipeline=Pipeline(...)

Its trainable variables are made once, on this process's CPU, instead of mirrored on every
replica's device; everything else (BatchNorm's statistics, seeds, metrics) is made as the
strategy makes it, small and per replica as Keras's fit expects. A model built under
`strategy.scope()` works too. When fit first starts, ZeRO-3 takes each weight's slices from
the host copy, and a pipeline each stage's weights, and the copy is dropped weight by
weight: from then on no process holds the whole model (`move_to_host` moves a model built
under `strategy.scope()` to this host's memory)."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.strategies import replica_layout
from tfdist.training.memory import nbytes


def host_device(strategy: tf.distribute.Strategy) -> str:
    """This process's CPU, where the whole model is kept."""
    first = tf.DeviceSpec.from_string(replica_layout(strategy).devices[0])
    return first.replace(device_type="CPU", device_index=0).to_string()


@contextlib.contextmanager
def host_scope(strategy: tf.distribute.Strategy):
    """Build and compile a model here, in place of `strategy.scope()`, so that no device
    holds the whole of it: the trainable variables are made in this host's memory, the
    rest as the strategy makes them. See the module docstring."""
    host = host_device(strategy)

    def creator(next_creator, **kwargs):
        if kwargs.get("trainable", True) is False:
            return next_creator(**kwargs)
        return compat.host_variable(strategy, host, **kwargs)

    with strategy.scope(), tf.variable_creator_scope(creator):
        yield


def hosted(model: keras.Model) -> bool:
    """Whether the model's weights are plain variables (built under host_scope), not
    copies mirrored on the replicas' devices."""
    weights = model.trainable_variables
    return bool(weights) and not isinstance(weights[0].value, tf.distribute.DistributedValues)


def move_to_host(model: keras.Model, strategy: tf.distribute.Strategy) -> int:
    """Moves the trainable weights of a model built under `strategy.scope()` to this host's
    memory (the devices' copies are freed when nothing else holds them); returns the bytes
    moved (0: already there)."""
    if hosted(model):
        return 0
    host, moved = host_device(strategy), 0
    for variable in model.trainable_variables:
        value = variable.value
        replacement = compat.host_variable(
            strategy,
            host,
            initial_value=tf.convert_to_tensor(value),
            trainable=True,
            name=variable.name,
            dtype=value.dtype,
        )
        compat.replace_storage(variable, replacement)
        moved += nbytes(variable) or 0
    return moved


__all__ = ["host_device", "host_scope", "hosted", "move_to_host"]

"""Where a model lives while it is built for a mode that gives each device only its share
of the weights: already in its share.

`host_scope(strategy)` is where to build and compile such a model, in place of
`strategy.scope()`, so that no device and no process ever holds the whole of it (as
DeepSpeed's `zero.Init()` and Keras's `distribution.scope()` build in place):

    with tfdist.host_scope(strategy):
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    tfdist.fit(model, data, shard_optimizer="zero3")   # or pipeline=Pipeline(...)

Each trainable variable is made as this process's replicas' slices of it, on their devices
(ZeRO-3's layout, `Slices`): its initializer gives the whole value once, the slices are
cut from it, and the whole is dropped before the next variable is made. Everything else
(BatchNorm's statistics, seeds, metrics) is made as the strategy makes it, small and per
replica as Keras's fit expects. Reading such a weight whole (`get_weights`, a call of the
model, `model.save`) gathers it, one weight at a time, and assigning it (`set_weights`,
`load_weights`, a restore) keeps each replica's slice of the value; across worker
processes a whole read is a collective every process makes at the same point. When fit
first starts, ZeRO-3 adopts the slices as they are, and a pipeline's stages take their
weights from them, one weight at a time. A strategy of one replica gets whole variables
on this process's CPU. A model built under `strategy.scope()` works too (`move_to_host`
moves its weights to this host's memory)."""

from __future__ import annotations

import contextlib
import gc
import math
import types
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.parallel import stand_in
from tfdist.strategies import replica_placement
from tfdist.training.memory import nbytes

WHO = "a model built in tfdist.host_scope"


class Dropped:
    """The whole copies a layout drops as it takes their values, freed the moment the last
    is dropped: by reference counting where it can, by a full garbage collection only where
    one still lives (in a reference cycle). A full collection walks every object of the
    process, a second or more in a notebook or a test session that holds many.

        dropped = Dropped()
        for variable in variables:
            dropped.add(compat.storage_of(variable))
            compat.replace_storage(variable, ...)
        dropped.free()
    """

    def __init__(self):
        self._copies: list[weakref.ref] = []
        self._unwatched = False  # a copy that takes no weak reference: collect to be sure

    def add(self, copy) -> None:
        # The copy, the variables it is made of (a distributed variable's per-device ones, a
        # Sliced's slices) and their resource handles: a handle a traced function captured
        # keeps the variable's memory alive after the variable object is gone.
        held = [copy, *(getattr(copy, "values", None) or getattr(copy, "parts", None) or ())]
        watched = [*held, *(getattr(v, "_handle", None) for v in held)]
        for obj in watched:
            if obj is None:
                continue
            try:
                self._copies.append(weakref.ref(obj))
            except TypeError:
                self._unwatched = True

    def free(self) -> None:
        def alive() -> bool:
            return self._unwatched or any(copy() is not None for copy in self._copies)

        # A cycle made since the last collections (a traced function that captured a copy's
        # handle) is in the young generations, which a collection of them alone frees.
        for generation in (1, 2):
            if not alive():
                break
            gc.collect(generation)
        self._copies, self._unwatched = [], False


def host_device(strategy: tf.distribute.Strategy) -> str:
    """This process's CPU, where the whole model is kept."""
    first = tf.DeviceSpec.from_string(replica_placement(strategy).devices[0])
    return first.replace(device_type="CPU", device_index=0).to_string()


@contextlib.contextmanager
def host_scope(strategy: tf.distribute.Strategy):
    """Build and compile a model here, in place of `strategy.scope()`, so that no device
    and no process holds the whole of it: each trainable variable is made as this process's
    replicas' slices, the rest as the strategy makes it. See the module docstring."""
    cut = Slices(strategy)
    host = host_device(strategy)

    def creator(next_creator, **kwargs):
        if kwargs.get("trainable", True) is False:
            return next_creator(**kwargs)
        if cut.ranks < 2:
            return compat.host_variable(strategy, host, **kwargs)
        value = kwargs["initial_value"]
        value = value() if callable(value) else value
        return Sliced(cut, tf.convert_to_tensor(value, kwargs.get("dtype")), kwargs.get("name"))

    with strategy.scope(), tf.variable_creator_scope(creator):
        yield


class Slices:
    """How a weight is cut over a strategy's replicas (ZeRO-3's layout): flattened, padded
    to a multiple of the replicas and cut into equal runs, replica r holding the r-th.

    Args:
      strategy: the strategy whose replicas hold the slices; this process holds those of
        its local replicas.
    """

    def __init__(self, strategy: tf.distribute.Strategy):
        layout = replica_placement(strategy)
        self.strategy, self.devices = strategy, list(layout.devices)
        self.ranks, self.first = layout.replicas, layout.first_replica
        # Every replica in this process (logical devices, GPUs): a whole read puts their
        # slices together; otherwise it is an all-gather across the worker processes.
        self.local = len(self.devices) == self.ranks
        self._gather = tf.function(self._gather_part, reduce_retracing=True)

    def same(self, other: Slices) -> bool:
        return (self.devices, self.ranks, self.first) == (other.devices, other.ranks, other.first)

    def length(self, size: int) -> int:
        """The elements of each replica's slice of a weight of `size` elements."""
        return max(1, math.ceil(size / self.ranks))

    def slice(self, whole, rank: int) -> tf.Tensor:
        """Replica `rank`'s slice of `whole`, in a buffer of its own (TensorFlow's slice of a
        tensor's leading rows shares its buffer: a slice kept would keep the whole)."""
        flat = tf.reshape(tf.convert_to_tensor(whole), [-1])
        size = int(flat.shape[0])
        k = self.length(size)
        flat = tf.pad(flat, [[0, k * self.ranks - size]])
        return tf.raw_ops.DeepCopy(x=flat[rank * k : (rank + 1) * k])

    def whole(self, parts: list, shape, who: str) -> tf.Tensor:
        """The weight of `shape` whole, from this process's replicas' slices `parts` (in
        device order): put together, or across worker processes all-gathered, which every
        process must make at the same point (`who` names the mode in the error if not)."""
        if self.local:
            flat = tf.concat([tf.reshape(tf.convert_to_tensor(p), [-1]) for p in parts], 0)
        else:
            with stand_in.read_together(who, self.strategy):
                flat = self._gather(tf.convert_to_tensor(parts[0]))
        return tf.reshape(flat[: int(np.prod(shape, dtype=np.int64))], shape)

    def _gather_part(self, part: tf.Tensor) -> tf.Tensor:
        def replica(part):
            with tf.device(self.devices[0]):  # the strategy gathers where its input lives
                part = tf.identity(part)
                return tf.distribute.get_replica_context().all_gather(
                    part, axis=0, options=stand_in.read_options()
                )

        gathered = self.strategy.run(replica, args=(part,))
        return self.strategy.experimental_local_results(gathered)[0]


class Sliced(stand_in.WholeStandIn):
    """A trainable weight made in host_scope over several replicas: its storage is only
    this process's replicas' slices (`parts`, plain variables on their devices), read whole
    on demand and assigned slice by slice. See the module docstring."""

    def __init__(self, cut: Slices, value: tf.Tensor, name: str | None):
        name = (name or "Variable").split(":")[0]
        self.cut = cut
        self.parts = parts = [
            compat.host_variable(
                cut.strategy,
                device,
                initial_value=cut.slice(value, cut.first + d),
                trainable=True,
                name=f"{name}_slice",
                dtype=value.dtype,
            )
            for d, device in enumerate(cut.devices)
        ]
        spec = types.SimpleNamespace(
            dtype=value.dtype, shape=value.shape, name=f"{name}:0", _shared_name=name
        )
        # The handle's source names the list, not self: no reference cycle, so the slices
        # are freed the moment a layout drops them (see Dropped).
        super().__init__(spec, lambda: parts[0])
        self.trainable = True

    @property
    def _unique_id(self) -> str:  # Keras's optimizer keys its per-weight choices by it
        return self.parts[0]._unique_id

    def read(self) -> tf.Tensor:
        return self.cut.whole([p.value() for p in self.parts], self.shape, WHO)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        del use_locking, name, read_value
        value = tf.convert_to_tensor(value, self.dtype)
        for d, part in enumerate(self.parts):
            part.assign(self.cut.slice(value, self.cut.first + d))


def hosted(model: keras.Model) -> bool:
    """Whether the model's weights are plain variables (built under host_scope), not
    copies mirrored on the replicas' devices."""
    weights = model.trainable_variables
    return bool(weights) and not isinstance(weights[0].value, tf.distribute.DistributedValues)


def check_trained_by(model: keras.Model, layout, hooks) -> None:
    """Refuses to train a model built in host_scope (its weights held in slices) where
    neither the runner factory `layout` (a pipeline) nor a hook takes it: plain data
    parallelism would keep every weight whole on every replica."""
    if layout is not None or not model.trainable_variables:
        return
    # Over several replicas host_scope makes each weight a Sliced (over one, a plain
    # variable, which trains as any other).
    if not any(isinstance(compat.storage_of(v), Sliced) for v in model.trainable_variables):
        return
    if any(hook.takes_host_scope_models for hook in hooks):
        return
    raise FitError(
        f"Model {model.name!r} was built in tfdist.host_scope, which holds its weights for "
        "the modes that share a model out: shard_optimizer='zero3', a Pipeline, or "
        "tensor_parallel(model, layout_map=...); plain data parallelism keeps every weight "
        "whole on every replica. Train it with one of those, or build it under "
        "strategy.scope(). Received: no such mode"
    )


def move_to_host(model: keras.Model, strategy: tf.distribute.Strategy) -> int:
    """Moves the trainable weights of a model to this host's memory, whole (tensor
    parallelism keeps them there): from the copies mirrored under `strategy.scope()` (the
    devices' copies are freed when nothing else holds them), or from host_scope's slices.
    Returns the bytes moved (0: already there)."""
    host, moved = host_device(strategy), 0
    for variable in model.trainable_variables:
        storage = compat.storage_of(variable)
        if not isinstance(storage, Sliced) and hosted(model):
            continue
        replacement = compat.host_variable(
            strategy,
            host,
            initial_value=tf.convert_to_tensor(variable.value),
            trainable=True,
            name=variable.name,
            dtype=variable.dtype,
        )
        compat.replace_storage(variable, replacement)
        moved += nbytes(variable) or 0
    return moved


__all__ = [
    "Sliced",
    "Slices",
    "check_trained_by",
    "host_device",
    "host_scope",
    "hosted",
    "move_to_host",
]

"""Keras 3 variables that a partitioner split across ps tasks, trained shard by shard.

With two or more ps tasks and a `variable_partitioner` (tfdist's `ps_min_shard_bytes`, or the
user's own), TensorFlow creates every large variable as a ShardedVariable: blocks of
consecutive rows, each block a variable of its own on one ps. Keras 3 wraps it like any
variable but can neither differentiate nor update through it ("'ShardedVariable' object has
no attribute 'handle'"). tfdist's parameter-server runner trains such a model this way:

- every shard gets a Keras variable of its own that wraps it (no copy), and the optimizer is
  built over those: its slot variables are per shard, created beside their shard on its ps,
  and each update runs there (the strategy colocates it with the shard);
- the forward pass reads a sharded variable through TensorFlow: an embedding lookup (Keras's
  `ops.take` along axis 0, which `Embedding` uses) gathers the batch's rows on the ps tasks
  that hold them, so a worker never fetches a whole table (a table kept whole on one ps is
  gathered there too); any other use (a `Dense` kernel) reads the whole variable, its
  shards concatenated;
- gradients are taken with respect to the shards (row slices, for a lookup) and applied to
  them, so the model's own variables stay the ones Keras saves and exports.

    training = ShardedTraining.attach(model, strategy, sample_batch)  # before the first step
    with training.lookups():
        ... forward pass and loss under a GradientTape ...
    grads = tape.gradient(loss, training.sources())
    model.optimizer.apply_gradients(training.pairs(grads))
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.training.checkpoints import CheckpointMismatchError

log = logging.getLogger(__name__)


def shards_of(value) -> list[tf.Variable] | None:
    """The shards of a ShardedVariable (or of a Keras variable backed by one), else None."""
    value = getattr(value, "value", value) if isinstance(value, keras.Variable) else value
    shards = getattr(value, "variables", None)
    if shards is None or hasattr(value, "handle"):
        return None
    return list(shards)


class ShardedTraining:
    """The model's trainable variables, with each sharded one replaced by its shards."""

    def __init__(self, model: keras.Model, parts: Mapping[int, list] | None = None):
        self.model = model
        # id(Keras variable) -> Keras variables wrapping its shards, in row order.
        self._parts: dict[int, list[keras.Variable]] = dict(parts or {})
        for variable in model.trainable_variables if parts is None else ():
            shards = shards_of(variable)
            if shards:
                _save_whole(variable)
                self._parts[id(variable)] = [
                    keras.Variable(shard, trainable=True, name=f"{variable.name}_shard_{i}")
                    for i, shard in enumerate(shards)
                ]
        self._shard_ids = {id(part) for parts in self._parts.values() for part in parts}

    @classmethod
    def attach(cls, model: keras.Model, strategy, data_batch) -> ShardedTraining | None:
        """Builds `model` from `data_batch` (as Keras's fit does) and its optimizer with
        `build_optimizer_over_shards`. Returns the ShardedTraining, or None when nothing is sharded."""
        optimizer = model.optimizer
        with strategy.scope():
            if optimizer is None or optimizer.built:
                compat.symbolic_build(model, data_batch)
                return cls.of(model) or _refuse_whole_slots(cls(model))
            # Keras would build the optimizer over the whole (sharded) variables; build the
            # model, metrics and losses first, then the optimizer over the shards.
            optimizer.built = True
            try:
                compat.symbolic_build(model, data_batch)
            finally:
                optimizer.built = False
            return build_optimizer_over_shards(model, optimizer)

    @classmethod
    def of(cls, model: keras.Model) -> ShardedTraining | None:
        """The ShardedTraining `build_optimizer_over_shards` made for `model`, if any.

        Found from the optimizer: it was built over Keras variables that wrap the shards.
        """
        optimizer = model.optimizer
        if optimizer is None or not optimizer.built:
            return None
        wrappers = {}
        for wrapper in compat.optimizer_variables_list(optimizer):
            wrappers.setdefault(id(getattr(wrapper, "value", None)), wrapper)
        parts = {}
        for variable in model.trainable_variables:
            shards = shards_of(variable)
            if shards and all(id(shard) in wrappers for shard in shards):
                parts[id(variable)] = [wrappers[id(shard)] for shard in shards]
        return cls(model, parts) if parts else None

    @property
    def sharded(self) -> list[keras.Variable]:
        """The model's variables that are split into shards."""
        return [v for v in self.model.trainable_variables if id(v) in self._parts]

    def optimizer_variables(self) -> list[keras.Variable]:
        """What the optimizer updates: each trainable variable, or its shards."""
        out = []
        for variable in self.model.trainable_variables:
            out.extend(self._parts.get(id(variable), [variable]))
        return out

    def sources(self) -> list:
        """What gradients are taken with respect to, in `optimizer_variables` order."""
        return [v.value if self._is_shard(v) else v for v in self.optimizer_variables()]

    def pairs(self, gradients) -> list[tuple]:
        """(gradient, variable) pairs for the optimizer, from gradients of `sources()`."""
        return list(zip(gradients, self.optimizer_variables(), strict=True))

    def whole(self) -> list[keras.Variable]:
        """The trainable variables that are not sharded (read whole, as Keras does)."""
        return [v for v in self.model.trainable_variables if id(v) not in self._parts]

    def _is_shard(self, variable) -> bool:
        return id(variable) in self._shard_ids

    def lookups(self):
        """While tracing a step: lookups into a table on the ps read only the batch's rows."""
        return sharded_lookups()


class _SavedWhole:
    """Saving and loading of a Keras variable backed by a ShardedVariable: as one tensor.

    Keras reads and writes a variable's value whole (`numpy()`, `__array__` for .weights.h5
    and .keras files, `_serialize_to_tensors` for tf.train.Checkpoint), which its TensorFlow
    variable delegates to the ShardedVariable, and that has neither an array form nor a
    checkpoint form Keras can write. Whole tensors also make a checkpoint independent of the
    number of shards. Mixed into the variable's own class (`_save_whole`).
    """

    def _whole(self) -> tf.Tensor:
        return tf.concat([shard.read_value() for shard in self._value.variables], axis=0)

    def numpy(self):
        return self._whole().numpy()

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._whole().numpy(), dtype=dtype)

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self._whole()}

    def _restore_from_tensors(self, restored_tensors):
        whole = _checked_shape(restored_tensors["VARIABLE_VALUE"], self.shape, self.path)
        self.assign(whole)  # the ShardedVariable splits it
        return tf.no_op()

    @property
    def _shared_name(self):
        return self.path


_SAVED_WHOLE_CLASSES: dict[type, type] = {}


def _checked_shape(tensor: tf.Tensor, shape, name: str) -> tf.Tensor:
    """`tensor`, which must have `shape`: a ValueError in TensorFlow's words when it is known
    not to (CheckpointMismatchError names it); else checked when it runs (in a tf.function,
    where the tensor read has no static shape)."""
    shape = tf.TensorShape(shape)
    if not tensor.shape.is_compatible_with(shape):
        raise ValueError(
            f"Received incompatible tensor with shape {tensor.shape} when attempting to "
            f"restore variable with shape {shape} and name {name}."
        )
    return tf.ensure_shape(tensor, shape)


def _save_whole(variable: keras.Variable) -> None:
    base = type(variable)
    if issubclass(base, _SavedWhole):
        return
    if base not in _SAVED_WHOLE_CLASSES:
        _SAVED_WHOLE_CLASSES[base] = type(f"Sharded{base.__name__}", (_SavedWhole, base), {})
    variable.__class__ = _SAVED_WHOLE_CLASSES[base]


def build_optimizer_over_shards(model: keras.Model, optimizer) -> ShardedTraining | None:
    """Builds `optimizer` for the built `model`: over the shards of its sharded variables.

    Call it under the strategy's scope, before the first step. Returns the ShardedTraining
    the parameter-server runner then trains through (`ShardedTraining.of(model)`), or None
    when no variable is sharded (the optimizer is then built as Keras builds it).
    """
    training = ShardedTraining(model)
    if not training.sharded:
        optimizer.build(model.trainable_variables)
        return None
    for variable in training.sharded:
        rows = [int(part.shape[0]) for part in training._parts[id(variable)]]
        size = int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize
        log.info(
            "%s (%s bytes) is split across the ps tasks in %d shards of %s rows; it trains "
            "shard by shard",
            variable.path, f"{size:,}", len(rows), "/".join(map(str, rows)),
        )  # fmt: skip
    _check_optimizer(optimizer, training)
    with _slots_recorded(optimizer) as slots:
        optimizer.build(training.optimizer_variables())
    _save_state_whole(training, optimizer, slots)
    return training


# Optimizers whose update of a variable depends on all of it (a norm, a factored second
# moment, an orthogonalisation), so shard-by-shard updates would differ from whole ones.
_WHOLE_VARIABLE_OPTIMIZERS = ("Adafactor", "Lamb", "Muon")


def _check_optimizer(optimizer, training: ShardedTraining) -> None:
    """Refuses an optimizer whose updates would change when a variable is split into shards."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    kind = type(inner).__name__
    if kind in _WHOLE_VARIABLE_OPTIMIZERS:
        why = f"{kind} updates each variable from all of its values"
        fix = "an optimizer that updates element by element (SGD, Adam, AdamW, RMSprop, Adagrad)"
    elif getattr(inner, "clipnorm", None):
        why = f"clipnorm={inner.clipnorm} clips each variable's gradient by its own norm"
        fix = "global_clipnorm or clipvalue instead of clipnorm"
    else:
        return
    variable = training.sharded[0]
    rows = [int(part.shape[0]) for part in training._parts[id(variable)]]
    size = int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize
    shard = size * rows[0] // int(variable.shape[0])
    raise FitError(
        f"{variable.path} ({size:,} bytes) is split across the ps tasks in shards of up to "
        f"{shard:,} bytes, and {why}, so it cannot be trained shard by shard. Use {fix}, or "
        f"keep the variable whole: a ps_min_shard_bytes (--ps_min_shard_bytes) above {size} "
        f"or one ps task. Received: optimizer={kind}"
    )


@contextlib.contextmanager
def _slots_recorded(optimizer) -> Iterator[list[tuple]]:
    """Records (slot, reference variable, slot name) for each slot the optimizer makes."""
    made: list[tuple] = []
    for each in _optimizers(optimizer):

        def add_variable_from_reference(
            reference_variable, name=None, initializer="zeros", _of=each
        ):
            slot = type(_of).add_variable_from_reference(
                _of, reference_variable, name=name, initializer=initializer
            )
            made.append((_of, slot, reference_variable, name))
            return slot

        object.__setattr__(each, "add_variable_from_reference", add_variable_from_reference)
    try:
        yield made
    finally:
        for each in _optimizers(optimizer):
            object.__delattr__(each, "add_variable_from_reference")


def _optimizers(optimizer) -> list:
    """The optimizer, and the one it wraps (a LossScaleOptimizer's) if any."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return [optimizer] if inner is None else [optimizer, inner]


class _WholeSlot(compat.Trackable):
    """One kind of optimizer slot (a momentum, say) of a sharded variable, as one tensor.

    The optimizer holds one slot per shard; saved whole, its state is the state an optimizer
    over the whole variable would hold, so a job resumes with any number of ps tasks (one:
    whole variables) from a checkpoint written with any other.
    """

    def __init__(self, parts: list[keras.Variable]):
        self.parts = parts

    def numpy(self) -> np.ndarray:
        return np.concatenate([np.asarray(part.numpy()) for part in self.parts], axis=0)

    def assign(self, value) -> None:
        start = 0
        for part in self.parts:
            rows = int(part.shape[0])
            part.assign(value[start : start + rows])
            start += rows

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": tf.concat([part.value for part in self.parts], axis=0)}

    def _restore_from_tensors(self, restored_tensors):
        rows = sum(int(part.shape[0]) for part in self.parts)
        shape = [rows, *self.parts[0].shape[1:]]
        whole = _checked_shape(restored_tensors["VARIABLE_VALUE"], shape, self.parts[0].path)
        self.assign(whole)
        return tf.no_op()


class _Listing(compat.Trackable):
    """Trackables checkpointed under "0", "1", ... as a list attribute is."""

    def __init__(self, items: list):
        self.items = items

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        return {str(i): item for i, item in enumerate(self.items)}


def _save_state_whole(training: ShardedTraining, optimizer, slots: list[tuple]) -> None:
    """Makes the optimizer save and load its state as an optimizer over whole variables does.

    Keras saves an optimizer's variables by position: in .weights.h5 and .keras files
    (`save_own_variables`), and in tf.train.Checkpoint under `_variables/<i>`, with the
    variables it was built over under `_trainable_variables/<i>`. Per-shard slots change both
    the count and the shapes, so each sharded variable's slots of one kind are listed as one
    `_WholeSlot`, where the first of them stood, and the model's own variables as built over.
    """
    owner = {
        id(part): (variable, index)
        for variable in training.sharded
        for index, part in enumerate(training._parts[id(variable)])
    }
    groups: dict[tuple, list] = {}
    for maker, slot, reference, name in slots:
        if id(reference) in owner:
            variable, index = owner[id(reference)]
            parts = groups.setdefault((id(maker), id(variable), name), [])
            parts.append((index, slot))
    whole = {}
    folded = set()
    for parts in groups.values():
        parts = [slot for _, slot in sorted(parts, key=lambda pair: pair[0])]
        whole[id(parts[0])] = _WholeSlot(parts)
        folded.update(id(slot) for slot in parts[1:])
    per_shard = folded | set(whole) | {id(v) for v in training.optimizer_variables()}
    for each in _optimizers(optimizer):
        listed = [whole.get(id(v), v) for v in each.variables if id(v) not in folded]
        _save_by_position(each, listed, training.model.trainable_variables, per_shard)


def _save_by_position(optimizer, listed: list, built_over: list, per_shard: set) -> None:
    original_children = optimizer._trackable_children
    variables, trainable = _Listing(listed), _Listing(list(built_over))

    def holds_shards(child) -> bool:
        # The optimizer's own lists of slots (Adam's `_momentums`, ...) list them per shard.
        if isinstance(child, Mapping):
            return any(id(item) in per_shard for item in child.values())
        if isinstance(child, Sequence):
            return any(id(item) in per_shard for item in child)
        return id(child) in per_shard

    def _trackable_children(save_type="checkpoint", **kwargs):
        children = original_children(save_type, **kwargs)
        if save_type != "checkpoint":
            return children
        children = {name: child for name, child in children.items() if not holds_shards(child)}
        children["_variables"], children["_trainable_variables"] = variables, trainable
        return children

    def save_own_variables(store):
        for i, variable in enumerate(listed):
            store[str(i)] = np.asarray(variable.numpy())

    def load_own_variables(store):
        if len(store.keys()) != len(listed):
            raise CheckpointMismatchError(
                f"The saved optimizer state does not fit {optimizer.name}: it holds "
                f"{len(store.keys())} variables where {optimizer.name} has {len(listed)}. It "
                "was saved by another optimizer or model; start afresh in a new directory."
            )
        for i, variable in enumerate(listed):
            variable.assign(store[str(i)])

    for method in (_trackable_children, save_own_variables, load_own_variables):
        object.__setattr__(optimizer, method.__name__, method)


def _refuse_whole_slots(training: ShardedTraining) -> None:
    # An optimizer built before tfdist saw the model has slots for whole sharded variables.
    if training.sharded:
        names = ", ".join(v.path for v in training.sharded)
        raise FitError(
            f"The optimizer was built before tfdist.fit, over variables split across the ps "
            f"tasks ({names}), so its state is not per shard. Let tfdist.fit build it: do not "
            "call optimizer.build() or train the model before. Received: an optimizer with "
            f"{len(training.model.optimizer.variables)} variables"
        )


def _on_a_ps(x) -> list[tf.Variable] | None:
    """[the variable] if x is a whole variable held by a ps task, else None."""
    value = x.value if isinstance(x, keras.Variable) else x
    if isinstance(value, tf.Variable) and "/job:ps/" in (value.device or ""):
        return [value]
    return None


@contextlib.contextmanager
def sharded_lookups() -> Iterator[None]:
    """Makes Keras's `ops.take(table, ids, axis=0)` gather on the ps tasks holding the table.

    `tf.nn.embedding_lookup` over the shards ('div' layout: the first shards take the extra
    rows, as ShardedVariable lays them out) gathers each id's row on the ps holding it; its
    gradient is a row slice of that shard. A whole table on a ps is gathered there too (Keras
    alone would read all of it into the worker every step). Other calls go to Keras
    unchanged. Only the tracing of a step is meant to run inside (the graph keeps the
    lookups).
    """
    original = compat.keras_take()

    def take(x, indices, axis=None):
        shards = (shards_of(x) or _on_a_ps(x)) if axis == 0 else None
        if not shards or isinstance(indices, tf.SparseTensor):
            return original(x, indices, axis=axis)  # Keras's own sparse lookup
        rows = sum(int(shard.shape[0]) for shard in shards)

        def wrapped(ids):  # negative ids count from the end, as in Keras's take
            return tf.where(ids < 0, ids + tf.cast(rows, ids.dtype), ids)

        if isinstance(indices, tf.RaggedTensor):
            return tf.nn.embedding_lookup(
                shards, indices.with_flat_values(wrapped(indices.flat_values))
            )
        return tf.nn.embedding_lookup(shards, wrapped(tf.convert_to_tensor(indices)))

    with compat.keras_take_replaced(take):
        yield


__all__ = ["ShardedTraining", "build_optimizer_over_shards", "shards_of", "sharded_lookups"]

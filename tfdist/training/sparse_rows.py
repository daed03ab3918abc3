"""Sparse gradients (an Embedding's looked-up rows) combined as one device's tape holds them.

Keras's optimizers apply an IndexedSlices gradient row by row, and Adam, AdamW, RMSprop and
Adagrad square each row apart: the same rows held apart or added up train differently.
One device's tape holds one row per lookup. For ids read from the batch (tokens) that is a
row per occurrence, so the rows of a batch split over replicas or micro-batches are the
parts' rows together, which is what tf.distribute gives. For ids that do not depend on the
batch (a ViT's or a Transformer's positions, `arange(length)`) the tape holds one row per
id, summed over the whole batch; split, each part holds such a row, and the parts' rows
must be added elementwise. tf.distribute concatenates them instead, so Keras's own
MirroredStrategy trains keras.io's ViT 4.3e-3 away from one device under AdamW.

Which kind a gradient is comes from the traced graph: its ids are batch-independent when
nothing they are computed from is the batch (a shape of it is not: the parts share it).
Where that cannot be shown (an eager step, a loop's carried values) the rows are treated as
read from the batch, which is tf.distribute's own behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

# Ops whose output depends on the shape of their input only.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "VariableShape"})


def batch_independent(indices) -> bool:
    """Whether `indices` (a sparse gradient's ids, in a traced step) are computed without
    reading the batch: from constants, shapes and variables only."""
    if not hasattr(indices, "graph") or not hasattr(indices, "op"):
        return False  # eager: no graph to read
    seen: set[int] = set()
    stack = [indices]
    while stack:
        tensor = stack.pop()
        op = tensor.op
        if id(op) in seen:
            continue
        seen.add(id(op))
        if op.type in _SHAPE_OPS or op.type in ("ReadVariableOp", "Const"):
            continue
        if "Iterator" in op.type or op.type == "OptionalGetValue":
            return False  # the batch itself
        if op.type == "Placeholder":
            outer = _captured(op.graph, tensor)
            if outer is None:
                return False  # an argument of the traced function: the batch, as far as known
            if not hasattr(outer, "op") or outer.dtype == tf.resource:
                continue  # an eager constant, or a variable's handle
            stack.append(outer)
            continue
        stack.extend(op.inputs)
    return True


def _captured(graph, internal):
    """The outer tensor `internal` (a placeholder of `graph`) captures, or None."""
    for external, placeholder in getattr(graph, "captures", ()):
        if placeholder is internal:
            return external
    return None


def added(a, b):
    """Two parts' gradients of one weight (two micro-batches', say), as one device's tape
    would hold them for both parts together: sparse rows of batch-independent ids added
    elementwise, other sparse rows kept side by side, dense gradients added."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        if _same_ids(a, b):
            return tf.IndexedSlices(a.values + b.values, a.indices, a.dense_shape)
        indices = [tf.cast(a.indices, tf.int64), tf.cast(b.indices, tf.int64)]
        return tf.IndexedSlices(
            tf.concat([a.values, b.values], 0), tf.concat(indices, 0), a.dense_shape
        )
    if isinstance(a, tf.IndexedSlices) or isinstance(b, tf.IndexedSlices):
        return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)
    return a + b


def _same_ids(a: tf.IndexedSlices, b: tf.IndexedSlices) -> bool:
    return (
        batch_independent(a.indices)
        and batch_independent(b.indices)
        and a.indices.shape.is_compatible_with(b.indices.shape)
    )


def scaled(grad, factor):
    """`grad` times `factor`, a sparse one kept sparse (its rows as they are)."""
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values * tf.cast(factor, grad.values.dtype)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    return grad * tf.cast(factor, grad.dtype)


def independent_made_dense(grads: Sequence[Any]) -> list[Any]:
    """`grads` with each sparse gradient of batch-independent ids made dense: for an
    exchange that sums dense gradients (a sharded update's reduce-scatter, the tensor parts'
    sum), where one device's one row per id is the parts' rows added."""
    return [
        tf.convert_to_tensor(g)
        if isinstance(g, tf.IndexedSlices) and batch_independent(g.indices)
        else g
        for g in grads
    ]


def summed_on_first_replica(grads: Sequence[Any]) -> list[Any]:
    """In a replica's step, before its gradients are summed over the replicas by
    concatenating sparse rows (Keras's apply, a sharded update's gather): each sparse
    gradient of batch-independent ids replaced by the replicas' rows added elementwise on
    the first replica, and by no rows on the others. Their concatenation is then the rows
    one device's tape holds for the global batch. Other gradients are returned as given."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return list(grads)
    if isinstance(tf.distribute.get_strategy(), tf.distribute.TPUStrategy):
        # The replicas are one XLA program, whose shapes cannot depend on the replica:
        # tf.distribute's rows there, as Keras's own fit has them.
        return list(grads)
    chosen = [
        i
        for i, g in enumerate(grads)
        if isinstance(g, tf.IndexedSlices) and batch_independent(g.indices)
    ]
    if not chosen:
        return list(grads)
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i].values for i in chosen])
    first = tf.cast(tf.equal(context.replica_id_in_sync_group, 0), tf.int32)
    out = list(grads)
    for i, values in zip(chosen, summed, strict=True):
        rows = tf.shape(values)[0] * first
        out[i] = tf.IndexedSlices(values[:rows], grads[i].indices[:rows], grads[i].dense_shape)
    return out

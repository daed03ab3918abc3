"""The exchanges of tensor-parallel layers within a group of T replicas, as conjugate pairs.

Megatron-LM names its collectives by what they do forward and pairs each with its gradient
(mappings.py there: copy-to / reduce-from, scatter-to / gather-from). tfdist's split layers
keep each replica's batch its own outside a split block (sequence parallelism, over the
batch), so their pairs are:

  forward                                      backward (the other of the pair)
  gather_from_group     all-gather the group's examples    reduce-scatter the gradient to them
  reduce_scatter_to_group  sum the group's partial results,  all-gather the gradient
                        each member keeps its own examples
  gather_from_parts     all-gather the feature parts       each member's part of the gradient
  scatter_to_parts      each member's part of the features  (the gradient's parts, gathered
                                                           by the gather_from_group before it)

A Column -> Row block is gather_from_group then reduce_scatter_to_group: one all-gather
forward and one reduce-scatter, the same two backward. The backward halves are the
gradients TensorFlow derives for `ReplicaContext.all_gather` (an all-reduce of the upstream
gradient, sliced back to each replica's part), so each pair is exact by construction.

Every replica's batch size is gathered once per traced step (by the first gather) and read
by the layers after it (`step_sizes`).
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from tfdist.collective import replicas
from tfdist.errors import FitError
from tfdist.training import sparse_rows


class TensorParallelError(FitError):
    """A layer cannot be split as asked (the message says why and how to fix it)."""


def replica_in_step() -> tuple[int, int] | None:
    """(this replica's id, replicas) inside a strategy's step with several replicas; else None."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    if replica is None:
        raise TensorParallelError(
            "Tensor-parallel layers need each replica's id when the step is traced (one "
            "program per replica, as mirrored strategies trace). Received: a dynamic id"
        )
    return int(replica), context.num_replicas_in_sync


def _group_rows(x, sizes, group: int, degree: int):
    """The rows of the members of `group` in `x`, every replica's rows end to end."""
    starts = tf.concat([[0], tf.cumsum(sizes)], 0)
    return x[starts[group * degree] : starts[(group + 1) * degree]]


# Every replica's row count at the last gather traced in the step: a row layer reads it to
# hand the rows back (its input holds the group's rows, not its own count). Each gather
# counts its own tensor's rows: not every split layer takes the batch (a position embedding
# looks up the positions, the same on every replica). Keyed by the graph being built (a
# loop's body is a graph of its own) and the replica (mirrored strategies trace their
# replicas in threads at once).
_SIZES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sizes(x, replica: int):
    sizes = replicas.all_gather(tf.shape(x)[:1])
    _SIZES.setdefault(tf.compat.v1.get_default_graph(), {})[replica] = sizes
    return sizes


def gather_from_group(x, degree: int, *, gather=None):
    """Forward: every example of this replica's group (its members' batches end to end),
    and every replica's batch size. Backward (its conjugate, reduce_scatter_to_group): each
    member's own rows of the gradient, summed over the group.

    `gather`: the all-gather to use (None: TensorFlow's `ReplicaContext.all_gather`)."""
    replica, _ = replica_in_step()
    sizes = _sizes(x, replica)
    boolean = x.dtype == tf.bool  # collectives take numbers: a mask travels as int32
    if gather is None:
        # TensorFlow's own gather, not replicas.all_gather: with that one alone here,
        # keras-hub's Gemma ended 1.1e-5 from one device's weights (its tests hold 1e-5),
        # rounding that moved (the forward is exact), against under 1e-5 with this.
        context = tf.distribute.get_replica_context()
        gather = lambda value: context.all_gather(value, axis=0)  # noqa: E731
    everyone = gather(tf.cast(x, "int32") if boolean else x)
    rows = _group_rows(everyone, sizes, replica // degree, degree)
    return (tf.cast(rows, tf.bool) if boolean else rows), sizes


def step_sizes(layer_name: str) -> tf.Tensor:
    """Every replica's batch size in this step (recorded by the split layer before)."""
    replica, _ = replica_in_step()
    sizes = _SIZES.get(tf.compat.v1.get_default_graph(), {}).get(replica)
    if sizes is None:
        raise TensorParallelError(
            f"{layer_name} takes the split output of a ColumnParallelDense (or a parallel "
            "embedding or attention layer) but none ran before it in this step. Put a "
            "column-parallel layer before it, or pass input_is_parallel=False. "
            "Received: a row-parallel layer first"
        )
    return sizes


def reduce_scatter_to_group(partial, sizes, degree: int):
    """Forward: this replica's own rows of the sum of its group's `partial`s (each [group
    examples, ...]). Backward (its conjugate, gather_from_group): the group's rows of the
    gradient, gathered."""
    replica, _ = replica_in_step()
    group, rank = divmod(replica, degree)
    # Every replica's partial, end to end: each is as long as its group's examples.
    everyone = replicas.all_gather(partial)
    length = tf.reduce_sum(sizes[group * degree : (group + 1) * degree])
    start = degree * tf.reduce_sum(sizes[: group * degree])
    # The group's partials as [degree, length, ...], summed: one slice and one sum, whose
    # gradient is one broadcast (a slice per member would each pad a gradient as large as
    # every replica's partials).
    members = everyone[start : start + degree * length]
    members = tf.reshape(members, tf.concat([[degree, length], tf.shape(partial)[1:]], 0))
    mine = tf.ensure_shape(tf.reduce_sum(members, axis=0), [None, *partial.shape[1:]])
    offset = tf.reduce_sum(sizes[group * degree : group * degree + rank])
    return mine[offset : offset + sizes[replica]]


def gather_from_parts(columns, sizes, degree: int):
    """Forward: this replica's own examples with every part's features, end to end (the
    group's column parts [group examples, units/T] gathered). Backward: each member's part."""
    replica, _ = replica_in_step()
    everyone = replicas.all_gather(columns[None])  # [replicas, rows, units/T]
    group, rank = divmod(replica, degree)
    members = everyone[group * degree : (group + 1) * degree]
    whole = tf.concat(tf.unstack(members, num=degree), axis=-1)
    offset = tf.reduce_sum(sizes[group * degree : group * degree + rank])
    return whole[offset : offset + sizes[replica]]


def scatter_to_parts(x, degree: int, width: int):
    """Forward: this member's `width` features of `x` (its part of the split input).
    Backward: the gradient in its part, zeros elsewhere; the gather_from_group before it
    adds the members' parts."""
    replica, _ = replica_in_step()
    rank = replica % degree
    return tf.ensure_shape(x[..., rank * width : (rank + 1) * width], [*x.shape[:-1], width])


def summed_over(grads: list, shapes: list, copies: list[int]) -> list:
    """Each of `grads` summed over the replicas `copies` (each replica passes its own).

    The dense ones travel packed in one gather. A sparse gradient (an embedding's lookups)
    stays sparse: its rows are gathered, not added, as Keras's own optimizers take them
    (Adam squares each looked-up row's gradient apart, so a densified sum would train
    differently from Keras on one device). Rows of ids that do not depend on the batch
    (positions) are one row per id on one device, summed over the batch: they travel dense
    (tfdist.training.sparse_rows), as do the group's copies of them on one replica.
    """
    grads = sparse_rows.independent_made_dense(grads)
    if len(copies) == 1:
        return grads
    out = list(grads)
    dense = [i for i, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
    if dense:
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(grads[i]), [-1]) for i in dense], 0)
        everyone = replicas.all_gather(flat[None])  # [replicas, elements]
        total = tf.add_n([everyone[r] for r in copies])
        sizes = [int(np.prod(shapes[i])) for i in dense]
        for i, piece in zip(dense, tf.split(total, sizes), strict=True):
            out[i] = tf.reshape(piece, shapes[i])
    for i, grad in enumerate(grads):
        if isinstance(grad, tf.IndexedSlices):
            counts = replicas.all_gather(tf.shape(grad.indices)[:1])
            values = replicas.all_gather(grad.values)
            indices = replicas.all_gather(grad.indices)
            starts = tf.concat([[0], tf.cumsum(counts)], 0)
            out[i] = tf.IndexedSlices(
                tf.concat([values[starts[r] : starts[r + 1]] for r in copies], 0),
                tf.concat([indices[starts[r] : starts[r + 1]] for r in copies], 0),
                grad.dense_shape,
            )
    return out


__all__ = [
    "TensorParallelError",
    "gather_from_group",
    "gather_from_parts",
    "reduce_scatter_to_group",
    "replica_in_step",
    "scatter_to_parts",
    "step_sizes",
    "summed_over",
]

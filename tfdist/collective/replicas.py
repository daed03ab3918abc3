"""Exchanges among a step's replicas, read where the values lie when every replica is in
this process.

`ReplicaContext.all_gather` builds, for each call on each replica, two collective gathers
(the shapes, then the padded values) with their pads and slices, and every collective is
resolved again when its program first runs. A tensor-parallel step gathers in every split
block. On 4 logical CPUs, a step of 40 differentiated gathers took 9.8 s to trace, 9.3 s to
run once and 46.5 ms a step after; read where the parts lie, 3.2 s, 0.38 s and 0.31 ms
(tools/gather_bench.py).

When the step's replicas are the threads of one MirroredStrategy in this process, one
`merge_call` hands every replica's value to the strategy at once (as TensorFlow's own
gather does before its collectives): each device concatenates the parts, which are tensors
of the same graph, and the gradient sums the replicas' gradients the same way. Where the
replicas are not all here (worker processes, a TPU), TensorFlow's collectives run. Every
replica takes the same path: they run the same code.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist import compat


def all_gather(x: tf.Tensor) -> tf.Tensor:
    """Every replica's `x` end to end along axis 0, on every replica, in its step
    (`ReplicaContext.all_gather(x, axis=0)`). The replicas' row counts may differ.

    Its gradient is what TensorFlow's is: the replicas' gradients of the whole summed, and
    this replica's rows of the sum.
    """
    context = tf.distribute.get_replica_context()
    if not _all_here(context):
        return context.all_gather(x, axis=0)

    @tf.custom_gradient
    def gather(part):
        whole, starts = context.merge_call(_concat_everywhere, args=(part,))

        def grad(upstream):
            # The replica context the gradient is taken in: a pipeline's stage group takes
            # a pass's gradient in a later run of its strategy than the pass's (the same
            # replica, another context).
            now = tf.distribute.get_replica_context()
            total = now.merge_call(_sum_everywhere, args=(tf.convert_to_tensor(upstream),))
            replica = now.replica_id_in_sync_group
            return total[starts[replica] : starts[replica + 1]]

        return whole, grad

    return gather(x)


def _all_here(context) -> bool:
    """Whether the step's replicas can hand their values over by one merge_call here."""
    if context is None or context.num_replicas_in_sync == 1:
        return False
    extended = context.strategy.extended
    return (
        len(extended.worker_devices) == context.num_replicas_in_sync
        and compat.replica_threads_here()
    )


def _concat_everywhere(strategy, parts):
    """(every part end to end, the row where each replica's part starts) on each device."""
    values = _ends(strategy, parts)
    rows = tf.stack([tf.shape(v, out_type=tf.int32)[0] for v in values])
    starts = tf.concat([[0], tf.cumsum(rows)], 0)
    return _on_each_device(strategy, lambda: (tf.concat(values, 0), tf.identity(starts)))


def _sum_everywhere(strategy, parts):
    values = _ends(strategy, parts)
    return _on_each_device(strategy, lambda: tf.add_n(values))


def _on_each_device(strategy, make):
    """`make()` on each of this process's devices, each replica given its own device's."""
    out = []
    for device in strategy.extended.worker_devices:
        with tf.device(device):
            out.append(make())
    return strategy.experimental_distribute_values_from_function(
        lambda c: out[c.replica_id_in_sync_group]
    )


def _ends(strategy, parts) -> list[tf.Tensor]:
    """Each replica's part, its gradient left to the caller's custom gradient. Stopped here:
    tf.custom_gradient walks back from what it returns to its input, looking for variables
    read, and would otherwise walk every other replica's graph (a walk per call that grows
    with the step: 10 s of a keras-hub model's 4-replica trace)."""
    return [tf.stop_gradient(v) for v in strategy.experimental_local_results(parts)]


__all__ = ["all_gather"]

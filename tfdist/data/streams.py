"""A shuffle order of its own for each parameter-server worker's copy of the data.

Under parameter-server training every worker streams the whole data (TensorFlow gives each
one the same input context: pipeline 0 of 1). A shuffle with a fixed seed then draws the same
order on every worker, and a global seed (`keras.utils.set_random_seed`) fixes an unseeded
shuffle just as well, so the workers apply the same batch one after another instead of
different ones. `worker_shuffle` is the cure: inside the dataset function of a per-worker
dataset it shuffles with `seed + k` on the k-th stream (streams are numbered 0, 1, ... by a
counter on the ps as the workers build their datasets, modulo the number of workers), and
everywhere else it is `dataset.shuffle(buffer_size, seed)` itself. Stream 0 keeps `seed`'s
order, so a one-worker job reads what one device would.

The stream number is a tensor, and a tensor seed fails under a global seed of 0 (TensorFlow
then compares the seed pair with (0, 0) in Python), so each stream's shuffle is one branch
of a `tf.switch_case` with a Python seed.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from tfdist import compat

_local = threading.local()


@contextlib.contextmanager
def numbered_streams(strategy: tf.distribute.Strategy):
    """Within: dataset functions traced for per-worker datasets number their stream."""
    with strategy.scope():
        counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="worker_streams")
    _local.counter, _local.claims = counter, {}
    _local.streams = compat.strategy_cluster_resolver(strategy).cluster_spec().num_tasks("worker")
    try:
        yield
    finally:
        _local.counter = _local.claims = _local.streams = None


def stream_number() -> tf.Tensor | None:
    """This per-worker stream's number in [0, workers), an int64 tensor; None outside one.

    A worker that is replaced builds its dataset again and takes the next number, which may
    repeat a live worker's order.
    """
    counter = getattr(_local, "counter", None)
    if counter is None or tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    # One claim per dataset function, however many shuffles ask for it.
    if graph not in _local.claims:
        _local.claims[graph] = (counter.assign_add(1) - 1) % _local.streams
    return _local.claims[graph]


def worker_shuffle(
    dataset: tf.data.Dataset,
    buffer_size: int,
    seed: int | None,
    *,
    reshuffle_each_iteration: bool = True,
) -> tf.data.Dataset:
    """`dataset.shuffle(buffer_size, seed)`, with each parameter-server worker's own seed.

    Call it where a dataset function shuffles: under parameter_server the k-th worker's
    stream shuffles with `seed + k` (with seed None, each draws its own op seed); under every
    other strategy, and on the first worker, the order is exactly `seed`'s.
    """
    number = stream_number()

    def shuffled(offset: int) -> tf.data.Dataset:
        return dataset.shuffle(
            buffer_size,
            seed=None if seed is None else seed + offset,
            reshuffle_each_iteration=reshuffle_each_iteration,
        )

    if number is None:
        return shuffled(0)
    return tf.switch_case(
        tf.cast(number, tf.int32), [lambda k=k: shuffled(k) for k in range(_local.streams)]
    )

"""Compiled losses normalised over the global batch, as one device normalises them.

Keras reduces a compiled loss on each replica by that replica's own count: under a mask
(`Embedding(mask_zero=True)`, `Masking`, a layer's `compute_mask`) by the replica's own
unmasked elements, under `reduction="mean_with_sample_weight"` by the replica's own sum of
weights. One device divides the whole batch's sum by the whole batch's count, so replicas
that hold different counts train other weights (Keras's own MirroredStrategy does: 1.2e-4
from one device on keras.io's seq2seq Transformer with SGD). Inside a step traced in
`global_batch()`, each such loss is the replica's sum divided by the count summed over the
replicas, one scalar all-reduce per loss, as Megatron-LM divides by the global number of
loss tokens. A loss with neither (Keras's default mean over the elements) needs nothing: its
count is the replica's share of the batch.

Micro-batches of one replica (accumulate_steps) see one micro-batch at a time, so each is
normalised by its own count (over the replicas) and the count is `recorded()`: the hook
that sums the micro-batches' gradients weighs each by its count, which makes the sum the
whole batch's sum over the whole batch's count.

A user's own `train_step` that calls `compute_loss` (or the compiled loss) gets the same; a
loss it computes itself (`tf.reduce_mean(...)`) means what it says on each replica.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import tensorflow as tf

from tfdist import compat

_MEANS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


class _Scope(threading.local):
    """Per thread (a mirrored strategy traces its replicas in threads at once): whether a
    step is traced here, and the counts recorded for the micro-batch being traced."""

    def __init__(self):
        self.depth = 0
        self.counts: list[list[tf.Tensor]] = []


_SCOPE = _Scope()
_LOCK = threading.Lock()
_USERS = 0
_ORIGINAL = None


@contextlib.contextmanager
def global_batch() -> Iterator[None]:
    """While a replica's step is traced in this thread, compiled losses under a mask or
    reduced by their weights divide by the count of the whole batch (every replica's)."""
    global _USERS, _ORIGINAL
    with _LOCK:
        if not _USERS:
            _ORIGINAL = compat.replace_loss_reduction(_reduce)
        _USERS += 1
    _SCOPE.depth += 1
    try:
        yield
    finally:
        _SCOPE.depth -= 1
        with _LOCK:
            _USERS -= 1
            if not _USERS:
                compat.replace_loss_reduction(_ORIGINAL)
                _ORIGINAL = None


@contextlib.contextmanager
def recorded() -> Iterator[list[tf.Tensor]]:
    """Within the block (inside `global_batch()`), the counts of the losses normalised by a
    count of their own (masked or weighted), each summed over the replicas, in the order the
    losses are reduced: one micro-batch's."""
    counts: list[tf.Tensor] = []
    _SCOPE.counts.append(counts)
    try:
        yield counts
    finally:
        _SCOPE.counts.pop()


def _reduce(values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None):
    """Keras's `reduce_weighted_values`, with the count over the global batch where the
    count is the replica's own (a mask, or the weights' sum)."""
    original = _ORIGINAL
    reduction = compat.standardize_loss_reduction(reduction)
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync if context is not None else 1
    own_count = mask is not None or (
        reduction == "mean_with_sample_weight" and sample_weight is not None
    )
    recording = bool(_SCOPE.counts)
    values = tf.convert_to_tensor(values, dtype=dtype)
    if (
        not _SCOPE.depth
        or reduction not in _MEANS
        or not own_count
        or values.shape.rank == 0
        or (replicas == 1 and not recording)
    ):
        return original(values, sample_weight, mask, reduction, dtype)
    summed = original(values, sample_weight, mask, "sum", dtype)
    count = tf.stop_gradient(_count(values, sample_weight, mask, reduction))
    if replicas > 1:
        count = context.all_reduce(tf.distribute.ReduceOp.SUM, count)
    if recording:
        _SCOPE.counts[-1].append(count)
    # Keras scales each replica's loss by 1/replicas before the gradients are summed over
    # them: the replica's sum over the global count, times the replicas, is what it scales.
    share = count / tf.cast(replicas, count.dtype)
    return compat.scale_loss_for_distribution(tf.math.divide_no_nan(summed, share))


def _count(values, sample_weight, mask, reduction) -> tf.Tensor:
    """What Keras divides a replica's sum by, as Keras computes it: the unmasked elements
    (scaled by the values' size over the mask's, as Keras's mask weights are), or the
    weights' sum (mask included) for mean_with_sample_weight."""
    dtype = values.dtype
    size = tf.cast(tf.size(values), dtype)
    if reduction == "mean_with_sample_weight":
        weights = None if sample_weight is None else tf.cast(sample_weight, dtype)
        if mask is not None:
            mask = tf.cast(mask, dtype)
            if weights is None:
                weights = mask
            else:
                mask, weights = compat.same_rank(mask, weights)
                weights = weights * mask
        _, weights = compat.same_rank(values, weights)
        return tf.reduce_sum(weights)
    mask = tf.cast(mask, dtype)
    return tf.reduce_sum(mask) * size / tf.cast(tf.size(mask), dtype)

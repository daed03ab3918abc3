"""What a stage's step adds up: one weight's gradients (dense, or rows as one device's tape
holds them), and the metric state and loss terms it hands on.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.training import sparse_rows


def added(a, b):
    """Two gradients of one weight (two micro-batches', two pipelines'), added as one
    device's tape holds them for both together (tfdist.training.sparse_rows). Between worker
    processes the ring sums them dense (see the pipeline's `_update`)."""
    return sparse_rows.added(a, b)


def dense_part(g) -> tf.Tensor:
    """A tensor that exists once `g` does (something to wait for)."""
    return g.values if isinstance(g, tf.IndexedSlices) else g


def metric_state(model, variables, state, y, y_pred, sample_weight, loss, size) -> list:
    """The metric state (`state`, the values of `variables`) after one micro-batch's loss
    (counted `size` times) and compiled metrics: what a stage-by-stage step hands on."""
    with keras.StatelessScope(state_mapping=list(zip(variables, state, strict=True))) as scope:
        compat.loss_tracker(model).update_state(loss, sample_weight=size)
        model.compute_metrics(None, y, y_pred, sample_weight=sample_weight)
    return [scope.get_current_value(v) for v in variables]


def added_to_loss(model, variables, state, amount) -> list:
    """`state` with `amount` added to the logged loss's total (a stage's penalty)."""
    total = compat.loss_tracker(model).total
    return [
        s + tf.cast(amount, s.dtype) if v is total else s
        for s, v in zip(state, variables, strict=True)
    ]

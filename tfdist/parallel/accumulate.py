"""Gradient accumulation: k micro-batches per optimizer step, one exchange per step.

A step's batch is too large to fit in memory, or a larger batch than the devices hold is
wanted: each replica splits its batch into k micro-batches, runs the model's train_step on
each (forward, backward, metrics), sums their gradients locally, and hands the sum on once
(the all-reduce, or a sharded update, then the optimizer): k times the examples per
exchange, and the same update as one batch of k micro-batches' size.

The sum weighs each micro-batch's gradient by its share of the batch's examples: Keras's
default loss reduction ('sum_over_batch_size') averages over the micro-batch, so the
weighted sum is the gradient of the average over the whole batch (exact for equal shares,
and for a short last batch too). A loss that divides by a count of its own (unmasked
tokens, or the weights' sum: tfdist.training.loss_normalisation) weighs each micro-batch by
that count instead, and the sum is divided by the batch's: the whole batch's mean, as one
device takes it.

Unlike Keras's own `gradient_accumulation_steps` (an optimizer option that decides with a
tf.cond whether a step exchanges, which fails under MirroredStrategy: "merge_call called
while defining a new graph"), the split happens inside one step, so every step exchanges
exactly once, unconditionally.

Example:

    tfdist.fit(model, data, batch_size=256, accumulate_steps=4)   # micro-batches of 64
    # or: tfdist.fit(model, data, step_hooks=[tfdist.parallel.Accumulate(4)])
"""

from __future__ import annotations

import threading

import keras
import tensorflow as tf

from tfdist.errors import FitError
from tfdist.training import loss_normalisation, sparse_rows
from tfdist.training.hooks import StepHook
from tfdist.training.job import Job


class Accumulate(StepHook):
    """Splits each replica's batch into `steps` micro-batches and applies their gradients,
    summed, once per step. Place it before a sharded update in a chain of hooks.

    Args:
      steps: micro-batches per step (>= 1; 1 changes nothing).
    """

    synchronous_only = True

    def __init__(self, steps: int):
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise FitError(f"accumulate_steps must be a whole number >= 1. Received: {steps!r}")
        self.steps = steps
        # A mirrored strategy traces its replicas' steps in threads of their own, at once.
        self._threads = threading.local()

    @property
    def name(self) -> str:
        return f"accumulate_steps={self.steps}"

    def build(self, model: keras.Model, job: Job) -> None:
        del job
        optimizer = model.optimizer
        if optimizer is not None and optimizer.gradient_accumulation_steps:
            raise FitError(
                "Give accumulation once: accumulate_steps splits each step into micro-batches, "
                "and the optimizer's gradient_accumulation_steps would accumulate again over "
                "steps. Drop gradient_accumulation_steps from the optimizer. Received: "
                f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps}"
            )

    def check_batch(self, per_replica_batch: int) -> None:
        """Refuses a per-replica batch that `steps` micro-batches do not split evenly."""
        if per_replica_batch % self.steps:
            raise FitError(
                f"accumulate_steps={self.steps} must divide each replica's batch, which is "
                f"{per_replica_batch} examples: choose a batch size that divides by "
                f"{self.steps} x the replicas, or another accumulate_steps. "
                f"Received: accumulate_steps={self.steps}"
            )

    def step(self, batch, train_step):
        if self.steps == 1:
            return train_step(batch)
        size = _batch_size(batch)
        per = (size + self.steps - 1) // self.steps  # the last micro-batch may be short
        state = self._threads
        state.sums, state.total, outputs = None, None, None
        try:
            for i in range(self.steps):
                start = tf.minimum(i * per, size)
                end = tf.minimum(start + per, size)
                micro = tf.nest.map_structure(lambda t, a=start, b=end: _rows(t, a, b), batch)
                # Its share of the batch's examples (0: an empty micro-batch of a short batch).
                state.weight = tf.cast(end - start, tf.float32) / tf.cast(
                    tf.maximum(size, 1), tf.float32
                )
                state.last = i == self.steps - 1
                with loss_normalisation.recorded() as counts:
                    state.counts = counts
                    outputs = train_step(micro)
        finally:
            state.sums = state.total = None
            del state.last, state.counts
        return outputs

    def apply(self, grads_and_vars, apply_next):
        state = self._threads
        if not hasattr(state, "last"):  # not inside `step`: nothing to accumulate
            return apply_next(grads_and_vars)
        weight = self._weight(state)
        weighted = [None if g is None else sparse_rows.scaled(g, weight) for g, _ in grads_and_vars]
        if state.sums is not None:
            weighted = [
                s if g is None else (g if s is None else sparse_rows.added(s, g))
                for s, g in zip(state.sums, weighted, strict=True)
            ]
        if not state.last:
            state.sums = weighted
            return None  # held: the next micro-batch adds to it
        if state.total is not None:  # weighed by counts: the batch's mean over its count
            total = state.total
            weighted = [None if g is None else sparse_rows.scaled(g, 1.0 / total) for g in weighted]
        state.sums = state.total = None
        return apply_next([(g, v) for g, (_, v) in zip(weighted, grads_and_vars, strict=True)])

    def _weight(self, state):
        """This micro-batch's weight in the sum: its loss's own count (over the replicas),
        added to the step's total; else its share of the examples."""
        if not state.counts:
            return state.weight
        if len(state.counts) > 1:
            raise FitError(
                f"accumulate_steps={self.steps} sums micro-batches whose losses each divide "
                f"by a count of their own (masked, or reduced by their weights): "
                f"{len(state.counts)} such losses cannot all be normalised over the whole "
                "batch by one weight per micro-batch. Use accumulate_steps=1 (a larger "
                "batch, or more replicas), or give all but one loss Keras's default "
                "reduction. Received: "
                f"{len(state.counts)} masked or weight-reduced losses"
            )
        count = tf.cast(state.counts[0], tf.float32)
        state.total = count if state.total is None else state.total + count
        return count


def _batch_size(batch) -> tf.Tensor:
    leaf = next(t for t in tf.nest.flatten(batch) if t is not None)
    return tf.shape(leaf)[0]


def _rows(tensor, start, end):
    return None if tensor is None else tensor[start:end]

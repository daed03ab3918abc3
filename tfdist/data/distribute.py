"""Strategy wiring in one place: global batch -> per-replica batch -> what training consumes.

The global batch is what users set; everything else is derived here and logged once:

    Global batch 64 = 2 replicas x 32 per replica, fed by 2 input pipelines (multi_worker_mirrored)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import tensorflow as tf

from tfdist.data.records import DataError
from tfdist.strategies import batch_multiple, distribute_datasets, strategy_kind

log = logging.getLogger(__name__)

DatasetFn = Callable[[tf.distribute.InputContext, int], tf.data.Dataset]
"""Builds one input pipeline's dataset: (input_context, per_replica_batch_size) -> batches."""


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of a strategy: the only place it is done."""

    strategy: str
    global_batch_size: int
    replicas: int

    @property
    def per_replica_batch_size(self) -> int:
        return self.global_batch_size // self.replicas

    def describe(self) -> str:
        text = (
            f"Global batch {self.global_batch_size} = {self.replicas} replica(s) x "
            f"{self.per_replica_batch_size} per replica ({self.strategy})"
        )
        multiple = batch_multiple(self.strategy)
        if self.per_replica_batch_size % multiple:
            # The multiple is 1 but on TPU cores (tfdist.strategies.tpu says why they pad),
            # hence the advice names them.
            text += (
                f"; TPU cores pad each batch to a multiple of {multiple}, so a global batch "
                f"that is a multiple of {multiple * self.replicas} wastes none of a step"
            )
        return text


def plan_batches(strategy: tf.distribute.Strategy, global_batch_size: int) -> BatchPlan:
    """Derives the per-replica batch from the global one.

    Raises:
      DataError: the global batch is not a positive multiple of the replicas in sync.
    """
    replicas = strategy.num_replicas_in_sync
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise DataError(
            f"The global batch size must be a positive integer. Received: global_batch_size={global_batch_size!r}"
        )
    if global_batch_size % replicas:
        lower = max(replicas, global_batch_size // replicas * replicas)
        raise DataError(
            f"The global batch size {global_batch_size} does not split evenly over the "
            f"{replicas} replicas in sync; use a multiple of {replicas}, e.g. {lower} or "
            f"{lower + replicas}. Received: global_batch_size={global_batch_size}"
        )
    return BatchPlan(strategy_kind(strategy), global_batch_size, replicas)


def distribute_dataset(
    strategy: tf.distribute.Strategy,
    dataset_fn: DatasetFn,
    *,
    global_batch_size: int,
    coordinator: tf.distribute.experimental.coordinator.ClusterCoordinator | None = None,
):
    """Turns a dataset function into what `strategy`'s training step consumes.

    Args:
      strategy: any tf.distribute strategy.
      dataset_fn: builds one input pipeline's batches, given its InputContext and the
        per-replica batch size.
      global_batch_size: examples per step across all replicas.
      coordinator: the ClusterCoordinator; required for parameter_server.

    Returns:
      A distributed dataset (from distribute_datasets_from_function) for synchronous
      strategies, or a per-worker dataset for parameter_server, whose iterator the
      coordinator's scheduled steps take their batches from.

    Raises:
      DataError: the global batch does not split over the replicas.
      StrategyError: parameter_server without a coordinator.
    """
    plan = plan_batches(strategy, global_batch_size)
    log.info("%s", plan.describe())

    def per_pipeline(context: tf.distribute.InputContext) -> tf.data.Dataset:
        return dataset_fn(context, context.get_per_replica_batch_size(global_batch_size))

    return distribute_datasets(strategy, per_pipeline, coordinator=coordinator)


# The label of the examples `pad_to_whole_steps` adds; evaluation weights them out.
PAD_LABEL = -1


def pad_to_whole_steps(
    dataset: tf.data.Dataset, *, batch_size: int, batches_per_step: int
) -> tf.data.Dataset:
    """Pads one input pipeline's (image, label) batches into whole steps of full batches.

    For evaluation on a TPU, which compiles a program per input shape: every batch gets the
    static shape [batch_size, ...] and the pipeline ends on a whole step (a batch for each of
    its replicas). Dropping the last partial batch instead would silently skip up to a batch
    per replica of the test set and make a TPU's figures differ from a GPU's; so the batches
    are topped up with zero images labelled PAD_LABEL, which the evaluation step counts for
    nothing.

    Args:
      dataset: batches of (image, label), the last batch possibly partial, images of a fully
        known shape.
      batch_size: the per-replica batch.
      batches_per_step: the replicas this pipeline feeds (num_replicas_in_sync //
        num_input_pipelines).

    Returns:
      Full batches, a multiple of `batches_per_step` of them, ending with the first step
      that holds the last real example.
    """
    examples = dataset.unbatch()
    image_spec, label_spec = examples.element_spec
    if not image_spec.shape.is_fully_defined():
        raise DataError(
            "Padding evaluation batches to a static shape needs images of a fixed shape. "
            f"Received: image shape {image_spec.shape}"
        )
    filler = tf.data.Dataset.from_tensors(
        (tf.zeros(image_spec.shape, image_spec.dtype), tf.constant(PAD_LABEL, label_spec.dtype))
    ).repeat()
    # The filler never ends, so every step is whole; a step that starts with padding holds
    # no real example, and is where the pipeline ends.
    steps = (
        examples.concatenate(filler)
        .batch(batch_size, drop_remainder=True)
        .batch(batches_per_step, drop_remainder=True)
        .take_while(lambda images, labels: labels[0, 0] != PAD_LABEL)
    )
    return steps.unbatch().prefetch(tf.data.AUTOTUNE)

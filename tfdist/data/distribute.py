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
from tfdist.strategies import strategy_kind

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
        return (
            f"Global batch {self.global_batch_size} = {self.replicas} replica(s) x "
            f"{self.per_replica_batch_size} per replica ({self.strategy})"
        )


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
      DataError: the global batch does not split over the replicas, or parameter_server is
        used without a coordinator.
    """
    plan = plan_batches(strategy, global_batch_size)
    log.info("%s", plan.describe())

    def per_pipeline(context: tf.distribute.InputContext) -> tf.data.Dataset:
        return dataset_fn(context, context.get_per_replica_batch_size(global_batch_size))

    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        if coordinator is None:
            raise DataError(
                "parameter_server training reads per-worker datasets through its "
                "ClusterCoordinator; pass coordinator=ClusterCoordinator(strategy)."
            )
        return coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(per_pipeline)
        )
    return strategy.distribute_datasets_from_function(per_pipeline)

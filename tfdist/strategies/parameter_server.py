"""The parameter_server builder, run by the chief of a parameter-server job.

The chief waits (bounded) for the ps tasks and enough workers, builds TensorFlow's
ParameterServerStrategy over the workers present, and makes variables start on their ps
without a whole copy of each initial value there.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Mapping, Sequence

import tensorflow as tf

from tfdist import compat, signals
from tfdist.cluster import CHIEF, WORKER, ClusterInfo
from tfdist.peers import explain_server_error, wait_for_servers
from tfdist.strategies.cluster_checks import check_layout, require_cluster
from tfdist.strategies.options import StrategyError, StrategyOptions


class PresentWorkersResolver(tf.distribute.cluster_resolver.SimpleClusterResolver):
    """The cluster a parameter-server chief trains on: the workers present, numbered 0..n-1.

    TensorFlow connects to every worker it is given and waits for each, so the chief gives it
    only the workers that are up, under indices 0..n-1 (a server takes the name the chief's
    connection gives it). The strategy keeps this resolver, and with it `tf_config_names`:
    TensorFlow's name of each worker ("worker:1") -> its name in TF_CONFIG ("worker:2").

    Args:
      cluster: the chief's view of the job, as TF_CONFIG describes it.
      present: the TF_CONFIG indices of the workers that are up, in order.
    """

    def __init__(self, cluster: ClusterInfo, *, present: Sequence[int]):
        workers = dict(cluster.indexed_addresses(WORKER))
        training = dataclasses.replace(
            cluster,
            cluster={**cluster.cluster, WORKER: tuple(workers[i] for i in present)},
            sparse_indices=None
            if cluster.sparse_indices is None
            else {**cluster.sparse_indices, WORKER: tuple(range(len(present)))},
        )
        super().__init__(
            tf.train.ClusterSpec(training.training_cluster()),
            task_type=training.task_type,
            task_id=training.task_index,
            rpc_layer=training.rpc_layer,
        )
        self.tf_config_names: Mapping[str, str] = types.MappingProxyType(
            {f"{WORKER}:{n}": f"{WORKER}:{i}" for n, i in enumerate(present)}
        )


def build_parameter_server(cluster: ClusterInfo | None, options: StrategyOptions):
    """The chief's ParameterServerStrategy over the ps tasks and the workers present."""
    cluster = require_cluster(
        "parameter_server",
        cluster,
        need="a chief, 1+ workers and 1+ ps",
        launch_flags="--chief --workers 2 --ps 1",
    )
    check_layout(cluster, "parameter_server")
    if cluster.task_type != CHIEF:
        raise StrategyError(
            f"In parameter-server training only the chief builds the strategy; this task is "
            f"{cluster.task_name}. Call tfdist.serve_if_needed() at the start of main(): it runs "
            "the worker and ps servers and returns only when the job ends."
        )
    with signals.doing("waiting for the workers and ps to start (parameter-server start-up)"):
        present = wait_for_servers(
            cluster, timeout=options.startup_timeout, min_workers=options.min_workers
        )
    partitioner = None
    if options.ps_min_shard_bytes and cluster.num_ps > 1:
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=options.ps_min_shard_bytes, max_shards=cluster.num_ps
        )
    try:
        with signals.doing("connecting to the workers and ps (parameter-server start-up)"):
            strategy = tf.distribute.experimental.ParameterServerStrategy(
                PresentWorkersResolver(cluster, present=present), variable_partitioner=partitioner
            )
    except tf.errors.OpError as e:
        explained = explain_server_error(e, cluster)
        if explained is None:
            raise
        raise explained from None
    compat.intercept_variable_creation(strategy, _initial_values_from_the_chief)
    return strategy


def needs_coordinator(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy` trains only through a tf.distribute ClusterCoordinator (true of
    parameter_server, TensorFlow's ParameterServerStrategy).

    Its chief runs no step itself: the coordinator schedules each step as a closure on a
    remote worker, which reads its batches from a per-worker dataset the coordinator made.
    So a caller must schedule its steps and make its datasets per worker through one; every
    other strategy runs its steps, and distributes its datasets, in the calling process.
    """
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def distribute_datasets(
    strategy: tf.distribute.Strategy,
    per_pipeline: Callable[[tf.distribute.InputContext], tf.data.Dataset],
    *,
    coordinator: tf.distribute.experimental.coordinator.ClusterCoordinator | None = None,
):
    """`strategy.distribute_datasets_from_function(per_pipeline)`, made per worker through
    `coordinator` where the strategy trains through one (parameter_server).

    Raises:
      StrategyError: parameter_server without a coordinator.
    """
    if not needs_coordinator(strategy):
        return strategy.distribute_datasets_from_function(per_pipeline)
    if coordinator is None:
        raise StrategyError(
            "parameter_server training reads per-worker datasets through its "
            "ClusterCoordinator; pass coordinator=ClusterCoordinator(strategy)."
        )
    return coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(per_pipeline)
    )


def tf_config_worker_names(strategy: tf.distribute.Strategy) -> Mapping[str, str]:
    """TensorFlow's name of each worker a parameter-server strategy trains on -> its TF_CONFIG
    name; empty for any other strategy, or one tfdist did not build."""
    resolver = compat.strategy_cluster_resolver(strategy)
    return resolver.tf_config_names if isinstance(resolver, PresentWorkersResolver) else {}


def task_name_in_tf_config(strategy: tf.distribute.Strategy, name: str) -> str:
    """The TF_CONFIG name ("worker:2") of the task TensorFlow calls `name` ("worker:1").

    They differ when a parameter-server job started without some of its workers (the
    workers present are numbered 0..n-1 for TensorFlow).
    """
    return tf_config_worker_names(strategy).get(name, name)


# Rows of an initial value sent to a ps in one message. tools/ps_bench.py, 1M x 64 table:
# with 256 KiB pieces a ps held its shard plus ~10-25 MB when the variables were made; with
# 16 MiB pieces, 1.5-2.5x its shard (the buffers of received pieces stay with the process).
_INIT_PIECE_BYTES = 256 << 10


def _initial_values_from_the_chief(
    create: Callable[..., tf.Variable],
) -> Callable[..., tf.Variable]:
    """Wraps a ParameterServerStrategy's creator: each variable is made on its ps as zeros,
    then its initial value is sent there in pieces.

    Keras 3 hands TensorFlow an initial value as a callable without a shape. Left alone,
    ParameterServerStrategy computes the value under the device scope of the variable's ps
    (a whole variable: ~3x its size there at once) or, for a split variable, computes it
    whole on the chief and takes each shard's rows on the shard's ps (the whole table then
    travels to every ps, and each holds it: tools/ps_bench.py measured ~2.7x the table on
    every ps, however many there were). Here the chief computes the value once (the same
    values as before, so split and whole variables start alike) and sends each variable or
    shard its own rows, in pieces of _INIT_PIECE_BYTES.
    """

    def create_variable(next_creator, **kwargs):
        initial = kwargs.get("initial_value")
        if (
            not callable(initial)
            or tf.inside_function()  # made while tracing: the graph keeps TensorFlow's way
            or kwargs.get("shape") is not None  # the caller's shape (perhaps partly unknown)
            or kwargs.get("per_worker_variable")
            or "colocate_with" in kwargs
            or inspect.signature(initial).parameters  # restore-on-create, or shard-aware
        ):
            return create(next_creator, **kwargs)
        value = tf.convert_to_tensor(initial(), dtype=kwargs.get("dtype"))
        if value.shape.rank == 0 or not (value.dtype.is_floating or value.dtype.is_integer):
            kwargs["initial_value"] = value  # a scalar, or a dtype scatter_update lacks
            return create(next_creator, **kwargs)

        def zeros(partition_shape=None, partition_offset=None):
            return tf.zeros(partition_shape or value.shape, value.dtype)  # made on the ps

        kwargs.update(initial_value=zeros, shape=value.shape, dtype=value.dtype)
        variable = create(next_creator, **kwargs)
        parts = getattr(variable, "variables", None) or [variable]
        row_bytes = max(1, value.shape[1:].num_elements() * value.dtype.size)
        step = max(1, _INIT_PIECE_BYTES // row_bytes)
        offset = 0
        for part in parts:
            rows = int(part.shape[0])
            for start in range(0, rows, step):
                end = min(rows, start + step)
                rows_here = tf.IndexedSlices(
                    value[offset + start : offset + end], tf.range(start, end, dtype=tf.int64)
                )
                part.scatter_update(rows_here)
            offset += rows
        return variable

    return create_variable

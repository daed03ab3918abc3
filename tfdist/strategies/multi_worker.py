"""The multi_worker_mirrored builder: synchronous training across worker processes.

Before TensorFlow's MultiWorkerMirroredStrategy is built, every task waits (bounded) for the
others to start and configures the coordination service, so a missing or dead peer ends the
job with an error naming it instead of a hang.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist import compat, signals
from tfdist import devices as _devices
from tfdist.cluster import CHIEF, WORKER, ClusterInfo
from tfdist.collective import ProcessRing
from tfdist.peers import (
    configure_coordination,
    explain_peer_error,
    explain_server_error,
    wait_for_peers,
)
from tfdist.strategies.all_reduce import ring_cross_device_ops
from tfdist.strategies.cluster_checks import check_layout, require_cluster
from tfdist.strategies.options import StrategyError, StrategyOptions

# collective option -> TensorFlow's implementation of the cross-worker collectives.
_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


def build_multi_worker_mirrored(cluster: ClusterInfo | None, options: StrategyOptions):
    """MultiWorkerMirroredStrategy for this task, once every peer is up (bounded waits)."""
    cluster = require_cluster(
        "multi_worker_mirrored", cluster, need="2+ workers", launch_flags="--workers 2"
    )
    check_layout(cluster, "multi_worker_mirrored")
    if options.collective == "nccl" and _devices.num_physical_gpus() == 0:
        raise StrategyError(
            "collective='nccl' runs the all-reduce on GPUs with NCCL, and this host has none. "
            "Use collective='ring' (or 'auto', which picks what the host has), or run on GPU "
            "hosts. Received: collective='nccl'"
        )
    communication = tf.distribute.experimental.CommunicationOptions(
        implementation=_IMPLEMENTATIONS[options.collective],
        timeout_seconds=options.collective_timeout,
    )
    if options.all_reduce not in (None, "ring"):
        raise StrategyError(
            f"multi_worker_mirrored sums gradients with TensorFlow's collectives or with "
            f"tfdist's ring; all_reduce={options.all_reduce!r} is a mirrored-only choice. Use "
            "all_reduce='ring', or collective='ring'/'nccl' to pick TensorFlow's collective "
            f"implementation. Received: all_reduce={options.all_reduce!r}"
        )
    others = [
        f"{task_type}:{index}"
        for task_type in (CHIEF, WORKER)
        for index, _ in cluster.indexed_addresses(task_type)
        if f"{task_type}:{index}" != cluster.task_name
    ]
    waiting_for = " and ".join(others) if len(others) <= 3 else f"the other {len(others)} tasks"
    with signals.doing(f"waiting for {waiting_for} to start (start-up)"):
        wait_for_peers(cluster, timeout=options.startup_timeout)
    configure_coordination(
        cluster,
        startup_timeout=options.startup_timeout,
        heartbeat_timeout=options.heartbeat_timeout,
    )
    try:
        with signals.doing(f"waiting for {waiting_for} to join the job (start-up)"):
            strategy = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=cluster.cluster_resolver(), communication_options=communication
            )
    except tf.errors.OpError as e:
        explained = explain_server_error(e, cluster) or explain_peer_error(
            e, cluster, starting=True, startup_timeout=options.startup_timeout
        )
        if explained is None:
            raise
        raise explained from None
    except (RuntimeError, ValueError) as e:
        if "startup" not in str(e) and "initialized" not in str(e):
            raise
        raise StrategyError(
            "multi_worker_mirrored must be built before TensorFlow runs anything else: "
            "its collective runtime can only be configured at program start. Build the "
            "strategy first thing in main(), before creating tensors, models or datasets "
            f"(in a notebook, restart the runtime). TensorFlow said: {e}"
        ) from None
    if options.all_reduce == "ring":
        # Gradients reach the strategy's CrossDeviceOps through batch_reduce (merge_call, as
        # on every CPU or non-XLA replica), so replacing that object reroutes them; anything
        # the ring does not handle still goes to TensorFlow's CollectiveAllReduce.
        ring = ProcessRing(
            rank=_training_rank(cluster),
            ranks=cluster.num_workers,
            timeout_seconds=options.collective_timeout,
        )
        compat.replace_cross_device_ops(
            strategy,
            lambda tensorflows: ring_cross_device_ops(
                options, process_ring=ring, fallback=tensorflows
            ),
        )
    return strategy


def joins_worker_processes(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy` joins the job's worker processes into one synchronous training, each
    process running the same program (true of multi_worker_mirrored alone).

    Any other strategy trains in the one process that built it (a parameter_server job's
    workers only run the steps its chief schedules), so several processes that each build
    one train as many separate models.
    """
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def worker_rank(strategy: tf.distribute.Strategy) -> int:
    """This process's place among the worker processes `strategy` joins (chief first, then
    the workers, as MultiWorkerMirroredStrategy numbers its replicas); 0 for one process."""
    resolver = strategy.cluster_resolver if joins_worker_processes(strategy) else None
    if resolver is None or not resolver.task_type:
        return 0
    has_chief = bool(resolver.cluster_spec().as_dict().get(CHIEF))
    return 0 if resolver.task_type == CHIEF else int(resolver.task_id) + int(has_chief)


def _training_rank(cluster: ClusterInfo) -> int:
    """This task's place among the training tasks: the chief first, then the workers."""
    has_chief = bool(cluster.cluster.get(CHIEF))
    return 0 if cluster.task_type == CHIEF else cluster.task_index + int(has_chief)

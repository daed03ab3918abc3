"""Server roles: the tasks of a parameter-server cluster that serve instead of training.

In parameter-server training only the chief runs the training program; worker and ps tasks
run a tf.distribute.Server that the chief's ClusterCoordinator drives. Calling
`serve_if_needed()` first thing in main() lets the same command run on every pod of a job:

    def main(argv):
        if tfdist.serve_if_needed():
            return          # this process was a worker or ps server; the job has ended
        strategy = tfdist.build_strategy("auto")
        ...
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from tfdist import logs, signals
from tfdist.cluster import FROM_ENV, PS, WORKER, ClusterInfo, cluster_from_environment
from tfdist.peers import explain_server_error

log = logging.getLogger(__name__)

# On a 2-core host TensorFlow sizes the inter-op pool to 2 threads; a server that both runs
# the coordinator's closures and answers variable reads then deadlocks. Four is enough.
_MIN_INTER_OP_THREADS = 4


def is_server_role(cluster: ClusterInfo | None) -> bool:
    """True for the worker and ps tasks of a parameter-server cluster."""
    return cluster is not None and cluster.num_ps > 0 and cluster.task_type in (WORKER, PS)


def serve_if_needed(
    cluster: ClusterInfo | None = FROM_ENV, *, stop: threading.Event | None = None
) -> bool:
    """Runs this task's tf.distribute.Server if its role is to serve, until the job ends.

    Args:
      cluster: the job's cluster; by default the environment's
        (`tfdist.cluster.cluster_from_environment`: TF_CONFIG, or a JobSet pod's).
      stop: an event that ends serving when set (for tests and embedding). SIGTERM and
        SIGINT, which launchers and Kubernetes send when the chief is done, also end it
        (in a program that routed its stop signals, by ending the process: exit 143).

    Returns:
      False at once for tasks that run the training program (chief, evaluator, and every
      task of a cluster without ps). True after a server role stopped serving.
    """
    if cluster is FROM_ENV:
        cluster = cluster_from_environment()
    if not is_server_role(cluster):
        return False
    import tensorflow as tf  # deferred: program roles need not pay for it here

    config = tf.compat.v1.ConfigProto(
        inter_op_parallelism_threads=max(_MIN_INTER_OP_THREADS, os.cpu_count() or 1)
    )
    # The server has devices of its own: a CPU split by tfdist.configure_cpu_devices (the
    # stage devices of a worker's split replica, tfdist.parallel.pipeline.downpour) is carried over.
    cpus = tf.config.get_logical_device_configuration(tf.config.list_physical_devices("CPU")[0])
    if cpus and len(cpus) > 1:
        config.device_count["CPU"] = len(cpus)
    try:
        server = tf.distribute.Server(
            tf.train.ClusterSpec(cluster.training_cluster()),
            job_name=cluster.task_type,
            task_index=cluster.task_index,
            protocol=cluster.rpc_layer,
            config=config,
            start=True,
        )
    except tf.errors.OpError as e:
        explained = explain_server_error(e, cluster)
        if explained is None:
            raise
        raise explained from None
    log.info(
        "Serving as %s until the job ends (%s)", cluster.describe(), server.target,
        extra=logs.EVERY_TASK,
    )  # fmt: skip
    stop = stop or threading.Event()
    # server.join() blocks inside C++ where Python signal handlers never run; waiting on an
    # event instead lets a signal end serving. In a program that routed its stop signals
    # (tfdist.signals), the router ends the process (exit 143 for SIGTERM) with a line saying
    # so; otherwise SIGTERM and SIGINT make this function return.
    previous = {}
    if signals.router() is None and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: stop.set())
    try:
        # The chief's launcher ends a finished job this way too: the line says it is usual.
        with signals.doing(
            f"serving as {cluster.task_name} (a parameter-server job's workers and ps are "
            "stopped this way when the chief is done)"
        ):
            while not stop.wait(timeout=1.0):
                pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    del server  # held until here: the server lives as long as this Python object
    log.info("%s stopped serving", cluster.task_name)
    return True

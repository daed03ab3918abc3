"""Multi-worker peers: bounded start-up, and errors that name the task that went missing.

TensorFlow's multi-worker runtimes wait forever for a task that never starts, and report a
peer that died as a collective-op failure deep inside a traceback. A parameter-server chief
first waits (`wait_for_servers`) for its workers and ps to accept connections; for
multi_worker_mirrored, tfdist sets up TensorFlow's coordination service so that both end
within a bound:

- start-up: every task waits at most `startup_timeout` seconds for the whole cluster to
  register (the service's registration barrier, which also covers the coordination leader);
- training: a peer that stops sending heartbeats for `heartbeat_timeout` seconds is declared
  dead and every collective aborts; a peer whose process died is noticed when its
  connection drops, at once.

`explain_peer_error` turns what TensorFlow raises then into a `PeerError` naming the task and
its address.
"""

from __future__ import annotations

import re
import socket
import time

from tfdist.cluster import CHIEF, PS, WORKER, ClusterInfo
from tfdist.errors import TfdistError

# torchrun waits 600 s for its rendezvous by default; Kubernetes pods pulling an image or
# waiting for a node can take minutes, so a shorter default would fail healthy jobs.
DEFAULT_STARTUP_TIMEOUT = 600.0

# The jobs whose tasks run the synchronous training program (the evaluator and ps never do).
_COORDINATED_JOBS = (CHIEF, WORKER)

_TASK = r"/job:(\w+)/replica:\d+/task:(\d+)"
# Where TensorFlow lists the tasks it gave up on, by the kind of failure.
_CAUSES = {
    "startup": re.compile(r"timed out task names:\s*((?:" + _TASK + r"\s*)+)"),
    "heartbeat": re.compile(r"stopped sending heartbeats\):\s*((?:" + _TASK + r"\s*)+)"),
    "connection": re.compile(r"remote target (" + _TASK + ")"),
}


class PeerError(TfdistError, RuntimeError):
    """A task of the job never started, died, or stopped answering.

    Attributes:
      exit_code: what a binary exits with: 1, a failure a restart may cure, not a mistake in
        the command line (2).
      restartable: a restart of the whole job cures it (see tfdist.exit_codes).
    """

    exit_code = 1
    restartable = True


def coordination_leader(cluster: ClusterInfo) -> tuple[str, int]:
    """The task that hosts TensorFlow's coordination service: the chief, else worker 0."""
    return (CHIEF, 0) if cluster.has_chief else (WORKER, 0)


def configure_coordination(
    cluster: ClusterInfo, *, startup_timeout: float | None, heartbeat_timeout: float | None
) -> None:
    """Bounds how long this task waits for its peers; call before building the strategy.

    MultiWorkerMirroredStrategy configures the coordination service itself only when nothing
    configured it before, so this configuration is the one it uses. A configuration the
    caller made earlier is kept.

    Args:
      cluster: this task's place in the job.
      startup_timeout: seconds to wait for every chief and worker task to register; None
        waits forever (TensorFlow's default).
      heartbeat_timeout: seconds without a heartbeat before a peer is declared dead; None
        keeps TensorFlow's default (10 s).
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(cluster.cluster[job]))
        for job in _COORDINATED_JOBS
        if cluster.cluster.get(job)
    ]
    ctx = context.context()
    if ctx.coordination_service is not None:
        return
    leader_type, leader_index = coordination_leader(cluster)
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=f"/job:{leader_type}/replica:0/task:{leader_index}",
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=_milliseconds(startup_timeout),
        heartbeat_timeout_in_ms=_milliseconds(heartbeat_timeout),
    )
    # Without the barrier only the other tasks time out: the leader would wait for a missing
    # peer forever. configure_coordination_service has no argument for it (TF 2.21).
    ctx.coordination_service.cluster_register_with_barrier = startup_timeout is not None


def wait_for_servers(
    cluster: ClusterInfo, *, timeout: float | None, poll_seconds: float = 0.5
) -> None:
    """Waits until every worker and ps server of a parameter-server cluster accepts a
    connection; the chief calls it before building the strategy.

    TensorFlow's ParameterServerStrategy waits forever for a task that never starts. A task
    that serves (tfdist.serve_if_needed) listens on its TF_CONFIG port, so a plain TCP
    connection tells whether it is up without speaking TensorFlow's protocol.

    Args:
      cluster: the chief's view of the job.
      timeout: seconds to wait; None waits forever.
      poll_seconds: pause between rounds of connection attempts.

    Raises:
      PeerError: naming the tasks that did not accept a connection within `timeout`.
    """
    pending = {
        f"{task_type}:{index}": address
        for task_type in (WORKER, PS)
        for index, address in cluster.indexed_addresses(task_type)
    }
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        for name, address in list(pending.items()):
            if _accepts(address):
                del pending[name]
        if not pending:
            return
        if deadline is not None and time.monotonic() >= deadline:
            missing = " and ".join(f"{name} ({address})" for name, address in pending.items())
            raise PeerError(
                f"{missing} did not start within {timeout:g} s: nothing accepted a connection "
                f"there ({cluster.task_name} was waiting for every worker and ps in "
                f"{cluster.source}). Start every task of the cluster (workers and ps run "
                "tfdist.serve_if_needed()), or fix the address in TF_CONFIG; if tasks start "
                f"slowly, raise --startup_timeout. Received: startup_timeout={timeout!r}"
            )
        time.sleep(poll_seconds)


def _accepts(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def explain_peer_error(
    error: BaseException,
    cluster: ClusterInfo,
    *,
    starting: bool,
    startup_timeout: float | None = None,
    resume_hint: str = "",
) -> PeerError | None:
    """A PeerError naming the missing task, or None when `error` is not about a peer.

    Args:
      error: what TensorFlow raised while building the strategy or running a step.
      cluster: this task's place in the job, for the peers' addresses.
      starting: True while the strategy is being built (peers that never started), False
        during training (peers that died or hung).
      startup_timeout: the start-up bound in force, quoted in the message.
      resume_hint: a sentence on where a restart resumes (the trainer's last checkpoint).
    """
    import tensorflow as tf

    if not isinstance(
        error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError)
    ):
        return None
    message = str(error)
    found = {cause: pattern.search(message) for cause, pattern in _CAUSES.items()}
    if starting:
        match = found["startup"] or found["connection"]
        # A task that cannot reach the leader is told no more than "Deadline Exceeded".
        leader = "/job:{}/replica:0/task:{}".format(*coordination_leader(cluster))
        tasks = _tasks(match.group(1) if match else leader, cluster)
        if not tasks:
            return None
        waited = f"within {startup_timeout:g} s" if startup_timeout else "in time"
        return PeerError(
            f"{' and '.join(tasks)} did not join the job {waited} ({cluster.task_name} was "
            f"waiting for every task in {cluster.source}). Start every task of the cluster, "
            "or fix the address in TF_CONFIG; if tasks start slowly (image pulls, "
            f"scheduling), raise --startup_timeout. Received: startup_timeout={startup_timeout!r}"
        )
    match = found["heartbeat"] or found["connection"]
    tasks = _tasks(match.group(1), cluster) if match else []
    if not tasks:
        return None
    how = "stopped sending heartbeats" if found["heartbeat"] else "closed its connection"
    return PeerError(
        f"Lost {' and '.join(tasks)} during training: it {how} (crashed, killed or hung). The "
        f"job cannot go on without it. {resume_hint}Restart the whole job to resume "
        "(tools.launch --max_restarts N restarts it for you)."
    )


def _tasks(text: str, cluster: ClusterInfo) -> list[str]:
    """'worker:1 (host:port)' for each distinct peer TensorFlow names in `text`."""
    named = []
    for task_type, index in re.findall(_TASK, text):
        if f"{task_type}:{index}" == cluster.task_name:
            continue
        address = _address_of(cluster, task_type, int(index))
        name = f"{task_type}:{index}" + (f" ({address})" if address else "")
        if name not in named:
            named.append(name)
    return named


def _address_of(cluster: ClusterInfo, task_type: str, index: int) -> str | None:
    return dict(cluster.indexed_addresses(task_type)).get(index)


def _milliseconds(seconds: float | None) -> int:
    return 0 if seconds is None else max(1, round(seconds * 1000))  # 0: TensorFlow's default

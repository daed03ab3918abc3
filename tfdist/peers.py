"""Multi-worker peers: bounded start-up, and errors that name the task that went missing.

TensorFlow's multi-worker runtimes wait forever for a task that never starts, and report a
peer that died as a collective-op failure deep inside a traceback. A parameter-server chief
first waits (`wait_for_servers`) for every ps and enough workers to accept connections, and
trains with those present (parameter-server training is meant to survive workers); for
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

import contextlib
import errno
import logging
import re
import socket
import time
from collections.abc import Callable, Iterator

from tfdist import logs
from tfdist.cluster import CHIEF, PS, WORKER, ClusterInfo
from tfdist.errors import TfdistError

log = logging.getLogger(__name__)

# torchrun waits 600 s for its rendezvous by default; Kubernetes pods pulling an image or
# waiting for a node can take minutes, so a shorter default would fail healthy jobs.
DEFAULT_STARTUP_TIMEOUT = 600.0
# A parameter-server chief that has every ps and enough workers waits this much longer for
# the rest: tasks launched together are up within seconds of each other.
LAST_CALL_SECONDS = 15.0
REPORT_EVERY_SECONDS = 30.0

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
    peers_gone = True  # ends past TensorFlow's shutdown (tfdist.exit_codes.end_process)


class PortTakenError(PeerError):
    """This task's own address is held by another process, so its server cannot start."""


def explain_server_error(error: Exception, cluster: ClusterInfo) -> PortTakenError | None:
    """A PortTakenError naming task, address and port if `error` is TensorFlow failing to
    start this task's gRPC server ("Could not start gRPC server"); else None."""
    if "Could not start gRPC server" not in str(error) or not cluster.address:
        return None
    return port_taken(cluster)


def port_taken(cluster: ClusterInfo) -> PortTakenError:
    """The error for this task's own port being held by another process."""
    port = cluster.address.rsplit(":", 1)[1]
    return PortTakenError(
        f"{cluster.task_name} cannot start its server on {cluster.address}: port {port} is "
        "taken by another process (or cannot be bound here). Stop that process, or give the "
        "task a free port in "
        "TF_CONFIG (tfdist-launch picks free ports, and moves a task whose port was taken "
        "when it restarts the job)."
    )


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
    from tfdist import compat  # deferred: parsing and waiting must not import TensorFlow

    if compat.coordination_service_configured():
        return
    leader_type, leader_index = coordination_leader(cluster)
    compat.configure_coordination_service(
        leader=f"/job:{leader_type}/replica:0/task:{leader_index}",
        jobs={
            job: len(cluster.cluster[job]) for job in _COORDINATED_JOBS if cluster.cluster.get(job)
        },
        register_timeout_ms=_milliseconds(startup_timeout),
        heartbeat_timeout_ms=_milliseconds(heartbeat_timeout),
        # Without the barrier only the other tasks time out: the leader would wait for a
        # missing peer forever.
        register_with_barrier=startup_timeout is not None,
    )


def wait_for_servers(
    cluster: ClusterInfo,
    *,
    timeout: float | None,
    min_workers: int | None = None,
    last_call: float = LAST_CALL_SECONDS,
    report_every: float = REPORT_EVERY_SECONDS,
    poll_seconds: float = 0.5,
) -> list[int]:
    """Waits for the servers a parameter-server chief needs: every ps and enough workers.

    TensorFlow's ParameterServerStrategy waits (for minutes) for every task it is given. A
    task that serves (tfdist.serve_if_needed) listens on its TF_CONFIG port, so a plain TCP
    connection tells whether it is up without speaking TensorFlow's protocol. Once every ps
    and `min_workers` workers answer, the wait goes on for `last_call` seconds more for the
    other workers (a "last call", as torchrun's elastic rendezvous), so that tasks started
    together all take part; workers still missing then are named in the log and left out.
    While waiting, a log line at once and every `report_every` seconds after names the tasks
    still missing and the time left.

    Args:
      cluster: the chief's view of the job.
      timeout: seconds to wait for every ps and `min_workers` workers; None waits forever.
      min_workers: the fewest workers to start training with; None: every worker.
      last_call: seconds to wait for the other workers once there are enough.
      report_every: seconds between log lines naming the tasks still missing.
      poll_seconds: pause between rounds of connection attempts.

    Returns:
      The indices of the workers that answered, in order.

    Raises:
      PeerError: naming the tasks missing when `timeout` passed without every ps and
        `min_workers` workers.
    """
    workers = dict(cluster.indexed_addresses(WORKER))
    servers = {f"{WORKER}:{i}": a for i, a in workers.items()}
    servers.update({f"{PS}:{i}": a for i, a in cluster.indexed_addresses(PS)})
    need = len(workers) if min_workers is None else min(min_workers, len(workers))
    deadline = None if timeout is None else time.monotonic() + timeout
    reported, enough_since = None, None
    with _Placeholder(cluster):
        pass  # this task's own port first: taken, it is the fault, not the peers it waits for
    while True:
        missing = {name: address for name, address in servers.items() if not _accepts(address)}
        up = [i for i in workers if f"{WORKER}:{i}" not in missing]
        if not missing:
            return up
        now = time.monotonic()
        enough = len(up) >= need and not any(name.startswith(PS) for name in missing)
        if not enough:
            enough_since = None  # a worker that was up went away: the last call starts over
        if enough:
            if enough_since is None:
                enough_since = now
                log.info(
                    "%d of %d workers and every ps are up; waiting up to %g s more for %s",
                    len(up), len(workers), last_call, _listed(missing),
                )  # fmt: skip
            elif now - enough_since >= last_call:
                log.warning(
                    "Starting parameter-server training with %d of %d workers: %s did not "
                    "start (a worker that is not up now takes no part in this run; restart "
                    "the job to use it)",
                    len(up), len(workers), _listed(missing),
                )  # fmt: skip
                return up
        elif deadline is not None and now >= deadline:
            wanted = f"every ps and {need} of {len(workers)} workers"
            raise PeerError(
                f"{_listed(missing)} did not start within {timeout:g} s: nothing accepted a "
                f"connection there ({cluster.task_name} was waiting for {wanted} in "
                f"{cluster.source}). Start every task of the cluster (workers and ps run "
                "tfdist.serve_if_needed()), or fix the address in TF_CONFIG; if tasks start "
                f"slowly, raise --startup_timeout. Received: startup_timeout={timeout!r}, "
                f"min_workers={min_workers!r}"
            )
        elif reported is None or now - reported >= report_every:
            reported = now
            _report(missing, deadline, now)
        time.sleep(poll_seconds)


def wait_for_peers(
    cluster: ClusterInfo,
    *,
    timeout: float | None,
    report_every: float = REPORT_EVERY_SECONDS,
    poll_seconds: float = 0.5,
) -> None:
    """Waits, in Python, until every other chief and worker task of a synchronous job is up.

    TensorFlow's own wait (the coordination service's registration, inside the
    MultiWorkerMirroredStrategy constructor) holds Python's global lock: no signal handler
    and no other Python thread runs until it ends, up to the whole start-up timeout. This
    wait comes first and keeps the long part in Python, where SIGTERM is honoured at once
    and a log line at once and every `report_every` seconds after names the tasks still
    missing.

    A peer's gRPC server starts only inside its own constructor, so each task listens on its
    own port (`_Placeholder`) while it waits: two tasks waiting for each other both see the
    other's port open. It closes before TensorFlow binds the port.

    Args:
      cluster: this task's place in the job.
      timeout: seconds to wait; None waits forever.
      report_every: seconds between log lines naming the tasks still missing.
      poll_seconds: pause between rounds of connection attempts.

    Raises:
      PeerError: naming the tasks that never accepted a connection within `timeout`.
    """
    peers = {
        f"{task_type}:{index}": address
        for task_type in _COORDINATED_JOBS
        for index, address in cluster.indexed_addresses(task_type)
        if f"{task_type}:{index}" != cluster.task_name
    }
    deadline = None if timeout is None else time.monotonic() + timeout
    reported = None
    with _Placeholder(cluster):
        while True:
            missing = {name: address for name, address in peers.items() if not _accepts(address)}
            if not missing:
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise PeerError(
                    f"{_listed(missing)} did not join the job within {timeout:g} s: nothing "
                    f"accepted a connection there ({cluster.task_name} was waiting for every "
                    f"task in {cluster.source}). Start every task of the cluster, or fix the "
                    "address in TF_CONFIG; if tasks start slowly (image pulls, scheduling), "
                    f"raise --startup_timeout. Received: startup_timeout={timeout!r}"
                )
            if reported is None or now - reported >= report_every:
                reported = now
                _report(missing, deadline, now)
            time.sleep(poll_seconds)


class _Placeholder:
    """Listens on this task's port, without accepting, until TensorFlow's server takes it.

    The kernel completes a connection to a listening socket by itself, which is all a peer's
    probe needs. The socket binds where TensorFlow's server will (every interface), or only
    loopback for a loopback address. A port another process holds is this task's own
    problem, reported at once (PortTakenError) rather than after waiting for peers that
    may be missing too; a port that cannot be bound for another reason is left to
    TensorFlow, which reports it when it binds.
    """

    def __init__(self, cluster: ClusterInfo):
        self._socket = None
        address = cluster.address
        if address is None:
            return
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        loopback = host in ("localhost", "127.0.0.1", "::1")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            return
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host if loopback else "", int(port)))
            sock.listen(64)
        except (OSError, ValueError) as e:
            sock.close()
            if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
                raise port_taken(cluster) from None
            return
        self._socket = sock

    def __enter__(self) -> _Placeholder:
        return self

    def __exit__(self, *exc) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _report(missing: dict[str, str], deadline: float | None, now: float) -> None:
    left = "no time limit" if deadline is None else f"{deadline - now:.0f} s left"
    log.info("Waiting for %s to start (%s)", _listed(missing), left, extra=logs.EVERY_TASK)


def _listed(tasks: dict[str, str]) -> str:
    return " and ".join(f"{name} ({address})" for name, address in tasks.items())


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
    when: str = "during training",
) -> PeerError | None:
    """A PeerError naming the missing task, or None when `error` is not about a peer.

    Args:
      error: what TensorFlow raised while building the strategy or running a step.
      cluster: this task's place in the job, for the peers' addresses.
      starting: True while the strategy is being built (peers that never started), False
        during training (peers that died or hung).
      startup_timeout: the start-up bound in force, quoted in the message.
      resume_hint: a sentence on where a restart resumes (the trainer's last checkpoint).
      when: when this task lost the peer ("during training").
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
        f"Lost {' and '.join(tasks)} {when}: it {how} (crashed, killed or hung). The "
        f"job cannot go on without it. {resume_hint}Restart the whole job to resume "
        "(tfdist-launch --max_restarts N restarts it for you)."
    )


@contextlib.contextmanager
def lost_peers_explained(
    cluster: ClusterInfo | None, *, when: str, resume_hint: Callable[[], str] = str
) -> Iterator[None]:
    """Turns TensorFlow's error for a task of `cluster` that died (a collective aborted, a
    socket closed) into one PeerError naming it, raised from inside the block.

    Args:
      cluster: this task's place in the job; None (one process) changes nothing.
      when: when the block runs, for the message ("during training").
      resume_hint: a sentence on where a restart resumes, asked for only when needed.
    """
    import tensorflow as tf

    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
            tf.errors.AbortedError) as error:  # fmt: skip
        lost = None
        if cluster is not None:
            lost = explain_peer_error(
                error, cluster, starting=False, resume_hint=resume_hint(), when=when
            )
        if lost is None:
            raise
        raise lost from None


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

"""Planning a local cluster: one task per process, each with its own port and TF_CONFIG."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
from collections.abc import Sequence

from tfdist.errors import TfdistError
from tfdist.layout import TASK_TYPES, Layout, LayoutError, launch_flags, validate_layout


class UsageError(TfdistError, ValueError):
    """A launch request that cannot work as given; the CLI prints it and exits with 2."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One process of the cluster.

    Args:
      type: the TF_CONFIG task type: "chief", "worker", "ps" or "evaluator".
      index: the task's index among the tasks of its type.
      address: "host:port" on which the task's tf.distribute.Server listens.
    """

    type: str
    index: int
    address: str

    @property
    def name(self) -> str:
        """The task as logs and messages write it, e.g. "worker:1"."""
        return f"{self.type}:{self.index}"


def plan_cluster(
    *,
    workers: int,
    chief: bool = False,
    ps: int = 0,
    evaluator: bool = False,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    strategy: str | None = None,
) -> tuple[dict[str, list[str]], list[Task]]:
    """Lays out a cluster on one host and gives every task its own port.

    Args:
      workers: number of worker tasks.
      chief: whether to add a chief (required with `ps`, where it coordinates).
      ps: number of parameter-server tasks.
      evaluator: whether to add an evaluator (listed in the cluster, as Kubeflow does).
      host: address every task listens on; "::1" and "[::1]" both mean IPv6 loopback.
      ports: one port per task in task order; by default the OS picks free ones.
      strategy: the strategy the command asks for (its --strategy flag), if any: a layout
        it cannot run is refused, as tfdist-k8s refuses it.

    Returns:
      `(cluster, tasks)`: the TF_CONFIG "cluster" dict holding only the task types present,
      and the tasks in order: chief, workers, ps, evaluator.

    Raises:
      UsageError: if the counts describe no cluster TensorFlow can run, `ports` has the wrong
        length, or no port can be bound on `host`.
    """
    layout = Layout(chief=int(chief), workers=workers, ps=ps, evaluator=int(evaluator))
    try:
        validate_layout(layout, strategy=strategy, spell=launch_flags)
    except LayoutError as error:
        raise UsageError(str(error)) from None
    counts = layout.counts()
    slots = [(task_type, i) for task_type in TASK_TYPES for i in range(counts.get(task_type, 0))]
    host = host.strip("[]")
    if ports is None:
        ports = _free_ports(host, len(slots))
    elif len(ports) != len(slots):
        raise UsageError(f"expected {len(slots)} ports, one per task. Received: ports={ports}")
    tasks = [Task(t, i, _address(host, port)) for (t, i), port in zip(slots, ports, strict=True)]
    return cluster_of(tasks), tasks


def tf_config_for(cluster: dict[str, list[str]], task: Task) -> str:
    """Returns the TF_CONFIG value (a JSON string) that makes a process play `task` in `cluster`."""
    return json.dumps({"cluster": cluster, "task": {"type": task.type, "index": task.index}})


def serving_tasks(tasks: Sequence[Task]) -> list[Task]:
    """Returns the tasks that only serve (run a tf.distribute.Server) and never exit by themselves.

    Under parameter-server training these are the workers and parameter servers: they wait for
    the chief to send them work. Without parameter servers every task runs the program to its end.
    """
    if not any(task.type == "ps" for task in tasks):
        return []
    return [task for task in tasks if task.type in ("worker", "ps")]


def _free_ports(host: str, count: int) -> list[int]:
    # Every socket stays bound until all ports are chosen, so the OS cannot hand out a port twice.
    # They close on return because the tasks must bind the ports themselves; the tasks start right
    # after, and take far longer than that to import TensorFlow and bind, so holding the sockets
    # any longer would not make the ports safer.
    with contextlib.ExitStack() as sockets:
        try:
            return [_bind(sockets, host, 0) for _ in range(count)]
        except OSError as error:
            raise UsageError(
                f"cannot bind a port on --host ({error}): expected an address of this "
                f"machine such as 127.0.0.1 or ::1. Received: --host={host}"
            ) from error


def reclaim_ports(tasks: Sequence[Task]) -> list[Task]:
    """Keeps every task's address whose port is still free and gives the others free ports.

    A restarted job should get the TF_CONFIG it had, but another program may have taken one
    of its ports since the first start.

    Args:
      tasks: the tasks of the job that is about to be restarted.

    Returns:
      The tasks in the same order, each with its old address or, if its port was taken, the
      same host with a port the OS picked.
    """
    with contextlib.ExitStack() as sockets:
        taken = []
        for task in tasks:
            try:
                _bind(sockets, *_split_address(task.address))
            except OSError:
                taken.append(task)
        # The free ports stay bound while new ones are picked, so none is handed out twice.
        moved = {}
        for task in taken:
            host, _ = _split_address(task.address)
            address = _address(host, _bind(sockets, host, 0))
            moved[task] = dataclasses.replace(task, address=address)
    return [moved.get(task, task) for task in tasks]


def _bind(sockets: contextlib.ExitStack, host: str, port: int) -> int:
    # Binds a socket that stays bound until `sockets` closes and returns its port.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = sockets.enter_context(socket.socket(family, socket.SOCK_STREAM))
    if port:
        # gRPC servers bind with SO_REUSEADDR, so a port whose closed connections linger in
        # TIME_WAIT after a run is free for them; it must count as free here too.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock.getsockname()[1]


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _address(host: str, port: int) -> str:
    # An IPv6 address contains colons, so it needs brackets to be told apart from the port.
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cluster_of(tasks: Sequence[Task]) -> dict[str, list[str]]:
    """The TF_CONFIG "cluster" dict of `tasks`: task type -> addresses in index order."""
    cluster: dict[str, list[str]] = {}
    for task in tasks:
        cluster.setdefault(task.type, []).append(task.address)
    return cluster

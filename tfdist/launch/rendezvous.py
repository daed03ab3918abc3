"""Several hosts agree on one cluster: tfdist-launch --nnodes N --node_rank R --master_addr H.

Like torchrun's static rendezvous: the same tfdist-launch command runs once on every host,
each with its own --node_rank. Each picks free ports for its own tasks and offers their
addresses to node 0, which listens on --master_addr (the address the user named) until every
node has offered, checks that all were started alike, lays the tasks out in node order
(node 0's chief first, then the workers of node 0, node 1, ...) and answers every node with
the whole cluster. Each host then starts its own tasks with TF_CONFIG naming that cluster.

The exchange is one line of JSON each way over TCP; nothing received is ever executed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable, Mapping

from tfdist.launch.plan import Task, UsageError
from tfdist.layout import TASK_TYPES

DEFAULT_PORT = 29500  # torchrun's MASTER_PORT default
_MAX_LINE = 1 << 20
# How often a node waiting for the others says what it waits for.
WAITING_EVERY_S = 30.0


class RendezvousError(UsageError):
    """The nodes could not agree on a cluster (the message says which node and why)."""


@dataclasses.dataclass(frozen=True)
class Offer:
    """What one node brings to the job.

    Attributes:
      node_rank: its --node_rank.
      nnodes: the --nnodes it was started with.
      flags: its layout flags (every node must be started with the same).
      addresses: its tasks' addresses, by task type, in index order.
    """

    node_rank: int
    nnodes: int
    flags: Mapping[str, object]
    addresses: Mapping[str, list[str]]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self) | {"flags": dict(self.flags)})

    @classmethod
    def from_json(cls, text: str) -> Offer:
        raw = json.loads(text)
        if not isinstance(raw, dict) or set(raw) != {"node_rank", "nnodes", "flags", "addresses"}:
            raise ValueError("not a tfdist-launch offer")
        return cls(int(raw["node_rank"]), int(raw["nnodes"]), raw["flags"], raw["addresses"])


def parse_master(text: str) -> tuple[str, int]:
    """HOST[:PORT] (IPv6 as [ADDR]:PORT) -> (host, port); the port defaults to 29500."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or str(DEFAULT_PORT)
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, str(DEFAULT_PORT)
    if not host or not port.isdecimal() or not 0 < int(port) < 65536:
        raise UsageError(
            "--master_addr is HOST or HOST:PORT (IPv6: [ADDR]:PORT), the address node 0 "
            f"listens on for the other nodes. Received: --master_addr={text}"
        )
    return host, int(port)


def local_address_towards(master: tuple[str, int]) -> str:
    """This host's address on the route to the master (what the other nodes can reach)."""
    family = socket.AF_INET6 if ":" in master[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(master)  # a UDP connect sends nothing; it only picks the route
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def assemble(offers: list[Offer]) -> dict[str, list[str]]:
    """The whole cluster: each task type's addresses, node 0's first."""
    cluster: dict[str, list[str]] = {}
    for task_type in TASK_TYPES:
        addresses = [a for offer in offers for a in offer.addresses.get(task_type, [])]
        if addresses:
            cluster[task_type] = addresses
    return cluster


def my_tasks(cluster: Mapping[str, list[str]], offer: Offer) -> list[Task]:
    """This node's tasks, with the indices they have in the whole cluster."""
    tasks = []
    for task_type in TASK_TYPES:
        addresses = list(cluster.get(task_type, []))
        for address in offer.addresses.get(task_type, []):
            tasks.append(Task(task_type, addresses.index(address), address))
    return tasks


class Master:
    """Node 0's side: collects one offer per node, then answers each with the cluster.

    Args:
      bind: (host, port) to listen on: the --master_addr the user named.
      nnodes: how many nodes to wait for.
      flags: node 0's layout flags, which every node must share: a node started otherwise
        is refused at once, whichever node offers first.
    """

    def __init__(self, bind: tuple[str, int], nnodes: int, flags: Mapping[str, object]):
        self.nnodes, self.flags = nnodes, dict(flags)
        family = socket.AF_INET6 if ":" in bind[0] else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind(bind)
        except OSError as error:
            self._socket.close()
            raise RendezvousError(
                f"node 0 cannot listen on --master_addr {bind[0]}:{bind[1]} ({error}): give an "
                "address of this host and a free port, the same on every node"
            ) from None
        self._socket.listen(nnodes)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stops listening, then waits (up to `timeout`) until every node that joined has its
        answer: node 0's launcher may exit next, and the answers are written by this daemon
        thread, which would die with it."""
        self._socket.close()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)

    def _serve(self) -> None:
        connections: dict[int, tuple[socket.socket, Offer]] = {}
        self._socket.settimeout(1.0)  # to tell the waiting nodes who is missing, now and then
        said = 0.0
        answer = None
        try:
            while len(connections) < self.nnodes:
                if connections and time.monotonic() - said >= WAITING_EVERY_S:
                    self._tell_waiting(connections)
                    said = time.monotonic()
                try:
                    connection, _ = self._socket.accept()
                except TimeoutError:
                    continue
                connection.settimeout(10.0)
                try:
                    offer = Offer.from_json(_read_line(connection))
                except (OSError, ValueError, KeyError, TypeError):
                    connection.close()  # not a tfdist-launch node: ignore it
                    continue
                problem = self._check(offer, connections)
                if problem:
                    # A node started otherwise cannot be part of this job, and the job cannot
                    # complete without it: every node, this one included, stops with the line.
                    self.error = problem
                    _send(connection, {"error": problem})
                    connection.close()
                    answer = {"error": problem}
                    break
                connections[offer.node_rank] = (connection, offer)
                said = 0.0  # who is still missing changed: say so at once
            else:
                offers = [connections[rank][1] for rank in range(self.nnodes)]
                answer = {"cluster": assemble(offers)}
        except OSError:  # closed: the launcher is going away
            answer = {"error": "node 0 stopped before every node joined"}
        for connection, _ in connections.values():
            with contextlib.suppress(OSError):
                _send(connection, answer)
                connection.close()
        if "error" in answer:
            self._refuse_late(answer)

    def _refuse_late(self, answer: dict) -> None:
        """Whoever joins after the refusal (node 0's own offer, when the bad one came first)
        hears the same line, until the launcher closes the socket: none waits for nothing."""
        while True:
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            with contextlib.suppress(OSError, ValueError), connection:
                connection.settimeout(10.0)
                _read_line(connection)  # its offer, read so that closing sends no reset
                _send(connection, answer)

    def _tell_waiting(self, connections: Mapping[int, tuple[socket.socket, Offer]]) -> None:
        missing = [rank for rank in range(self.nnodes) if rank not in connections]
        for connection, _ in connections.values():
            with contextlib.suppress(OSError):
                _send(connection, {"waiting": missing})

    def _check(self, offer: Offer, joined: Mapping[int, tuple[socket.socket, Offer]]) -> str:
        if offer.nnodes != self.nnodes:
            return (
                f"node {offer.node_rank} was started with --nnodes {offer.nnodes}, node 0 with "
                f"--nnodes {self.nnodes}: start every node with the same --nnodes"
            )
        if offer.node_rank in joined:
            return (
                f"node {offer.node_rank} joined twice: give every host its own --node_rank, "
                f"0 to {self.nnodes - 1}"
            )
        if dict(offer.flags) != self.flags:
            return (
                f"node {offer.node_rank} was started with {_flags(offer.flags)}, node 0 with "
                f"{_flags(self.flags)}: start every node with the same layout flags"
            )
        return ""


def join(
    master: tuple[str, int],
    offer: Offer,
    *,
    timeout: float,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> dict[str, list[str]]:
    """Offers this node's tasks to the master and returns the whole cluster.

    Retries the connection until `timeout` (node 0 may start after this node). Says at once,
    and every WAITING_EVERY_S seconds, what it waits for (node 0, or the nodes node 0 has not
    heard from).

    Raises:
      RendezvousError: the master refused the offer (or another node's), or did not answer
        within `timeout`.
    """
    deadline = time.monotonic() + timeout
    where = f"{master[0]}:{master[1]}"
    said = time.monotonic()
    say(
        f"[launch] node 0: gathering --nnodes {offer.nnodes} at --master_addr {where}"
        if offer.node_rank == 0
        else f"[launch] node {offer.node_rank}: waiting for node 0 at --master_addr {where}"
    )
    answer = None
    while answer is None:
        try:
            with socket.create_connection(master, timeout=5.0) as connection:
                _send(connection, offer)
                lines = _Lines(connection)
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    connection.settimeout(min(left, WAITING_EVERY_S + 5.0))
                    try:
                        message = json.loads(lines.next())
                    except TimeoutError:
                        continue  # joined: keep the place (an offer again would be refused)
                    if "waiting" not in message:
                        answer = message
                        break
                    missing = ", ".join(str(rank) for rank in message["waiting"])
                    say(
                        f"[launch] node {offer.node_rank}: joined node 0 at {where}; waiting for "
                        f"node(s) {missing} of --nnodes {offer.nnodes} "
                        f"({time.monotonic() - deadline + timeout:.0f} s so far)"
                    )
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"node {offer.node_rank} found no complete job at --master_addr "
                    f"{where} within {timeout:g} s: start tfdist-launch with "
                    f"--node_rank 0 on that host, and every other node (--nnodes "
                    f"{offer.nnodes}); check that the address is reachable, or raise "
                    "--rdzv_timeout"
                ) from None
            if time.monotonic() - said >= WAITING_EVERY_S:
                said = time.monotonic()
                say(
                    f"[launch] node {offer.node_rank}: still waiting for node 0 at {where} "
                    f"({time.monotonic() - deadline + timeout:.0f} s of --rdzv_timeout {timeout:g})"
                )
            time.sleep(0.5)
    if "error" in answer:
        raise RendezvousError(str(answer["error"]))
    return answer["cluster"]


def _flags(flags: Mapping[str, object]) -> str:
    return " ".join(f"--{name} {value}" for name, value in flags.items())


def _send(connection: socket.socket, message) -> None:
    text = message.to_json() if isinstance(message, Offer) else json.dumps(message)
    connection.sendall(text.encode() + b"\n")


class _Lines:
    """The newline-ended messages of a connection, one at a time (several may come in one
    read; a timeout keeps what was read of the next)."""

    def __init__(self, connection: socket.socket):
        self.connection, self.buffer = connection, b""

    def next(self) -> str:
        while b"\n" not in self.buffer:
            chunk = self.connection.recv(65536)
            if not chunk:
                raise OSError("connection closed")
            self.buffer += chunk
            if len(self.buffer) > _MAX_LINE:
                raise ValueError("line too long")
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


def _read_line(connection: socket.socket) -> str:
    return _Lines(connection).next()

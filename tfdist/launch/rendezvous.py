"""Several hosts agree on one cluster: tfdist-launch --nnodes N --node_rank R --master_addr H.

Like torchrun's static rendezvous: the same tfdist-launch command runs once on every host,
each with its own --node_rank. Each picks free ports for its own tasks and offers their
addresses to node 0, which listens on --master_addr (the address the user named) until every
node has offered, checks that all were started alike, lays the tasks out in node order
(node 0's chief first, then the workers of node 0, node 1, ...) and answers every node with
the whole cluster. Each host then starts its own tasks with TF_CONFIG naming that cluster.

The exchange is one line of JSON each way over TCP; nothing received is ever executed.
Only the job's own nodes can join: node 0 sends each connection a fresh challenge, and a
node answers with its offer signed with the job's token (--rdzv_token, or
TFDIST_RDZV_TOKEN; node 0 makes one and prints it when given none): an HMAC-SHA256 over
the challenge and the offer. Node 0 signs its answers the same way. Anything unsigned, or
signed with another token, is dropped with one log line per address.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import secrets
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
# How long a connection to node 0 has to answer its challenge with a signed offer.
OFFER_DEADLINE_S = 5.0
# Where a launcher reads the job's token when --rdzv_token is not given.
TOKEN_ENV = "TFDIST_RDZV_TOKEN"


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

    Each connection is served in a thread of its own: it is sent a fresh challenge and has
    OFFER_DEADLINE_S to answer it with an offer signed with the job's token. A connection
    that sends nothing, or anything else (a forged offer, another job's node, a port
    scanner), is closed with one log line per address and changes nothing; only signed
    offers count, so a stranger can neither join, nor end, nor stall the job.

    Args:
      bind: (host, port) to listen on: the --master_addr the user named.
      nnodes: how many nodes to wait for.
      flags: node 0's layout flags, which every node must share: a node started otherwise
        is refused at once, whichever node offers first.
      token: the job's token (--rdzv_token): what every message is signed with.
      say: where the lines about ignored connections go.
    """

    def __init__(
        self,
        bind: tuple[str, int],
        nnodes: int,
        flags: Mapping[str, object],
        token: str,
        *,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ):
        self.nnodes, self.flags, self._key = nnodes, dict(flags), token.encode()
        self._say = say
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
        self._socket.listen(64)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._lock = threading.Condition()
        # node rank -> (connection, offer, challenge); a refused node under a negative key
        self._joined: dict[int, tuple[socket.socket, Offer, str]] = {}
        self._answer: dict | None = None  # the cluster, or the error every node hears
        self._ignored: set[str] = set()  # addresses already named in a log line
        self.error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stops listening, then waits (up to `timeout`) until every node that joined has its
        answer: node 0's launcher may exit next, and the answers are written by this daemon
        thread, which would die with it."""
        with self._lock:
            if self._answer is None:
                self._answer = {"error": "node 0 stopped before every node joined"}
            self._lock.notify_all()
        self._socket.close()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)

    def _serve(self) -> None:
        """Accepts connections, each served by `_greet` in a thread of its own, until the
        job is complete (or refused); then answers every node that joined."""
        self._socket.settimeout(0.2)  # how soon a complete job is answered
        said = time.monotonic()
        while True:
            with self._lock:
                if self._answer is not None:
                    break
                if self._joined and time.monotonic() - said >= WAITING_EVERY_S:
                    self._tell_waiting()
                    said = time.monotonic()
            try:
                connection, peer = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:  # closed: the launcher is going away
                break
            threading.Thread(target=self._greet, args=(connection, peer), daemon=True).start()
        with self._lock:
            answer = self._answer or {"error": "node 0 stopped before every node joined"}
            joined = list(self._joined.values())
        for connection, _, nonce in joined:
            with contextlib.suppress(OSError):
                _send(connection, sign(self._key, nonce, answer))
                connection.close()
        if "error" in answer:
            # Whoever joins after the refusal (node 0's own offer, when the bad one came
            # first) hears the same line, until the launcher closes the socket.
            while True:
                try:
                    connection, peer = self._socket.accept()
                except TimeoutError:
                    continue
                except OSError:  # closed
                    return
                threading.Thread(target=self._greet, args=(connection, peer), daemon=True).start()

    def _greet(self, connection: socket.socket, peer) -> None:
        """One connection: a challenge, a signed offer within OFFER_DEADLINE_S, or nothing."""
        nonce = secrets.token_hex(16)
        try:
            connection.settimeout(OFFER_DEADLINE_S)
            _send(connection, {"challenge": nonce})
            offer = Offer.from_json(verified(self._key, nonce, _read_line(connection)))
        except (OSError, ValueError, KeyError, TypeError) as error:
            if isinstance(error, ValueError):  # a node with another token learns that much
                with contextlib.suppress(OSError):
                    _send(connection, {"refused": "not signed with this job's token"})
            connection.close()
            self._ignore(peer, error)
            return
        with self._lock:
            if self._answer is not None:  # refused already (or closing): it hears why
                with contextlib.suppress(OSError):
                    _send(connection, sign(self._key, nonce, self._answer))
                connection.close()
                return
            problem = self._check(offer, self._joined)
            if problem:
                # A node of this job started otherwise cannot be part of it, and the job
                # cannot complete without it: every node, this one included, stops with it.
                self.error = problem
                self._answer = {"error": problem}
                self._joined[-1 - len(self._joined)] = (connection, offer, nonce)
            else:
                self._joined[offer.node_rank] = (connection, offer, nonce)
                if len(self._joined) == self.nnodes:
                    offers = [self._joined[rank][1] for rank in range(self.nnodes)]
                    self._answer = {"cluster": assemble(offers)}
                else:
                    self._tell_waiting()  # who is still missing changed: say so at once
            self._lock.notify_all()

    def _ignore(self, peer, error: BaseException) -> None:
        address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        with self._lock:
            if address in self._ignored:
                return
            self._ignored.add(address)
        why = "sent nothing in time" if isinstance(error, TimeoutError) else str(error)
        self._say(
            f"[launch] node 0: ignored a connection from {address} to the rendezvous ({why}): "
            "only nodes started with this job's --rdzv_token can join"
        )

    def _tell_waiting(self) -> None:
        missing = [rank for rank in range(self.nnodes) if rank not in self._joined]
        for connection, _, nonce in self._joined.values():
            with contextlib.suppress(OSError):
                _send(connection, sign(self._key, nonce, {"waiting": missing}))

    def _check(self, offer: Offer, joined: Mapping[int, tuple]) -> str:
        if offer.nnodes != self.nnodes:
            return (
                f"node {offer.node_rank} was started with --nnodes {offer.nnodes}, node 0 with "
                f"--nnodes {self.nnodes}: start every node with the same --nnodes"
            )
        if not 0 <= offer.node_rank < self.nnodes:
            return (
                f"node {offer.node_rank} was started with --node_rank {offer.node_rank}: give "
                f"every host its own --node_rank, 0 to {self.nnodes - 1}"
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
    token: str,
    timeout: float,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> dict[str, list[str]]:
    """Offers this node's tasks to the master and returns the whole cluster.

    Retries the connection until `timeout` (node 0 may start after this node). Says at once,
    and every WAITING_EVERY_S seconds, what it waits for (node 0, or the nodes node 0 has not
    heard from). The offer answers the master's challenge signed with `token`, and only
    answers signed with it are believed.

    Raises:
      RendezvousError: the master refused the offer (or another node's), or did not answer
        within `timeout`.
    """
    key = token.encode()
    deadline = time.monotonic() + timeout
    where = f"{master[0]}:{master[1]}"
    said = time.monotonic()
    say(
        f"[launch] node 0: gathering --nnodes {offer.nnodes} at --master_addr {where}"
        if offer.node_rank == 0
        else f"[launch] node {offer.node_rank}: waiting for node 0 at --master_addr {where}"
    )
    answer = None
    unsigned = False
    while answer is None:
        try:
            with socket.create_connection(master, timeout=5.0) as connection:
                lines = _Lines(connection)
                challenge = json.loads(lines.next())
                nonce = challenge["challenge"]
                _send(connection, sign(key, nonce, json.loads(offer.to_json())))
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    connection.settimeout(min(left, WAITING_EVERY_S + 5.0))
                    try:
                        line = lines.next()
                    except TimeoutError:
                        continue  # joined: keep the place (an offer again would be refused)
                    try:
                        message = json.loads(verified(key, nonce, line))
                    except ValueError:
                        unsigned = True
                        raise
                    if "waiting" not in message:
                        answer = message
                        break
                    missing = ", ".join(str(rank) for rank in message["waiting"])
                    say(
                        f"[launch] node {offer.node_rank}: joined node 0 at {where}; waiting for "
                        f"node(s) {missing} of --nnodes {offer.nnodes} "
                        f"({time.monotonic() - deadline + timeout:.0f} s so far)"
                    )
        except (OSError, ValueError, KeyError, TypeError):
            if time.monotonic() >= deadline:
                hint = (
                    " (what answered there did not sign with this node's --rdzv_token: "
                    "start every node with node 0's token)"
                    if unsigned
                    else ""
                )
                raise RendezvousError(
                    f"node {offer.node_rank} found no complete job at --master_addr "
                    f"{where} within {timeout:g} s{hint}: start tfdist-launch with "
                    f"--node_rank 0 on that host, and every other node (--nnodes "
                    f"{offer.nnodes}) with the same --rdzv_token; check that the address is "
                    "reachable, or raise --rdzv_timeout"
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


def sign(key: bytes, nonce: str, body: Mapping) -> dict:
    """`body` with its proof of the job's token: an HMAC-SHA256 over the connection's
    challenge and the body, so a message can be neither forged nor replayed elsewhere."""
    text = json.dumps(body)
    return {"body": text, "mac": _mac(key, nonce, text)}


def verified(key: bytes, nonce: str, line: str) -> str:
    """The body of a signed message, if its proof holds (compared in constant time).

    Raises:
      ValueError: not a signed message, or not signed with `key` for this connection.
    """
    message = json.loads(line)
    if not isinstance(message, dict) or set(message) != {"body", "mac"}:
        raise ValueError("not a signed tfdist-launch message")
    body, mac = message["body"], message["mac"]
    if not isinstance(body, str) or not isinstance(mac, str):
        raise ValueError("not a signed tfdist-launch message")
    if not hmac.compare_digest(mac, _mac(key, nonce, body)):
        raise ValueError("not signed with this job's token")
    return body


def _mac(key: bytes, nonce: str, text: str) -> str:
    return hmac.new(key, f"{nonce}\n{text}".encode(), hashlib.sha256).hexdigest()


def new_token() -> str:
    """A fresh job token, for a node 0 started without one."""
    return secrets.token_urlsafe(18)


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

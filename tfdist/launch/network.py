"""A job's own network: its tasks' servers out of every other process's reach.

TensorFlow's gRPC server listens on every interface of the host (`0.0.0.0:PORT`, or
`[::]:PORT`), whatever address TF_CONFIG names for the task: its server options have no
bind address. Its servers have no authentication either, so on a shared host or a host
with a public interface any process that reaches the port can join a task's collectives.

`tfdist-launch --private_network` runs a one-host job inside a user and network namespace
of its own (`unshare --user --map-root-user --net`, which most Linux hosts allow without
privileges): its loopback interface is the job's alone, the tasks reach each other there,
and nothing outside the namespace can connect to them, while files, signals and the
terminal are the host's. Where namespaces are not allowed, the launcher says so;
docs/reference/security.md gives the firewall recipe.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence

from tfdist.launch.plan import UsageError

# Set in the re-executed launcher: it runs inside the job's namespace.
INSIDE_ENV = "TFDIST_PRIVATE_NETWORK"
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def enter(argv: Sequence[str]) -> None:
    """Re-executes this launcher (`python -m tfdist.launch argv`) inside a new user and
    network namespace; returns only when already inside (after bringing loopback up).

    Raises:
      UsageError: the host does not allow the namespaces (or has no `unshare`).
    """
    if os.environ.get(INSIDE_ENV) == "1":
        _loopback_up()
        return
    unshare = shutil.which("unshare")
    why = "no unshare command (util-linux) on this host" if unshare is None else _refused(unshare)
    if why:
        raise UsageError(
            f"--private_network needs a user and network namespace of the job's own, and "
            f"{why}. Drop --private_network and keep the task ports from other hosts with a "
            "firewall (docs/reference/security.md). Received: --private_network"
        )
    os.environ[INSIDE_ENV] = "1"
    os.execv(
        unshare,
        [unshare, "--user", "--map-root-user", "--net", "--",
         sys.executable, "-m", "tfdist.launch", *argv],
    )  # fmt: skip


def _refused(unshare: str) -> str:
    """Why `unshare` cannot make the namespaces here ('' when it can)."""
    probe = subprocess.run(
        [unshare, "--user", "--map-root-user", "--net", "true"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if probe.returncode == 0:
        return ""
    return f"this host refuses them ({probe.stderr.strip() or f'exit {probe.returncode}'})"


def _loopback_up() -> None:
    """A new network namespace starts with its loopback interface down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))

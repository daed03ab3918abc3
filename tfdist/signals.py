"""Stop signals at any moment: SIGTERM and SIGINT end a tfdist task promptly and truthfully.

A scheduler (`timeout`, Slurm, `kubectl delete`, a launcher) asks a task to stop with SIGTERM;
a person at a terminal with SIGINT. Python's own handlers cannot be relied on for either:

- while a task waits for its peers, TensorFlow holds the main thread inside C++ (the
  coordination service's registration, a parameter-server connection), where Python signal
  handlers never run, for as long as the start-up timeout (600 s by default);
- TensorFlow's coordination service installs a SIGTERM handler of its own (its preemption
  notifier) that only records the signal, so a task waiting for a peer ignored SIGTERM.

`route_stop_signals()`, called first thing in a program, before TensorFlow starts any
thread, blocks both signals in every thread and receives them with `sigwait` in a thread of
its own, whatever handlers get installed later. What happens then depends on the phase:

- by default (start-up, data preparation, serving, the evaluator's polling): one line saying
  what the task was doing, and exit 143 for SIGTERM (or `TFDIST_RESTARTABLE_EXIT_CODE`,
  which a Kubernetes ExitCode policy restarts) or 130 for SIGINT, within a second;
- while a `handling(fn)` block is active (training: tfdist's preemption watcher), `fn(signum)`
  decides (save a checkpoint at the next step boundary, then stop);
- inside a `deferred()` block (writing a record or a checkpoint), the exit waits for the
  block to end, so a signal never leaves half a file behind.

Library code marks its phases with `doing("...")` whether or not a program routed its
signals; without routing, the calls cost nothing and change nothing.

This module imports nothing heavy (the launcher and binaries use it before TensorFlow).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from tfdist.exit_codes import restartable_exit_code

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

Handler = Callable[[int], None]


def exit_code_for(signum: int) -> int:
    """128 + the signal, as a shell reports a death by it; SIGTERM's is restartable
    (TFDIST_RESTARTABLE_EXIT_CODE where a launcher set it)."""
    code = 128 + signum
    return restartable_exit_code(code) if signum == signal.SIGTERM else code


class SignalRouter:
    """Receives SIGTERM and SIGINT in a thread of its own; see the module docstring.

    Args:
      name: how the process is named in its one-line message (the task, e.g. "worker:1").
      write: where the message goes; standard error by default.
      exit_process: how the process ends; `os._exit` by default (the main thread may be stuck in
        C++, so a normal exit, which needs it, could never happen).
    """

    def __init__(
        self,
        *,
        name: str = "",
        write: Callable[[str], None] | None = None,
        exit_process: Callable[[int], None] = os._exit,
    ):
        self.name = name
        self._write = write or _write_stderr
        self._exit = exit_process
        self._activities: list[str] = ["starting"]
        self._handlers: list[Handler] = []
        # Held by deferred() blocks; the exit takes it first, so it waits for them.
        self._writing = threading.RLock()
        self.signals: list[int] = []  # every signal received, in order

    @property
    def activity(self) -> str:
        return self._activities[-1]

    @contextlib.contextmanager
    def doing(self, activity: str) -> Iterator[None]:
        self._activities.append(activity)
        try:
            yield
        finally:
            self._activities.pop()

    @contextlib.contextmanager
    def handling(self, handler: Handler) -> Iterator[None]:
        self._handlers.append(handler)
        try:
            yield
        finally:
            self._handlers.remove(handler)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        with self._writing:
            yield

    def deliver(self, signum: int) -> None:
        """What the routing thread does with each signal it receives."""
        self.signals.append(signum)
        if self._handlers:
            self._handlers[-1](signum)
        else:
            self.stop(signum, f"while {self.activity}")

    def stop(self, signum: int, why: str) -> None:
        """Ends the process for `signum` with one line: '<name>: SIGTERM <why>; exit 143'."""
        code = exit_code_for(signum)
        with self._writing:
            prefix = f"{self.name}: " if self.name else ""
            self._write(f"{prefix}received {signal.Signals(signum).name} {why}; exit {code}")
            _flush_standard_streams()
            self._exit(code)


_router: SignalRouter | None = None


def route_stop_signals(*, name: str = "") -> SignalRouter:
    """Routes SIGTERM and SIGINT to a thread of their own for the rest of the process.

    Call it first thing in a program's main module, before importing TensorFlow: the signal
    mask is inherited only by threads started afterwards. A signal the process ignores
    (`nohup`, a background job's SIGINT) stays ignored. Calling it again returns the router.

    Args:
      name: how the process is named in its one-line message; `set_name` changes it later.

    Raises:
      RuntimeError: if called outside the main thread.
    """
    global _router
    if _router is not None:
        return _router
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("route_stop_signals() must be called from the main thread")
    routed = [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
    _router = SignalRouter(name=name)
    if routed:
        signal.pthread_sigmask(signal.SIG_BLOCK, routed)
        threading.Thread(
            target=_receive, args=(_router, routed), name="tfdist-signals", daemon=True
        ).start()
    return _router


def _receive(router: SignalRouter, routed: list[int]) -> None:
    while True:
        router.deliver(signal.sigwait(routed))


def router() -> SignalRouter | None:
    """The process's router, or None when its program did not route its stop signals."""
    return _router


def set_name(name: str) -> None:
    """Names the task in the router's messages, once the program knows which it is."""
    if _router is not None:
        _router.name = name


def doing(activity: str) -> contextlib.AbstractContextManager[None]:
    """Says what the task is doing, for the message a stop signal prints ('waiting for ...')."""
    return _router.doing(activity) if _router is not None else contextlib.nullcontext()


def deferred() -> contextlib.AbstractContextManager[None]:
    """A block a stop signal waits for (writing a record): no file is left half written."""
    return _router.deferred() if _router is not None else contextlib.nullcontext()


def _write_stderr(line: str) -> None:
    # os.write, not print: the main thread may hold sys.stderr's lock, stuck in C++.
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


def _flush_standard_streams() -> None:
    # A flush can block on a full pipe; it gets a second, then the exit goes ahead anyway.
    def flush():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    flusher = threading.Thread(target=flush, daemon=True)
    flusher.start()
    flusher.join(1.0)

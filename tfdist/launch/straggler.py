"""A slow or paused task, on purpose: how a way of exchanging copes with a straggler.

For benchmarks (tools/exchange_bench.py), not for tests of correctness: the launcher stops
and continues one task's process group with SIGSTOP / SIGCONT, as a busy neighbour or a
slow disk would hold it up, whatever strategy it runs.

  tfdist-launch --workers 4 --slow worker:1=2 -- python -m experiments.train ...
      worker:1 runs at half speed: in every 100 ms it is stopped for the last 50 ms.
  tfdist-launch --chief --workers 4 --ps 1 --pause worker:2=20+5 -- ...
      worker:2 is stopped for 5 s, 20 s after it starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import threading
import time
from collections.abc import Callable

from tfdist.errors import TfdistError

# One cycle of a slowed task: short beside a step's wait for its peers' time-outs, long
# beside the scheduler's time slice, so the stops add up to the asked share.
PERIOD_SECONDS = 0.1


class StragglerError(TfdistError, ValueError):
    """A --slow or --pause value that cannot be understood."""


@dataclasses.dataclass(frozen=True)
class Straggle:
    """What to do to one task: run it `factor` times slower, and/or stop it `pause_seconds`
    at `pause_at` seconds after it starts."""

    task: str
    factor: float = 1.0
    pause_at: float | None = None
    pause_seconds: float = 0.0


def parse_slow(text: str) -> Straggle:
    """'worker:1=2' -> worker:1 at half speed."""
    found = re.fullmatch(r"(\w+:\d+)=([0-9.]+)", text.strip())
    if not found or float(found[2]) < 1:
        raise StragglerError(
            "--slow takes TASK=FACTOR, a factor of 1 or more, e.g. --slow worker:1=2 (half "
            f"speed). Received: --slow {text}"
        )
    return Straggle(found[1], factor=float(found[2]))


def parse_pause(text: str) -> Straggle:
    """'worker:1=20+5' -> worker:1 stopped for 5 s, 20 s after it starts."""
    found = re.fullmatch(r"(\w+:\d+)=([0-9.]+)\+([0-9.]+)", text.strip())
    if not found:
        raise StragglerError(
            "--pause takes TASK=AT+SECONDS, e.g. --pause worker:1=20+5 (stopped for 5 s, 20 s "
            f"after it starts). Received: --pause {text}"
        )
    return Straggle(found[1], pause_at=float(found[2]), pause_seconds=float(found[3]))


class Straggler:
    """Holds up one task's process group as a Straggle says, from a thread of its own.

    Example:
        straggler = Straggler(Straggle("worker:1", factor=2), pid=lambda: proc.pid)
        straggler.start()
        ...
        straggler.stop()   # the task runs freely again (SIGCONT), whatever the moment

    Args:
      straggle: what to do.
      pid: gives the task's process now (the leader of its group; a task restarted in
        place has a new one).
      say: reports what it did (the launcher's own lines).
    """

    def __init__(
        self, straggle: Straggle, *, pid: Callable[[], int], say: Callable[[str], None] = print
    ):
        self.straggle, self.pid, self._say = straggle, pid, say
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tfdist-straggler")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._signal(signal.SIGCONT)  # never leave a task stopped

    def _run(self) -> None:
        straggle, started = self.straggle, time.monotonic()
        if straggle.factor > 1:
            self._say(f"{straggle.task} runs {straggle.factor:g}x slower (--slow)")
        paused = straggle.pause_at is None
        running = PERIOD_SECONDS / straggle.factor
        while not self._done.is_set():
            if not paused and time.monotonic() - started >= straggle.pause_at:
                paused = True
                self._say(f"{straggle.task} stopped for {straggle.pause_seconds:g} s (--pause)")
                self._hold(straggle.pause_seconds)
                self._say(f"{straggle.task} goes on")
                continue
            if straggle.factor > 1:
                if self._done.wait(running):
                    break
                self._hold(PERIOD_SECONDS - running)
            elif self._done.wait(0.05):
                break

    def _hold(self, seconds: float) -> None:
        self._signal(signal.SIGSTOP)
        try:
            self._done.wait(seconds)
        finally:
            self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid(), signum)

"""What tfdist-launch passes on of a task's output: TensorFlow's native lines, tamed.

- OncePerProcess: TensorFlow's start-up block (absl's notice, the INFO lines stamped before
  its logging is set up, the CPU-instructions notice) once per task; each of TensorFlow's
  two native libraries printed it, so every process said it twice.
- RuntimeLines: TensorFlow's runtime error lines held back until the task's next line says
  whether they matter, so that after a lost peer tfdist's own line comes first and the
  abort lines that only repeat it are counted, not printed (TFDIST_NATIVE_LOGS=all shows
  them); after a clean finish, the coordination service's complaints that its peers have
  gone, and the runtime's that it cannot reach them, are dropped.
"""

from __future__ import annotations

import re
import time

# TensorFlow's native start-up block: absl's notice before its logging is set up, the INFO
# lines logged before that (stamped "I0000 00:00:<seconds since 1970>", which no Python
# absl line is) and the CPU-instructions notice. Each of TensorFlow's two native libraries
# prints it, so every process printed it twice.
_NATIVE_INFO = re.compile(rb"^I0000 00:00:\d+\.\d+ +\d+ (\S+:\d+\] .*)$")
_NATIVE_NOTICES = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    b"To enable the following instructions: ",
)


class OncePerProcess:
    """Drops a task's repeats of TensorFlow's native start-up lines (the same source line
    and message, whatever its time stamp): the block shows once per process."""

    def __init__(self):
        self._seen: set[bytes] = set()

    def repeats(self, line: bytes) -> bool:
        text = line.rstrip(b"\r\n")
        match = _NATIVE_INFO.match(text)
        if match:
            key = match.group(1)
        elif text.startswith(_NATIVE_NOTICES):
            key = text
        else:
            return False
        if key in self._seen:
            return True
        self._seen.add(key)
        return False


NATIVE_LOGS_ENV = "TFDIST_NATIVE_LOGS"
# TensorFlow's runtime error and warning lines once it runs, and the lines that continue them
# (gRPC's details of a failed call).
# TensorFlow 2.21 stamps them as it stamps the start-up block, "E0000 00:00:<seconds since
# 1970>", since its logging is never set up; absl's own stamp is "E1127 04:29:09.929320".
_RUNTIME_LINE = re.compile(rb"^[EWF]\d{4} (\d\d:\d\d:\d\d|00:00:\d+)\.\d+ +\d+ \S+:\d+\] ")
# A runtime message of several lines arrives in one write: lines this soon after it continue it.
_CONTINUES_WITHIN_S = 0.2
_TFDIST_LINE = re.compile(rb"^\d\d:\d\d:\d\d [A-Z]+ \S+: ")  # tfdist.logs.FORMAT
_AFTER_A_CLEAN_FINISH = re.compile(rb"coordination.?service|heartbeat|PollForError", re.I)
# tfdist's one line at the end of a task (tfdist.exit_codes.end_process).
_TFDIST_ERROR = re.compile(rb"^(error|preempted|interrupted): ")
# A message that only says a peer cannot be reached (a parameter-server job's coordinator
# after losing a worker repeats it for every function it registers or removes there: 192
# lines in one run). Said once, with the peer; the repeats are counted.
_UNREACHABLE = re.compile(rb"failed to connect to all addresses|Connection refused")
_REMOTE_TARGET = re.compile(rb"remote target (/job:[\w-]+/replica:\d+/task:\d+)")


class RuntimeLines:
    """Holds TensorFlow's runtime error lines back until the task's next line says whether
    they matter, so that tfdist's own line comes first when a peer is lost.

    - Followed by an ordinary line: released before it, in order.
    - Followed by the task's own one-line error (`error: ...`): dropped, and counted (the
      runtime's abort lines only repeat, less clearly, what that line says).
    - At a clean exit (0): the coordination service's complaints that its peers have gone
      (the chief exits first) are dropped; others are released.
    - At any other exit: dropped and counted after the task's own error line (its
      teardown's complaints), released without one (they are all there is).
    """

    def __init__(self, *, show_all: bool = False):
        self.show_all = show_all
        self.held: list[bytes] = []
        self.dropped = 0
        self.said_error = False  # the task printed its own one-line error
        self._last_held = 0.0
        self._unreachable: set[bytes] = set()  # peers whose unreachability was said

    def passed(self, line: bytes, now: float | None = None) -> list[bytes]:
        """The lines to print now, given the task's next line (arrived at `now`)."""
        if self.show_all:
            return [line]
        now = time.monotonic() if now is None else now
        continues = (
            self.held
            and now - self._last_held < _CONTINUES_WITHIN_S
            and not _TFDIST_ERROR.match(line)
            and not _TFDIST_LINE.match(line)
        )
        if _RUNTIME_LINE.match(line) or continues:
            self.held.append(line)
            self._last_held = now
            return []
        held, self.held = self.held, []
        if _TFDIST_ERROR.match(line):
            self.said_error = True
            self.dropped += len(held)
            return [line]
        return [*self._unrepeated(held), line]

    def _unrepeated(self, held: list[bytes]) -> list[bytes]:
        """`held`, with each message that only says a peer cannot be reached said once per
        peer, in one line; its repeats are counted in `dropped`."""
        kept = []
        for message in _messages(held):
            text = b" ".join(message)
            if not _UNREACHABLE.search(text):
                kept += message
                continue
            target = _REMOTE_TARGET.search(text)
            peer = target.group(1) if target else b"a peer"
            if peer in self._unreachable:
                self.dropped += len(message)
                continue
            self._unreachable.add(peer)
            self.dropped += len(message) - 1
            kept.append(
                b"TensorFlow's runtime cannot reach " + peer + b" (connection refused: it is not "
                b"running); its repeats of this are held back (" + NATIVE_LOGS_ENV.encode()
                + b"=all shows them)\n"
            )  # fmt: skip
        return kept

    def at_exit(self, returncode: int | None) -> list[bytes]:
        """The held lines to print once the task has exited with `returncode`."""
        held, self.held = self.held, []
        if returncode != 0:
            if self.said_error:  # its teardown's complaints after its own line: counted
                self.dropped += len(held)
                return []
            return self._unrepeated(held)
        # After a clean finish, its peers finishing first is no news: the coordination
        # service's goodbyes, and the runtime's "cannot reach" a peer that has exited
        # (counted).
        kept = []
        for message in _messages(held):
            text = b" ".join(message)
            if _UNREACHABLE.search(text):
                self.dropped += len(message)
            elif not _AFTER_A_CLEAN_FINISH.search(message[0]):
                kept += message
        return kept


def _messages(held: list[bytes]) -> list[list[bytes]]:
    """`held` cut into messages: each runtime line with the lines that continue it."""
    messages: list[list[bytes]] = []
    for line in held:
        if _RUNTIME_LINE.match(line) or not messages:
            messages.append([line])
        else:
            messages[-1].append(line)
    return messages

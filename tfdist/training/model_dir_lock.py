"""One job per model_dir: a lock file the chief holds while it trains there.

Two jobs writing one model_dir would interleave their checkpoints and records (a merge of one
job's checkpoint meets the other's files; history.jsonl holds both). The chief of a job takes
`model_dir/tfdist.lock` before it restores or writes anything, renews it every
`RENEW_SECONDS` and removes it when training ends. A second job finds it and stops at once,
on every task, with one line naming the holder: host, process IDs, start time.

A lock whose job is gone is taken over, with a warning: on the same host when its process is
no longer running (or is another process under a reused ID), on another host when it was
last renewed more than `STALE_SECONDS` ago (a shared filesystem: NFS, gs://). Within one
process the lock is re-entrant: fit called twice, or StepCheckpoint and RunRecord of one fit,
share it.

The lock is made by an exclusive create where the filesystem has one (local paths); on
filesystems TensorFlow reaches through plugins (gs://, s3://) it is written, then read back
to check that this job's token is the one that stayed.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid

import tensorflow as tf

from tfdist.exit_codes import EXIT_STORAGE
from tfdist.storage import StorageError, agree_on_fault, cause_of, fault, write_atomically

log = logging.getLogger(__name__)

LOCK_FILE = "tfdist.lock"
RENEW_SECONDS = 10.0
STALE_SECONDS = 60.0


class ModelDirInUseError(StorageError):
    """Another job holds the model_dir: this one stops before writing anything there."""

    exit_code = EXIT_STORAGE


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lock, as its file says."""

    host: str
    pid: int
    parent_pid: int
    started: float  # time.time() when taken
    renewed: float  # time.time() when last renewed
    token: str
    process_start: str = ""  # the process's start in /proc/PID/stat: tells a reused PID

    def describe(self, now: float) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (
            f"host {self.host}, pid {self.pid} (its parent {self.parent_pid}), started "
            f"{started}, renewed {max(0.0, now - self.renewed):.0f} s ago"
        )

    def gone(self, now: float) -> str | None:
        """Why the job that took this lock is gone; None if it may be running."""
        if self.host == socket.gethostname():
            if not _running(self.pid):
                return f"its process {self.pid} is no longer running"
            if self.process_start and _process_start(self.pid) != self.process_start:
                return f"process ID {self.pid} now belongs to another process"
            return None
        if now - self.renewed > STALE_SECONDS:
            return f"it was last renewed {now - self.renewed:.0f} s ago (> {STALE_SECONDS:g} s)"
        return None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _process_start(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command may hold spaces; the fields after its closing bracket do not.
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def read_holder(path: str) -> Holder | None:
    """The holder a lock file names; None when it is missing or unreadable (a torn write)."""
    try:
        with tf.io.gfile.GFile(path) as f:
            fields = json.load(f)
        return Holder(**{k: fields[k] for k in Holder.__dataclass_fields__ if k in fields})
    except (tf.errors.OpError, OSError, ValueError, TypeError):
        return None


class ModelDirLock:
    """The lock of one model_dir, held by this process (see the module)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.path = os.path.join(model_dir, LOCK_FILE)
        self.holder: Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises ModelDirInUseError naming the job that holds it."""
        now = time.time()
        mine = Holder(
            host=socket.gethostname(), pid=os.getpid(), parent_pid=os.getppid(), started=now,
            renewed=now, token=uuid.uuid4().hex, process_start=_process_start(os.getpid()),
        )  # fmt: skip
        tf.io.gfile.makedirs(self.model_dir)  # fit may be the first to write there
        for _ in range(3):  # a lock taken over by two jobs at once: one of them wins
            if self._create(mine):
                break
            held = read_holder(self.path)
            if held is None:  # torn or vanished between the create and the read
                time.sleep(0.2)
                held = read_holder(self.path)
            if held is not None and held.host == mine.host and held.pid == mine.pid:
                mine = dataclasses.replace(mine, token=held.token)  # this process's own
                break
            gone = "its file cannot be read" if held is None else held.gone(now)
            if gone is None:
                raise ModelDirInUseError(in_use_message(self.model_dir, held, now))
            log.warning(
                "Taking over %s: the job that held it is gone (%s)", self.path,
                gone if held is None else f"{held.describe(now)}; {gone}",
            )  # fmt: skip
            _remove(self.path)
        else:
            held = read_holder(self.path)
            raise ModelDirInUseError(in_use_message(self.model_dir, held, now))
        self.holder = mine
        self._thread = threading.Thread(target=self._renew, name="tfdist-lock", daemon=True)
        self._thread.start()

    def _create(self, holder: Holder) -> bool:
        text = json.dumps(dataclasses.asdict(holder), indent=2)
        if "://" not in self.path:  # an exclusive create: one process wins, atomically
            try:
                descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(descriptor, "w") as f:
                f.write(text)
            return True
        if tf.io.gfile.exists(self.path):
            return False
        write_atomically(self.path, text)
        time.sleep(0.5)  # another job's write in the same moment lands before the read
        held = read_holder(self.path)
        return held is not None and held.token == holder.token

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            holder = dataclasses.replace(self.holder, renewed=time.time())
            try:
                held = read_holder(self.path)
                if held is not None and held.token != holder.token:
                    log.warning(
                        "%s was taken by another job: %s", self.path, held.describe(time.time())
                    )
                    return
                write_atomically(self.path, json.dumps(dataclasses.asdict(holder), indent=2))
                self.holder = holder
            except (tf.errors.OpError, OSError) as error:  # a full disk: kept as it was
                log.debug("Could not renew %s: %s", self.path, error)

    def release(self) -> None:
        """Removes the lock (if it is still this job's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        held = read_holder(self.path)
        if self.holder is not None and held is not None and held.token == self.holder.token:
            _remove(self.path)
        self.holder = None


def in_use_message(model_dir: str, holder: Holder | None, now: float) -> str:
    who = holder.describe(now) if holder else "its lock file cannot be read"
    return (
        f"model_dir {model_dir} is in use by another job ({who}; "
        f"{os.path.join(model_dir, LOCK_FILE)}). Wait for that job to end or stop it, or "
        "give this job another model_dir. A lock whose job is gone is taken over by itself "
        f"(after {STALE_SECONDS:g} s when that job ran on another host)."
    )


def _remove(path: str) -> None:
    with contextlib.suppress(tf.errors.NotFoundError):
        tf.io.gfile.remove(path)


# The locks this process holds, by model_dir, with how many holds each has.
_HELD: dict[str, tuple[ModelDirLock, int]] = {}
_GUARD = threading.Lock()


def _key(model_dir: str) -> str:
    return model_dir if "://" in model_dir else os.path.realpath(model_dir)


def hold(model_dir: str) -> ModelDirLock:
    """Takes model_dir's lock for this process, or adds a hold on the one it has.

    Raises:
      ModelDirInUseError: another job holds it.
    """
    with _GUARD:
        key = _key(model_dir)
        if key in _HELD:
            lock, count = _HELD[key]
            _HELD[key] = (lock, count + 1)
            return lock
        lock = ModelDirLock(model_dir)
        lock.acquire()
        _HELD[key] = (lock, 1)
        return lock


def let_go(model_dir: str) -> None:
    """Drops one hold on model_dir's lock; the last one removes it."""
    with _GUARD:
        key = _key(model_dir)
        if key not in _HELD:
            return
        lock, count = _HELD[key]
        if count > 1:
            _HELD[key] = (lock, count - 1)
            return
        del _HELD[key]
    lock.release()


@atexit.register
def _release_all() -> None:
    for lock, _ in list(_HELD.values()):
        lock.release()
    _HELD.clear()


def agree_to_hold(model_dir: str, job) -> None:
    """Every lockstep worker calls this at the same point: the chief takes the lock, and if
    it cannot (another job holds it, or a storage fault), every worker stops with its line.

    Args:
      job: the fit's job (`is_chief`, `tally`; tfdist.training.job).
    """
    path = os.path.join(model_dir, LOCK_FILE)
    refusal = None
    if job.is_chief:
        try:
            hold(model_dir)
        except ModelDirInUseError as error:
            refusal = error
        except (tf.errors.OpError, OSError) as error:
            cause = cause_of(error)
            if cause is None:
                raise
            refusal = fault(cause, what="lock", path=path, resume=_RESUME)

    def peer_fault(cause):
        if cause is None:
            return ModelDirInUseError(
                "The chief stopped: " + in_use_message(model_dir, read_holder(path), time.time())
            )
        return fault(cause, what="lock", path=path, resume=_RESUME, where="on the chief")

    agree_on_fault(job.tally, refusal, peer_fault)


_RESUME = "from the last checkpoint"

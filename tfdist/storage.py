"""Files on any filesystem TensorFlow reads: local disk, gs://, ram://, hdfs://.

Everything tfdist writes to a model_dir or data_dir goes through tf.io.gfile, never `open`
or `glob`: on a TPU Node the model_dir must be a gs:// bucket, where local calls find
nothing.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import uuid
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from tfdist.errors import TfdistError
from tfdist.exit_codes import EXIT_STORAGE

log = logging.getLogger(__name__)


class StorageError(TfdistError, OSError):
    """A directory tfdist must write to that is not a writable directory."""


def temporary_suffix() -> str:
    """A suffix no other process uses: '.tmp-<pid>-<random>'."""
    return f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def write_atomically(path: str, text: str, *, suffix: str | None = None) -> None:
    """Replaces `path` with `text` in one step: a reader sees the old file or the new one.

    Written under a temporary name, then renamed over `path`. Besides surviving a crash in
    the middle, this is the only correct way on some filesystems: TensorFlow's ram:// opens
    an existing file for writing ("w") without truncating it.
    """
    temporary = path + (suffix or temporary_suffix())
    with tf.io.gfile.GFile(temporary, "w") as f:
        f.write(text)
    tf.io.gfile.rename(temporary, path, overwrite=True)


def strict_json(value, *, what: str, indent: int | None = None) -> str:
    """`value` as strict JSON: a non-finite number (NaN, Infinity) is written as null.

    Python's json writes NaN and Infinity, which are not JSON, and strict parsers (jq,
    JavaScript, Go) reject the whole file. The log names each value so replaced.
    """
    replaced: list[str] = []

    def clean(item, where: str):
        if isinstance(item, np.generic):
            item = item.item()
        if isinstance(item, float) and not math.isfinite(item):
            replaced.append(f"{where} ({item})")
            return None
        if isinstance(item, dict):
            return {k: clean(v, f"{where}.{k}" if where else str(k)) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(item)]
        return item

    text = json.dumps(clean(value, ""), indent=indent, allow_nan=False)
    if replaced:
        log.warning(
            "%s: %s not a finite number; written as null",
            what, ", ".join(replaced[:5]) + (f" and {len(replaced) - 5} more" if len(replaced) > 5 else ""),
        )  # fmt: skip
    return text


# What TensorFlow raises for a path that is wrong, rather than for a storage service that
# failed for the moment (Unavailable, DeadlineExceeded, ...): a restart cannot cure these.
PATH_ERRORS = (
    tf.errors.PermissionDeniedError,
    tf.errors.NotFoundError,
    tf.errors.FailedPreconditionError,
    tf.errors.UnimplementedError,
    tf.errors.AlreadyExistsError,
    tf.errors.InvalidArgumentError,
)


def check_writable_directory(path: str, *, name: str) -> None:
    """Creates `path` if needed and checks that this process can write files in it.

    Raises:
      StorageError: `path` is a file, lies under a file, is not writable, or is on a
        filesystem TensorFlow cannot open (a scheme it has no plugin for); `name` (the flag
        or argument, e.g. "--model_dir") names it in the message.
    """
    fix = (
        f"Give {name} a directory this process can write (it is created if missing): a "
        "local path, or a gs:// path with credentials."
    )
    try:
        if tf.io.gfile.exists(path) and not tf.io.gfile.isdir(path):
            raise StorageError(f"{name} {path} is a file, not a directory. {fix}")
        tf.io.gfile.makedirs(path)
        probe = os.path.join(path, ".tfdist-probe" + temporary_suffix())
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("")
        tf.io.gfile.remove(probe)
    except PATH_ERRORS as e:  # not a passing failure (Unavailable, ...): those propagate
        reason = e.message.strip().splitlines()[0] if e.message.strip() else type(e).__name__
        raise StorageError(
            f"{name} {path} cannot be written ({type(e).__name__}: {reason}). {fix}"
        ) from None


# --- storage faults met while a job writes -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cause:
    """One way a write can fail: how to recognise it, and what to tell the user."""

    name: str  # what happened, as the line says it
    fix: str  # what to do before running the same command again
    errnos: tuple[int, ...]  # from Python's open/write (OSError)
    words: tuple[str, ...]  # in TensorFlow's message (its filesystems name the errno's text)
    kinds: tuple[type, ...] = ()  # TensorFlow's error classes that mean it whatever the words
    restartable: bool = False  # a restart alone can cure it


# In the order they are recognised. TensorFlow's local filesystem reports ENOSPC as
# ResourceExhausted, EROFS and EACCES as PermissionDenied, EFBIG as OutOfRange and ENOENT as
# NotFound, each with strerror's text in the message; gs:// and s3:// raise the same
# classes (a bucket's quota is ResourceExhausted, a missing bucket NotFound), and a storage
# service that did not answer Unavailable or DeadlineExceeded.
CAUSES = (
    Cause("no space left on the device", "free space there, or give the job a larger disk",
          (errno.ENOSPC,), ("no space left",), (tf.errors.ResourceExhaustedError,)),
    Cause("the disk quota is used up", "free space or raise the quota",
          (errno.EDQUOT,), ("quota exceeded",)),
    Cause("a file reached the file-size limit", "raise the limit (ulimit -f unlimited)",
          (errno.EFBIG,), ("file too large",), (tf.errors.OutOfRangeError,)),
    Cause("the filesystem is read-only", "remount it writable, or give another model_dir",
          (errno.EROFS,), ("read-only file system",)),
    Cause("permission denied", "give this user write permission there, or another model_dir",
          (errno.EACCES, errno.EPERM), ("permission denied",),
          (tf.errors.PermissionDeniedError,)),
    Cause("the directory vanished", "recreate it (or restore it from a backup)",
          (errno.ENOENT, errno.ESTALE), ("no such file", "not found"),
          (tf.errors.NotFoundError,)),
    Cause("the storage service did not answer", "check the storage service",
          (errno.EIO, errno.ETIMEDOUT), ("input/output error", "timed out"),
          (tf.errors.UnavailableError, tf.errors.DeadlineExceededError), restartable=True),
)  # fmt: skip


class StorageFault(StorageError):
    """A file of the run could not be written: a full disk, a read-only or vanished
    model_dir, a file-size limit. The job stops on every task with one line, exit code
    EXIT_STORAGE (the launcher does not restart it: a restart meets the same fault), and the
    last complete checkpoint stays the one the same command resumes from once it is fixed. A
    storage service that did not answer is `restartable` instead.

    Attributes:
      cause: the Cause, one of CAUSES.
      path: what could not be written.
    """

    def __init__(self, message: str, *, cause: Cause, path: str):
        super().__init__(message)
        self.cause, self.path = cause, path
        self.restartable = cause.restartable
        self.exit_code = 1 if cause.restartable else EXIT_STORAGE


def cause_of(error: BaseException) -> Cause | None:
    """The storage fault `error` (an OSError or a TensorFlow error from a write) stands for,
    or None if it is not one."""
    if isinstance(error, OSError) and not isinstance(error, TfdistError):
        for cause in CAUSES:
            if error.errno in cause.errnos:
                return cause
        return None
    if not isinstance(error, tf.errors.OpError):
        return None
    text = (error.message or "").lower()
    for cause in CAUSES:
        if any(word in text for word in cause.words):
            return cause
    for cause in CAUSES:
        if isinstance(error, cause.kinds):
            return cause
    return None


def fault(cause: Cause, *, what: str, path: str, resume: str, where: str = "") -> StorageFault:
    """The StorageFault for `cause` met writing `what` at `path`.

    Args:
      resume: where the same command resumes once it is fixed ("from checkpoint ckpt-60").
      where: the task that met it, when it is another one ("on the chief").
    """
    then = (
        "a restart of the job resumes"
        if cause.restartable
        else "then run the same command again: it resumes"
    )
    return StorageFault(
        f"Cannot write the {what} {path}{' ' + where if where else ''}: {cause.name}. "
        f"{cause.fix[0].upper()}{cause.fix[1:]}; {then} {resume}.",
        cause=cause, path=path,
    )  # fmt: skip


def agree_on_fault(
    tally: Callable[[list[int]], list[int]],
    local: StorageError | None,
    peer_fault: Callable[[Cause | None], StorageError],
) -> None:
    """Stops every task of a job when any of them met a fault writing (each calls this at the
    same point: `tally` sums over them, a collective).

    Args:
      tally: sums a list of counts over the tasks (a runner's `tally`).
      local: the fault this task met, if any: raised here.
      peer_fault: the error of a task that met none, from the cause another one met (None:
        not a Cause but another StorageError, e.g. a model_dir another job holds).
    """
    counts = [0] * (len(CAUSES) + 1)
    if local is not None:
        counts[CAUSES.index(local.cause) if isinstance(local, StorageFault) else -1] = 1
    totals = tally(counts)
    if local is not None:
        raise local
    if any(totals):
        index = next(i for i, n in enumerate(totals) if n)
        raise peer_fault(CAUSES[index] if index < len(CAUSES) else None)

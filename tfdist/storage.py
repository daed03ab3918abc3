"""Files on any filesystem TensorFlow reads: local disk, gs://, ram://, hdfs://.

Everything tfdist writes to a model_dir or data_dir goes through tf.io.gfile, never `open`
or `glob`: on a TPU Node the model_dir must be a gs:// bucket, where local calls find
nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid

import numpy as np
import tensorflow as tf

from tfdist.errors import TfdistError

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

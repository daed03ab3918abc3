"""Files on any filesystem TensorFlow reads: local disk, gs://, ram://, hdfs://.

Everything tfdist writes to a model_dir or data_dir goes through tf.io.gfile, never `open`
or `glob`: on a TPU Node the model_dir must be a gs:// bucket, where local calls find
nothing.
"""

from __future__ import annotations

import os
import uuid

import tensorflow as tf


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

"""Checkpoints: written by the chief only, restored by every task at start.

TensorFlow's multi-worker rule: every worker of a MultiWorkerMirroredStrategy job must take
part in saving (saving may need their variables' values), but only the chief's copy is
kept. The other workers write to a private temporary directory that is removed afterwards,
so two processes never write the same files.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

import tensorflow as tf

from tfdist.errors import TfdistError

log = logging.getLogger(__name__)


class CheckpointMismatchError(TfdistError, ValueError):
    """A checkpoint whose variables do not fit the job that tries to resume from it."""


CHECKPOINT_SUBDIR = "checkpoints"


class Checkpoints:
    """A CheckpointManager that writes where this task may write.

    Args:
      checkpoint: the tf.train.Checkpoint to save and restore.
      model_dir: the run's directory; None disables checkpoints altogether.
      is_chief: whether this task keeps its checkpoints.
      max_to_keep: how many of the newest checkpoints to keep.
    """

    def __init__(
        self,
        checkpoint: tf.train.Checkpoint,
        *,
        model_dir: str | None,
        is_chief: bool,
        max_to_keep: int,
    ):
        self.checkpoint = checkpoint
        self.directory = os.path.join(model_dir, CHECKPOINT_SUBDIR) if model_dir else None
        self._scratch = None
        if self.directory is None:
            self.manager = None
            return
        write_to = self.directory
        if not is_chief:
            self._scratch = tempfile.mkdtemp(prefix="tfdist-worker-ckpt-")
            write_to = self._scratch
        self.manager = tf.train.CheckpointManager(checkpoint, write_to, max_to_keep=max_to_keep)

    def restore_latest(self) -> str | None:
        """Restores the chief's newest complete checkpoint, if any; returns its path.

        A checkpoint cut short (a crash or preemption while writing) or damaged on disk is
        passed over for the one before it, with a warning naming both.
        """
        if self.directory is None:
            return None
        rejected = []
        for path in checkpoint_candidates(self.directory):
            problem = verify_checkpoint(path)
            if problem:
                log.warning("Checkpoint %s is incomplete or corrupt: %s", path, problem)
                rejected.append(os.path.basename(path))
                continue
            # expect_partial: a checkpoint from another tfdist version may hold extra slots.
            try:
                self.checkpoint.restore(path).expect_partial()
            except ValueError as error:
                if "incompatible" not in str(error):
                    raise
                raise CheckpointMismatchError(
                    f"The checkpoint {path} does not fit this job: a variable's saved shape "
                    f"differs ({error}). It was written by another model or optimizer. "
                    "Resume with the model it was saved with, or start afresh in a new "
                    "model_dir. "
                    f"Received: {path}"
                ) from None
            if rejected:
                log.warning(
                    "Resuming from %s, the newest complete checkpoint (skipped %s)",
                    path, ", ".join(rejected),
                )  # fmt: skip
            else:
                log.info("Restored %s", path)
            return path
        if rejected:
            log.warning("No complete checkpoint in %s; starting from scratch", self.directory)
        return None

    def save(self, step: int) -> None:
        if self.manager is not None:
            path = self.manager.save(checkpoint_number=step)
            if self._scratch is None:
                log.info("Saved checkpoint %s", path)

    def close(self) -> None:
        """Removes a non-chief task's scratch directory."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None


def checkpoint_candidates(directory: str) -> list[str]:
    """Checkpoint prefixes in `directory`, newest (highest number) first.

    Read from the files themselves, not from the CheckpointManager's state file, which
    can point at a checkpoint whose writing never finished. `directory` may be any
    filesystem TensorFlow reads (gs://, ram://, ...).
    """
    numbered = {}
    # tf.io.gfile, not glob: model_dir may be remote (gs://, a TPU Node's only choice), where
    # the local glob finds nothing and a restarted job would silently start from step 0.
    if not tf.io.gfile.isdir(directory):
        return []
    for name in tf.io.gfile.listdir(directory):
        if not name.endswith(".index"):
            continue
        prefix = os.path.join(directory, name[: -len(".index")])
        match = re.search(r"-(\d+)$", prefix)
        if match:
            numbered[prefix] = int(match.group(1))
    return sorted(numbered, key=numbered.get, reverse=True)


def verify_checkpoint(prefix: str) -> str | None:
    """None if every tensor of the checkpoint reads back (checksums included); else why not."""
    try:
        # Not tf.train.load_checkpoint, which takes a prefix for a directory wherever the
        # filesystem says one exists (ram:// does for "ckpt-3", a prefix of its files).
        reader = tf.compat.v1.train.NewCheckpointReader(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    # The reader reports a short file as IndexError and a bad checksum as DataLossError.
    except (tf.errors.OpError, ValueError, IndexError, RuntimeError) as e:
        message = getattr(e, "message", str(e)).strip().splitlines()[0]
        return f"{type(e).__name__}: {message[:200]}"
    return None

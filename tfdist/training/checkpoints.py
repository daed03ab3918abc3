"""Checkpoints: written by the chief only, restored by every task at start.

TensorFlow's multi-worker rule: every worker of a MultiWorkerMirroredStrategy job must take
part in saving (saving may need their variables' values), but only the chief's copy is
kept. The other workers write to a private temporary directory that is removed afterwards,
so two processes never write the same files.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import tensorflow as tf

log = logging.getLogger(__name__)

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
        """Restores the chief's newest checkpoint, if any; returns its path."""
        if self.directory is None:
            return None
        latest = tf.train.latest_checkpoint(self.directory)
        if latest is not None:
            # expect_partial: a checkpoint from another tfdist version may hold extra slots.
            self.checkpoint.restore(latest).expect_partial()
            log.info("Restored %s", latest)
        return latest

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

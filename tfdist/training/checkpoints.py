"""Checkpoints: written by the chief only, restored by every task at start.

TensorFlow's multi-worker rule: every worker of a MultiWorkerMirroredStrategy job must take
part in saving (saving may need their variables' values), but only the chief's copy is
kept. The other workers write to a private temporary directory that is removed afterwards,
so two processes never write the same files.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile

import tensorflow as tf

from tfdist.errors import TfdistError
from tfdist.storage import strict_json, write_atomically

log = logging.getLogger(__name__)


class CheckpointMismatchError(TfdistError, ValueError):
    """A checkpoint whose variables do not fit the job that tries to resume from it."""


CHECKPOINT_SUBDIR = "checkpoints"
# The settings a run's checkpoints were written under, beside them: a resume compares.
SETTINGS_FILE = "run.json"
# Settings a resume must keep: with another model, dataset or optimizer (mixed precision
# wraps it in a LossScaleOptimizer) the checkpoint does not fit; with another global batch
# its step counts batches of another size (another data position and schedule). The others
# may change, with a warning.
_MUST_MATCH = ("model", "dataset", "optimizer", "mixed_precision", "global_batch_size")


def check_resume_settings(model_dir: str, settings: dict, *, write: bool) -> None:
    """Compares this job's settings with those the run in `model_dir` was saved with.

    Raises CheckpointMismatchError where resuming would be wrong (another model, dataset,
    optimizer, mixed precision or global batch); warns where the saved step means something new (another
    number of workers or replicas, or of steps per epoch). With `write` (the chief), records
    `settings` in model_dir/run.json for the next resume.
    """
    path = os.path.join(model_dir, SETTINGS_FILE)
    # The files themselves, as restore_latest reads them (the state file can lag behind).
    candidates = checkpoint_candidates(os.path.join(model_dir, CHECKPOINT_SUBDIR))
    has_checkpoint = candidates[0] if candidates else None
    saved = None
    if has_checkpoint and tf.io.gfile.exists(path):
        try:
            with tf.io.gfile.GFile(path) as f:
                saved = json.load(f)
        except ValueError:
            log.warning("%s is not JSON; resuming without comparing settings", path)
    if isinstance(saved, dict):
        changed = {
            k: (saved[k], settings[k]) for k in settings if k in saved and saved[k] != settings[k]
        }
        refused = [k for k in _MUST_MATCH if k in changed]
        if refused:
            what = ", ".join(f"{k}={changed[k][0]!r}" for k in refused)
            now = ", ".join(f"{k}={changed[k][1]!r}" for k in refused)
            step = has_checkpoint.rsplit("-", 1)[-1]
            why = (
                f" Its step {step} counts batches of {changed['global_batch_size'][0]} examples; "
                f"with {changed['global_batch_size'][1]} it would stand for another data "
                "position and learning-rate schedule."
                if "global_batch_size" in changed else ""
            )  # fmt: skip
            raise CheckpointMismatchError(
                f"{model_dir} holds a run saved with {what}; this job has {now}.{why} Resume "
                f"with the settings it was saved with, or start afresh in a new model_dir."
            )
        for key, (before, after) in changed.items():
            meaning = (
                f"epochs now end every {after} steps, so the saved step falls in another epoch"
                if key == "steps_per_epoch"
                else "each step still trains the same number of examples, but they are now "
                "split over another number of replicas, so the order of the examples from "
                "here on differs from an uninterrupted run's"
            )
            log.warning(
                "Resuming a run saved with %s=%s under %s=%s: %s", key, before, key, after, meaning
            )
    if write:
        write_atomically(path, strict_json(settings, what=SETTINGS_FILE, indent=2))


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
            mismatch = None
            try:
                self.checkpoint.restore(path).expect_partial()
            except (ValueError, tf.errors.InvalidArgumentError) as error:
                # A ValueError when shapes are known; in a multi-task job TensorFlow restores
                # in a tf.function, where a shape check fails as it runs.
                text = getattr(error, "message", None) or str(error)
                if "incompatible" not in text and "not compatible with" not in text:
                    raise
                mismatch = text.strip().splitlines()[0]
            if mismatch is not None:
                _quiet_unrestored_values()
                raise CheckpointMismatchError(
                    f"The checkpoint {path} does not fit this job: a variable's saved shape "
                    f"differs ({mismatch}). It was written by another model or optimizer. "
                    "Resume with the model it was saved with, or start afresh in a new "
                    "model_dir."
                )
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


class _UnrestoredValues(logging.Filter):
    """Drops TensorFlow's lines about the values a failed restore left unrestored (logged when
    its leftovers are deleted, often at exit): the mismatch error already said what failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            "being deleted with unrestored values" in message
            or "could not be found in the restored object" in message
        )


_UNRESTORED_VALUES = _UnrestoredValues()


def _quiet_unrestored_values() -> None:
    logging.getLogger("tensorflow").addFilter(_UNRESTORED_VALUES)  # once: filters are a set

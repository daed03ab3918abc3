"""Checkpoints: written by the chief only, restored by every task at start.

TensorFlow's multi-worker rule: every worker of a MultiWorkerMirroredStrategy job must take
part in saving (saving may need their variables' values), but only the chief's copy is
kept. The other workers write to a private temporary directory that is removed afterwards,
so two processes never write the same files.

`StepCheckpoint` is the public callback over them: a `tfdist.fit` run that resumes at the
saved step, where the data left off, and saves at the step a SIGTERM stops it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable, Collection

import keras
import tensorflow as tf

from tfdist.errors import TfdistError
from tfdist.storage import agree_on_fault, cause_of, fault, strict_json, write_atomically
from tfdist.training import model_dir_lock, shard_reads
from tfdist.training import shards as shard_files
from tfdist.training.shards import Shards

log = logging.getLogger(__name__)


class CheckpointDamagedError(TfdistError, OSError):
    """The only checkpoint left to resume from failed to read back after part of it was
    restored (the message says which and what to do)."""


class CheckpointMismatchError(TfdistError, ValueError):
    """A checkpoint whose variables do not fit the job that tries to resume from it."""


CHECKPOINT_SUBDIR = "checkpoints"
# The settings a run's checkpoints were written under, beside them: a resume compares.
SETTINGS_FILE = "run.json"
# Settings every resume must keep: with another model, dataset or optimizer (mixed
# precision wraps it in a LossScaleOptimizer) the checkpoint does not fit; with another
# global batch its step counts batches of another size (another data position and
# schedule). The parallel modes whose registry entry says `resume_must_match` (their state
# is laid out by them) are the caller's to add. The others may change, with a warning.
MUST_MATCH = ("model", "dataset", "optimizer", "mixed_precision", "global_batch_size")
# What a saved step means after a change of these (the warning says it).
_MEANING = {
    "steps_per_epoch": "epochs now end every {after} steps, so the saved step falls in "
    "another epoch",
    "workers": "each step still trains the same number of examples, but they are now split "
    "over another number of replicas, so the order of the examples from here on differs "
    "from an uninterrupted run's",
}
_MEANING["replicas"] = _MEANING["workers"]


def check_resume_settings(
    model_dir: str, settings: dict, *, must_match: Collection[str] = MUST_MATCH
) -> None:
    """Compares this job's settings with those the run in `model_dir` was saved with.

    Raises CheckpointMismatchError where a setting in `must_match` changed (resuming would
    be wrong: another model, dataset, optimizer, mixed precision, global batch, or a mode
    whose state the checkpoint lays out); warns where another one changed, saying what the
    saved step now means. `record_settings` writes them for the next resume
    (StepCheckpoint's `settings`, once it holds model_dir's lock).
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
        refused = [k for k in must_match if k in changed]
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
            meaning = _MEANING.get(key, "the run goes on from its step under the new value")
            meaning = meaning.format(after=after)
            log.warning(
                "Resuming a run saved with %s=%s under %s=%s: %s", key, before, key, after, meaning
            )


def record_settings(model_dir: str, settings: dict, job) -> None:
    """The chief writes `settings` to model_dir/run.json for the next resume to compare; a
    storage fault there stops every task with one line (each calls this at the same point)."""
    path = os.path.join(model_dir, SETTINGS_FILE)
    local = None
    if job.is_chief:
        try:
            write_atomically(path, strict_json(settings, what=SETTINGS_FILE, indent=2))
        except (tf.errors.OpError, OSError) as error:
            if (cause := cause_of(error)) is None:
                raise
            local = fault(cause, what="settings file", path=path, resume=_FROM_LAST)

    def peer_fault(cause):
        return fault(cause, what="settings file", path=path, resume=_FROM_LAST,
                     where="on the chief")  # fmt: skip

    agree_on_fault(job.tally, local, peer_fault)


_FROM_LAST = "from the last checkpoint"


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
        shards: Shards | None = None,
        rank: int = 0,
        ranks: int = 1,
        barrier: Callable[[bool], bool] = lambda failed=False: failed,
    ):
        self.checkpoint = checkpoint
        self.directory = os.path.join(model_dir, CHECKPOINT_SUBDIR) if model_dir else None
        # What each process writes of a sharded checkpoint (tfdist.training.shards), and
        # its place among the processes that write them.
        self.shards, self.rank, self.ranks, self.barrier = shards, rank, ranks, barrier
        self._scratch = None
        if self.directory is None:
            self.manager = None
            return
        write_to = self.directory
        if not is_chief:
            self._scratch = tempfile.mkdtemp(prefix="tfdist-worker-ckpt-")
            write_to = self._scratch
            # Removed however the run ends (an error skips the callbacks' on_train_end).
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._scratch, True)
        self.manager = tf.train.CheckpointManager(checkpoint, write_to, max_to_keep=max_to_keep)

    def restore_latest(self) -> str | None:
        """Restores the chief's newest complete checkpoint, if any; returns its path.

        A checkpoint cut short (a crash or preemption while writing) or damaged on disk is
        passed over for the one before it, with a warning naming both.
        """
        if self.directory is None:
            return None
        if self._scratch is None:
            self._remove_leftovers()
        # In a mode whose processes each hold part of the model, every process decides each
        # candidate together (a collective): each reads, and so checksums, its own part.
        agree = self.shards is not None
        rejected, partly = [], None
        for path in checkpoint_candidates(self.directory):
            problem = verify_checkpoint(path)
            if problem is None and shard_files.has_shards(path):
                if shard_files.has_metadata(path):  # checked without reading a tensor
                    problem = shard_files.incomplete(path)
                else:  # shards an earlier tfdist wrote: every tensor read to check them
                    problem = verify_checkpoint(shard_files.merged(path))
            if agree and self.barrier(problem is not None) and problem is None:
                problem = "another process found it incomplete or corrupt"
            if problem:
                log.warning("Checkpoint %s is incomplete or corrupt: %s", path, problem)
                rejected.append(os.path.basename(path))
                continue
            mismatch, damaged, error = None, None, None
            try:
                mismatch = self._restore_main(path)
                if mismatch is None:
                    mismatch, damaged = self._read_shards(path)
            except Exception as e:  # noqa: BLE001 - raised below, once every process agreed
                if not agree:
                    raise
                error = e
            if agree:  # the same three collectives on every process, whatever happened
                others_failed = self.barrier(error is not None)
                if self.barrier(mismatch is not None) and mismatch is None:
                    mismatch = "another process's part of it does not fit"
                if self.barrier(damaged is not None) and damaged is None:
                    damaged = "another process's read of its shards failed"
                if error is not None:
                    raise error
                if others_failed:
                    raise CheckpointDamagedError(
                        f"Another process failed to restore {path} (its log says why); this "
                        "process stopped with it rather than train from another step."
                    )
            if damaged is not None and mismatch is None:
                log.warning("Checkpoint %s is incomplete or corrupt: %s", path, damaged)
                rejected.append(os.path.basename(path))
                partly = path  # read in part: an older one must overwrite all of it
                continue
            if mismatch is not None:
                _quiet_unrestored_values()
                raise CheckpointMismatchError(
                    f"The checkpoint {path} does not fit this job ({mismatch}). It was "
                    "written by another model, optimizer or parallel mode. Resume with the "
                    "model and optimizer it was saved with, or start afresh in a new model_dir."
                )
            if rejected:
                log.warning(
                    "Resuming from %s, the newest complete checkpoint (skipped %s)",
                    path, ", ".join(rejected),
                )  # fmt: skip
            else:
                log.info("Restored %s", path)
            return path
        if partly is not None:
            raise CheckpointDamagedError(
                f"The checkpoint {partly} is damaged (its shards failed to read back, see the "
                "warning above) and no older complete checkpoint is left, so the model holds "
                "part of it. Move the damaged checkpoint aside (its ckpt-N files and ckpt-N"
                f"{shard_files.SHARDS_SUFFIX}) to start afresh, or put back a copy from a backup."
            )
        if rejected:
            log.warning("No complete checkpoint in %s; starting from scratch", self.directory)
        return None

    def _remove_leftovers(self) -> None:
        """Removes what an earlier run left of checkpoints it could not finish: a save that
        failed on storage that then refused the clean-up too (a read-only remount)."""
        try:
            left = tf.io.gfile.glob(os.path.join(self.directory, "ckpt-*_temp*"))
            for path in left:
                if tf.io.gfile.isdir(path):
                    tf.io.gfile.rmtree(path)
                else:
                    tf.io.gfile.remove(path)
        except (tf.errors.OpError, OSError) as error:
            log.warning(
                "Could not remove a half-written checkpoint in %s: %s", self.directory, error
            )
            return
        if left:
            log.info(
                "Removed what an earlier run left of a checkpoint it could not finish: %s",
                ", ".join(os.path.basename(path) for path in left),
            )

    def _restore_main(self, path: str) -> str | None:
        """Restores the chief's part of checkpoint `path`; why it does not fit, or None."""
        try:
            # expect_partial: a checkpoint from another tfdist version may hold extra slots.
            self.checkpoint.restore(path).expect_partial()
        except (ValueError, tf.errors.InvalidArgumentError) as error:
            # A ValueError when shapes are known; in a multi-task job TensorFlow restores
            # in a tf.function, where a shape check fails as it runs.
            text = getattr(error, "message", None) or str(error)
            if "incompatible" not in text and "not compatible with" not in text:
                raise
            return text.strip().splitlines()[0]
        return None

    def _read_shards(self, path: str) -> tuple[str | None, str | None]:
        """This process's part of a sharded checkpoint read back: (why it does not fit, why
        it is damaged), both None when it was read (or there is nothing to read)."""
        if not shard_files.has_shards(path):
            return None, None
        # A job holding the whole model reads every weight and slot whole.
        shards = self.shards or shard_files.WholeModel(self.checkpoint.model)
        try:
            done = shard_reads.read(shards, path)
        except (KeyError, tf.errors.InvalidArgumentError) as error:  # another model's shards
            return _first_line(error), None
        # A checksum that fails, a file cut short or gone: damage (other failures, memory or
        # storage that answers no more, are raised: the checkpoint may be sound).
        except (tf.errors.DataLossError, tf.errors.OutOfRangeError, tf.errors.NotFoundError) as e:
            return None, f"{type(e).__name__}: {_first_line(e)[:200]}"
        if done is not None:
            read = "" if done.read_bytes is None else f", {done.read_bytes / 2**20:.1f} MB read"
            log.info(
                "Read this process's part of %s: %.1f MB of slices in %d read(s)%s",
                os.path.basename(path), done.wanted_bytes / 2**20, done.reads, read,
            )  # fmt: skip
        return None, None

    def save(self, step: int, *, tally: Callable[[list[int]], list[int]] = list) -> None:
        """Saves checkpoint `step` (every task calls it at the same step).

        A storage fault on any task (a full disk, a read-only or vanished directory, a file
        size limit) stops every one with one line (StorageFault): the half-written
        checkpoint is removed, and the one before it stays the resume point.

        Args:
          tally: sums counts over the job's tasks (the runner's `tally`).
        """
        if self.manager is None:
            return
        local = None
        try:
            self._save(step)
        except (tf.errors.OpError, OSError, shard_files.PeerFailed) as error:
            cause = None if isinstance(error, shard_files.PeerFailed) else cause_of(error)
            if cause is None and not isinstance(error, shard_files.PeerFailed):
                raise
            self._discard(step)
            if cause is not None:
                where = self.directory if self._scratch is None else self._scratch
                local = fault(cause, what="checkpoint", path=os.path.join(where, f"ckpt-{step}"),
                              resume=self._resume_point())  # fmt: skip

        def peer_fault(cause):
            return fault(cause, what="checkpoint", path=os.path.join(self.directory, f"ckpt-{step}"),
                         resume=self._resume_point(), where="on another task")  # fmt: skip

        agree_on_fault(tally, local, peer_fault)

    def _save(self, step: int) -> None:
        if self.shards is None:
            path = self.manager.save(checkpoint_number=step)
        else:
            # The parts first (every process, then the chief merges them), then the main
            # checkpoint: a complete ckpt-N means complete shards.
            shard_files.write(
                self.shards, os.path.join(self.directory, f"ckpt-{step}"), rank=self.rank,
                ranks=self.ranks, barrier=self.barrier, is_chief=self._scratch is None,
            )  # fmt: skip
            with shard_files.main_part():
                path = self.manager.save(checkpoint_number=step)
            if self._scratch is None:
                self._drop_old_shards()
        if self._scratch is None:
            log.info("Saved checkpoint %s", path)

    def _discard(self, step: int) -> None:
        """What a failed save of `step` left: its temporary directory, its files, its shards
        (on the chief; a worker's scratch is its own). Best effort: the storage failed."""
        where = self._scratch or self.directory
        prefix = os.path.join(where, f"ckpt-{step}")
        try:
            for path in tf.io.gfile.glob(prefix + "_temp*") + tf.io.gfile.glob(prefix + ".*"):
                if tf.io.gfile.isdir(path):
                    tf.io.gfile.rmtree(path)
                else:
                    tf.io.gfile.remove(path)
        except (tf.errors.OpError, OSError) as error:
            log.warning("Could not remove the half-written checkpoint %s: %s", prefix, error)

    def _resume_point(self) -> str:
        """Where the same command resumes: the newest checkpoint kept, as this task sees it."""
        candidates = checkpoint_candidates(self.directory) if self._scratch is None else []
        if candidates:
            return f"from {candidates[0]}, the last complete checkpoint"
        if self._scratch is None:
            return "from the start (no checkpoint was completed)"
        return f"from the last complete checkpoint in {self.directory}"

    def _drop_old_shards(self) -> None:
        """The shards of checkpoints the manager no longer keeps."""
        kept = set(self.manager.checkpoints)
        for name in tf.io.gfile.listdir(self.directory):
            name = name.rstrip("/")
            if name.endswith(shard_files.SHARDS_SUFFIX):
                prefix = os.path.join(self.directory, name[: -len(shard_files.SHARDS_SUFFIX)])
                if prefix not in kept:
                    shard_files.remove(prefix)

    def close(self) -> None:
        """Removes a non-chief task's scratch directory."""
        if self._scratch is not None:
            self._cleanup()
            self._scratch = None


class StepCheckpoint(keras.callbacks.Callback):
    """Checkpoints of a `tfdist.fit` run that resume at the saved step, at its data position.

    Saves the model, its optimizer, the global step and whatever the runner keeps for an
    exact resume (the parameter-server update counter) in `model_dir/checkpoints`, at every
    epoch end, every `every_n_steps` steps, and at the step where a SIGTERM stops training
    (fit then exits with the restartable code). Before the first step it restores the newest
    complete checkpoint (passing over one a crash cut short) and tells fit the step to resume
    from: fit skips the batches already trained, so the resumed run trains what an
    uninterrupted one would. Every worker calls it at the same steps (a save may need every
    worker's part); only the chief keeps the files.

    Unlike `keras.callbacks.BackupAndRestore`, which keeps one backup and deletes it when
    training ends, the checkpoints stay (the newest `max_to_keep`), for an evaluator task to
    read or a later run to continue: a re-run with more epochs trains on from the last one.

    Example:

        tfdist.fit(model, dataset_fn, epochs=10, steps_per_epoch=500,
                   callbacks=[tfdist.StepCheckpoint("/tmp/run", every_n_steps=100)])

    Args:
      model_dir: the run's directory (local or any filesystem TensorFlow writes: gs://...);
        None keeps nothing (the callback then only counts steps).
      every_n_steps: also save every this many steps (0: at epoch ends only).
      max_to_keep: how many of the newest checkpoints to keep.
      settings: the run's settings, written to model_dir/run.json for the next resume to
        compare (`check_resume_settings`); None writes none.

    Before it reads or writes anything, the chief takes model_dir's lock (one job per
    model_dir: `tfdist.training.model_dir_lock`); a second job stops there on every task.

    Attributes:
      restored_step: the step of the checkpoint restored at the start (0: none).
      step: the last step trained.
    """

    reads_batch_logs = False  # it counts steps: no metrics need reading for it

    def __init__(
        self,
        model_dir: str | None,
        *,
        every_n_steps: int = 0,
        max_to_keep: int = 5,
        settings: dict | None = None,
    ):
        super().__init__()
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(
                f"every_n_steps must be a whole number >= 0. Received: {every_n_steps!r}"
            )
        self.model_dir, self.every_n_steps, self.max_to_keep = model_dir, every_n_steps, max_to_keep
        self.settings = settings
        self._holds_lock = False
        self.restored_step = self.step = 0
        self._runner = None
        self._checkpoints: Checkpoints | None = None
        self._step_variable: tf.Variable | None = None
        self._saved_step: int | None = None  # the newest checkpoint kept (chief's view)
        self._last_saved: int | None = None  # the step this task last saved at
        self._epoch_start = 0

    def set_runner(self, runner) -> None:
        """Called by tfdist.fit before training: the runner says who keeps the files, how
        to settle the variables before a save, and what else a checkpoint must hold."""
        self._runner = runner

    @property
    def directory(self) -> str | None:
        """Where the checkpoints are kept (model_dir/checkpoints), or None."""
        return os.path.join(self.model_dir, CHECKPOINT_SUBDIR) if self.model_dir else None

    def checkpoint_status(self) -> tuple[int | None, str | None]:
        """(step, directory) of the newest checkpoint this run saved or restored: where a
        restart would resume (fit names it when a peer is lost)."""
        return self._saved_step, self.directory

    def on_train_begin(self, logs=None):
        runner = self._runner
        if runner is None:
            raise TypeError(
                "tfdist.StepCheckpoint resumes at a step, which needs tfdist.fit's loop: pass "
                "it to tfdist.fit(..., callbacks=[...]). With keras.Model.fit, use "
                "keras.callbacks.BackupAndRestore."
            )
        job, state = runner.job, runner.state()
        if self._step_variable is None:  # the first fit of this callback
            with job.strategy.scope():
                # The loop counts steps in Python; this variable carries the count in the
                # checkpoint (assigned at every save).
                self._step_variable = tf.Variable(
                    0, dtype=tf.int64, trainable=False,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )  # fmt: skip
        checkpoint = tf.train.Checkpoint(
            model=self.model, optimizer=self.model.optimizer, step=self._step_variable,
            **state.variables,
        )  # fmt: skip
        if self.model_dir and not self._holds_lock:
            model_dir_lock.agree_to_hold(self.model_dir, job)
            self._holds_lock = True
        if self.model_dir and self.settings is not None:
            record_settings(self.model_dir, self.settings, job)
        processes = job.placement.processes
        self._checkpoints = Checkpoints(
            checkpoint, model_dir=self.model_dir, is_chief=job.is_chief,
            max_to_keep=self.max_to_keep, shards=state.shards,
            rank=job.placement.process_index, ranks=processes,
            barrier=shard_files.barrier(job.strategy, processes),
        )  # fmt: skip
        self._checkpoints.restore_latest()
        self.restored_step = self.step = int(self._step_variable.numpy())
        self._last_saved = self.restored_step
        if self.restored_step and self.directory:
            self._saved_step = self.restored_step

    def steps_until_due(self) -> int | None:
        """Steps until the next save `every_n_steps` asks for: tfdist.fit ends a call of
        several steps (steps_per_execution) there, so that the save lands on its step."""
        if not self.every_n_steps:
            return None
        return self.every_n_steps - self.step % self.every_n_steps

    def on_epoch_begin(self, epoch, logs=None):
        # An epoch of known length starts at a multiple of it (a resumed one too: its batch
        # numbers start where the checkpoint left it); else where the last one ended.
        steps = self.params.get("steps")
        self._epoch_start = epoch * steps if steps else self.step

    def on_train_batch_end(self, batch, logs=None):
        self.step = self._epoch_start + batch + 1
        if self.every_n_steps and self.step % self.every_n_steps == 0:
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        self.save()

    def on_train_end(self, logs=None):
        self._checkpoints.close()

    def release(self) -> None:
        """Lets go of model_dir's lock (when fit ends, however it ends)."""
        if self._holds_lock:
            self._holds_lock = False
            model_dir_lock.let_go(self.model_dir)

    def backup_now(self, *, epoch: int, step: int) -> str | None:
        """Saves at `step` (fit stops there for a SIGTERM); returns the directory."""
        del epoch
        self.step = step
        self.save()
        return self.directory

    def save(self) -> None:
        """Saves the current step (every worker takes part; the chief keeps the files)."""
        if self.step == self._last_saved:  # e.g. every_n_steps at an epoch's end
            return
        self._last_saved = self.step
        self._runner.settle()  # every scheduled step applied, the replicas one model
        self._step_variable.assign(self.step)
        self._checkpoints.save(self.step, tally=self._runner.job.tally)
        if self.directory:
            self._saved_step = self.step


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


def _first_line(error: BaseException) -> str:
    text = (getattr(error, "message", None) or str(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__


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

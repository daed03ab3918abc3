"""The evaluator task: evaluates each new checkpoint of a training run, beside it.

A side-car in the manner of TensorFlow's SidecarEvaluator: it watches model_dir/checkpoints,
restores each new checkpoint's weights into the same model the trainer builds, evaluates it
on the test split with `tfdist.evaluate` (the computation the trainer's own validation runs)
and writes the metrics. It never joins the training cluster (its strategy
is one_device, it runs no collective), so a slow evaluation never slows the training steps,
and the trainer does not need to evaluate at all (--eval_every=0).

Example (what experiments.train runs on the launcher's --evaluator task):

    config = TrainConfig(model="mlp", epochs=2, model_dir="/tmp/run")
    records = evaluate_checkpoints(config, poll_seconds=2, timeout_seconds=600)
    records[-1].eval_accuracy

For each checkpoint it writes TensorBoard scalars to model_dir/logs/eval (at the
checkpoint's training step) and appends a line to model_dir/eval.jsonl:
{"step": 44, "eval_loss": 0.21, "eval_accuracy": 0.94, "checkpoint": ".../ckpt-44"}.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import tensorflow as tf

from tfdist import signals
from tfdist import strategy_kinds as kinds
from tfdist.app.config import TrainConfig
from tfdist.app.trainer import Trainer
from tfdist.errors import TfdistError, first_line
from tfdist.storage import strict_json, write_atomically
from tfdist.strategies import build_strategy
from tfdist.training.checkpoints import CHECKPOINT_SUBDIR
from tfdist.training.report import LOG_SUBDIR, SUMMARY_FILE

log = logging.getLogger(__name__)

EVAL_LOG_SUBDIR = "eval"  # under model_dir/logs: TensorBoard shows it as the run "eval"
EVAL_FILE = "eval.jsonl"


class EvaluatorError(TfdistError, RuntimeError):
    """The evaluator cannot go on; the message says why and what to do."""


class EvaluatorTimeoutError(EvaluatorError, TimeoutError):
    """No new checkpoint appeared within the evaluator's timeout."""


@dataclasses.dataclass(frozen=True)
class EvalRecord:
    """One checkpoint's evaluation, as a line of model_dir/eval.jsonl."""

    step: int
    eval_loss: float
    eval_accuracy: float
    checkpoint: str

    def to_json(self) -> str:
        return strict_json(dataclasses.asdict(self), what=EVAL_FILE)


def evaluate_checkpoints(
    config: TrainConfig,
    *,
    model_dir: str | None = None,
    poll_seconds: float = 2.0,
    timeout_seconds: float = 3600.0,
) -> list[EvalRecord]:
    """Evaluates every new checkpoint of the run in `model_dir` until training is done.

    Checkpoints are taken oldest first, each once; a checkpoint that disappears before it is
    read (the trainer keeps only its newest `max_checkpoints`) or cannot be read (partial or
    corrupt) is skipped with a warning. Steps already in model_dir/eval.jsonl (an evaluator
    that was restarted) are not evaluated again.

    It returns when training is done: the checkpoint of the final step (config.epochs x the
    trainer's steps per epoch) has been handled, or the chief's summary.json for this many
    epochs exists and every checkpoint listed has been handled.

    Args:
      config: the training run's config: the model, the data and the epochs (the same flags
        as the training tasks).
      model_dir: the directory to watch; default `config.model_dir`.
      poll_seconds: how often to look for a new checkpoint.
      timeout_seconds: give up after this long without a new checkpoint.

    Returns:
      The evaluations made by this call, in step order.

    Raises:
      EvaluatorTimeoutError: no new checkpoint for `timeout_seconds`.
      EvaluatorError: no model_dir, or a checkpoint that does not hold the config's model.
    """
    model_dir = model_dir or config.model_dir
    if not model_dir:
        raise EvaluatorError(
            "The evaluator watches the training run's model_dir for checkpoints, but none was "
            "given; pass the same --model_dir as the training tasks. Received: model_dir=None"
        )
    if not poll_seconds > 0 or not timeout_seconds > 0:
        raise EvaluatorError(
            "poll_seconds and timeout_seconds must be positive. Received: "
            f"poll_seconds={poll_seconds!r}, timeout_seconds={timeout_seconds!r}"
        )
    evaluator = CheckpointEvaluator(config, model_dir=model_dir)
    checkpoint_dir = os.path.join(model_dir, CHECKPOINT_SUBDIR)
    total_steps = evaluator.total_steps
    done_step = _resume_eval_file(model_dir)
    if done_step >= 0:
        log.info("%s already holds step %d; continuing after it", EVAL_FILE, done_step)
    log.info(
        "Evaluator watching %s for checkpoints up to step %d (every %g s, timeout %g s)",
        checkpoint_dir, total_steps, poll_seconds, timeout_seconds,
    )  # fmt: skip
    records: list[EvalRecord] = []
    with signals.doing(f"watching {checkpoint_dir} for checkpoints (evaluator)"):
        try:
            deadline = time.monotonic() + timeout_seconds
            while True:
                # Read before listing: the chief saves its last checkpoint before it writes the
                # summary, so every checkpoint of a finished run is in the listing that follows.
                finished = _training_finished(model_dir, config.epochs)
                for step, path in _listed_checkpoints(checkpoint_dir):
                    if step <= done_step:
                        continue
                    with signals.doing(f"evaluating {path} (evaluator)"):
                        record = evaluator.evaluate(path)
                    done_step, deadline = step, time.monotonic() + timeout_seconds
                    if record is not None:
                        with signals.deferred():  # a stop signal waits: no record half written
                            evaluator.write(record)
                        records.append(record)
                if done_step >= total_steps:
                    log.info("Evaluated up to the final step %d; the evaluator is done", done_step)
                    break
                if finished:
                    log.info(
                        "Training finished (%s) at step %d of %d; the evaluator is done",
                        SUMMARY_FILE, done_step, total_steps,
                    )  # fmt: skip
                    break
                if time.monotonic() >= deadline:
                    last = f"the newest at step {done_step}" if done_step >= 0 else "none seen yet"
                    raise EvaluatorTimeoutError(
                        f"No new checkpoint in {checkpoint_dir} for {timeout_seconds:g} s "
                        f"({len(records)} evaluated here, {last}; the run ends at step "
                        f"{total_steps}). Check that the training tasks are running and write to the "
                        "same model_dir, or raise the timeout (--eval_timeout) if their checkpoints "
                        f"are further apart. Received: timeout_seconds={timeout_seconds:g}"
                    )
                time.sleep(max(0.0, min(poll_seconds, deadline - time.monotonic())))
        finally:
            evaluator.close()
    return records


class CheckpointEvaluator:
    """The trainer's model and test data on one device, restored from one checkpoint at a time.

    The model, its compiled metrics and the test data are the Trainer's own, built from the
    same config, and `Trainer.evaluate` (tfdist.evaluate) scores them: the evaluator reads
    exactly what the trainer saves and reports what the trainer's validation would.

    Args:
      config: the training run's config.
      model_dir: where the metrics go (logs/eval and eval.jsonl).
    """

    def __init__(self, config: TrainConfig, *, model_dir: str):
        self.config, self.model_dir = config, model_dir
        # one_device whatever the training strategy: the evaluator must not join the
        # cluster's collectives, and variables restored from a checkpoint need no mirroring.
        # The Trainer gets no model_dir so that it writes nothing of its own.
        self.trainer = Trainer(
            dataclasses.replace(config, model_dir=None),
            strategy=build_strategy(kinds.ONE_DEVICE, cluster=None),
        )
        self.trainer.compile()
        self.total_steps = self.trainer.total_steps
        # Weights and step only: the optimizer's slots are of no use here (expect_partial).
        self._step = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._checkpoint = tf.train.Checkpoint(model=self.trainer.model, step=self._step)
        self._writer = None

    def evaluate(self, path: str) -> EvalRecord | None:
        """Restores `path` and evaluates it; None (and a warning) if it cannot be read."""
        try:
            status = self._checkpoint.restore(path).expect_partial()
        except tf.errors.NotFoundError:
            log.warning(
                "Skipping checkpoint %s: it disappeared before it could be read (the trainer "
                "keeps only its newest max_checkpoints)",
                path,
            )
            return None
        except (tf.errors.OpError, IndexError) as e:  # a truncated data file: IndexError
            log.warning(
                "Skipping checkpoint %s: it cannot be read, it is partial or corrupt (%s)",
                path,
                first_line(e),
            )
            return None
        except ValueError as e:  # a variable of another shape
            raise self._mismatch(path, e) from None
        try:
            status.assert_existing_objects_matched()
        except AssertionError as e:  # variables the checkpoint does not have
            raise self._mismatch(path, e) from None
        metrics = self.trainer.evaluate()
        return EvalRecord(
            step=int(self._step.numpy()),
            eval_loss=metrics["eval_loss"],
            eval_accuracy=metrics["eval_accuracy"],
            checkpoint=path,
        )

    def write(self, record: EvalRecord) -> None:
        """Logs `record`, adds it to TensorBoard (logs/eval) and appends it to eval.jsonl."""
        log.info(
            "eval step %d/%d: eval_loss %.4g  eval_accuracy %.4g  (%s)",
            record.step, self.total_steps, record.eval_loss, record.eval_accuracy,
            os.path.basename(record.checkpoint),
        )  # fmt: skip
        if self._writer is None:  # created on first use: a run that never starts leaves no trace
            self._writer = tf.summary.create_file_writer(
                os.path.join(self.model_dir, LOG_SUBDIR, EVAL_LOG_SUBDIR)
            )
        with self._writer.as_default(step=record.step):
            tf.summary.scalar("eval_loss", record.eval_loss)
            tf.summary.scalar("eval_accuracy", record.eval_accuracy)
        self._writer.flush()
        with tf.io.gfile.GFile(os.path.join(self.model_dir, EVAL_FILE), "a") as f:
            f.write(record.to_json() + "\n")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def _mismatch(self, path: str, error: Exception) -> EvaluatorError:
        return EvaluatorError(
            f"Checkpoint {path} does not hold the model the evaluator built "
            f"(model={self.config.model!r} on {self.config.dataset!r}): "
            f"{first_line(error)}. Run the evaluator with the same model and dataset "
            f"flags as the training tasks. Received: model={self.config.model!r}"
        )


def _listed_checkpoints(checkpoint_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints the trainer's CheckpointManager lists, oldest first.

    The manager updates its state file only after a checkpoint is complete, so a checkpoint
    being written is not listed yet. Checkpoints are numbered by their training step.
    """
    try:
        state = tf.train.get_checkpoint_state(checkpoint_dir)
    except tf.errors.OpError as e:  # a state file replaced while being read: next poll
        log.warning("Cannot read the checkpoint list in %s yet (%s)", checkpoint_dir, e)
        return []
    if state is None:
        return []
    listed = []
    for path in state.all_model_checkpoint_paths:
        try:
            listed.append((int(path.rsplit("-", 1)[1]), path))
        except (IndexError, ValueError):
            log.warning("Ignoring checkpoint %s: its name does not end in -STEP", path)
    return sorted(listed)


def _training_finished(model_dir: str, epochs: int) -> bool:
    """Whether the chief has written summary.json for a run of `epochs` epochs.

    The epochs are compared so that a summary left by an earlier, shorter run in the same
    model_dir (which this run resumes and extends) does not end the evaluation early.
    """
    path = os.path.join(model_dir, SUMMARY_FILE)
    if not tf.io.gfile.exists(path):
        return False
    try:
        with tf.io.gfile.GFile(path) as f:
            summary = json.load(f)
    except (tf.errors.OpError, ValueError):  # being written: look again at the next poll
        return False
    return isinstance(summary, dict) and summary.get("epochs") == epochs


def _resume_eval_file(model_dir: str) -> int:
    """The newest step in model_dir/eval.jsonl (-1 if none); drops a line a crash cut short.

    An evaluator killed while appending leaves a torn line: it is removed (the file stays
    JSON, line by line) with a warning, and its step is evaluated again.
    """
    path = os.path.join(model_dir, EVAL_FILE)
    if not tf.io.gfile.exists(path):
        return -1
    with tf.io.gfile.GFile(path) as f:
        text = f.read()
    steps, kept, torn = [-1], [], []
    for line in text.splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
            kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):  # the line cut short
            torn.append(line)
    if torn or (text and not text.endswith("\n")):
        if torn:
            log.warning(
                "Removed %d line(s) of %s that a crash cut short: %s",
                len(torn), path, "; ".join(line[:60] for line in torn),
            )  # fmt: skip
        write_atomically(path, "".join(kept))
    return max(steps)


__all__ = [
    "CheckpointEvaluator",
    "EvalRecord",
    "EvaluatorError",
    "EvaluatorTimeoutError",
    "evaluate_checkpoints",
]

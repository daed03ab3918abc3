"""What the chief shows and writes: progress bar, epoch log lines, TensorBoard, summary.json.

Every method is a no-op on other tasks, so training code calls them unconditionally and the
single `is_chief` predicate decides who writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import keras
import tensorflow as tf

from tfdist.storage import write_atomically

log = logging.getLogger(__name__)

LOG_SUBDIR = "logs"
SUMMARY_FILE = "summary.json"


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """The outcome of a training run, as the chief writes it to summary.json."""

    strategy: str
    replicas: int
    global_batch_size: int
    per_replica_batch_size: int
    steps: int
    epochs: int
    resumed_from_step: int
    train_loss: float
    train_accuracy: float
    eval_loss: float | None
    eval_accuracy: float | None
    examples_per_second: float
    wall_seconds: float
    # Parameter-server training only (None for synchronous strategies, whose updates are
    # never stale): staleness over this run's updates, and the updates that reached the
    # parameters since the first step; more than `steps` means a dead worker's re-run
    # closures applied some steps twice.
    staleness_mean: float | None = None
    staleness_max: int | None = None
    applied_updates: int | None = None
    # One dict per epoch this run trained (a resumed run: the epochs since it resumed): the
    # epoch's metrics as logged (train_loss, train_accuracy, eval_* when evaluated, ...)
    # with its "epoch" number (from 1) and the "step" it ended on; e.g. a learning curve.
    history: tuple[dict[str, float], ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


class Reporter:
    """Progress, logs and summaries of one task (silent unless it is the chief)."""

    def __init__(self, *, is_chief: bool, model_dir: str | None, steps_per_epoch: int, epochs: int):
        self.active = is_chief
        self.model_dir = model_dir if is_chief else None
        self.steps_per_epoch = steps_per_epoch
        self.epochs = epochs
        self._bar = None
        self._writer = None
        if self.model_dir:
            self._writer = tf.summary.create_file_writer(os.path.join(self.model_dir, LOG_SUBDIR))

    def start_epoch(self, epoch: int, done_in_epoch: int) -> None:
        # A bar only where it can redraw in place; in a log file the epoch line says it all.
        if self.active and sys.stdout.isatty():
            self._bar = keras.utils.Progbar(
                self.steps_per_epoch, stateful_metrics=["loss", "accuracy"]
            )
            self._bar.update(done_in_epoch)

    def progress(self, done_in_epoch: int, *, loss: float, accuracy: float) -> None:
        if self._bar is not None:
            self._bar.update(done_in_epoch, values=[("loss", loss), ("accuracy", accuracy)])

    def end_epoch(self, epoch: int, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        self._bar = None
        parts = [f"epoch {epoch + 1}/{self.epochs}", f"step {step}"]
        parts += [f"{name} {value:.4g}" for name, value in metrics.items()]
        log.info("%s", "  ".join(parts))
        if self._writer is not None:
            with self._writer.as_default(step=step):
                for name, value in metrics.items():
                    tf.summary.scalar(name, value)
            self._writer.flush()

    def finish(self, result: TrainResult, model: keras.Model) -> None:
        """Writes summary.json and exports the model (chief with a model_dir only)."""
        if not self.model_dir:
            return
        write_atomically(os.path.join(self.model_dir, SUMMARY_FILE), result.to_json())
        export_dir = os.path.join(self.model_dir, "export")
        tf.io.gfile.makedirs(export_dir)
        model.save(os.path.join(export_dir, "model.keras"))
        log.info("Wrote %s and exported the model to %s", SUMMARY_FILE, export_dir)

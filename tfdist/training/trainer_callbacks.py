"""The training binary's duties, as Keras callbacks that `tfdist.fit` runs on every worker.

- CheckpointsAndPreemption: restores the newest checkpoint before the first step (telling
  fit the step to resume from, so it skips the data already trained), saves at epoch ends
  and every `checkpoint_every` steps, and at the step where fit stops for a SIGTERM
  (`backup_now`).
- Report: the chief's epoch log lines and TensorBoard scalars, and the run's history
  (recorded by the Reporter).

Every worker calls them at the same steps, which is what makes their collective parts (a
save under multi_worker_mirrored, the preemption vote) safe.
"""

from __future__ import annotations

import time

import keras
import tensorflow as tf


class CheckpointsAndPreemption(keras.callbacks.Callback):
    """Restore, save and stop on SIGTERM for a Trainer; see the module docstring.

    Attributes:
      restored_step: the step of the checkpoint restored at the start (0: none); fit resumes
        there.
      step: the last step trained.
    """

    reads_batch_logs = False  # it counts steps; fit need not read the metrics for it

    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer
        self.restored_step = 0
        self.step = 0
        self._saved_step: int | None = None
        self._epoch = 0

    def checkpoint_status(self) -> tuple[int | None, str | None]:
        """(step, directory) of the newest checkpoint this run saved or restored."""
        return self._saved_step, self.trainer.checkpoints.directory

    def on_train_begin(self, logs=None):
        self.trainer.checkpoints.restore_latest()
        self.restored_step = self.step = int(self.trainer.step.numpy())
        self.trainer.reporter.resumed_from_step = self.restored_step
        if self.restored_step and self.trainer.checkpoints.directory:
            self._saved_step = self.restored_step

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.step = self._epoch * self.trainer.steps_per_epoch + batch + 1
        epoch_end = batch + 1 == self.trainer.steps_per_epoch
        every = self.trainer.config.checkpoint_every
        if every and self.step % every == 0 and not epoch_end:
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        self.save()

    def backup_now(self, *, epoch: int, step: int) -> str | None:
        """Saves at `step` (fit stops there for a SIGTERM); returns the directory."""
        self.step = step
        self.save()
        return self.trainer.checkpoints.directory

    def save(self) -> None:
        trainer = self.trainer
        if trainer.is_ps:
            # Every scheduled step must have reached the ps before the variables are saved.
            tf.distribute.experimental.coordinator.ClusterCoordinator(trainer.strategy).join()
        trainer.step.assign(self.step)
        trainer.checkpoints.save(self.step)  # every worker saves; only the chief keeps it
        if trainer.checkpoints.directory:
            self._saved_step = self.step


class Report(keras.callbacks.Callback):
    """Epoch lines, TensorBoard scalars and the history of the run, in the binary's names."""

    reads_batch_logs = False

    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer
        self._epoch = 0
        self._start = self._end = 0.0
        self._first_batch: int | None = None
        self._last_batch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._first_batch, self._end = epoch, None, 0.0
        self._start = time.perf_counter()

    def on_train_batch_begin(self, batch, logs=None):
        if self._first_batch is None:
            self._first_batch = batch

    def on_train_batch_end(self, batch, logs=None):
        self._last_batch = batch

    def on_test_begin(self, logs=None):
        self._end = self._end or time.perf_counter()  # evaluation is not training time

    def on_epoch_end(self, epoch, logs=None):
        trainer = self.trainer
        end = self._end or time.perf_counter()
        steps = 0 if self._first_batch is None else self._last_batch + 1 - self._first_batch
        logs = dict(logs or {})
        metrics = {
            "train_loss": logs.pop("loss", None),
            "train_accuracy": logs.pop("accuracy", None),
        }
        eval_logs = {k: logs.pop(k) for k in list(logs) if k.startswith("val_")}
        logs.pop("xent", None)  # the padding-exact test loss's twin on training data
        metrics.update({f"train_{k}": v for k, v in logs.items()})
        metrics = {k: v for k, v in metrics.items() if v is not None}
        metrics["learning_rate"] = float(
            keras.ops.convert_to_numpy(trainer.optimizer.learning_rate)
        )
        metrics["examples_per_second"] = (
            steps * trainer.config.global_batch_size / max(end - self._start, 1e-9)
        )
        if eval_logs:
            metrics.update(self.eval_metrics({k[len("val_") :]: v for k, v in eval_logs.items()}))
        step = (epoch + 1) * trainer.steps_per_epoch
        trainer.reporter.end_epoch(epoch, step, metrics, steps=steps, seconds=end - self._start)

    def eval_metrics(self, logs: dict[str, float]) -> dict[str, float]:
        """eval_loss and eval_accuracy from evaluation logs (padding-exact under static shapes)."""
        loss = logs["xent"] if "xent" in logs else logs["loss"]
        return {"eval_loss": loss, "eval_accuracy": logs["accuracy"]}

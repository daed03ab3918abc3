"""Public Keras callbacks for distributed training, usable with tfdist.fit and model.fit.

LearningRateWarmup: the linear scaling rule for large global batches with a gradual warmup
(Goyal et al., 2017, "Accurate, Large Minibatch SGD"), as Horovod's
`LearningRateWarmupCallback` offers it.

WarmupSchedule: the same rule as a learning-rate schedule, which a user can give the
optimizer directly (the binary's `--lr_scaling=linear --warmup_epochs=E`).
"""

from __future__ import annotations

import logging
import math

import keras
import tensorflow as tf

log = logging.getLogger(__name__)


class LearningRateWarmup(keras.callbacks.Callback):
    """Ramps the learning rate up to its (batch-scaled) peak over the first epochs.

    The peak is the optimizer's learning rate when training starts, times
    `global_batch_size / base_batch_size` when both are given (the linear scaling rule:
    a rate tuned for `base_batch_size` examples per step, used with a global batch k times
    larger, becomes k times larger). Step s of the warmup (0-based) uses
    peak * (s + 1) / warmup_steps; from then on the peak.

    Example:

        with strategy.scope():
            model = build_model()
            model.compile(keras.optimizers.SGD(0.1, momentum=0.9), loss=...)  # tuned for 256
        warmup = tfdist.LearningRateWarmup(
            warmup_epochs=5, global_batch_size=8192, base_batch_size=256)  # peak 3.2
        tfdist.fit(model, dataset, epochs=90, callbacks=[warmup])

    Args:
      warmup_epochs: epochs (a fraction allowed) over which the rate rises to its peak.
      global_batch_size: the global batch training uses; with `base_batch_size`, scales
        the peak by their ratio.
      base_batch_size: the batch the compiled learning rate was tuned for.
      verbose: 1 logs the peak and each epoch's rate.

    Raises (at the start of training):
      ValueError: the optimizer's rate is a schedule (put the warmup in the schedule, e.g.
        tfdist.WarmupSchedule, or compile with a number), or the batch sizes are not
        positive, or only one of them is given.
    """

    # It sets the rate before each batch and reads no batch logs: tfdist fetches none for it.
    reads_batch_logs = False

    def __init__(
        self,
        *,
        warmup_epochs: float = 5.0,
        global_batch_size: int | None = None,
        base_batch_size: int | None = None,
        verbose: int = 0,
    ):
        super().__init__()
        if not warmup_epochs >= 0:
            raise ValueError(
                f"warmup_epochs is a number of epochs, 0 or more. Received: {warmup_epochs!r}"
            )
        if (global_batch_size is None) != (base_batch_size is None):
            raise ValueError(
                "The linear scaling rule needs both global_batch_size (the batch trained "
                "with) and base_batch_size (the batch the rate was tuned for), or neither. "
                f"Received: global_batch_size={global_batch_size!r}, "
                f"base_batch_size={base_batch_size!r}"
            )
        for name, value in (("global_batch_size", global_batch_size), ("base_batch_size",
                                                                       base_batch_size)):  # fmt: skip
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive whole number. Received: {value!r}")
        self.warmup_epochs = float(warmup_epochs)
        self.scale = 1.0 if global_batch_size is None else global_batch_size / base_batch_size
        self.verbose = verbose
        self.peak: float | None = None
        self._warmup_steps = 0
        self._steps = 0
        self._epoch = 0

    def on_train_begin(self, logs=None):
        rate = self.model.optimizer.learning_rate
        if not hasattr(rate, "assign"):  # a schedule's rate is computed, not stored
            raise ValueError(
                "LearningRateWarmup sets the optimizer's learning rate each step, but this "
                "optimizer's rate is a schedule. Compile with a number, or put the warmup in "
                "the schedule (tfdist.WarmupSchedule)."
            )
        if self.peak is None:  # a second fit call keeps the peak of the first
            self.peak = float(rate.numpy()) * self.scale
        steps = (self.params or {}).get("steps")
        self._steps = steps or 0
        if not steps and self.warmup_epochs:
            raise ValueError(
                "LearningRateWarmup counts its warmup in steps, so it needs the steps per "
                "epoch: pass steps_per_epoch to fit, or data of known length."
            )
        self._warmup_steps = int(round(self.warmup_epochs * (steps or 0)))
        if self.verbose:
            log.info(
                "Learning-rate warmup to %.4g over %d steps (%.3g epochs)",
                self.peak, self._warmup_steps, self.warmup_epochs,
            )  # fmt: skip

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        # Counted from the epoch and batch, not read from the optimizer: the same on every
        # worker, and exact under parameter-server training, where the optimizer's
        # iteration count lags the steps being scheduled.
        step = self._epoch * self._steps + batch
        if step < self._warmup_steps:
            self._set(self.peak * (step + 1) / self._warmup_steps)
        elif step == self._warmup_steps or batch == 0:
            self._set(self.peak)

    def on_epoch_end(self, epoch, logs=None):
        if self.verbose:
            log.info("Epoch %d learning rate %.4g", epoch + 1, self._current())

    def _set(self, value: float) -> None:
        self.model.optimizer.learning_rate.assign(value)

    def _current(self) -> float:
        return float(self.model.optimizer.learning_rate.numpy())


@keras.saving.register_keras_serializable(package="tfdist")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from peak/warmup_steps to `peak`, then constant or cosine decay to 0.

    Large global batches train stably at a proportionally larger learning rate only if the
    first epochs ramp up to it; with warmup_steps=0 the rate starts at its peak.
    """

    def __init__(
        self, peak: float, *, warmup_steps: int, total_steps: int, decay: str = "constant"
    ):
        self.peak = float(peak)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.decay = decay

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        rate = tf.constant(self.peak, tf.float32)
        if self.decay == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = tf.clip_by_value((step - self.warmup_steps) / span, 0.0, 1.0)
            rate = rate * 0.5 * (1.0 + tf.cos(math.pi * progress))
        if self.warmup_steps:
            rate = tf.minimum(rate, self.peak * (step + 1.0) / self.warmup_steps)
        return rate

    def get_config(self):
        return {
            "peak": self.peak,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "decay": self.decay,
        }

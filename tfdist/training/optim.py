"""Optimizers and the learning-rate schedule: linear scaling with warmup (Goyal et al., 2017)."""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from tfdist.training.config import TrainConfig


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


def build_schedule(config: TrainConfig, *, steps_per_epoch: int) -> WarmupSchedule:
    return WarmupSchedule(
        config.peak_learning_rate,
        warmup_steps=int(round(config.warmup_epochs * steps_per_epoch)),
        total_steps=config.epochs * steps_per_epoch,
        decay=config.lr_schedule,
    )


def build_optimizer(config: TrainConfig, schedule: WarmupSchedule) -> keras.optimizers.Optimizer:
    """The optimizer named by the config; wrapped for loss scaling under mixed_float16."""
    if config.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(schedule, momentum=config.momentum)
    elif config.optimizer == "adam":
        optimizer = keras.optimizers.Adam(schedule)
    else:  # lamb: layer-wise adaptive rates, made for very large batches (You et al., 2019)
        optimizer = keras.optimizers.Lamb(schedule)
    if config.mixed_precision == "mixed_float16":
        # float16 gradients underflow without a loss scale; bfloat16 has float32's range.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer

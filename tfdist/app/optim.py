"""The binary's optimizer and learning-rate schedule from its TrainConfig: linear scaling with
warmup (Goyal et al., 2017) through tfdist.WarmupSchedule."""

from __future__ import annotations

import keras

from tfdist.app.config import TrainConfig
from tfdist.training.callbacks import WarmupSchedule


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

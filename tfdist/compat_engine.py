"""(To be merged into tfdist/compat.py.) Private TF/Keras entry points of the training engine."""

from __future__ import annotations

import keras
import tensorflow as tf


def sync_worker_count(strategy: tf.distribute.Strategy) -> int:
    """Processes that run a synchronous strategy's steps together (1 unless multi-worker).

    MultiWorkerMirroredStrategy's extended object keeps the count privately.
    """
    return int(getattr(strategy.extended, "_num_workers", 1) or 1)


def symbolic_build(model: keras.Model, sample_batch) -> None:
    """Builds the model, its compiled metrics and losses and the optimizer's slots from one
    batch's shapes, as Keras's fit does before its first step (`Trainer._symbolic_build`)."""
    model._symbolic_build(data_batch=sample_batch)


def optimizer_variables_list(optimizer) -> list:
    """The variables an optimizer was built over (Keras keeps them privately)."""
    return list(optimizer._trainable_variables)


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether the model's `call` takes `training` (Keras records it privately)."""
    return bool(model._call_has_training_arg)


def compute_loss(model: keras.Model, **kwargs):
    """The compiled loss of a batch, as Keras's train_step computes it (private in 3.15)."""
    return model._compute_loss(**kwargs)


def loss_tracker(model: keras.Model):
    """The Mean metric that Keras's train_step feeds the loss into (private in 3.15)."""
    return model._loss_tracker


def unscale_loss(loss):
    """A replica's loss without the 1/replicas factor Keras's losses apply under a strategy."""
    from keras.src.losses.loss import unscale_loss_for_distribution

    return unscale_loss_for_distribution(loss)


def learning_rate_schedule(optimizer):
    """The optimizer's learning rate as given (a schedule, or a variable), kept privately."""
    return getattr(optimizer, "_learning_rate", None)


def cluster_resolver(strategy: tf.distribute.Strategy):
    """The strategy's cluster resolver: ParameterServerStrategy keeps it privately (its public
    attribute is None)."""
    return strategy.cluster_resolver or getattr(strategy, "_cluster_resolver", None)


def should_evaluate(model: keras.Model, epoch: int, validation_freq) -> bool:
    """Keras's rule for whether fit validates after `epoch` (an int period or a list)."""
    return bool(model._should_eval(epoch, validation_freq))


def take_restored_epoch(model: keras.Model) -> int | None:
    """The epoch a BackupAndRestore callback restored (Keras leaves it on the model for its
    fit to start from), consumed: a later fit call starts afresh."""
    restored = model._initial_epoch
    model._initial_epoch = None
    return restored


def backup_now(callback: keras.callbacks.BackupAndRestore, *, epoch: int) -> None:
    """Makes a BackupAndRestore callback write its backup now, as taken during `epoch`.

    Keras's callback saves at epoch ends or every `save_freq` batches; a preemption saves
    between. Its metadata records the epoch, and the optimizer's iteration count tells
    how far into it the backup was taken.
    """
    callback._current_epoch = epoch
    callback._save_model()


def strategy_of(model: keras.Model):
    """The strategy Keras recorded when the model was created (None: no strategy's scope)."""
    return model._distribute_strategy


def compiled_loss(model: keras.Model):
    """The loss `compile` was given, in Keras's wrapper (None: compiled without one)."""
    return model._compile_loss


def metrics_in_order(model: keras.Model, logs: dict) -> list | float:
    """Logs as `evaluate` returns them without return_dict: `metrics_names` order."""
    return model._flatten_metrics_in_order(logs)

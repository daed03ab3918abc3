"""The training binary's run: a zoo model and a named dataset, trained by `tfdist.fit`.

`Trainer` is one client of `tfdist.fit` (tfdist/training/fit.py), the engine every Keras
model trains on: it turns a TrainConfig into a compiled model, dataset functions and the
callbacks that give the binary its duties — checkpoints that resume at the saved step and
data position, SIGTERM preemption, progress, TensorBoard and summary.json written by the
chief (tfdist/training/trainer_callbacks.py). Strategy-specific work (parameter-server
closures, staleness, surviving a dead worker) lives in fit's runners, not here.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import keras
import tensorflow as tf

from tfdist.cluster import ClusterInfo
from tfdist.data import PipelineOptions, plan_batches, prepare_dataset
from tfdist.data.datasets import TFRECORD_PREFIX
from tfdist.data.distribute import PAD_LABEL, pad_to_whole_steps
from tfdist.data.pipeline import explain_data_error
from tfdist.models import build_model
from tfdist.peers import explain_peer_error
from tfdist.storage import check_writable_directory
from tfdist.strategies import check_tpu_node_paths, strategy_kind, tpu_node_address
from tfdist.training import fit as fit_module
from tfdist.training import ps_shards
from tfdist.training.checkpoints import Checkpoints, check_resume_settings
from tfdist.training.config import ConfigError, TrainConfig
from tfdist.training.optim import build_optimizer, build_schedule
from tfdist.training.report import Reporter, TrainResult
from tfdist.training.staleness import StalenessAwareSchedule, attach_update_counter
from tfdist.training.trainer_callbacks import CheckpointsAndPreemption, Report

log = logging.getLogger(__name__)


def train(
    config: TrainConfig, *, strategy: tf.distribute.Strategy, cluster: ClusterInfo | None = None
) -> TrainResult:
    """Trains `config.model` on `config.dataset` under `strategy`: `Trainer(...).fit()`.

    Restores the newest checkpoint in `config.model_dir` first, so a re-run continues from
    the last saved step, reading the data from where that step left it.

    Args:
      config: the run.
      strategy: any tf.distribute strategy (build it with tfdist.build_strategy).
      cluster: this task's place in the job (for the chief's duties); None = single host.

    Returns:
      The TrainResult the chief also writes to model_dir/summary.json.

    Raises:
      DataError, ModelError, ConfigError: a mistake in the config or the data, explained.
    """
    return Trainer(config, strategy=strategy, cluster=cluster).fit()


class Trainer:
    """One run of the training binary: the model, its optimizer and data, and tfdist.fit.

    Example:

        trainer = Trainer(TrainConfig(model="cnn", epochs=5), strategy=strategy)
        result = trainer.fit()
        trainer.model.predict(...)

    Args:
      config: the run.
      strategy: any tf.distribute strategy.
      cluster: this task's place in the job; None = single host.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        strategy: tf.distribute.Strategy,
        cluster: ClusterInfo | None = None,
    ):
        self.config, self.strategy = config, strategy
        self.is_ps = isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)
        if config.staleness_aware_lr and not self.is_ps:
            raise ConfigError(
                "staleness_aware_lr applies to parameter-server training only: synchronous "
                "strategies apply every update to the parameters it was computed from "
                "(staleness 0). Use the parameter_server strategy or drop the option. "
                f"Received: staleness_aware_lr=True with {strategy_kind(strategy)}"
            )
        self.cluster = cluster
        self.is_chief = cluster.is_chief if cluster is not None else True
        self.plan = plan_batches(strategy, config.global_batch_size)
        # Before anything is read or written, as a TPU Node's host sees only Cloud Storage.
        # Synthetic data is made in memory; without a model_dir nothing is written.
        paths = {} if config.dataset == "synthetic" else {"data_dir": config.data_dir}
        if config.dataset.startswith(TFRECORD_PREFIX):
            paths = {"dataset": config.dataset[len(TFRECORD_PREFIX) :]}
        if config.model_dir is not None:
            paths["model_dir"] = config.model_dir
        check_tpu_node_paths(tpu_node_address(strategy), paths)
        if config.model_dir is not None and self.is_chief:  # the others write elsewhere
            check_writable_directory(config.model_dir, name="model_dir")
        # TPUs compile a program per input shape, so evaluation pads its last batches.
        self.static_shapes = strategy_kind(strategy) == "tpu"
        if self.static_shapes and self.is_chief:
            log.info(
                "Evaluation pads its last batches to full ones for the TPU's static shapes; "
                "the padding is masked out, so every test example counts once"
            )
        self.data = prepare_dataset(
            config.dataset, data_dir=config.data_dir, **config.dataset_options
        )
        train_examples = self.data.info.num_examples["train"]
        self.steps_per_epoch = config.steps_per_epoch or max(
            1, train_examples // config.global_batch_size
        )
        self.total_steps = config.epochs * self.steps_per_epoch
        if config.global_batch_size > train_examples and self.is_chief:
            log.warning(
                "The global batch of %d is larger than the %d training examples: every step "
                "repeats examples (some twice in one batch). Use a global batch of at most %d.",
                config.global_batch_size, train_examples, train_examples,
            )  # fmt: skip
        if config.model_dir is not None:
            settings = {
                "model": config.model, "dataset": _comparable(config.dataset),
                "optimizer": config.optimizer, "mixed_precision": config.mixed_precision,
                "global_batch_size": config.global_batch_size,
                "steps_per_epoch": self.steps_per_epoch,
                "workers": cluster.num_workers if cluster is not None else 1,
                "replicas": strategy.num_replicas_in_sync,
            }  # fmt: skip
            check_resume_settings(config.model_dir, settings, write=self.is_chief)
        if self.is_chief:
            log.info(
                "%s; %d steps per epoch x %d epochs; %s on %s (%d training examples)",
                self.plan.describe(), self.steps_per_epoch, config.epochs, config.model,
                config.dataset, train_examples,
            )  # fmt: skip

        with strategy.scope():
            keras.utils.set_random_seed(config.seed)
            # Layers take the dtype policy when they are built; the global policy is restored
            # right after so the process is left as it was found.
            previous_policy = keras.mixed_precision.dtype_policy()
            keras.mixed_precision.set_dtype_policy(config.mixed_precision or previous_policy)
            try:
                self.model = build_model(
                    config.model,
                    input_shape=self.data.info.image_shape,
                    num_classes=self.data.info.num_classes,
                    **config.model_options,
                )
            finally:
                keras.mixed_precision.set_dtype_policy(previous_policy)
            schedule = build_schedule(config, steps_per_epoch=self.steps_per_epoch)
            if config.staleness_aware_lr:  # fit's parameter-server runner scales it per update
                schedule = StalenessAwareSchedule(schedule)
            self.optimizer = build_optimizer(config, schedule)
            # Over the shards of variables a partitioner split across ps tasks (ps_shards.py).
            ps_shards.build_optimizer_over_shards(self.model, self.optimizer)
            # The step counter is ours: assigned from the host at every save.
            self.step = tf.Variable(
                0,
                dtype=tf.int64,
                trainable=False,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
        # Parameter-server updates are asynchronous: fit counts them on a ps to measure their
        # staleness. Synchronous strategies have none, and skip the counter's cost.
        self.update_counter = attach_update_counter(self.model, strategy) if self.is_ps else None
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step)
        if self.update_counter is not None:
            # Saved so that updates applied minus steps counts the updates a dead worker's
            # re-run closures applied twice, across restarts too.
            checkpoint.applied_updates = self.update_counter.variable
        self.checkpoints = Checkpoints(
            checkpoint,
            model_dir=config.model_dir,
            is_chief=self.is_chief,
            max_to_keep=config.max_checkpoints,
        )
        self.reporter = Reporter(
            is_chief=self.is_chief,
            model_dir=config.model_dir,
            steps_per_epoch=self.steps_per_epoch,
            epochs=config.epochs,
        )

    # --- data ---------------------------------------------------------------------------------

    def train_dataset_fn(self, context: tf.distribute.InputContext) -> tf.data.Dataset:
        """One input pipeline's per-replica training batches, repeated, in a seeded order."""
        options = PipelineOptions(
            seed=self.config.seed,
            shuffle_buffer=self.config.shuffle_buffer,
            deterministic=True,  # with the seed, the data order is a function of the step
            skip_corrupt=self.config.skip_corrupt,
        )
        return self.data.dataset(
            "train",
            batch_size=context.get_per_replica_batch_size(self.config.global_batch_size),
            input_context=context,
            options=options,
        )

    def eval_dataset_fn(self, context, batch_size):
        """One pipeline's (image, label) test batches (the evaluator task's input too)."""
        options = PipelineOptions(
            repeat=False, shuffle_buffer=0, drop_remainder=False, deterministic=True,
            skip_corrupt=self.config.skip_corrupt,
        )  # fmt: skip
        dataset = self.data.dataset(
            "test", batch_size=batch_size, input_context=context, options=options
        )
        if not self.static_shapes:
            return dataset
        # Dropping the partial last batches would skip test examples (and make the figures
        # differ from other hardware's); padding keeps every one and the shapes static.
        replicas_here = (
            1 if context is None else context.num_replicas_in_sync // context.num_input_pipelines
        )
        return pad_to_whole_steps(dataset, batch_size=batch_size, batches_per_step=replicas_here)

    def _validation_fn(self, context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch_size = context.get_per_replica_batch_size(self.config.global_batch_size)
        dataset = self.eval_dataset_fn(context, batch_size)
        if not self.static_shapes:
            return dataset
        # Padding (PAD_LABEL) is scored as class 0 with weight 0: it counts for nothing.
        return dataset.map(
            lambda images, labels: (
                images,
                tf.maximum(labels, 0),
                tf.cast(labels != PAD_LABEL, tf.float32),
            )
        )

    # --- the evaluator task's step --------------------------------------------------------------

    def replica_eval(self, images, labels):
        """[loss sum, correct, count] of one test batch (padding, PAD_LABEL, counts nothing)."""

        def evaluate():
            logits = self.model(images, training=False)
            real = labels != PAD_LABEL
            known = tf.where(real, labels, tf.zeros_like(labels))
            return _sums(self.loss_fn(known, logits), logits, known, weights=real)

        # oneDNN's convolution rejects a batch of zero images: such a batch adds nothing.
        return tf.cond(tf.size(labels) > 0, evaluate, lambda: tf.zeros([3]))

    # --- the run ------------------------------------------------------------------------------

    def _compile(self) -> None:
        # Metric variables are created with the metric: inside the scope, to be the strategy's.
        with self.strategy.scope():
            accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
            if self.static_shapes:
                # The padding's zero weights must count for nothing: weighted metrics honour
                # them, but the loss Keras tracks counts every example of a batch, so the exact
                # test loss is a weighted cross-entropy metric ("xent").
                metrics, weighted = (
                    None,
                    [
                        accuracy,
                        keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent"),
                    ],
                )
            else:
                metrics, weighted = [accuracy], None
            self.model.compile(
                optimizer=self.optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=metrics,
                weighted_metrics=weighted,
                steps_per_execution=self.config.steps_per_execution,
            )

    def fit(self) -> TrainResult:
        """Trains to `config.epochs`, resuming from the newest checkpoint; see `train()`."""
        try:
            return self._fit()
        except tf.errors.InvalidArgumentError as e:
            explained = explain_data_error(e)  # a truncated TFRecord, named
            if explained is None:
                raise
            raise explained from None
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as e:
            lost = (
                None
                if self.is_ps or self.cluster is None
                else explain_peer_error(
                    e, self.cluster, starting=False, resume_hint=self._resume_hint()
                )
            )
            if lost is None:
                raise
            raise lost from None
        finally:
            self.checkpoints.close()

    def _resume_hint(self) -> str:
        if self.checkpoints.directory is None:
            return "Nothing was saved (no model_dir), so a restart starts over. "
        latest = tf.train.latest_checkpoint(self.checkpoints.directory)
        if latest is None:
            return f"No checkpoint was saved yet in {self.checkpoints.directory}. "
        return f"A restart resumes from {latest}, the newest checkpoint. "

    def _fit(self) -> TrainResult:
        start = time.perf_counter()
        self._compile()
        checkpoints = CheckpointsAndPreemption(self)
        report = Report(self)
        callbacks = [checkpoints, report]
        eval_every = self.config.eval_every
        validation_freq = sorted(
            {*(range(eval_every, self.config.epochs + 1, eval_every) if eval_every else ()),
             self.config.epochs}
        )  # fmt: skip
        fit_module.fit(
            self.model,
            self.train_dataset_fn,
            epochs=self.config.epochs,
            steps_per_epoch=self.steps_per_epoch,
            validation_data=self._validation_fn,
            validation_freq=validation_freq,
            callbacks=callbacks,
            # Keras's bar on the chief, where it can redraw in place (it reads the chief's own
            # replicas' logs: no collective); in a log file the epoch line says it all.
            verbose=1 if self.is_chief and sys.stdout.isatty() else 0,
            strategy=self.strategy,
        )
        start_step = checkpoints.restored_step or 0
        step = max(start_step, checkpoints.step)
        if start_step >= self.total_steps:
            log.info("Already trained %d of %d steps; nothing to do", start_step, self.total_steps)
        # The run's record: this session's epochs and those of earlier sessions (a resume,
        # a re-run), which a session with nothing left to train keeps.
        record = self.reporter.run_record()
        history = record.history
        last = history[-1] if history else {}
        eval_metrics = {k: v for k, v in last.items() if k.startswith("eval_")}
        if not self.reporter.trained:  # nothing trained now: evaluate where the run stands
            logs = fit_module.evaluate(
                self.model, self._validation_fn, verbose=0, return_dict=True,
                strategy=self.strategy,
            )  # fmt: skip
            eval_metrics = report.eval_metrics(logs)
        result = TrainResult(
            strategy=strategy_kind(self.strategy),
            replicas=self.strategy.num_replicas_in_sync,
            global_batch_size=self.config.global_batch_size,
            per_replica_batch_size=self.plan.per_replica_batch_size,
            steps=step,
            epochs=self.config.epochs,
            resumed_from_step=start_step,
            train_loss=last.get("train_loss"),
            train_accuracy=last.get("train_accuracy"),
            eval_loss=eval_metrics.get("eval_loss"),
            eval_accuracy=eval_metrics.get("eval_accuracy"),
            examples_per_second=record.examples_per_second(self.config.global_batch_size),
            wall_seconds=time.perf_counter() - start,
            **self._staleness_summary(step),
            history=history,
            steps_trained=record.steps_trained,
            train_seconds=record.train_seconds,
            resume_points=tuple(record.resume_points),
            sessions=record.sessions,
        )
        self.reporter.finish(result, self.model)
        return result

    def _staleness_summary(self, step: int) -> dict:
        if self.update_counter is None:
            return {}
        mean, largest = self.update_counter.stats.run_summary()
        applied = self.update_counter.value()
        if applied > step:
            log.warning(
                "%d update(s) reached the parameters twice: a worker died after applying them "
                "and the coordinator ran its closure again elsewhere (%d updates for %d steps)",
                applied - step, applied, step,
            )  # fmt: skip
        return {"staleness_mean": mean, "staleness_max": largest, "applied_updates": applied}


def _sums(per_example_loss, logits, labels, weights=None):
    correct = tf.cast(tf.argmax(logits, axis=-1, output_type=tf.int32) == labels, tf.float32)
    per_example_loss = tf.cast(per_example_loss, tf.float32)
    if weights is None:
        count = tf.cast(tf.shape(labels)[0], tf.float32)
    else:  # examples of weight 0 count for nothing
        weights = tf.cast(weights, tf.float32)
        per_example_loss, correct, count = (
            per_example_loss * weights,
            correct * weights,
            tf.reduce_sum(weights),
        )
    return tf.stack([tf.reduce_sum(per_example_loss), tf.reduce_sum(correct), count])


def _comparable(dataset: str) -> str:
    """The dataset's name, with a local tfrecord:DIR made absolute (a resume from another
    working directory, or with a trailing slash, names the same data)."""
    if dataset.startswith(TFRECORD_PREFIX) and "://" not in dataset:
        return TFRECORD_PREFIX + os.path.abspath(dataset[len(TFRECORD_PREFIX) :])
    return dataset


__all__ = ["TrainResult", "Trainer", "train"]

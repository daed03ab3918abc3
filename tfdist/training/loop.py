"""The distributed training loop: one entry point, `train()`, for every strategy.

Synchronous strategies (one_device, mirrored, central_storage, multi_worker_mirrored, tpu)
run `steps_per_execution` steps per tf.function call through `strategy.run`; each replica's
loss is averaged over the GLOBAL batch, so the strategy's gradient sum equals one device's
gradient of the same batch. parameter_server schedules the same steps on its workers through
a ClusterCoordinator and counts them on the coordinator — Keras's `optimizer.iterations`
loses increments under asynchronous updates, so it cannot be the step counter.

Keras 3's model.fit cannot train under multi_worker_mirrored or parameter_server; this loop
can, with checkpoints, resume, progress, TensorBoard and a summary written by the chief.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time

import keras
import tensorflow as tf

from tfdist.cluster import ClusterInfo
from tfdist.data import PipelineOptions, plan_batches, prepare_dataset
from tfdist.data.distribute import PAD_LABEL, pad_to_whole_steps
from tfdist.data.pipeline import explain_data_error
from tfdist.models import build_model
from tfdist.peers import explain_peer_error
from tfdist.strategies import check_tpu_node_paths, strategy_kind, tpu_node_address
from tfdist.training.checkpoints import Checkpoints
from tfdist.training.config import ConfigError, TrainConfig
from tfdist.training.optim import build_optimizer, build_schedule
from tfdist.training.preemption import Preempted, PreemptionWatcher
from tfdist.training.report import Reporter, TrainResult
from tfdist.training.runners import ParameterServerRunner, SyncRunner
from tfdist.training.staleness import (
    StalenessAwareSchedule,
    UpdateCounter,
)

log = logging.getLogger(__name__)

# Sums kept per step: loss summed over examples, correct predictions, examples.
_LOSS, _CORRECT, _COUNT = range(3)


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
    """One training run: the model, its optimizer and data, and the loop for its strategy.

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
        if config.model_dir is not None:
            paths["model_dir"] = config.model_dir
        check_tpu_node_paths(tpu_node_address(strategy), paths)
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
            if config.staleness_aware_lr:
                schedule = StalenessAwareSchedule(schedule)
            self.schedule = schedule
            self.optimizer = build_optimizer(config, schedule)
            self.optimizer.build(self.model.trainable_variables)
            # The step counter is ours: assigned from the host after each execution.
            self.step = tf.Variable(
                0,
                dtype=tf.int64,
                trainable=False,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            # Parameter-server updates are asynchronous: count them on a ps to measure their
            # staleness. Synchronous strategies have none, and skip the counter's cost.
            self.update_counter = UpdateCounter() if self.is_ps else None
            if not self.is_ps:
                # Per-replica running sums, added without communication and summed on read.
                self.train_sums = _sum_variable()
                self.eval_sums = _sum_variable()
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
        # (steps, start, end) of each epoch's training steps, in perf_counter seconds.
        self.epoch_timings: list[tuple[int, float, float]] = []
        self.reporter = Reporter(
            is_chief=self.is_chief,
            model_dir=config.model_dir,
            steps_per_epoch=self.steps_per_epoch,
            epochs=config.epochs,
        )

    # --- the step every strategy runs ---------------------------------------------------------

    def replica_step(self, images, labels):
        """One replica's share of a training step; returns [loss sum, correct, count].

        Under parameter-server training it returns [loss sum, correct, count, staleness]: see
        tfdist/training/staleness.py.
        """
        counter = self.update_counter
        read = counter.read() if counter is not None else None
        # The counter must be read before the weights are, or the staleness comes out low.
        with tf.control_dependencies([] if read is None else [read]), tf.GradientTape() as tape:
            logits = self.model(images, training=True)
            per_example = self.loss_fn(labels, logits)
            loss = tf.nn.compute_average_loss(
                per_example, global_batch_size=self.config.global_batch_size
            )
            if self.model.losses:  # weight decay: every replica adds 1/replicas of it
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.model.trainable_variables)
        if counter is None:
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
            return _sums(per_example, logits, labels)
        staleness = counter.claim(read, after=grads)
        with (
            self.schedule.scaled(staleness)
            if isinstance(self.schedule, StalenessAwareSchedule)
            else contextlib.nullcontext()
        ):
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        return tf.concat([_sums(per_example, logits, labels), [staleness]], axis=0)

    def replica_eval(self, images, labels):
        def evaluate():
            logits = self.model(images, training=False)
            # Padding added for static shapes (PAD_LABEL) is scored as class 0, then weighed 0.
            real = labels != PAD_LABEL
            known = tf.where(real, labels, tf.zeros_like(labels))
            return _sums(self.loss_fn(known, logits), logits, known, weights=real)

        # The last evaluation batch can leave a replica empty-handed, and oneDNN's convolution
        # rejects a batch of zero images; such a replica simply adds nothing.
        return tf.cond(tf.size(labels) > 0, evaluate, lambda: tf.zeros([3]))

    # --- data ---------------------------------------------------------------------------------

    def train_dataset_fn(self, start_step: int):
        options = PipelineOptions(
            seed=self.config.seed,
            shuffle_buffer=self.config.shuffle_buffer,
            deterministic=True,  # with the seed, the data order is a function of the step
        )

        def dataset_fn(context, batch_size):
            dataset = self.data.dataset(
                "train", batch_size=batch_size, input_context=context, options=options
            )
            # Resume where the checkpoint left off: each pipeline skips the batches it fed.
            # (Parameter-server workers read independently; their position is not tracked.)
            replicas_here = context.num_replicas_in_sync // context.num_input_pipelines
            skip = 0 if self.is_ps else start_step * replicas_here
            return dataset.skip(skip) if skip else dataset

        return dataset_fn

    def eval_dataset_fn(self, context, batch_size):
        options = PipelineOptions(
            repeat=False, shuffle_buffer=0, drop_remainder=False, deterministic=True
        )
        dataset = self.data.dataset(
            "test", batch_size=batch_size, input_context=context, options=options
        )
        if not self.static_shapes:
            return dataset
        # Dropping the partial last batches would skip test examples (and make the figures
        # differ from other hardware's); padding keeps every one and the shapes static.
        replicas_here = context.num_replicas_in_sync // context.num_input_pipelines
        return pad_to_whole_steps(dataset, batch_size=batch_size, batches_per_step=replicas_here)

    # --- the loop -----------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Trains to `config.epochs`, resuming from the newest checkpoint; see `train()`."""
        # Synchronous workers each run this loop and must agree on a preemption; in
        # parameter-server training only the chief does.
        workers = 1 if self.is_ps or self.cluster is None else self.cluster.num_workers
        try:
            with PreemptionWatcher(self.strategy, workers=workers) as watcher:
                return self._fit(watcher)
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

    def _fit(self, watcher: PreemptionWatcher) -> TrainResult:
        start = time.perf_counter()
        self.checkpoints.restore_latest()
        step = start_step = int(self.step.numpy())
        if start_step >= self.total_steps:
            log.info("Already trained %d of %d steps; nothing to do", start_step, self.total_steps)
        runner = (
            ParameterServerRunner(self, start_step) if self.is_ps else SyncRunner(self, start_step)
        )
        train_metrics: dict[str, float] = {}
        eval_metrics: dict[str, float] = {}
        history: list[dict[str, float]] = []
        # Reading the running sums synchronises the host with the steps (and, across workers,
        # is a collective), so the progress bar is fed about ten times an epoch, at the same
        # steps on every worker, not after every call.
        progress_every = max(1, self.steps_per_epoch // 10)
        for epoch in range(start_step // self.steps_per_epoch, self.config.epochs):
            epoch_end = (epoch + 1) * self.steps_per_epoch
            self.reporter.start_epoch(epoch, step - epoch * self.steps_per_epoch)
            runner.reset_sums()
            epoch_start, epoch_first_step = time.perf_counter(), step
            while step < epoch_end:
                n = min(self.config.steps_per_execution, epoch_end - step)
                if self.config.checkpoint_every:
                    n = min(n, self.config.checkpoint_every - step % self.config.checkpoint_every)
                runner.run(n)
                synchronised = (step + n) // progress_every != step // progress_every
                if synchronised and step + n < epoch_end:
                    self.reporter.progress(
                        step + n - epoch * self.steps_per_epoch, **_averages(runner.peek())
                    )
                step += n
                if (synchronised or step == epoch_end or watcher.workers == 1) and watcher.agreed():
                    runner.save(step)
                    raise Preempted(step, self.checkpoints.directory)
                if (
                    self.config.checkpoint_every
                    and step % self.config.checkpoint_every == 0
                    and step < epoch_end
                ):
                    runner.save(step)
            sums = runner.finish_epoch(step)
            self.epoch_timings.append((step - epoch_first_step, epoch_start, time.perf_counter()))
            self.reporter.progress(step - epoch * self.steps_per_epoch, **_averages(sums))
            train_metrics = {f"train_{k}": v for k, v in _averages(sums).items()}
            metrics = dict(train_metrics)
            metrics.update({f"train_{k}": v for k, v in runner.epoch_metrics().items()})
            metrics["learning_rate"] = float(self.optimizer.learning_rate)
            metrics["examples_per_second"] = (
                (step - epoch_first_step)
                * self.config.global_batch_size
                / max(self.epoch_timings[-1][2] - epoch_start, 1e-9)
            )
            last = epoch + 1 == self.config.epochs
            if last or (self.config.eval_every and (epoch + 1) % self.config.eval_every == 0):
                eval_metrics = {f"eval_{k}": v for k, v in _averages(runner.evaluate()).items()}
                metrics.update(eval_metrics)
            runner.save(step)
            self.reporter.end_epoch(epoch, step, metrics)
            history.append({"epoch": epoch + 1, "step": step, **metrics})
        if not train_metrics:  # nothing left to train: still report where the run stands
            eval_metrics = {f"eval_{k}": v for k, v in _averages(runner.evaluate()).items()}
        result = TrainResult(
            strategy=strategy_kind(self.strategy),
            replicas=self.strategy.num_replicas_in_sync,
            global_batch_size=self.config.global_batch_size,
            per_replica_batch_size=self.plan.per_replica_batch_size,
            steps=step,
            epochs=self.config.epochs,
            resumed_from_step=start_step,
            train_loss=train_metrics.get("train_loss", math.nan),
            train_accuracy=train_metrics.get("train_accuracy", math.nan),
            eval_loss=eval_metrics.get("eval_loss"),
            eval_accuracy=eval_metrics.get("eval_accuracy"),
            examples_per_second=self._examples_per_second(),
            wall_seconds=time.perf_counter() - start,
            **runner.run_summary(),
            history=tuple(history),
        )
        self.reporter.finish(result, self.model)
        return result

    def _examples_per_second(self) -> float:
        """Training throughput over the epochs' steps, evaluation and checkpoints excluded.

        The first epoch is left out when there are others: its time includes tracing.
        """
        epochs = self.epoch_timings[1:] or self.epoch_timings
        seconds = sum(end - start for _, start, end in epochs)
        return (
            sum(n for n, _, _ in epochs) * self.config.global_batch_size / seconds
            if seconds
            else math.nan
        )


def _sum_variable() -> tf.Variable:
    return tf.Variable(
        tf.zeros([3]),
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM,
    )


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


def _averages(sums) -> dict[str, float]:
    count = max(sums[_COUNT], 1.0)
    return {"loss": sums[_LOSS] / count, "accuracy": sums[_CORRECT] / count}


__all__ = ["TrainResult", "Trainer", "train"]

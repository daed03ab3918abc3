"""The training binary's run: a zoo model on a named dataset, trained by `tfdist.fit`.

`Trainer` is a thin client of the engine every Keras model trains on (fit.py): it turns a
TrainConfig into a compiled model, the data functions and tfdist's public callbacks —
`StepCheckpoint` (resume at the saved step and data position, save on SIGTERM) and
`RunRecord` (epoch lines, history.jsonl, TensorBoard, summary.json) — and hands them to
`tfdist.fit`, which any user's script can do alike. It holds no strategy-specific code.
"""

from __future__ import annotations

import logging
import os
import sys

import keras
import tensorflow as tf

from tfdist.api import fit as fit_module
from tfdist.app.config import TrainConfig
from tfdist.app.optim import build_optimizer, build_schedule
from tfdist.cluster import ClusterInfo
from tfdist.data import PipelineOptions, plan_batches, prepare_dataset
from tfdist.data.datasets import TFRECORD_PREFIX
from tfdist.data.distribute import PAD_LABEL, pad_to_whole_steps
from tfdist.models import build_model
from tfdist.parallel import registry
from tfdist.storage import check_writable_directory
from tfdist.strategies import check_tpu_node_paths, tpu_node_address
from tfdist.strategies.defaults import needs_static_shapes
from tfdist.training import chain
from tfdist.training.checkpoints import MUST_MATCH, StepCheckpoint, check_resume_settings
from tfdist.training.report import RunRecord, TrainResult

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
        self.cluster = cluster
        self.is_chief = cluster.is_chief if cluster is not None else True
        self.plan = plan_batches(strategy, config.global_batch_size)
        self._check_modes_and_paths()
        self._prepare_data()
        settings = self._check_resume()
        self._build_model_and_optimizer()
        self.callbacks = [
            StepCheckpoint(
                config.model_dir,
                every_n_steps=config.checkpoint_every,
                max_to_keep=config.max_checkpoints,
                settings=settings,
            ),
            RunRecord(config.model_dir, global_batch_size=config.global_batch_size),
        ]

    # --- construction, step by step -------------------------------------------------------------

    def _check_modes_and_paths(self) -> None:
        """The modes against the per-replica batch, and every path before it is used."""
        config, strategy = self.config, self.strategy
        # The data is a dataset_fn of per-replica batches, which fit cannot measure.
        chain.check_batch(
            registry.chain(config.mode_options(), (), model=None),
            self.plan.per_replica_batch_size,
        )
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

    def _prepare_data(self) -> None:
        """The dataset (written as TFRecords where it must be), and the epoch's length."""
        config = self.config
        # TPUs compile a program per input shape, so evaluation pads its last batches.
        self.static_shapes = needs_static_shapes(self.strategy)
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
        if self.is_chief:
            log.info(
                "%s; %d steps per epoch x %d epochs; %s on %s (%d training examples)",
                self.plan.describe(), self.steps_per_epoch, config.epochs, config.model,
                config.dataset, train_examples,
            )  # fmt: skip

    def _check_resume(self) -> dict | None:
        """The settings this run's checkpoints are written under (None without a
        model_dir), checked against those of the run it resumes."""
        config, cluster = self.config, self.cluster
        if config.model_dir is None:
            return None
        modes = registry.resume_settings(config.mode_options())
        settings = {
            "model": config.model, "dataset": _comparable(config.dataset),
            "optimizer": config.optimizer, "mixed_precision": config.mixed_precision,
            "global_batch_size": config.global_batch_size, **modes,
            "steps_per_epoch": self.steps_per_epoch,
            "workers": cluster.num_workers if cluster is not None else 1,
            "replicas": self.strategy.num_replicas_in_sync,
        }  # fmt: skip
        check_resume_settings(config.model_dir, settings, must_match=[*MUST_MATCH, *modes])
        return settings

    def _build_model_and_optimizer(self) -> None:
        """The model, under the strategy and the run's dtype policy, and its optimizer."""
        config = self.config
        with self.strategy.scope():
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
            self.optimizer = build_optimizer(config, schedule)

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

    def validation_fn(self, context: tf.distribute.InputContext) -> tf.data.Dataset:
        """(image, label[, weight]) test batches for validation: padding weighs nothing."""
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

    # --- the run ------------------------------------------------------------------------------

    def compile(self) -> None:
        """Compiles the model for this run (the evaluator task compiles it alike)."""
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
            self.record.eval_loss = "xent" if self.static_shapes else "loss"
            self.model.compile(
                optimizer=self.optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=metrics,
                weighted_metrics=weighted,
                # 'auto' is tfdist.fit's to choose (fit below).
                steps_per_execution=self.config.steps_per_execution
                if isinstance(self.config.steps_per_execution, int)
                else 1,
            )

    def evaluate(self) -> dict[str, float]:
        """eval_loss, eval_accuracy of the model as it stands, on every test example once."""
        return self.record.eval_metrics(self._evaluation_logs())

    def _evaluation_logs(self) -> dict[str, float]:
        """tfdist.evaluate's logs (loss, accuracy) of the model as it stands."""
        return fit_module.evaluate(
            self.model, self.validation_fn, verbose=0, return_dict=True, strategy=self.strategy
        )

    @property
    def checkpoint(self) -> StepCheckpoint:
        return self.callbacks[0]

    @property
    def record(self) -> RunRecord:
        return self.callbacks[1]

    def fit(self) -> TrainResult:
        """Trains to `config.epochs`, resuming from the newest checkpoint; see `train()`."""
        self.compile()
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
            validation_data=self.validation_fn,
            validation_freq=validation_freq,
            callbacks=self.callbacks,
            # Keras's bar on the chief, where it can redraw in place (it reads the chief's own
            # replicas' logs: no collective); in a log file Keras's line an epoch (verbose=2,
            # which also keeps tfdist.fit's own lines: verbose=0 would quiet them).
            verbose=1 if self.is_chief and sys.stdout.isatty() else 2,
            strategy=self.strategy,
            steps_per_execution=self.config.steps_per_execution,
            **self.config.mode_options(),
        )
        if self.record.trained:
            return self.record.result
        # Nothing left to train: the record so far, evaluated where the run stands.
        log.info("Already trained all %d steps; nothing to do", self.total_steps)
        # finish() names the logs eval_ itself (evaluate()'s were named eval_eval_, and lost).
        return self.record.finish(self._evaluation_logs(), step=self.checkpoint.restored_step)


def _comparable(dataset: str) -> str:
    """The dataset's name, with a local tfrecord:DIR made absolute (a resume from another
    working directory, or with a trailing slash, names the same data)."""
    if dataset.startswith(TFRECORD_PREFIX) and "://" not in dataset:
        return TFRECORD_PREFIX + os.path.abspath(dataset[len(TFRECORD_PREFIX) :])
    return dataset


__all__ = ["TrainResult", "Trainer", "train"]

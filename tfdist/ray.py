"""Ray Train as the engine that starts the workers: `tfdist.fit` as a TensorflowTrainer's loop.

Ray Train's `TensorflowTrainer` starts one process per worker — on a laptop in an embedded
local Ray cluster, on a Ray cluster or KubeRay on its nodes — sets each one's TF_CONFIG and
runs your training function in all of them. What that function must then run is multi-worker
Keras code, which Keras 3's `model.fit` cannot train. `tfdist.ray.fit` is that code:

    import ray.train
    from ray.train.tensorflow import TensorflowTrainer

    import tfdist.ray

    def train_loop(config):
        tfdist.ray.fit(build_and_compile_model, make_dataset, epochs=config["epochs"])

    trainer = TensorflowTrainer(
        train_loop,
        train_loop_config={"epochs": 3},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name="digits", storage_path="/tmp/ray_results"),
    )
    result = trainer.fit()  # result.checkpoint: the weights and optimizer state, per epoch

On every worker it builds the strategy from the TF_CONFIG Ray set, builds and compiles your
model in its scope, resumes from Ray Train's latest checkpoint when there is one (weights,
optimizer state and epoch: a run Ray restarts after a failure, or a new trainer with the same
`RunConfig(name, storage_path)`, goes on from there), trains with `tfdist.fit` and at each
epoch's end reports the epoch's logs and a checkpoint with `ray.train.report`. Every worker
reports (Ray requires it); only worker 0's checkpoint files reach Ray's storage.

Outside a Ray Train worker (`python my_train.py`, or `tfdist-launch --workers 2 -- python
my_train.py`) the same call is `tfdist.fit` with the strategy TF_CONFIG asks for, without
reporting: one training function runs on a laptop, under tfdist's launcher and on Ray.

It talks to Ray Train V2, the default of Ray 2.60 (tested with Ray 2.60 and TensorFlow 2.21).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

try:
    import ray.train
except ImportError as e:  # the optional extra is not installed
    raise ImportError(
        'tfdist.ray needs Ray Train, an optional extra: pip install "tfdist[ray]" '
        f"(which installs ray[train]). Importing ray.train failed: {e}"
    ) from e

import keras
import tensorflow as tf

import tfdist
from tfdist.errors import FitError
from tfdist.strategies.registry import check_joins_processes

log = logging.getLogger(__name__)

# What a checkpoint of tfdist.ray.fit holds: the model's weights with its optimizer's state
# (Keras's .weights.h5 format) and the training state beside them.
WEIGHTS_FILE = "model.weights.h5"
STATE_FILE = "tfdist_state.json"


def in_ray_train_worker() -> bool:
    """Whether this process is a worker of a Ray Train run (inside `trainer.fit()`)."""
    try:
        ray.train.get_context()
    except RuntimeError:  # Ray Train V2 refuses its context outside a training worker
        return False
    return True


def fit(
    build_model: Callable[[], keras.Model],
    x: Any = None,
    y: Any = None,
    *,
    strategy: str | tf.distribute.Strategy = "auto",
    checkpoint_every: int = 1,
    **fit_kwargs: Any,
) -> keras.callbacks.History:
    """Trains the model `build_model` makes with `tfdist.fit`, reporting to Ray Train.

    Call it in a `TensorflowTrainer`'s training function: every worker calls it alike.
    `build_model` is a function, not a model, because the strategy comes first: a
    MultiWorkerMirroredStrategy must be built before TensorFlow runs anything, and the model
    must be created in its scope. For the same reason give a tf.data dataset as a function
    of no arguments that makes it (called once the strategy is built), or as a
    `dataset_fn(input_context)`, or as `tfdist.ray.dataset_shard(...)` for Ray Data.

    Example:

        def train_loop(config):
            history = tfdist.ray.fit(
                build_and_compile_model,              # () -> a compiled keras.Model
                lambda: make_dataset(global_batch),   # batched with the GLOBAL batch
                epochs=config["epochs"],
                steps_per_epoch=70,
                verbose=2,
            )
            model = history.model                     # trained, on every worker

    Args:
      build_model: a function of no arguments returning a compiled keras.Model; it is
        called inside the strategy's scope.
      x: the training data, in any form `tfdist.fit` takes (a tf.data.Dataset batched with
        the global batch, a dataset_fn(input_context), arrays), or a function of no
        arguments returning one; `tfdist.ray.dataset_shard(...)` reads a Ray Data shard.
      y: labels, when `x` is arrays.
      strategy: a strategy name for `tfdist.build_strategy` ("auto" reads the TF_CONFIG Ray
        Train set: multi_worker_mirrored for 2+ workers), or a strategy already built.
      checkpoint_every: report a checkpoint every this many epochs, and after the last one
        (0: metrics only, never a checkpoint).
      **fit_kwargs: the keywords of `tfdist.fit` (epochs, steps_per_epoch, callbacks,
        validation_data, which may also be a function of no arguments, verbose, ...).

    Returns:
      The History of `tfdist.fit` (`history.model` is the trained model). After a resume
      it holds the epochs trained since.

    Raises:
      FitError: `build_model` is not a model-building function, the strategy does not span
        Ray Train's workers, a checkpoint is not one of tfdist.ray's, or `tfdist.fit`
        refused the model, the data or an argument (the message says why).
    """
    _check_builder(build_model)
    if (
        not isinstance(checkpoint_every, int)
        or isinstance(checkpoint_every, bool)
        or checkpoint_every < 0
    ):
        raise FitError(
            "checkpoint_every must be a whole number of epochs >= 0 (0: never). "
            f"Received: checkpoint_every={checkpoint_every!r}"
        )
    reporting = in_ray_train_worker()
    if isinstance(strategy, str):
        strategy = tfdist.build_strategy(strategy)
    if reporting:
        _check_spans_workers(strategy)
    with strategy.scope():
        model = build_model()
    if not isinstance(model, keras.Model):
        raise FitError(
            "build_model must return a compiled keras.Model. "
            f"Received: {getattr(build_model, '__name__', build_model)!r} returned "
            f"{type(model).__name__}"
        )
    x = _made(x)
    if "validation_data" in fit_kwargs:
        fit_kwargs["validation_data"] = _made(fit_kwargs["validation_data"])
    if not reporting:
        log.info("Not in a Ray Train worker: training with tfdist.fit, reporting nothing")
        return tfdist.fit(model, x, y, strategy=strategy, **fit_kwargs)

    # The chief of the job Ray Train's TF_CONFIG describes (worker 0): the one that reports
    # checkpoints for the run.
    reporter = _Reporter(is_chief=tfdist.is_chief(), checkpoint_every=checkpoint_every)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        reporter.restore_from(checkpoint)
    callbacks = [*(fit_kwargs.pop("callbacks", None) or []), reporter]
    try:
        return tfdist.fit(model, x, y, strategy=strategy, callbacks=callbacks, **fit_kwargs)
    finally:
        reporter.remove_copy()  # if fit stopped before reading it


def dataset_shard(
    name: str = "train",
    *,
    feature_columns: str | list[str],
    label_columns: str | list[str],
    global_batch_size: int,
    **to_tf_kwargs: Any,
) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """This worker's shard of a Ray Dataset, as the `dataset_fn` `tfdist.fit` takes.

    The trainer splits each dataset of `TensorflowTrainer(datasets={name: ...})` over its
    workers; each worker's shard feeds its replicas batches of `global_batch_size /
    replicas` rows (Ray's `DataIterator.to_tf`), so each step trains `global_batch_size`
    rows in all, as with a tf.data dataset batched with the global batch.

    Example:

        trainer = TensorflowTrainer(train_loop, datasets={"train": ray.data.from_items(rows)},
                                    scaling_config=ray.train.ScalingConfig(num_workers=2))

        def train_loop(config):
            data = tfdist.ray.dataset_shard("train", feature_columns="x", label_columns="y",
                                            global_batch_size=64)
            tfdist.ray.fit(build_and_compile_model, data, epochs=3)

    Args:
      name: the key of the dataset in the trainer's `datasets`.
      feature_columns: the model's input column(s), as for `to_tf`.
      label_columns: the label column(s), as for `to_tf`.
      global_batch_size: rows per step over all replicas of all workers.
      **to_tf_kwargs: more keywords of `ray.data.DataIterator.to_tf` (feature_type_spec,
        drop_last, local_shuffle_buffer_size, ...).

    Returns:
      A function of the tf.distribute.InputContext returning per-replica batches.

    Raises:
      FitError: `global_batch_size` is not a positive whole number, or does not divide by
        the replicas in sync; or the function is called outside a Ray Train worker.
    """
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise FitError(
            "global_batch_size must be a positive whole number. "
            f"Received: global_batch_size={global_batch_size!r}"
        )
    if "batch_size" in to_tf_kwargs:
        raise FitError(
            "dataset_shard derives to_tf's batch_size from global_batch_size and the replicas "
            f"in sync; pass global_batch_size only. Received: batch_size={to_tf_kwargs['batch_size']!r}"
        )

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        replicas = context.num_replicas_in_sync
        if global_batch_size % replicas:
            raise FitError(
                f"global_batch_size={global_batch_size} does not split evenly over the "
                f"{replicas} replicas in sync; use a multiple of {replicas}. "
                f"Received: global_batch_size={global_batch_size}"
            )
        if not in_ray_train_worker():
            raise FitError(
                f"dataset_shard({name!r}) reads this worker's shard of a Ray Dataset, which "
                "exists only inside a Ray Train worker: pass the dataset to "
                f"TensorflowTrainer(datasets={{{name!r}: ...}}) and call tfdist.ray.fit in its "
                "training function. Outside Ray, give tfdist.ray.fit a tf.data dataset."
            )
        shard = ray.train.get_dataset_shard(name)
        return shard.to_tf(
            feature_columns,
            label_columns,
            batch_size=global_batch_size // replicas,
            **to_tf_kwargs,
        )

    return dataset_fn


def read_state(checkpoint_dir: str) -> dict[str, Any]:
    """The training state of a checkpoint tfdist.ray.fit reported (`{"epoch": 3, ...}`).

    Args:
      checkpoint_dir: a local directory holding the checkpoint, e.g. from
        `result.checkpoint.as_directory()`; its model weights are in `WEIGHTS_FILE`.

    Raises:
      FitError: the directory holds no checkpoint of tfdist.ray.fit.
    """
    return _read_state(checkpoint_dir, where=checkpoint_dir)


def _read_state(directory: str, *, where: str) -> dict[str, Any]:
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    if WEIGHTS_FILE not in names or STATE_FILE not in names:
        raise FitError(
            f"Ray Train's checkpoint {where} is not one of tfdist.ray.fit's, which "
            f"hold {WEIGHTS_FILE} and {STATE_FILE}: resume with the training function that "
            "reported it, or give this run another RunConfig(name=...) to start afresh. "
            f"Received: files {names}"
        )
    with open(os.path.join(directory, STATE_FILE)) as f:
        return json.load(f)


class _Reporter(keras.callbacks.Callback):
    """Restores Ray Train's checkpoint before the first step; reports every epoch's end.

    Attributes:
      restored_epoch: epochs the restored checkpoint had completed (0: none). tfdist.fit
        resumes after them, and continues the data where an uninterrupted run would be.
    """

    def __init__(self, *, is_chief: bool, checkpoint_every: int):
        super().__init__()
        self.is_chief, self.checkpoint_every = is_chief, checkpoint_every
        self.restored_epoch = 0
        self._restore_dir: str | None = None
        self._state: dict[str, Any] = {}

    def restore_from(self, checkpoint: ray.train.Checkpoint) -> None:
        # A private copy: the directory Ray keeps may be deleted (CheckpointConfig's
        # num_to_keep) while this run trains, and the weights are read only once the model
        # and its optimizer are built, in on_train_begin.
        self._restore_dir = checkpoint.to_directory(tempfile.mkdtemp(prefix="tfdist-ray-"))
        try:
            self._state = _read_state(self._restore_dir, where=checkpoint.path)
        except FitError:
            self.remove_copy()
            raise

    def on_train_begin(self, logs=None):
        if self._restore_dir is None:
            return
        try:
            self.model.load_weights(os.path.join(self._restore_dir, WEIGHTS_FILE))
        except ValueError as e:
            raise FitError(
                "Ray Train's latest checkpoint does not fit the model build_model made (was "
                "the model changed since it was reported?). Give this run another "
                f"RunConfig(name=...) to start afresh. Keras said: {e}"
            ) from None
        finally:
            self.remove_copy()
        self.restored_epoch = int(self._state["epoch"])
        log.info("Resuming from Ray Train's checkpoint after epoch %d", self.restored_epoch)

    def remove_copy(self) -> None:
        if self._restore_dir is not None:
            shutil.rmtree(self._restore_dir, ignore_errors=True)
            self._restore_dir = None

    def on_epoch_end(self, epoch, logs=None):
        done = epoch + 1
        metrics = {name: float(value) for name, value in (logs or {}).items() if _is_number(value)}
        metrics["epoch"] = done
        every = self.checkpoint_every
        if not every or (done % every and done != self.params.get("epochs")):
            ray.train.report(metrics)
            return
        # Every worker saves, as tf.distribute asks (a save may read every worker's part of a
        # variable), but only worker 0 hands its directory to Ray; the others' copies are
        # removed with their temporary directory.
        with tempfile.TemporaryDirectory(prefix="tfdist-ray-") as directory:
            self.model.save_weights(os.path.join(directory, WEIGHTS_FILE))
            if not self.is_chief:
                ray.train.report(metrics, checkpoint=None)
                return
            state = {"epoch": done, "steps_per_epoch": self.params.get("steps")}
            with open(os.path.join(directory, STATE_FILE), "w") as f:
                json.dump(state, f)
            # Synchronous upload (Ray's default): the files are in storage when this returns.
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _made(data: Any) -> Any:
    """`data`, or what it returns if it is a function of no parameters (a data maker)."""
    if not callable(data) or isinstance(data, tf.data.Dataset):
        return data
    try:
        parameters = inspect.signature(data).parameters
    except (TypeError, ValueError):
        return data  # a builtin or a callable object: tfdist.fit tells what it makes of it
    return data() if not parameters else data


def _check_builder(build_model) -> None:
    if isinstance(build_model, keras.Model):
        raise FitError(
            "tfdist.ray.fit takes a function that builds and compiles the model, not a model: "
            "it calls it in the scope of the strategy it builds first (a multi-worker "
            "strategy must exist before TensorFlow runs anything). Pass e.g. "
            f"`lambda: make_model()`. Received: the model {build_model.name!r}"
        )
    if not callable(build_model):
        raise FitError(
            "build_model must be a function of no arguments returning a compiled keras.Model. "
            f"Received: {type(build_model).__name__}"
        )


def _check_spans_workers(strategy: tf.distribute.Strategy) -> None:
    check_joins_processes(
        strategy,
        processes=ray.train.get_context().get_world_size(),
        started_by="Ray Train",
        error=FitError,
    )

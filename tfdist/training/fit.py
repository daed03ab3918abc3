"""`tfdist.fit` and `tfdist.evaluate`: Keras's fit/evaluate for any compiled Keras 3 model,
under every tf.distribute strategy — multi_worker_mirrored and parameter_server included,
where Keras 3's own `model.fit` fails ("Attempt to convert a value (PerReplica...").

    strategy = tfdist.build_strategy("auto")
    with strategy.scope():
        model = build_and_compile_model()  # plain Keras: model.compile(optimizer, loss, metrics)
    history = tfdist.fit(model, dataset, epochs=3, steps_per_epoch=70, validation_data=val,
                         callbacks=[keras.callbacks.BackupAndRestore("/tmp/backup")])
    results = tfdist.evaluate(model, val, return_dict=True)

Keyword names and meanings follow `keras.Model.fit` / `evaluate`. Everything `compile` holds is
honoured, because the model's own `train_step` / `test_step` run (on parameter_server, the
same loss, metrics and optimizer through Keras's stateless metric API): the optimizer with its
schedule, clipping and loss scaling, any loss and `loss_weights`, `metrics` and
`weighted_metrics`, regularisation losses, several inputs and outputs, sample weights, and
`steps_per_execution`.

The logs every worker's callbacks see are those of the whole step — every replica and
worker — so callbacks that decide (EarlyStopping, TerminateOnNaN, ReduceLROnPlateau) decide
the same on every worker; only the chief writes files (see fit_callbacks.py).
"""

from __future__ import annotations

import difflib
import logging
from typing import Any

import keras
import tensorflow as tf

from tfdist import signals
from tfdist.cluster import cluster_from_environment
from tfdist.data.distribute import first_description, plan_batches
from tfdist.training import fit_callbacks
from tfdist.training.fit_data import FitData, FitError, make_fit_data, split_arrays, unpack
from tfdist.training.fit_runners import CentralStorageRunner, ParameterServerRunner, SyncRunner
from tfdist.training.sharded import ShardedTraining

log = logging.getLogger(__name__)

_FIT_KEYWORDS = (
    "x", "y", "batch_size", "epochs", "verbose", "callbacks", "validation_data", "shuffle",
    "validation_split", "class_weight", "sample_weight", "initial_epoch", "steps_per_epoch",
    "validation_steps", "validation_batch_size", "validation_freq", "strategy",
)  # fmt: skip
_EVALUATE_KEYWORDS = (
    "x", "y", "batch_size", "verbose", "sample_weight", "steps", "callbacks", "return_dict",
    "strategy",
)  # fmt: skip


def fit(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    *,
    batch_size: int | None = None,
    epochs: int = 1,
    verbose: int | str = "auto",
    callbacks: list[keras.callbacks.Callback] | None = None,
    validation_split: float = 0.0,
    validation_data: Any = None,
    shuffle: bool = True,
    class_weight: dict[int, float] | None = None,
    sample_weight: Any = None,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_batch_size: int | None = None,
    validation_freq: int | list[int] = 1,
    strategy: tf.distribute.Strategy | None = None,
    **unknown: Any,
) -> keras.callbacks.History:
    """Trains a compiled Keras model under its tf.distribute strategy, as `model.fit` would.

    The arguments after `model` mean what they mean for `keras.Model.fit`, with these forms
    of data: a tf.data.Dataset batched with the GLOBAL batch (tfdist splits each batch over
    the replicas and shards the data over the workers); a `dataset_fn(input_context)` that
    returns PER-REPLICA batches; or arrays (dicts, lists) with `batch_size`, the global
    batch. Under parameter_server every worker streams its own copy of the data (shuffle it)
    and `steps_per_epoch` is required unless the data's length is known.

    A BackupAndRestore callback resumes exactly where its last backup was taken, mid-epoch
    too: tfdist skips the batches already trained (keep the data order deterministic).

    Example:

        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        history = tfdist.fit(model, dataset, epochs=2)

    Args:
      model: a Keras model compiled under `strategy.scope()` (or under none, for one device).
      strategy: the strategy to train under; default: the one the model was created under.
      (the rest: as for keras.Model.fit)

    Returns:
      The History callback, as keras.Model.fit returns it (`history.history`: epoch logs).

    Raises:
      FitError: the model, the data or an argument cannot train (the message says why).
    """
    _reject_unknown("fit", unknown, _FIT_KEYWORDS)
    strategy = _checked_model(model, strategy, "fit")
    _check_count("epochs", epochs, minimum=0)
    _check_count("initial_epoch", initial_epoch, minimum=0)
    for name, value in (
        ("steps_per_epoch", steps_per_epoch),
        ("validation_steps", validation_steps),
    ):
        if value is not None:
            _check_count(name, value, minimum=1)
    is_ps = _is_parameter_server(strategy)
    if validation_split and validation_data is None:
        # Keras's rule: the last examples, before shuffling; validation_data overrides it.
        (x, y, sample_weight), validation_data = split_arrays(x, y, sample_weight, validation_split)
    data = make_fit_data(
        x, y, sample_weight=sample_weight, batch_size=batch_size, shuffle=shuffle,
        strategy=strategy, for_training=True,
    )  # fmt: skip
    if class_weight is not None:
        data = data.class_weighted(class_weight)
    val = None
    if validation_data is not None:
        val = _validation(validation_data, validation_batch_size or batch_size, strategy)
    _check_labels(model, data, "x")
    _build(model, strategy, data)
    is_chief = strategy.extended.should_checkpoint
    if data.global_batch is not None:
        plan = plan_batches(strategy, data.global_batch)
        if first_description(strategy, plan) and is_chief:
            log.info("%s", plan.describe())

    steps = steps_per_epoch or data.num_batches
    if is_ps and steps is None:
        raise FitError(
            "parameter_server training streams each worker's data without end, so an epoch "
            "needs a length: pass steps_per_epoch (e.g. examples // global batch). "
            "Received: steps_per_epoch=None with data of unknown length"
        )
    runner = _runner_for(model, strategy)
    callbacks = list(callbacks or [])
    if is_ps:
        _warn_batch_hooks_under_ps(callbacks)
    progress_bar = verbose != 0 and is_chief
    workers = _sync_workers(strategy)
    # Reading batch logs is collective across workers, so they must all do it or none: a
    # callback only some workers were given counts for all.
    with_batch_logs = _any_worker(
        strategy, workers, fit_callbacks.needs_batch_logs(callbacks, progress_bar=verbose != 0)
    )

    with (
        signals.doing(f"training in tfdist.fit (epochs {initial_epoch + 1}-{epochs})"),
        fit_callbacks.writes_redirected(callbacks, is_chief=is_chief) as redirect,
    ):
        callback_list = keras.callbacks.CallbackList(
            callbacks, add_history=True, add_progbar=progress_bar, verbose=verbose,
            epochs=epochs, steps=steps, model=model,
        )  # fmt: skip
        model.stop_training = False
        callback_list.on_train_begin()
        redirect.after_restore()
        start_epoch, start_step = _resume_point(model, initial_epoch, steps, callbacks)
        runner.begin(
            start_epoch * steps + start_step if steps else int(model.optimizer.iterations.numpy()),
            total_steps=epochs * steps if steps else None,
            checkpoint_status=_checkpoint_status(callbacks),
        )
        loop = _Loop(
            model=model, runner=runner, data=data, steps=steps, user_steps=steps_per_epoch,
            callbacks=callback_list, with_batch_logs=with_batch_logs, workers=workers,
            strategy=strategy, is_ps=is_ps, first_epoch=initial_epoch,
        )  # fmt: skip
        training_logs = None
        for epoch in range(start_epoch, epochs):
            epoch_logs = loop.epoch(epoch, start_step if epoch == start_epoch else 0)
            if val is not None and model._should_eval(epoch, validation_freq):
                callback_list.on_test_begin()
                val_logs = runner.evaluate(val, validation_steps)
                callback_list.on_test_end(val_logs)
                epoch_logs.update({f"val_{name}": value for name, value in val_logs.items()})
            callback_list.on_epoch_end(epoch, epoch_logs)
            training_logs = epoch_logs
            if loop.stopping():
                break
        if isinstance(model.optimizer, keras.optimizers.Optimizer) and epochs > 0:
            model.optimizer.finalize_variable_values(model.trainable_weights)
        callback_list.on_train_end(logs=training_logs)
    return model.history


def evaluate(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    *,
    batch_size: int | None = None,
    verbose: int | str = "auto",
    sample_weight: Any = None,
    steps: int | None = None,
    callbacks: list[keras.callbacks.Callback] | None = None,
    return_dict: bool = False,
    strategy: tf.distribute.Strategy | None = None,
    **unknown: Any,
) -> float | list[float] | dict[str, float]:
    """Evaluates a compiled Keras model under its strategy, as `model.evaluate` would.

    Every example counts once, over every replica and worker; the data forms are those of
    `fit`. Returns the loss (and metrics) as a scalar, a list in `model.metrics_names` order,
    or, with `return_dict=True`, a dict.
    """
    _reject_unknown("evaluate", unknown, _EVALUATE_KEYWORDS)
    strategy = _checked_model(model, strategy, "evaluate")
    if steps is not None:
        _check_count("steps", steps, minimum=1)
    data = make_fit_data(
        x, y, sample_weight=sample_weight, batch_size=batch_size, strategy=strategy
    )
    _check_labels(model, data, "x")
    _build(model, strategy, data)
    runner = _runner_for(model, strategy)
    is_chief = strategy.extended.should_checkpoint
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_progbar=verbose != 0 and is_chief, verbose=verbose, epochs=1,
        steps=steps or data.num_batches, model=model,
    )  # fmt: skip
    callback_list.on_test_begin()
    with signals.doing("evaluating in tfdist.evaluate"):
        logs = runner.evaluate(data, steps)
    callback_list.on_test_end(logs)
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


class _Loop:
    """The epoch loop of one fit call: steps, batch callbacks and the stop decision."""

    def __init__(
        self, *, model, runner, data: FitData, steps, user_steps, callbacks, with_batch_logs,
        workers, strategy, is_ps, first_epoch,
    ):  # fmt: skip
        self.model, self.runner, self.data = model, runner, data
        self.steps, self.user_steps = steps, user_steps
        self.callbacks, self.with_batch_logs = callbacks, with_batch_logs
        self.workers, self.strategy, self.is_ps = workers, strategy, is_ps
        self.first_epoch = first_epoch
        self.per_call = max(1, int(model.steps_per_execution))
        self.iterator = None
        self.pass_position = 0
        # Steps are run without asking for the end of the data when its length is known:
        # parameter-server data and repeated data never end, and a known number of batches
        # per epoch bounds each pass (asking costs a collective per step across workers).
        self.bounded = (
            is_ps
            or data.infinite
            or (
                user_steps is None
                and data.num_batches is not None
                and (data.form == "dataset" or workers == 1)
            )
        )

    def _iterator_for(self, epoch: int, skip: int):
        if self.is_ps:
            return self.runner.per_worker_iterator(self.data)
        if self.user_steps is None:  # each epoch is one pass over the data (Keras's rule)
            return iter(self.data.distribute(self.strategy, skip=skip))
        # With steps_per_epoch the data is one stream across epochs, as in Keras: a pass
        # that runs out ends its epoch early, and the next epoch starts a new pass.
        if self.iterator is None:
            position = (epoch - self.first_epoch) * self.user_steps + skip
            if self.data.num_batches:
                position %= self.data.num_batches
            self.pass_position = position
            self.iterator = iter(self.data.distribute(self.strategy, skip=position))
        return self.iterator

    def epoch(self, epoch: int, start_step: int) -> dict[str, float]:
        self.runner.reset()
        self.callbacks.on_epoch_begin(epoch)
        iterator = self._iterator_for(epoch, start_step)
        step = start_step
        while self.steps is None or step < self.steps:
            n = self.per_call if self.steps is None else min(self.per_call, self.steps - step)
            self.callbacks.on_train_batch_begin(step)
            done, logs = self.runner.train(
                iterator, n, bounded=self.bounded, with_logs=self.with_batch_logs
            )
            if done:
                step += done
                self.callbacks.on_train_batch_end(step - 1, logs)
            if done < n:  # the data ran out
                if self.user_steps is not None:
                    self.iterator = None
                    log.warning(
                        "The training data ran out in epoch %d after %d of %d steps: the "
                        "epoch ends there and the next one starts a new pass (as in Keras). "
                        "Give the data steps_per_epoch x epochs batches, e.g. with .repeat().",
                        epoch + 1, step, self.steps,
                    )  # fmt: skip
                break
            if self.with_batch_logs and self._agreed_stop():
                break
        if self.steps is None:
            self.steps = step  # a first whole pass tells the length of an epoch
        if self.iterator is not None:
            self.pass_position += step - start_step
            if self.data.num_batches and self.pass_position >= self.data.num_batches:
                self.iterator = None
        self.runner.finish_epoch()
        return self.runner.logs()

    def _agreed_stop(self) -> bool:
        # Callbacks decide on the same reduced logs everywhere; the agreement also covers a
        # decision only one worker took, which would otherwise leave the others waiting.
        stop = _any_worker(self.strategy, self.workers, bool(self.model.stop_training))
        self.model.stop_training = stop
        return stop

    def stopping(self) -> bool:
        return self._agreed_stop()


# --- checks at the boundary -------------------------------------------------------------------


def _reject_unknown(function: str, unknown: dict, known: tuple[str, ...]) -> None:
    if not unknown:
        return
    name = sorted(unknown)[0]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean `{close[0]}`?)" if close else ""
    raise FitError(
        f"tfdist.{function} got an unknown keyword `{name}`{hint}. It takes the keywords of "
        f"keras.Model.{function}: {', '.join(known)}. Received: {name}={unknown[name]!r}"
    )


def _checked_model(model, strategy, function: str) -> tf.distribute.Strategy:
    if not isinstance(model, keras.Model):
        raise FitError(
            f"tfdist.{function} trains a keras.Model. Received: model of type {type(model).__name__}"
        )
    if not model.compiled:
        raise FitError(
            f"Model {model.name!r} is not compiled: call model.compile(optimizer=..., "
            f"loss=..., metrics=...) inside strategy.scope() before tfdist.{function}."
        )
    created_under = model._distribute_strategy  # what Keras recorded when the model was made
    if strategy is None:
        if created_under is None and function == "fit":
            _refuse_a_model_of_its_own(model)
        strategy = created_under or tf.distribute.get_strategy()
    elif created_under is not strategy and not (
        created_under is None and not tf.distribute.has_strategy() and _is_default(strategy)
    ):
        where = (
            "outside any strategy's scope"
            if created_under is None
            else f"under another strategy ({type(created_under).__name__})"
        )
        raise FitError(
            f"Model {model.name!r} was created {where}, so its variables are not "
            f"{type(strategy).__name__}'s. Create and compile it inside the strategy's scope: "
            "`with strategy.scope(): model = ...; model.compile(...)`. "
            f"Received: strategy={type(strategy).__name__}"
        )
    optimizer_strategy = getattr(model.optimizer, "_distribution_strategy", None)
    if (
        optimizer_strategy is not None
        and optimizer_strategy is not strategy
        and not _is_default(strategy)
    ):
        raise FitError(
            f"Model {model.name!r} was compiled outside {type(strategy).__name__}'s scope, so "
            "its optimizer's variables are not distributed. Call model.compile(...) inside "
            "`with strategy.scope():` too."
        )
    return strategy


def _refuse_a_model_of_its_own(model) -> None:
    """A model made outside any strategy in a multi-worker job would train on its own."""
    if tf.distribute.has_strategy():
        return  # fit called inside a scope: that strategy is the model's
    cluster = cluster_from_environment()
    if cluster is None or cluster.cluster_strategy is None or cluster.is_evaluator:
        return
    raise FitError(
        f"Model {model.name!r} was created outside any strategy's scope, but this process "
        f"is {cluster.task_name} of a {cluster.cluster_strategy} job ({cluster.task_counts()}, "
        f"from {cluster.source}): it would train a model of its own, apart from the other "
        "tasks', and each would write the same files. Build the strategy first and create "
        'and compile the model inside its scope: `strategy = tfdist.build_strategy("auto")`, '
        "then `with strategy.scope(): model = ...; model.compile(...)`. "
        "Received: a model created under no strategy"
    )


def _runner_for(model, strategy):
    if _is_parameter_server(strategy):
        return ParameterServerRunner(model, strategy)
    if isinstance(strategy, tf.distribute.experimental.CentralStorageStrategy):
        return CentralStorageRunner(model, strategy)
    return SyncRunner(model, strategy)


def _is_default(strategy) -> bool:
    return strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy()


def _is_parameter_server(strategy) -> bool:
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def _sync_workers(strategy) -> int:
    """Processes that each run this loop in step (1 unless multi-worker synchronous)."""
    if _is_parameter_server(strategy):
        return 1
    return int(getattr(strategy.extended, "_num_workers", 1) or 1)


def _any_worker(strategy, workers: int, flag: bool) -> bool:
    """Whether `flag` is true on any worker (every worker must call this at the same point)."""
    if workers <= 1:
        return flag
    flags = strategy.experimental_distribute_values_from_function(
        lambda _: tf.constant(int(flag), tf.int32)
    )
    return int(strategy.reduce(tf.distribute.ReduceOp.SUM, flags, axis=None)) > 0


def _check_count(name: str, value, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise FitError(f"{name} must be a whole number >= {minimum}. Received: {name}={value!r}")


def _validation(validation_data, batch_size, strategy) -> FitData:
    if isinstance(validation_data, (tuple, list)) and not isinstance(
        validation_data, tf.data.Dataset
    ):
        if len(validation_data) not in (2, 3):
            raise FitError(
                "validation_data is a dataset, a dataset_fn, or a tuple (x_val, y_val) or "
                f"(x_val, y_val, sample_weight_val). Received: a tuple of {len(validation_data)}"
            )
        vx, vy, vw = (*validation_data, None)[:3]
        return make_fit_data(
            vx, vy, sample_weight=vw, batch_size=batch_size, strategy=strategy,
            what="validation_data",
        )  # fmt: skip
    return make_fit_data(validation_data, strategy=strategy, what="validation_data")


def _check_labels(model, data: FitData, what: str) -> None:
    _, y, _ = unpack(data.sample_batch)
    if y is None and model._compile_loss is not None:
        raise FitError(
            f"`{what}` yields inputs without labels, but the model was compiled with a loss. "
            "Give the data as (x, y) or (x, y, sample_weight) elements, or pass y=. "
            f"Received: elements of {type(data.sample_batch).__name__}"
        )


def _build(model, strategy, data: FitData) -> None:
    # Keras builds the model, its compiled metrics and losses and the optimizer's slots from
    # one batch's shapes; under the strategy's scope they become its variables. Under
    # parameter_server a partitioner may split variables across the ps tasks: the optimizer
    # is then built over their shards (sharded.py).
    if _is_parameter_server(strategy):
        ShardedTraining.attach(model, strategy, data.sample_batch)
        return
    with strategy.scope():
        model._symbolic_build(data_batch=data.sample_batch)


def _resume_point(model, initial_epoch: int, steps: int | None, callbacks) -> tuple[int, int]:
    """(epoch, steps into it) where training starts: after a restored backup if any.

    A callback with a `restored_step` attribute (tfdist's own checkpoints) gives the global
    step it restored; one with `restored_epoch` (tfdist.ray's) the number of epochs its
    checkpoint had completed. Keras's BackupAndRestore restores the weights and optimizer and
    the epoch the backup was taken in; the optimizer's iteration count then says how far into
    that epoch it was.
    """
    restored = model._initial_epoch
    model._initial_epoch = None  # consumed: a later fit call starts afresh
    for callback in callbacks:
        # A callback that restored a checkpoint of its own says at which step it was taken.
        step = getattr(callback, "restored_step", None)
        if step and steps:
            return divmod(int(step), steps)
        epoch = getattr(callback, "restored_epoch", None)
        if epoch:
            return int(epoch), 0
    if restored is None or not fit_callbacks.backups(callbacks):
        return initial_epoch, 0
    epoch = int(restored)
    if steps is None:
        return epoch, 0
    into = int(model.optimizer.iterations.numpy()) - epoch * steps
    if 0 < into < steps:
        log.info("Resuming from the backup at epoch %d, step %d of %d", epoch + 1, into, steps)
        return epoch, into
    if into == steps:  # the backup was taken after the epoch's last step, before its end
        return epoch + 1, 0
    return epoch, 0


def _checkpoint_status(callbacks):
    """A function giving (step, directory) of the newest checkpoint a callback saved, if any.

    A callback that saves checkpoints of its own may offer `checkpoint_status()`; the message
    when a parameter server dies then says where a restart resumes.
    """
    for callback in callbacks:
        if callable(getattr(callback, "checkpoint_status", None)):
            return callback.checkpoint_status
    return None


def _warn_batch_hooks_under_ps(callbacks) -> None:
    hooked = [type(c).__name__ for c in callbacks if fit_callbacks.reads_batch_logs(c)]
    if hooked:
        log.warning(
            "Under parameter_server, batch-level callbacks (%s) run on the coordinator as "
            "steps are scheduled, not as workers finish them; the logs they get are the "
            "metrics of the steps finished so far. Epoch-level hooks see every step.",
            ", ".join(hooked),
        )

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

import contextlib
import difflib
import inspect
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfdist import compat, signals
from tfdist.cluster import cluster_from_environment
from tfdist.data.pipeline import explain_data_error
from tfdist.errors import FitError, TfdistError
from tfdist.parallel import host, layout_line, registry
from tfdist.parallel.zero import units
from tfdist.strategies import strategy_kind
from tfdist.training import chain, fit_callbacks, kept
from tfdist.training.controller import Controller
from tfdist.training.data_checks import check_batch
from tfdist.training.fit_data import FitData, make_fit_data, split_arrays, unpack
from tfdist.training.hooks import StepHook
from tfdist.training.runners import mode_defaults, runner_for

log = logging.getLogger(__name__)

_FIT_KEYWORDS = (
    "x", "y", "batch_size", "epochs", "verbose", "callbacks", "validation_data", "shuffle",
    "validation_split", "class_weight", "sample_weight", "initial_epoch", "steps_per_epoch",
    "validation_steps", "validation_batch_size", "validation_freq", "strategy", "step_hooks",
    *registry.keywords(),
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
    step_hooks: Sequence[StepHook] = (),
    steps_per_execution: int | str | None = None,
    **options: Any,
) -> keras.callbacks.History:
    """Trains a compiled Keras model under its tf.distribute strategy, as `model.fit` would.

    The arguments after `model` mean what they mean for `keras.Model.fit`, with these forms
    of data: a tf.data.Dataset batched with the GLOBAL batch (tfdist splits each batch over
    the replicas and shards the data over the workers); a `dataset_fn(input_context)` that
    returns PER-REPLICA batches; or arrays (dicts, lists) with `batch_size`, the global
    batch. Under parameter_server every worker streams its own copy of the data, in an order
    of its own (arrays: fit's shuffle; a dataset_fn: shuffle with
    `tfdist.data.worker_shuffle`), and `steps_per_epoch` is required unless the data's length
    is known.

    A BackupAndRestore callback resumes exactly where its last backup was taken, mid-epoch
    too: tfdist skips the batches already trained (keep the data order deterministic).

    Example:

        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        history = tfdist.fit(model, dataset, epochs=2)

    Every argument of keras.Model.fit is taken, with its meaning; tfdist's own are these.
    `verbose=0` is quiet, as Keras's is: tfdist's lines of the call (the global batch and
    the layout, the step-time breakdown, what 'auto' chose) are logged at debug, not info;
    warnings, errors and a resume stay. `verbose=2` prints one line an epoch and keeps them.

    Args:
      model: a Keras model compiled under `strategy.scope()` (or under none, for one device).
      strategy: the strategy to train under; default: the one the model was created under.
      step_hooks: StepHooks between each step's gradients and the optimizer's update, in
        order (tfdist.StepHook: accumulation, sharded updates, corrections plug in there).
      steps_per_execution: steps run in one traced call, as compile's (the default: the
        model's); 'auto' measures the first calls and chooses the count that keeps a
        call's fixed cost near 5% (one step a call while a callback other than tfdist's
        hooks every batch). Batch-level callbacks fire once a call with its last step's
        logs, as in Keras; a call ends where StepCheckpoint's `every_n_steps` saves.
      **options: the parallel modes, by their keywords (tfdist.parallel.registry):
        {modes}

    Returns:
      The History callback, as keras.Model.fit returns it (`history.history`: epoch logs).

    Raises:
      FitError: the model, the data or an argument cannot train (the message says why).
    """
    unknown = {k: v for k, v in options.items() if k not in registry.keywords()}
    _reject_unknown("fit", unknown, _FIT_KEYWORDS)
    strategy = _checked_model(model, strategy, "fit")
    # A mode left out (or 'auto') takes what the binary's 'auto' takes under this strategy.
    options = registry.resolve_auto(options, mode_defaults(strategy))
    for problem in registry.problems(options):
        raise FitError(problem)
    _check_counts(
        steps_per_execution=steps_per_execution, epochs=epochs, initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
    )  # fmt: skip
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
    options = registry.with_model_layout(options, model=model, strategy=strategy)
    runner = _built_engine(model, strategy, data, options, step_hooks, callbacks, verbose)
    steps = steps_per_epoch or data.num_batches
    if runner.job.streams and steps is None:
        raise FitError(
            f"{strategy_kind(strategy)} training streams each worker's data without end, so "
            "an epoch needs a length: pass steps_per_epoch (e.g. examples // global batch). "
            "Received: steps_per_epoch=None with data of unknown length"
        )
    controller = Controller(
        model=model, runner=runner, data=data, validation=val, steps=steps,
        user_steps=steps_per_epoch, callbacks=list(callbacks or []),
        options=dict(
            epochs=epochs, initial_epoch=initial_epoch, verbose=verbose,
            validation_steps=validation_steps, validation_freq=validation_freq,
            steps_per_execution=steps_per_execution,
        ),
    )  # fmt: skip
    with kept.forgotten_on_error(model), _explained(runner):
        return controller.fit()


def _check_counts(
    *, steps_per_execution, epochs, initial_epoch, steps_per_epoch, validation_steps
) -> None:
    """fit's counts, each refused in one line where it cannot be one."""
    if steps_per_execution not in (None, "auto") and not (
        isinstance(steps_per_execution, int) and steps_per_execution >= 1
    ):
        raise FitError(
            "steps_per_execution must be a whole number >= 1 or 'auto'. Received: "
            f"steps_per_execution={steps_per_execution!r}"
        )
    _check_count("epochs", epochs, minimum=0)
    _check_count("initial_epoch", initial_epoch, minimum=0)
    for name, value in (
        ("steps_per_epoch", steps_per_epoch),
        ("validation_steps", validation_steps),
    ):
        if value is not None:
            _check_count(name, value, minimum=1)


def _built_engine(model, strategy, data, options, step_hooks, callbacks, verbose):
    """The engine that trains this call, built: the chain of hooks `options` and the user's
    `step_hooks` make, checked; the engine the last call kept where nothing its traced step
    closes over changed (kept.py), else a new one; and the chief's lines saying how the
    batch splits and what sits between the gradients and the update."""
    layout = registry.runner_factory_of(options)
    settings = registry.factory_settings(options)  # what the layout takes over
    user_hooks = chain.check_hooks(step_hooks)
    hooks = registry.chain(options, user_hooks, model=model)
    host.check_trained_by(model, layout, hooks)
    chain.check_chain(hooks)
    if data.global_batch is not None:
        chain.check_batch(hooks, data.global_batch // strategy.num_replicas_in_sync)
    chain.check_callbacks(hooks, callbacks)
    runner, hooks, _ = kept.runner_for_call(
        model, strategy,
        lambda: runner_for(model, strategy, layout=layout, settings=settings), hooks,
        user_hooks=user_hooks, layout=layout if layout is None else (repr(layout), repr(settings)),
    )  # fmt: skip
    with kept.forgotten_on_error(model):
        runner.build(data.sample_batch, hooks)
    say = log.debug if verbose == 0 else log.info  # verbose=0 is quiet, as Keras's fit is
    if runner.job.is_chief:
        if data.global_batch is not None:
            line = layout_line.batch_line(runner, data.global_batch)
            trained = layout_line.trained_as(model, runner, options)
            say("%s", line if trained is None else f"{line}; {trained}")
        named = [hook.name for hook in hooks]
        if named:
            say("Between each step's gradients and its update: %s", ", ".join(named))
    return runner


fit.__doc__ = registry.fill_docstring(fit.__doc__)
fit.__signature__ = inspect.signature(fit).replace(
    parameters=[
        *(p for p in inspect.signature(fit).parameters.values() if p.kind != p.VAR_KEYWORD),
        *(
            inspect.Parameter(
                m.keyword,
                inspect.Parameter.KEYWORD_ONLY,
                default=registry.AUTO if m.auto else m.default,
            )
            for m in registry.MODES
            if m.keyword
        ),
    ]
)


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
    runner, _, built = kept.runner_for_call(
        model, strategy, lambda: runner_for(model, strategy), None
    )
    if not built:
        with kept.forgotten_on_error(model):
            runner.build(data.sample_batch)
    callback_list = fit_callbacks.callback_list(
        callbacks, add_progbar=verbose != 0 and runner.job.is_chief, verbose=verbose, epochs=1,
        steps=steps or data.num_batches, model=model,
    )  # fmt: skip
    callback_list.on_test_begin()
    evaluating = signals.doing("evaluating in tfdist.evaluate")
    with evaluating, kept.forgotten_on_error(model), _explained(runner):
        logs = runner.evaluate(data, steps)
    callback_list.on_test_end(logs)
    if return_dict:
        return logs
    return compat.metrics_in_order(model, logs)


@contextlib.contextmanager
def _explained(runner) -> Iterator[None]:
    """The runner's failures (a lost peer, a dead ps) and a tfdist pipeline's data errors (a
    truncated TFRecord) as tfdist's one-line errors."""
    try:
        with runner.job.explained():
            yield
    except tf.errors.InvalidArgumentError as e:
        explained = explain_data_error(e)
        if explained is None:
            raise
        raise explained from None
    except Exception as e:
        # A mode that refuses what it finds while the step is traced raises tfdist's error
        # there; autograph wraps it in a StagingError ("in user code: ..."): give the
        # user tfdist's one line, not the trace.
        cause = _tfdist_error_in(e)
        if cause is None or cause is e:
            raise
        raise cause from None


def _tfdist_error_in(error: BaseException) -> TfdistError | None:
    """The TfdistError that `error` (autograph's wrapper) was raised from, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, TfdistError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


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
    created_under = compat.strategy_of(model)  # what Keras recorded when the model was made
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
    optimizer_strategy = compat.optimizer_strategy(model.optimizer)
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
    # Layers Keras's RematScope marked recompute tfdist's way (Keras's own way fails in a
    # TensorFlow graph).
    units.honour_remat_scope(model)
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


def _is_default(strategy) -> bool:
    return strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy()


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
    check_batch(model, data.sample_batch, what)
    _, y, _ = unpack(data.sample_batch)
    if y is None and compat.compiled_loss(model) is not None:
        raise FitError(
            f"`{what}` yields inputs without labels, but the model was compiled with a loss. "
            "Give the data as (x, y) or (x, y, sample_weight) elements, or pass y=. "
            f"Received: elements of {type(data.sample_batch).__name__}"
        )

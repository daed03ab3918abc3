"""The model's own steps, as Keras's fit runs them, and the logs they return.

A model may override `train_step` / `test_step` (keras.io's "Customizing what happens in
fit()"). tfdist runs the override under every strategy, and reports what Keras's fit would:

- Keras's rule (`Trainer._get_metrics_result_or_logs`): when the step returns a dict whose
  keys are those of the model's metric results, the logs are the metrics, read over every
  replica; otherwise they are the step's own return value of the last step, each leaf
  averaged over the replicas (Keras's `reduce_per_replica(..., "mean")`). Nested dicts are
  flattened as Keras flattens them (`{"compile_metrics": {"mae": x}}` -> `{"mae": x}`).
- Strategies whose metric variables cannot take concurrent updates (parameter_server,
  central_storage) run the step inside `MetricState`: the model's metric variables read and
  write tensors the runner carries, every other variable (weights, optimizer slots, seeds,
  BatchNorm statistics) is read and updated in place as the step asks.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.training import sparse_rows
from tfdist.training.hooks import StepHook

# Keras's own steps on TensorFlow; a model whose class replaces either has a custom step.
_KERAS_TRAIN_STEP = compat.keras_train_step()
_KERAS_TEST_STEP = compat.keras_test_step()


def traced(function):
    """`function` traced as Keras traces its train, test and predict functions: a
    tf.function with autograph off, so the user's train_step and layers run as written, as
    under Keras's fit (and nothing of tfdist is converted, which costs a trace seconds).
    The loops over steps are tf.while_loops (training/loop.py)."""
    return tf.function(tf.autograph.experimental.do_not_convert(function))


def custom_train_step(model: keras.Model) -> bool:
    """Whether `model`'s class overrides Keras's `train_step`."""
    return type(model).train_step is not _KERAS_TRAIN_STEP


def own_optimizers(model: keras.Model) -> dict[str, keras.optimizers.Optimizer]:
    """The optimizers a custom `train_step` keeps as attributes of its own, beside the one
    compile took (keras.io's GAN: `d_optimizer` and `g_optimizer`), by attribute name."""
    if not custom_train_step(model):
        return {}
    return {
        name: value
        for name, value in sorted(vars(model).items())
        if isinstance(value, keras.optimizers.Optimizer) and value is not model.optimizer
    }


def custom_test_step(model: keras.Model) -> bool:
    """Whether `model`'s class overrides Keras's `test_step`."""
    return type(model).test_step is not _KERAS_TEST_STEP


def python_logs(logs: Any) -> dict[str, Any]:
    """Logs as callbacks and History keep them: flat, sorted, scalars as floats.

    Nested dicts are flattened into their keys, as Keras's `pythonify_logs` does; a value
    that is not a number (a string, say) is kept as it is; an array of several numbers
    becomes a list.
    """
    out: dict[str, Any] = {}
    for name, value in sorted((logs or {}).items()):
        if isinstance(value, dict):
            out.update(python_logs(value))
            continue
        try:
            array = np.asarray(value)
            out[name] = float(array) if array.size == 1 else array.tolist()
        except (TypeError, ValueError):
            out[name] = value
    return out


def step_logs(
    outputs: Any,
    *,
    metric_names: Sequence[str],
    metrics: Callable[[], dict[str, Any]],
    mean: Callable[[Any], Any],
) -> dict[str, Any]:
    """The logs Keras's fit reports for a step that returned `outputs`.

    Args:
      outputs: what the (last) step returned, per replica as the strategy gave it.
      metric_names: the keys of the model's metric results (flattened).
      metrics: reads the model's metric results over every replica.
      mean: averages one per-replica value over the replicas (and workers).
    """
    if isinstance(outputs, dict) and set(outputs) == set(metric_names):
        return metrics()
    if outputs is None:
        return {}
    if not isinstance(outputs, dict):
        raise FitError(
            "A train_step or test_step returns a dict of logs (name -> value), as "
            f"keras.Model.fit expects. Received: a {type(outputs).__name__}"
        )
    return python_logs(tf.nest.map_structure(mean, outputs))


class MetricState(keras.StatelessScope):
    """A scope in which the model's metric variables live in tensors, and nothing else does.

    Keras's StatelessScope holds every variable's updates; this one holds only those of
    `variables` (read from and written to `state`) and lets every other assignment through,
    so a user's `train_step` applies its gradients as it would outside the scope while its
    metric updates stay local to this step (`value(variable)` after the step).

    Example:

        with MetricState(model.metrics_variables, zeros) as scope:
            outputs = model.train_step(batch)
        state = [scope.value(v) for v in model.metrics_variables]
    """

    def __init__(self, variables: Sequence[keras.Variable], state: Sequence[Any]):
        super().__init__(state_mapping=list(zip(variables, state, strict=True)))
        self._held = {id(v) for v in variables}

    def add_update(self, update) -> None:
        variable, value = update
        if id(variable) in self._held:
            super().add_update(update)
        else:  # a weight, slot or statistic: updated in place, as outside the scope
            compat.direct_assign(variable, value)  # below Keras's stateless check

    def value(self, variable: keras.Variable) -> tf.Tensor:
        """The value `variable` (one of the held ones) has now in this scope."""
        return self.get_current_value(variable)


# --- the update chain: where StepHooks sit in a step --------------------------------------------


def hooked_train_step(model: keras.Model, hooks: Sequence[StepHook]) -> Callable[[Any], Any]:
    """The model's `train_step`, run through each hook's `step` (the first hook outermost)."""
    step = model.train_step
    for hook in reversed(hooks):
        step = functools.partial(_hook_step, hook, step)
    return step


def _hook_step(hook: StepHook, train_step, batch):
    return hook.step(batch, train_step)


@contextlib.contextmanager
def updates_through(optimizer, hooks: Sequence[StepHook]) -> Iterator[None]:
    """While a step is traced, routes the optimizer's updates through `hooks`, in order.

    Keras's `train_step`, a model's own, and tfdist's parameter-server step all update the
    weights through `optimizer.apply` (`apply_gradients` calls it); during the trace, that
    call runs the chain instead, which ends with the optimizer's own `apply`. Outside the
    `with` the optimizer is as it was.

    A mirrored strategy traces its replicas' steps in threads of its own, at the same time,
    each with a chain of its own (a StepClock per replica): the optimizer is patched once
    while any thread is inside, and each call runs the chain of the thread that makes it.
    """
    if not hooks:
        yield
        return
    key = id(optimizer)
    with _PATCH_LOCK:
        if key not in _PATCHED:
            _PATCHED[key] = _Patch(optimizer)
        patch = _PATCHED[key]
        patch.users += 1
    chains = patch.chains_of_this_thread()
    chains.append(list(hooks))
    try:
        yield
    finally:
        chains.pop()
        with _PATCH_LOCK:
            patch.users -= 1
            if not patch.users:
                patch.undo()
                del _PATCHED[key]


class _Patch:
    """`optimizer.apply` replaced by a dispatch to the calling thread's innermost chain."""

    def __init__(self, optimizer):
        self.optimizer, self.users = optimizer, 0
        self.own = vars(optimizer).get("apply")  # normally absent: the class's method is used
        self.original = optimizer.apply
        self._threads = threading.local()
        optimizer.apply = self.apply

    def chains_of_this_thread(self) -> list[list[StepHook]]:
        if not hasattr(self._threads, "chains"):
            self._threads.chains = []
        return self._threads.chains

    def apply(self, grads, trainable_variables=None):
        chains = self.chains_of_this_thread()
        if not chains:  # a thread outside any `updates_through`: Keras's own update
            return self.original(grads, trainable_variables)
        hooks = chains[-1]
        variables = (
            trainable_variables
            if trainable_variables is not None
            else compat.optimizer_variables_list(self.optimizer)
        )

        def link(i: int, pairs_now):
            if i == len(hooks):  # Keras's apply: it sums the gradients over the replicas
                grads = sparse_rows.summed_on_first_replica([g for g, _ in pairs_now])
                return self.original(grads, [v for _, v in pairs_now])
            return hooks[i].apply(list(pairs_now), lambda p: link(i + 1, p))

        return link(0, list(zip(grads, variables, strict=True)))

    def undo(self) -> None:
        if self.own is None:
            del self.optimizer.apply
        else:
            self.optimizer.apply = self.own


# The optimizers patched now, by id, each until its last user leaves (see updates_through).
_PATCH_LOCK = threading.Lock()
_PATCHED: dict[int, _Patch] = {}


class StepClock(StepHook):
    """Marks, inside a traced step, when its gradients are ready and when they are applied.

    The first link of every synchronous step's chain. `tf.timestamp()` ops taken with
    control dependencies on the gradients and on the updated weights measure the step's
    phases as they ran (not estimated): compute (forward and backward) ends when the last
    gradient exists; the exchange (the all-reduce, then the optimizer's update) ends when
    every weight has its new value.

    `away`: the weights live away from the replica (on the CPU, on a ps). Reading each
    updated weight back costs nothing on the replica's own device, but from there it would
    copy every weight to the replica each step (under parameter_server, every shard of a
    split table); such a clock waits instead on a check that each variable is initialized,
    which runs where the variable lives, after its update (ops on one resource run in
    program order), and sends back a bool.
    """

    def __init__(self, *, away: bool = False):
        self.away = away
        # Each update's (gradients ready, weights updated); a custom step may apply several
        # optimizers (a GAN's two), each an exchange of its own.
        self.spans: list[tuple[tf.Tensor, tf.Tensor]] = []

    @property
    def marks(self) -> tuple[tf.Tensor, tf.Tensor] | None:
        """(gradients ready, weights updated) of the step's only update, or None."""
        return self.spans[-1] if self.spans else None

    def exchange(self) -> tf.Tensor | None:
        """The seconds the step's updates took, all of them, or None: no update."""
        if not self.spans:
            return None
        return tf.add_n([applied - ready for ready, applied in self.spans])

    def apply(self, grads_and_vars, apply_next):
        grads = [g for g, _ in grads_and_vars if g is not None]
        with tf.control_dependencies(grads):
            ready = tf.timestamp()
        with tf.control_dependencies([ready]):
            result = apply_next(grads_and_vars)
        updated = [self.updated(v) for g, v in grads_and_vars if g is not None]
        with tf.control_dependencies([*updated, *([result] if tf.is_tensor(result) else [])]):
            applied = tf.timestamp()
        self.spans.append((ready, applied))
        return result

    def updated(self, variable) -> tf.Tensor:
        """A tensor that exists once `variable` has its new value: reading it, which is
        ordered after its update (same resource). A weight whose storage is a stand-in
        (ZeRO-3's gathered slices) says itself what to read: `read_after_update()`."""
        if self.away:
            return tf.raw_ops.VarIsInitializedOp(resource=variable.handle)
        storage = variable.value
        read = getattr(storage, "read_after_update", None)
        return read() if read is not None else tf.identity(storage)

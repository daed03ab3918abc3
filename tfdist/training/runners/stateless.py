"""The base of runners whose metric state lives in tensors, not in the metric variables.

For strategies whose metric variables cannot take concurrent updates: parameter_server (one
variable on a ps, updated by several workers at once: they race) and central_storage (one
variable on the CPU, updated by every replica: Keras's own fit logs wrong figures there).
Each step starts from the state it is given and returns the state it leads to (Keras's
stateless metric API); states add up, as a SUM-aggregated read of replicas would.

Their training steps are timed as the synchronous runner's are (step_times.py), with marks in
the step's graph (StepMarks); the update's end is marked without reading the weights back,
which here live away from the replica (StepClock(away=True)).
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.strategies import strategy_kind
from tfdist.training.engine import Engine, Report
from tfdist.training.fit_data import unpack
from tfdist.training.hooks import StepHook
from tfdist.training.job import Job
from tfdist.training.ps_shards import ShardedTraining
from tfdist.training.runners.common import (
    batch_size,
    logs_from_state,
    metric_names,
    refuse_asynchronous_hooks,
)
from tfdist.training.step_times import StepTimes
from tfdist.training.steps import (
    MetricState,
    StepClock,
    custom_test_step,
    custom_train_step,
    step_logs,
    updates_through,
)


class StepMarks:
    """Where one training step's time goes (step_times.py), marked in its graph as it runs.

    Example (inside a traced step; `asked` is a `tf.timestamp()` taken before the batch was
    asked for, with the batch's request depending on it):

        marks = StepMarks(asked, batch)     # the batch's arrival
        with updates_through(optimizer, [marks.clock, *hooks]):
            optimizer.apply_gradients(...)  # gradients ready, weights updated
        times = marks.end(after=state)      # [input, compute, exchange] seconds, float64
    """

    def __init__(self, asked: tf.Tensor, batch):
        self.asked = asked
        with tf.control_dependencies(_tensors(batch)):
            self.arrived = tf.timestamp()
        self.clock = StepClock(away=True)  # the first link of the step's update chain

    def end(self, *, after) -> tf.Tensor:
        """The step's [input, compute, exchange] seconds, once `after` (what it returns) exists."""
        marks = self.clock.marks
        with tf.control_dependencies([*_tensors(after), *(marks or ())]):
            end = tf.timestamp()
        ready, applied = marks or (end, end)  # no update: all of it was compute
        # Compute: the forward and backward passes, and whatever ran after the update.
        return tf.stack(
            [self.arrived - self.asked, (ready - self.arrived) + (end - applied), applied - ready]
        )


def _tensors(structure) -> list[tf.Tensor]:
    return [t for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor)]


class StatelessMetricsRunner(Engine):
    """Metric state carried in tensors instead of the metric variables (Keras's stateless API).

    For strategies whose metric variables cannot take concurrent updates: parameter_server
    (one variable on a ps, updated by several workers) and central_storage (one variable on
    the CPU, updated by every replica: Keras's own fit logs wrong figures there). Each step
    starts from zeros and returns its metric state; states add up, as a SUM-aggregated read
    of replicas would.
    """

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy, job: Job):
        self.model, self.strategy, self.job = model, strategy, job
        self.hooks: list[StepHook] = []
        self.metric_variables: list[keras.Variable] = []
        self._state: list[np.ndarray] = []
        # The last step's own logs, when the model's train_step returns its own (steps.py).
        self._last_outputs = None
        self._names: list[str] | None = None
        self.times = StepTimes()  # the epoch's timed steps

    def _prepare(
        self,
        sharded: ShardedTraining | None,
        step_hooks: Sequence[StepHook],
        *,
        asynchronous: bool = False,
    ) -> None:
        """Once the model is built: checks what the stateless steps need, and sets up.

        Args:
          asynchronous: the steps are asynchronous (parameter_server): hooks that correct
            for asynchrony are taken.
        """
        model, strategy = self.model, self.strategy
        if not asynchronous:
            refuse_asynchronous_hooks(step_hooks, strategy)
        for hook in step_hooks:
            if hook.synchronous_only:
                raise FitError(
                    f"{hook.name} works on the steps of a synchronous strategy "
                    "(mirrored, multi_worker_mirrored), where every replica runs each step "
                    f"together; {strategy_kind(strategy)} updates the variables another way. "
                    "Use a synchronous strategy or drop the option. "
                    f"Received: {hook.name} under {strategy_kind(strategy)}"
                )
        with strategy.scope():
            for hook in step_hooks:
                hook.build(model, self.job)
            if model.optimizer is not None and not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)  # no hook built it
        self.hooks = list(step_hooks)
        self.metric_variables = list(model.metrics_variables)
        # The trainable variables as the step reads and updates them: whole, or for variables
        # a partitioner split across ps tasks (parameter_server), shard by shard (ps_shards.py).
        self.sharded = sharded or ShardedTraining(model)
        self.custom_train = custom_train_step(model)
        self.custom_test = custom_test_step(model)
        if self.custom_train and self.sharded.sharded:
            variable = self.sharded.sharded[0]
            raise FitError(
                f"Model {model.name!r} has its own train_step, which takes gradients of the "
                f"whole variables, but {variable.path} is split across the ps tasks (Keras 3 "
                "cannot differentiate a ShardedVariable). Keep the variables whole (no "
                "variable_partitioner; tfdist: ps_min_shard_bytes=None), or move the step's "
                "logic into the loss and metrics given to compile(). "
                f"Received: {len(self.sharded.sharded)} split variable(s)"
            )
        for variable in self.metric_variables:
            if getattr(variable, "aggregation", "sum") not in ("sum", None):
                raise FitError(
                    f"Under {type(strategy).__name__}, tfdist adds up the metric state of "
                    "every step, which needs metric variables aggregated by 'sum'. Metric "
                    f"variable {variable.path} is aggregated by {variable.aggregation!r}; "
                    "compute that metric after training, or drop it from compile(). "
                    f"Received: aggregation={variable.aggregation!r}"
                )
        self._state = self._zeros()

    def _zeros(self) -> list[np.ndarray]:
        return [np.zeros(v.shape, v.dtype) for v in self.metric_variables]

    def _zero_tensors(self) -> list[tf.Tensor]:
        return [tf.zeros(v.shape, v.dtype) for v in self.metric_variables]

    def _stateless_train_step(self, batch, state, asked: tf.Tensor):
        """One step from metric `state`, timed from `asked` (when the batch was asked for).

        Returns (the metric state it leads to, its [input, compute, exchange] seconds).
        """
        marks = StepMarks(asked, batch)
        gradients, state = self._stateless_gradients(batch, state)
        with updates_through(self.model.optimizer, [marks.clock, *self.hooks]):
            self.model.optimizer.apply_gradients(gradients)
        return state, marks.end(after=state)

    def _stateless_gradients(self, batch, state):
        """(gradient, variable) pairs of one step and the metric state it leads to."""
        model = self.model
        x, y, sample_weight = unpack(batch)
        sharded = self.sharded
        with tf.GradientTape() as tape, sharded.lookups():
            y_pred = model(x, training=True) if compat.call_has_training_arg(model) else model(x)
            # Regularisers read the trainable weights through the scope: map them to
            # themselves, read inside the tape so the penalty's gradient reaches them.
            mapping = [(v, v.value) for v in sharded.whole()]
            mapping += list(zip(self.metric_variables, state, strict=True))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                loss = compat.compute_loss(
                    model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
                compat.loss_tracker(model).update_state(
                    compat.unscale_loss(loss), sample_weight=batch_size(x)
                )
                model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            scaled = model.optimizer.scale_loss(loss)
        # With respect to the shards of sharded variables, for the optimizer built over them.
        gradients = sharded.pairs(tape.gradient(scaled, sharded.sources()))
        return gradients, [scope.get_current_value(v) for v in self.metric_variables]

    def _stateless_test_step(self, batch, state):
        mapping = [(v, v.value) for v in self.sharded.whole()]  # for regularisers
        mapping += list(zip(self.metric_variables, state, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope, self.sharded.lookups():
            self.model.test_step(batch)
        return [scope.get_current_value(v) for v in self.metric_variables]

    def _user_step(
        self, step, batch, state, *, clock: StepClock | None = None, claim: StepHook | None = None
    ):
        """Runs the model's own `step` on `batch`, its metric variables held in `state`.

        Returns (what the step returned, the metric state it leads to). A training step is
        timed by a `clock` (a StepMarks' clock), which goes first in its update chain; an
        asynchronous step's `claim` of its update comes next.
        """
        hooks = [h for h in (clock, claim) if h is not None] + list(self.hooks)
        with (
            MetricState(self.metric_variables, state) as scope,
            updates_through(self.model.optimizer, hooks),
        ):
            outputs = step(batch)
        return outputs, [scope.value(v) for v in self.metric_variables]

    def _logs_of(self, state) -> dict[str, float]:
        return logs_from_state(self.model, self.metric_variables, state)

    def _step_logs(self, outputs, state) -> dict[str, float]:
        """Keras's rule for a step that returned `outputs` (already one value per name)."""
        if self._names is None:
            self._names = metric_names(self.model)
        return step_logs(
            outputs,
            metric_names=self._names,
            metrics=lambda: self._logs_of(state),
            mean=lambda value: value,
        )

    def _add_state(self, values) -> None:
        self._state = [a + np.asarray(b) for a, b in zip(self._state, values, strict=True)]

    def logs(self) -> dict[str, float]:
        if self._last_outputs is not None:
            return self._step_logs(self._last_outputs, self._state)
        return self._logs_of(self._state)

    def reset(self) -> None:
        self._state = self._zeros()
        self._last_outputs = None
        self.times = StepTimes()

    def report(self) -> Report:
        figures: dict[str, float | int | None] = {}
        for hook in self.hooks:
            figures.update(hook.summary())
        return Report(step_times=self.times.per_step(), figures=figures)

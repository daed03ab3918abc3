"""How `tfdist.fit` runs a compiled Keras model's steps under each kind of strategy.

Every runner offers the same narrow interface, so the loop in fit.py is written once:

  begin(global_step, ...) -> where counting starts    reset() -> a new epoch's metrics
  train(iterator, n, bounded=, with_logs=) -> (steps run, logs or None)
  logs() -> the epoch's logs so far                   finish_epoch() -> every step landed
  evaluate(data, steps) -> logs

SyncRunner (one_device, mirrored, multi_worker_mirrored, tpu) runs the model's own
`train_step` / `test_step` inside `strategy.run`, as Keras's fit does on one host: a user's
overridden step runs unchanged. Keras scales each replica's loss by 1/replicas, so with equal
per-replica batches the all-reduced gradient is that of the global batch; metric variables
are summed over the replicas (one all-reduce per dtype), so the logs are those of every
replica and worker.

CentralStorageRunner keeps central_storage's metric state in tensors (see _StatelessMetrics):
its metric variables live once on the CPU and Keras's own fit logs wrong figures there.

ParameterServerRunner schedules closures on the workers through a ClusterCoordinator. Metric
variables live on the ps tasks there and several workers would update them at once (racing),
so each closure accumulates its metric state in local tensors (Keras's stateless metric API)
and returns it; the coordinator adds the states up — the same sum a replica read does.
"""

from __future__ import annotations

import collections
import contextlib
import logging

import keras
import numpy as np
import tensorflow as tf
from keras.src.losses.loss import unscale_loss_for_distribution

from tfdist.strategies import task_name_in_tf_config
from tfdist.training.batch_norm import MovingStatistics
from tfdist.training.faults import CLUSTER_ERRORS, explain_cluster_error, lost_worker
from tfdist.training.fit_data import FitData, FitError, unpack
from tfdist.training.sharded import ShardedTraining
from tfdist.training.staleness import (
    STALENESS_STATS,
    StalenessAwareSchedule,
    attach_update_counter,
)
from tfdist.training.steps import (
    MetricState,
    custom_test_step,
    custom_train_step,
    python_logs,
    step_logs,
)

log = logging.getLogger(__name__)

_NO_LIMIT = 2**62  # steps: until the data ends


def _logs_from_state(model: keras.Model, variables, state) -> dict[str, float]:
    """The model's metric results had its metric variables held `state`."""
    with keras.StatelessScope(state_mapping=list(zip(variables, state, strict=True))):
        return python_logs(model.get_metrics_result())


def metric_names(model: keras.Model) -> list[str]:
    """The keys of the model's metric results (read from zeros: no collective)."""
    variables = list(model.metrics_variables)
    return list(_logs_from_state(model, variables, [np.zeros(v.shape, v.dtype) for v in variables]))


def _run_until_end(iterator, n, step) -> tf.Tensor:
    """Runs `step(batch)` on up to `n` batches, stopping where the data ends (in a tf.function).

    Returns how many ran. Every worker's distributed iterator agrees on the end.
    """
    done = tf.constant(0)
    for _ in tf.range(n):
        batch = iterator.get_next_as_optional()
        if not batch.has_value():
            break
        step(batch.get_value())
        done += 1
    return done


def _each_batch(iterator, n: int, call):
    """Calls `call(batch)` on up to `n` batches, a call each, asking for every batch first.

    For the user's own steps on data of unknown length, whose last return value gives the
    logs. Returns (batches taken, what the last call returned).
    """
    done, result = 0, None
    while done < n:
        batch = iterator.get_next_as_optional()  # every worker agrees on the end
        if not batch.has_value():
            break
        result = call(batch.get_value())
        done += 1
    return done, result


def _call_until_end(call, model: keras.Model, steps: int | None) -> None:
    """Calls `call(n)` (which runs up to n steps and returns how many ran) for `steps` steps,
    steps_per_execution at a time, or until the data ends."""
    per_call = max(1, model.steps_per_execution)
    remaining = steps
    while remaining is None or remaining > 0:
        n = per_call if remaining is None else min(per_call, remaining)
        done = call(tf.constant(n))
        if remaining is not None:
            remaining -= done
        if done < n:
            break


def _batch_size(x) -> tf.Tensor:
    leaf = next(leaf for leaf in tf.nest.flatten(x) if leaf is not None)
    return tf.shape(leaf)[0]


class SyncRunner:
    """Synchronous strategies: every replica runs every step; see the module docstring."""

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy):
        self.model, self.strategy = model, strategy
        self.custom = custom_train_step(model)
        self._train_fns: dict[str, tf.types.experimental.PolymorphicFunction] = {}
        self._counts: dict[int, tf.Tensor] = {}
        self._stream_fn = None
        self._one_fns: dict[str, tf.types.experimental.PolymorphicFunction] = {}
        self.metric_variables = list(model.metrics_variables)
        self._read_state = tf.function(self._summed_state)
        self._test_fn = None
        self.moving_statistics = MovingStatistics(model, strategy)
        self._metric_names: list[str] | None = None
        # What the epoch's last step returned (a custom train_step's own logs).
        self._last_outputs = None

    # --- training -----------------------------------------------------------------------------

    def _train_fn(self, n: int):
        """The traced call that runs `n` steps (its count is an argument: one graph for all).

        Logs are read by a call of their own: an all-reduce of metric state in the same graph
        as the gradients' would share the ring all-reduce's transfer keys.
        """
        # A custom train_step's own logs are those of the call's last step, run after the
        # loop and returned; Keras's step logs its metrics, read apart. A single step needs
        # no loop (nor a count), which spares a small model's step on a CPU the overhead.
        kind = "single" if n == 1 else "loop"
        if kind not in self._train_fns:
            strategy, step, custom = self.strategy, self.model.train_step, self.custom

            if n == 1:

                @tf.function
                def train(iterator):
                    outputs = strategy.run(step, args=(next(iterator),))
                    return outputs if custom else None

            else:

                @tf.function
                def train(iterator, n):
                    for _ in tf.range(n - 1 if custom else n):
                        strategy.run(step, args=(next(iterator),))
                    return strategy.run(step, args=(next(iterator),)) if custom else None

            self._train_fns[kind] = train
        return self._train_fns[kind]

    def _stream(self, iterator, n):
        # For data of unknown length: each step first asks whether there is a batch.
        if self._stream_fn is None:
            model, strategy = self.model, self.strategy

            @tf.function
            def train(iterator, n):
                return _run_until_end(
                    iterator, n, lambda batch: strategy.run(model.train_step, args=(batch,))
                )

            self._stream_fn = train
        return int(self._stream_fn(iterator, n))

    def _one(self, kind: str, batch):
        """One step of `kind` ('train' or 'test') on a batch; returns what the step returned."""
        if kind not in self._one_fns:
            step = self.model.train_step if kind == "train" else self.model.test_step
            strategy = self.strategy
            self._one_fns[kind] = tf.function(lambda batch: strategy.run(step, args=(batch,)))
        return self._one_fns[kind](batch)

    def _mean(self, value):
        if isinstance(value, (tf.Tensor, tf.distribute.DistributedValues)):
            return self.strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None)
        return value

    def _logs_of(self, outputs) -> dict[str, float]:
        if self._metric_names is None:
            self._metric_names = metric_names(self.model)
        return step_logs(
            outputs, metric_names=self._metric_names, metrics=self._metrics_only, mean=self._mean
        )

    def _count(self, n: int) -> tf.Tensor:
        if n not in self._counts:  # made once: a constant per call costs a small step time
            self._counts[n] = tf.constant(n)
        return self._counts[n]

    def train(self, iterator, n: int, *, bounded: bool, with_logs: bool):
        if not self.custom:
            if bounded:
                train = self._train_fn(n)
                train(iterator) if n == 1 else train(iterator, self._count(n))
                done = n
            else:
                done = self._stream(iterator, self._count(n))
            return done, (self.logs() if with_logs else None)
        if bounded:
            train = self._train_fn(n)
            outputs = train(iterator) if n == 1 else train(iterator, self._count(n))
            done = n
        else:
            done, outputs = _each_batch(iterator, n, lambda batch: self._one("train", batch))
        if done:
            self._last_outputs = outputs
        return done, (self._logs_of(outputs) if with_logs and done else None)

    def _summed_state(self) -> list[tf.Tensor]:
        # Every metric variable summed over the replicas in one all-reduce per dtype, rather
        # than a reduce per variable: cheaper across workers, and tfdist's ring cannot take
        # several unfused all-reduces in one graph.
        variables = self.metric_variables
        groups: dict[str, list[int]] = {}
        for i, v in enumerate(variables):
            groups.setdefault(str(v.dtype), []).append(i)

        def local():
            return {
                dtype: tf.concat([tf.reshape(variables[i].value, [-1]) for i in members], 0)
                for dtype, members in groups.items()
            }

        per_replica = self.strategy.run(local)
        flats = {
            dtype: self.strategy.reduce(tf.distribute.ReduceOp.SUM, flat, axis=None)
            for dtype, flat in per_replica.items()
        }
        state = [None] * len(variables)
        for dtype, members in groups.items():
            sizes = [int(np.prod(variables[i].shape)) for i in members]
            for i, part in zip(members, tf.split(flats[dtype], sizes), strict=True):
                state[i] = tf.reshape(part, variables[i].shape)
        return state

    def logs(self) -> dict[str, float]:
        """The epoch's logs: the metrics over every replica, or, for a custom train_step
        whose logs are its own (Keras's rule), what its last step returned."""
        if self._last_outputs is not None:
            return self._logs_of(self._last_outputs)
        return self._metrics_only()

    def reset(self) -> None:
        self._last_outputs = None
        self.model.reset_metrics()

    def begin(self, global_step: int, **unused) -> None:
        pass  # synchronous updates count themselves

    def finish_epoch(self) -> None:
        # Before validation and the callbacks that save: one model, not one per replica.
        self.moving_statistics.average()

    # --- evaluation ---------------------------------------------------------------------------

    def evaluate(self, data: FitData, steps: int | None) -> dict[str, float]:
        self.moving_statistics.average()
        self.model.reset_metrics()
        iterator = iter(data.distribute(self.strategy))
        if custom_test_step(self.model):
            # The user's test_step runs as Keras's evaluate runs it, a step a call, and its
            # last return value gives the logs (Keras's rule).
            done, outputs = _each_batch(
                iterator, steps or _NO_LIMIT, lambda batch: self._one("test", batch)
            )
            return self._logs_of(outputs) if done else self._metrics_only()
        if self._test_fn is None:
            model, strategy = self.model, self.strategy

            def replica_test(batch):
                def run():
                    model.test_step(batch)
                    return tf.constant(0)

                # The last batch can leave a replica without examples, and some kernels
                # (oneDNN's convolution) reject an empty batch: such a replica adds nothing.
                x, _, _ = unpack(batch)
                tf.cond(_batch_size(x) > 0, run, lambda: tf.constant(0))

            @tf.function
            def test(iterator, n):
                return _run_until_end(
                    iterator, n, lambda batch: strategy.run(replica_test, args=(batch,))
                )

            self._test_fn = test
        _call_until_end(lambda n: int(self._test_fn(iterator, n)), self.model, steps)
        return self._metrics_only()

    def _metrics_only(self) -> dict[str, float]:
        if not self.metric_variables:
            return python_logs(self.model.get_metrics_result())
        return _logs_from_state(self.model, self.metric_variables, self._read_state())


class _StatelessMetrics:
    """Metric state carried in tensors instead of the metric variables (Keras's stateless API).

    For strategies whose metric variables cannot take concurrent updates: parameter_server
    (one variable on a ps, updated by several workers) and central_storage (one variable on
    the CPU, updated by every replica: Keras's own fit logs wrong figures there). Each step
    starts from zeros and returns its metric state; states add up, as a SUM-aggregated read
    of replicas would.
    """

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy):
        self.model, self.strategy = model, strategy
        self.metric_variables = list(model.metrics_variables)
        # The trainable variables as the step reads and updates them: whole, or for variables
        # a partitioner split across ps tasks (parameter_server), shard by shard (sharded.py).
        self.sharded = ShardedTraining.of(model) or ShardedTraining(model)
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
        # The last step's own logs, when the model's train_step returns its own (steps.py).
        self._last_outputs = None
        self._names: list[str] | None = None

    def _zeros(self) -> list[np.ndarray]:
        return [np.zeros(v.shape, v.dtype) for v in self.metric_variables]

    def _zero_tensors(self) -> list[tf.Tensor]:
        return [tf.zeros(v.shape, v.dtype) for v in self.metric_variables]

    def _stateless_train_step(self, batch, state):
        gradients, state = self._stateless_gradients(batch, state)
        self.model.optimizer.apply_gradients(gradients)
        return state

    def _stateless_gradients(self, batch, state):
        """(gradient, variable) pairs of one step and the metric state it leads to."""
        model = self.model
        x, y, sample_weight = unpack(batch)
        sharded = self.sharded
        with tf.GradientTape() as tape, sharded.lookups():
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            # Regularisers read the trainable weights through the scope: map them to
            # themselves, read inside the tape so the penalty's gradient reaches them.
            mapping = [(v, v.value) for v in sharded.whole()]
            mapping += list(zip(self.metric_variables, state, strict=True))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                loss = model._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
                model._loss_tracker.update_state(
                    unscale_loss_for_distribution(loss), sample_weight=_batch_size(x)
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

    def _user_step(self, step, batch, state):
        """Runs the model's own `step` on `batch`, its metric variables held in `state`.

        Returns (what the step returned, the metric state it leads to).
        """
        with MetricState(self.metric_variables, state) as scope:
            outputs = step(batch)
        return outputs, [scope.value(v) for v in self.metric_variables]

    def _logs_of(self, state) -> dict[str, float]:
        return _logs_from_state(self.model, self.metric_variables, state)

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


class CentralStorageRunner(_StatelessMetrics):
    """central_storage: synchronous replicas, variables on one device, metrics in tensors.

    A model's own train_step / test_step runs on every replica with that replica's running
    metric state (carried between steps in a tensor stacked over the replicas), so what it
    returns is what it would return under mirrored, where each replica keeps its own.
    """

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy):
        super().__init__(model, strategy)
        self._custom_fns: dict[str, tf.types.experimental.PolymorphicFunction] = {}
        self._stacked = self._replica_zeros()

        def replica_train(batch):
            return self._stateless_train_step(batch, self._zero_tensors())

        def replica_test(batch):
            x, _, _ = unpack(batch)
            zeros = self._zero_tensors()
            # A replica the last batch left without examples adds nothing.
            return tf.cond(
                _batch_size(x) > 0, lambda: self._stateless_test_step(batch, zeros), lambda: zeros
            )

        self._train_fn = tf.function(lambda it, n: self._summed_steps(it, n, replica_train))
        self._test_fn = tf.function(lambda it, n: self._summed_steps(it, n, replica_test))

    def _summed_steps(self, iterator, n, replica_fn):
        """(steps run, metric state summed over them and the replicas), until the data ends."""
        done, state = tf.constant(0), self._zero_tensors()
        for _ in tf.range(n):
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                break
            per_replica = self.strategy.run(replica_fn, args=(batch.get_value(),))
            state = [
                total + self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
                for total, value in zip(state, per_replica, strict=True)
            ]
            done += 1
        return done, state

    def _replica_zeros(self) -> list[tf.Tensor]:
        replicas = self.strategy.num_replicas_in_sync
        return [tf.zeros([replicas, *v.shape], v.dtype) for v in self.metric_variables]

    def _custom_fn(self, kind: str):
        """One step of the model's own train_step or test_step on every replica: (the step's
        return value averaged over the replicas, the replicas' metric states stacked)."""
        if kind not in self._custom_fns:
            model, strategy = self.model, self.strategy
            step = model.train_step if kind == "train" else model.test_step

            def replica(batch, stacked):
                replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
                return self._user_step(step, batch, [s[replica_id] for s in stacked])

            @tf.function
            def one(batch, stacked):
                outputs, state = strategy.run(replica, args=(batch, stacked))
                mean = tf.nest.map_structure(
                    lambda v: strategy.reduce(tf.distribute.ReduceOp.MEAN, v, axis=None), outputs
                )
                return mean, [tf.stack(strategy.experimental_local_results(s)) for s in state]

            self._custom_fns[kind] = one
        return self._custom_fns[kind]

    def _custom_steps(self, kind: str, iterator, n: int, stacked):
        """(steps run, the last step's return value, the stacked metric states after them)."""
        one = self._custom_fn(kind)

        def call(batch):
            nonlocal stacked
            outputs, stacked = one(batch, stacked)
            return outputs

        done, outputs = _each_batch(iterator, n, call)
        return done, outputs, stacked

    def train(self, iterator, n: int, *, bounded: bool, with_logs: bool):
        if self.custom_train:
            done, outputs, self._stacked = self._custom_steps("train", iterator, n, self._stacked)
            self._state = [np.asarray(s).sum(axis=0) for s in self._stacked]
            if done:
                self._last_outputs = tf.nest.map_structure(np.asarray, outputs)
            return done, (self.logs() if with_logs and done else None)
        done, state = self._train_fn(iterator, tf.constant(n))
        self._add_state(state)
        return int(done), (self.logs() if with_logs else None)

    def reset(self) -> None:
        super().reset()
        self._stacked = self._replica_zeros()

    def begin(self, global_step: int, **unused) -> None:
        pass

    def finish_epoch(self) -> None:
        pass

    def evaluate(self, data: FitData, steps: int | None) -> dict[str, float]:
        iterator = iter(data.distribute(self.strategy))
        if self.custom_test:
            done, outputs, stacked = self._custom_steps(
                "test", iterator, steps or _NO_LIMIT, self._replica_zeros()
            )
            state = [np.asarray(s).sum(axis=0) for s in stacked]
            if not done:
                return self._logs_of(state)
            return self._step_logs(tf.nest.map_structure(np.asarray, outputs), state)
        total = self._zeros()

        def call(n):
            nonlocal total
            done, state = self._test_fn(iterator, n)
            total = [a + np.asarray(b) for a, b in zip(total, state, strict=True)]
            return int(done)

        _call_until_end(call, self.model, steps)
        return self._logs_of(total)


class ParameterServerRunner(_StatelessMetrics):
    """parameter_server: closures of `n` steps scheduled on any free worker; see the module."""

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy):
        super().__init__(model, strategy)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        self._pending: collections.deque = collections.deque()
        # Results are fetched a few closures behind the newest: the progress stays current
        # without waiting on every step.
        self._lag = 2 * max(1, len(self._cluster().get("worker", [])))
        self._closures: dict[int, tf.types.experimental.PolymorphicFunction] = {}
        self._eval_step = tf.function(
            (lambda batch, state: self._user_step(model.test_step, batch, state))
            if self.custom_test
            else (lambda batch, state: (None, self._stateless_test_step(batch, state)))
        )
        self._per_worker_iterators: dict[int, object] = {}
        self.counter = attach_update_counter(model, strategy)
        self.staleness = self.counter.stats
        self.scheduled_steps = 0
        self._landed = 0
        self.total_steps: int | None = None
        self.checkpoint_status = None

    def _step_with_staleness(self, batch, state):
        # The counter is read before the step reads the weights, and claimed once its
        # gradients exist: the updates that landed in between are its staleness.
        read = self.counter.read()
        with tf.control_dependencies([read]):
            gradients, state = self._stateless_gradients(batch, state)
        staleness = self.counter.claim(read, after=[g for g, _ in gradients])
        schedule = getattr(self.model.optimizer, "_learning_rate", None)
        scaled = (
            schedule.scaled(staleness)
            if isinstance(schedule, StalenessAwareSchedule)
            else contextlib.nullcontext()
        )
        with scaled:
            self.model.optimizer.apply_gradients(gradients)
        return state, staleness

    def _user_step_with_staleness(self, batch, state):
        # The model's own train_step applies its gradients itself: its update is claimed
        # once the step has run, which counts the updates that landed while it ran.
        read = self.counter.read()
        with tf.control_dependencies([read]):
            outputs, state = self._user_step(self.model.train_step, batch, state)
        staleness = self.counter.claim(read, after=[*state, *tf.nest.flatten(outputs)])
        return outputs, state, staleness

    def _closure(self, n: int):
        if n not in self._closures:
            strategy = self.strategy

            def count(stats, tau):  # [sum, max, count] of the closure's staleness
                return tf.stack([stats[0] + tau, tf.maximum(stats[1], tau), stats[2] + 1.0])

            @tf.function
            def steps(iterator):
                state = self._zero_tensors()
                stats = tf.zeros([STALENESS_STATS])
                for _ in tf.range(n):
                    state, tau = strategy.run(
                        self._step_with_staleness, args=(next(iterator), state)
                    )
                    stats = count(stats, tau)
                return state, stats  # (a None among the outputs would fail the fetch)

            @tf.function
            def user_steps(iterator, start):
                # The model's own step starts from the epoch's metric state as the
                # coordinator knew it, so what it returns covers the epoch so far; the
                # closure hands back only what its own steps added.
                state, stats = start, tf.zeros([STALENESS_STATS])
                for _ in tf.range(n - 1):
                    _, state, tau = strategy.run(
                        self._user_step_with_staleness, args=(next(iterator), state)
                    )
                    stats = count(stats, tau)
                outputs, state, tau = strategy.run(
                    self._user_step_with_staleness, args=(next(iterator), state)
                )
                added = [end - begin for end, begin in zip(state, start, strict=True)]
                return added, count(stats, tau), outputs

            self._closures[n] = user_steps if self.custom_train else steps
        return self._closures[n]

    # --- the runner interface -------------------------------------------------------------------

    def per_worker_iterator(self, data: FitData):
        key = id(data)
        if key not in self._per_worker_iterators:
            self._per_worker_iterators[key] = iter(data.per_worker(self.coordinator))
        return self._per_worker_iterators[key]

    def train(self, iterator, n: int, *, bounded: bool, with_logs: bool):
        del bounded  # per-worker data repeats without end
        with self._explained():
            args = (iterator, self._state) if self.custom_train else (iterator,)
            self._pending.append(self.coordinator.schedule(self._closure(n), args=args))
            self.scheduled_steps += n
            while len(self._pending) > self._lag or (with_logs and not self._landed):
                # Batch logs wait for the epoch's first closure: before it they would be zeros.
                self._add(self._pending.popleft())
        return n, (self.logs() if with_logs else None)

    def _add(self, remote) -> None:
        try:
            values = remote.fetch()
        except CLUSTER_ERRORS as e:
            worker = lost_worker(e, cluster=self._cluster())
            if worker is None:
                raise
            worker = task_name_in_tf_config(self.strategy, worker)
            # The steps ran and their updates reached the ps; their metrics died with it.
            log.warning("The metrics of steps that ran on %s were lost with it", worker)
            return
        state, stats, *outputs = values  # the model's own step's outputs come third
        self._landed += 1
        self._add_state(state)
        if outputs:
            self._last_outputs = tf.nest.map_structure(np.asarray, outputs[0])
        self.staleness.add(*np.asarray(stats).tolist())

    def begin(
        self, global_step: int, *, total_steps: int | None = None, checkpoint_status=None
    ) -> None:
        """Starts counting at `global_step` (a resumed run counts on from its checkpoint).

        Args:
          global_step: the step training starts from.
          total_steps: the steps the run is to reach (for the message if a ps dies).
          checkpoint_status: returns (step, directory) of the newest checkpoint, where a
            restart would resume; None if nothing saves checkpoints.
        """
        self.scheduled_steps = global_step
        self.total_steps = total_steps
        self.checkpoint_status = checkpoint_status

    def logs(self) -> dict[str, float]:
        # Staleness is part of what asynchronous training did: logged beside the metrics.
        return {**super().logs(), **self.staleness.epoch_metrics()}

    def reset(self) -> None:
        self._pending.clear()
        self._landed = 0  # closures of this epoch whose results arrived
        self.staleness.reset_epoch()
        super().reset()

    def finish_epoch(self) -> None:
        with self._explained():
            self.coordinator.join()  # the epoch ends when every scheduled step has run
            while self._pending:
                self._add(self._pending.popleft())
            # Keras's iteration counter loses increments under asynchronous updates; the
            # coordinator's count is exact, and drives the learning-rate schedule.
            self.model.optimizer.iterations.assign(self.scheduled_steps)

    def evaluate(self, data: FitData, steps: int | None) -> dict[str, float]:
        # On the coordinator, reading the variables from the ps tasks: every example once.
        state, outputs = self._zeros(), None
        dataset = data.local()
        if steps is not None:
            dataset = dataset.take(steps)
        with self._explained():
            for batch in dataset:
                outputs, state = self._eval_step(batch, state)
        if outputs is None:
            return self._logs_of(state)
        return self._step_logs(tf.nest.map_structure(np.asarray, outputs), state)

    # --- failures -------------------------------------------------------------------------------

    def _cluster(self) -> dict[str, list[str]]:
        # ParameterServerStrategy keeps its resolver privately (its public attribute is None).
        resolver = self.strategy.cluster_resolver or getattr(
            self.strategy, "_cluster_resolver", None
        )
        return resolver.cluster_spec().as_dict() if resolver is not None else {}

    @contextlib.contextmanager
    def _explained(self):
        # Every call that waits on the ps tasks goes through here: a dead ps ends training
        # with one ClusterTaskFailed message instead of TensorFlow's traceback.
        try:
            yield
        except CLUSTER_ERRORS as e:
            saved_step, directory = (
                self.checkpoint_status() if self.checkpoint_status else (None, None)
            )
            explained = explain_cluster_error(
                e,
                cluster=self._cluster(),
                step=self.scheduled_steps,
                total_steps=self.total_steps or self.scheduled_steps,
                checkpoint_step=saved_step,
                checkpoint_dir=directory,
            )
            if explained is None:
                raise
            raise explained from None

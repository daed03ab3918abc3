"""Synchronous strategies: every replica runs every step (one_device, mirrored, tpu,
multi_worker_mirrored, and the default strategy).

The model's own `train_step` / `test_step` runs inside `strategy.run`, as Keras's fit runs
it on one host, so a user's overridden step runs unchanged. Keras scales each replica's loss
by 1/replicas, so with equal per-replica batches the all-reduced gradient is that of the
global batch; metric variables are summed over the replicas (one all-reduce per dtype), so
the logs are those of every replica and worker.

The optimizer's update runs through the step's chain of StepHooks (steps.updates_through),
whose first link, a StepClock, times the step's phases in the graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist import strategy_kinds as kinds
from tfdist.training import loss_normalisation
from tfdist.training.batch_norm import MovingStatistics
from tfdist.training.engine import Engine, EngineState, Report
from tfdist.training.fit_data import FitData, unpack
from tfdist.training.hooks import StepHook
from tfdist.training.job import Job, LockstepJob
from tfdist.training.loop import NO_LIMIT, StepLoop, call_until_end, each_batch
from tfdist.training.runners.common import (
    batch_size,
    logs_from_state,
    metric_names,
    refuse_asynchronous_hooks,
    refuse_staleness_scaling,
)
from tfdist.training.step_times import PHASES, StepTimes
from tfdist.training.steps import (
    StepClock,
    custom_test_step,
    custom_train_step,
    hooked_train_step,
    own_optimizers,
    python_logs,
    step_logs,
    traced,
    updates_through,
)


class SyncRunner(Engine):
    """Synchronous strategies; see the module docstring.

    Args:
      model: the compiled model.
      strategy: its strategy.
      job: the job it trains in (default: a LockstepJob of `strategy`).
      builds_optimizer: whether `build` builds the user's optimizer where it is not built
        (an engine that keeps its slots elsewhere, a pipeline's stages, builds it itself).
    """

    kinds = (
        kinds.DEFAULT,
        kinds.ONE_DEVICE,
        kinds.MIRRORED,
        kinds.MULTI_WORKER_MIRRORED,
        kinds.TPU,
    )

    def __init__(
        self,
        model: keras.Model,
        strategy: tf.distribute.Strategy,
        *,
        job: Job | None = None,
        builds_optimizer: bool = True,
    ):
        self.model, self.strategy = model, strategy
        self.job = job or LockstepJob(strategy)
        self.builds_optimizer = builds_optimizer
        self.custom = custom_train_step(model)
        self.own_optimizers = list(own_optimizers(model).values())
        self.hooks: list[StepHook] = []
        self._steps = StepLoop(
            self._timed_step,
            start=lambda: tf.zeros([len(PHASES)], tf.float64),
            untimed=self._untimed_step,
            last=self._last_step,
        )
        self._one_fns: dict[str, tf.types.experimental.PolymorphicFunction] = {}
        self.metric_variables: list[keras.Variable] = []
        self._read_state = traced(lambda: self._metric_state(reduce=True))
        self._read_local_state = traced(lambda: self._metric_state(reduce=False))
        self._resets: dict[int, tf.types.experimental.PolymorphicFunction] = {}
        self._test_steps: StepLoop | None = None
        self.moving_statistics: MovingStatistics | None = None
        self._metric_names: list[str] | None = None
        # What the epoch's last step returned (a custom train_step's own logs).
        self._last_outputs = None
        self.times = StepTimes()

    # --- building and data --------------------------------------------------------------------

    def build(self, sample_batch, step_hooks: Sequence[StepHook] = ()) -> None:
        refuse_staleness_scaling(self.model, self.strategy)
        refuse_asynchronous_hooks(step_hooks, self.strategy)
        optimizer = self.model.optimizer
        with self.strategy.scope():
            # A hook may keep the optimizer's state itself (a sharded update builds the
            # optimizer for its slice): hooks build first, the optimizer after if none did.
            compat.symbolic_build(self.model, sample_batch, build_optimizer=False)
            for hook in step_hooks:
                hook.build(self.model, self.job)
            if optimizer is not None and not optimizer.built and self.builds_optimizer:
                optimizer.build(self.model.trainable_variables)
        self.hooks = list(step_hooks)
        # A hook may have put its own stand-in for an optimizer the step applies itself.
        self.own_optimizers = list(own_optimizers(self.model).values())
        self.metric_variables = list(self.model.metrics_variables)
        self.moving_statistics = MovingStatistics(
            self.model, self.strategy, is_chief=self.job.is_chief
        )

    # --- one step -----------------------------------------------------------------------------

    def _replica_step(self, batch, asked):
        """The model's train_step on one replica's batch, timed: (outputs, [3] seconds).

        `asked` is when the batch was asked for; the batch's arrival, the gradients and the
        updated weights are marked in the graph as they happen.
        """
        with tf.control_dependencies(_tensors(batch)):
            arrived = tf.timestamp()
        clock = StepClock()
        with self._updates_routed([clock]), loss_normalisation.global_batch():
            outputs = hooked_train_step(self.model, self.hooks)(batch)
        with tf.control_dependencies(_tensors(outputs)):
            end = tf.timestamp()
        exchange = clock.exchange()
        if exchange is None:  # no update: all of it was compute
            exchange = tf.zeros([], end.dtype)
        # Input, compute (forward, backward, and the metrics after the update), exchange.
        times = tf.stack([arrived - asked, end - arrived - exchange, exchange])
        return outputs, times

    def _untimed_step(self, batch, times):
        """One step on every replica, with no marks in its graph (a call's steps but its
        last: the marks' control edges cost a small step more than they tell)."""

        def replica(batch):
            with self._updates_routed(), loss_normalisation.global_batch():
                return hooked_train_step(self.model, self.hooks)(batch)

        self.strategy.run(replica, args=(batch,))
        return times

    @contextlib.contextmanager
    def _updates_routed(self, first: Sequence[StepHook] = ()):
        """While a step is traced: the updates of compile's optimizer through `first` (a
        clock) and the hooks, and those of a custom step's own optimizers (a GAN's two)
        through `first` and the hooks that take them on (a sharded update's siblings)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(updates_through(self.model.optimizer, [*first, *self.hooks]))
            for optimizer in self.own_optimizers:
                chain = [hook for own in self.hooks for hook in own.chain_for(optimizer)]
                stack.enter_context(updates_through(optimizer, [*first, *chain]))
            yield

    def _step(self, batch, asked):
        """One step on every replica: (what the step returned, the local replicas' mean times)."""
        strategy = self.strategy
        outputs, times = strategy.run(self._replica_step, args=(batch, asked))
        local = strategy.experimental_local_results(times)
        return outputs, tf.add_n(list(local)) / len(local)

    def _timed_step(self, batch, asked, total):
        """A timed step whose times add to `total` (the steps' summed [3] seconds)."""
        _, times = self._step(batch, asked)
        return total + times

    def _last_step(self, batch, asked, total):
        """A call's last step: also what the step returned, for a model's own train_step.
        Logs are read by a call of their own: an all-reduce of metric state in the same graph
        as the gradients' would share the ring all-reduce's transfer keys."""
        outputs, times = self._step(batch, asked)
        return total + times, (outputs if self.custom else None)

    def _one(self, kind: str, batch):
        """One step of `kind` ('train' or 'test') on a batch; returns what the step returned."""
        if kind not in self._one_fns:
            model, strategy, hooks = self.model, self.strategy, self.hooks

            def replica(batch):
                if kind == "test":
                    return model.test_step(batch)
                with self._updates_routed():
                    return hooked_train_step(model, hooks)(batch)

            self._one_fns[kind] = traced(lambda batch: strategy.run(replica, args=(batch,)))
        return self._one_fns[kind](batch)

    # --- training -----------------------------------------------------------------------------

    def train(self, iterator, n: int, *, bounded: bool, logs: str | None):
        with self.job.explained():
            if self.custom and not bounded:
                # The user's step on data of unknown length: a step a call (untimed), its
                # last return value giving the logs.
                done, outputs = each_batch(iterator, n, lambda batch: self._one("train", batch))
            else:
                done, times, outputs = self._steps(iterator, n, bounded=bounded)
                done = int(done)
                # Bounded, the call's last step alone is timed: a sample of its steps.
                self.times.add(1 if bounded else done, np.asarray(times))
            if self.custom and done:
                self._last_outputs = outputs
            return done, (self._read_logs(logs) if logs and done else None)

    def _read_logs(self, scope: str) -> dict[str, float]:
        if scope == "local":  # this process's replicas: no collective, for a progress bar
            if self._last_outputs is not None:
                return self._logs_of(self._last_outputs, local=True)
            return self._metrics(local=True)
        return self.logs()

    def _mean(self, value, *, local: bool = False):
        if not isinstance(value, (tf.Tensor, tf.distribute.DistributedValues)):
            return value
        if local:
            parts = [np.asarray(v) for v in self.strategy.experimental_local_results(value)]
            return np.mean(parts, axis=0)
        return self.strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None)

    def _logs_of(self, outputs, *, local: bool = False) -> dict[str, float]:
        if self._metric_names is None:
            self._metric_names = metric_names(self.model)
        return step_logs(
            outputs,
            metric_names=self._metric_names,
            metrics=lambda: self._metrics(local=local),
            mean=lambda value: self._mean(value, local=local),
        )

    def _metric_state(self, *, reduce: bool) -> list[tf.Tensor]:
        # Every metric variable summed over the replicas in one all-reduce per dtype, rather
        # than a reduce per variable: cheaper across workers, and tfdist's ring cannot take
        # several unfused all-reduces in one graph. Without `reduce`: this process's
        # replicas only, added here, with no collective.
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
        if reduce:
            flats = {
                dtype: self.strategy.reduce(tf.distribute.ReduceOp.SUM, flat, axis=None)
                for dtype, flat in per_replica.items()
            }
        else:
            flats = {
                dtype: tf.add_n(list(self.strategy.experimental_local_results(flat)))
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
        with self.job.explained():
            if self._last_outputs is not None:
                return self._logs_of(self._last_outputs)
            return self._metrics()

    def reset(self) -> None:
        self._last_outputs = None
        self.times = StepTimes()
        self._reset_metrics()

    def _reset_metrics(self) -> None:
        """The model's reset_metrics, each replica resetting its own part of the state in one
        traced call. Called across replicas, a metric variable's assign reads the variable
        back, an all-reduce each (4 for a loss and an accuracy: 18 ms across 2 processes on
        this machine, where an epoch of a small model's steps takes 500)."""
        count = len(self.model.metrics_variables)  # a metric built since: traced again
        if count not in self._resets:
            model, strategy = self.model, self.strategy

            def replica():
                for metric in model.metrics:
                    metric.reset_state()

            self._resets[count] = traced(lambda: strategy.run(replica))
        self._resets[count]()

    def begin(self, global_step: int) -> None:
        del global_step  # synchronous updates count themselves
        for hook in self.hooks:
            hook.start()

    def settle(self) -> None:
        # Before validation and the callbacks that save: one model, not one per replica.
        with self.job.explained():
            self.moving_statistics.average()
            for hook in self.hooks:
                hook.settle()

    def report(self) -> Report:
        figures: dict[str, float | int | None] = {}
        for hook in self.hooks:
            figures.update(hook.summary())
        return Report(step_times=self.times.per_step(), figures=figures)

    def state(self) -> EngineState:
        variables = {}
        for hook in self.hooks:
            variables.update(hook.checkpoint_state())
        shards = next((s for s in (h.checkpoint_shards() for h in self.hooks) if s), None)
        return EngineState(variables, shards)

    # --- evaluation ---------------------------------------------------------------------------

    def evaluate(self, data: FitData, steps: int | None) -> dict[str, float]:
        with self.job.explained():
            return self._evaluate(data, steps)

    def _evaluate(self, data: FitData, steps: int | None) -> dict[str, float]:
        self.moving_statistics.average()
        self._reset_metrics()
        iterator = iter(data.distribute(self.strategy))
        if custom_test_step(self.model):
            # The user's test_step runs as Keras's evaluate runs it, a step a call, and its
            # last return value gives the logs (Keras's rule).
            done, outputs = each_batch(
                iterator, steps or NO_LIMIT, lambda batch: self._one("test", batch)
            )
            return self._logs_of(outputs) if done else self._metrics()
        if self._test_steps is None:
            model, strategy = self.model, self.strategy
            # Weights held in parts across worker processes (zero3, a pipeline) are read by
            # collectives, which the strategy cannot make inside a cond's branch.
            together = self.job.placement.processes > 1 and any(
                getattr(compat.storage_of(v), "read_by_collectives", False)
                for v in model.trainable_variables
            )

            def replica_test(batch):
                def run():
                    model.test_step(batch)
                    return tf.constant(0)

                if together:
                    run()
                    return
                # The last batch can leave a replica without examples, and some kernels
                # (oneDNN's convolution) reject an empty batch: such a replica adds nothing.
                x, _, _ = unpack(batch)
                tf.cond(batch_size(x) > 0, run, lambda: tf.constant(0))

            def step(batch, ran):  # a count to carry: a cond's branches return something
                strategy.run(replica_test, args=(batch,))
                return ran + 1

            self._test_steps = StepLoop(step, start=lambda: tf.constant(0), timed=False)
        call_until_end(
            lambda n: int(self._test_steps(iterator, n, bounded=False)[0]), self.model, steps
        )
        return self._metrics()

    def _metrics(self, *, local: bool = False) -> dict[str, float]:
        if not self.metric_variables:
            return python_logs(self.model.get_metrics_result())
        state = self._read_local_state() if local else self._read_state()
        return logs_from_state(self.model, self.metric_variables, state)


def _tensors(structure) -> list[tf.Tensor]:
    return [t for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor)]

"""parameter_server: closures of steps scheduled on any free worker by a ClusterCoordinator.

Metric variables live on the ps tasks there and several workers would update them at once
(racing), so each closure accumulates its metric state in local tensors (Keras's stateless
metric API) and returns it; the coordinator adds the states up, the same sum a replica read
does. Each step's staleness (the updates that landed between its read of the weights and its
own update) is counted on a ps and logged beside the metrics.

Each step is timed on its worker (step_times.py): input is the worker's `next` on its copy of
the data; exchange runs from its gradients being ready to its update applied on the ps (the
gradients' push and the update). A closure returns its steps' times beside their metric state,
and a lost worker's times are lost with its metrics.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist import strategy_kinds as kinds
from tfdist.training.engine import EngineState, Report
from tfdist.training.faults import CLUSTER_ERRORS, lost_worker
from tfdist.training.fit_data import FitData
from tfdist.training.hooks import AsyncStep, StepHook
from tfdist.training.job import CoordinatedJob
from tfdist.training.loop import StepLoop
from tfdist.training.ps_shards import ShardedTraining
from tfdist.training.runners.stateless import StatelessMetricsRunner, StepMarks
from tfdist.training.staleness import (
    STALENESS_STATS,
    StalenessAwareSchedule,
    StalenessStats,
    UpdateCounter,
)
from tfdist.training.step_times import PHASES
from tfdist.training.steps import traced, updates_through

log = logging.getLogger(__name__)

# The staleness bound parameter-server training takes when a binary asks for 'auto': the
# option that learned best in tools/exchange_bench.py, for Adam and for SGD with momentum
# (README "Which exchange for which cluster"; the figures are in --max_staleness's help).
PS_MAX_STALENESS = 0


class SplitReplica(Protocol):
    """A worker's replica that computes its gradients its own way (Downpour's, split over the
    worker's devices: tfdist.parallel.pipeline.downpour)."""

    def build(self, engine: ParameterServerRunner, sample_batch: Any) -> None:
        """Once the engine has built the model and its hooks: checks and plans the split."""

    def gradients(self, batch: Any, state: list) -> tuple[list, list]:
        """One step's (gradient, variable) pairs and metric state (while traced)."""


class ClaimUpdate(StepHook):
    """The link of an asynchronous step's chain, ahead of the user's hooks, that counts its
    update: once the gradients exist and the hooks' before_update waits are over, it claims
    the update counter (the step's staleness), and the update, under a staleness-aware
    rate's scaling, runs after the claim. A hook's `apply` (bounded staleness marking the
    update written) so always sees `step.staleness` set, and anything that follows the
    update follows its claim: a step that reads the weights once another's update is
    written also sees that update counted."""

    def __init__(self, runner: ParameterServerRunner, step: AsyncStep, read: tf.Tensor):
        self.runner, self.step, self.read = runner, step, read

    def apply(self, grads_and_vars, apply_next):
        if self.step.staleness is None:  # one claim a step, at its first update
            grads = [g for g, _ in grads_and_vars if g is not None]
            self.runner._claim(self.step, self.read, after=grads)
        schedule = compat.learning_rate_schedule(self.runner.model.optimizer)
        scaled = (
            schedule.scaled(self.step.staleness)
            if isinstance(schedule, StalenessAwareSchedule)
            else contextlib.nullcontext()
        )
        with scaled, tf.control_dependencies([self.step.staleness]):
            return apply_next(list(grads_and_vars))


class ParameterServerRunner(StatelessMetricsRunner):
    """parameter_server: closures of `n` steps scheduled on any free worker; see the module."""

    kinds = (kinds.PARAMETER_SERVER,)

    def __init__(
        self,
        model: keras.Model,
        strategy: tf.distribute.Strategy,
        *,
        replica: SplitReplica | None = None,
    ):
        """`replica`: a worker's replica computes its gradients its own way (Downpour's
        split over the worker's devices: tfdist.parallel.pipeline.downpour); None: the
        model's layers in one program.

        The coordinator, the update counter on a ps and the closures' traced steps serve
        the model's next call too; each call starts its own count, data and staleness
        figures."""
        super().__init__(model, strategy, CoordinatedJob(strategy, scheduled=self._scheduled))
        self.coordinator = self.job.coordinator
        self.replica = replica
        # (steps, the closure's RemoteValue) of the closures whose results are not added yet.
        self._pending: collections.deque = collections.deque()
        # Results are fetched a few closures behind the newest: the progress stays current
        # without waiting on every step.
        self._lag = 2 * max(1, len(self.job.cluster().get("worker", [])))
        self._steps: StepLoop | None = None  # the closures' traced steps
        self._eval_step = traced(
            lambda batch, state: (
                self._user_step(model.test_step, batch, state)
                if self.custom_test
                else (None, self._stateless_test_step(batch, state))
            )
        )
        with strategy.scope():  # on a ps, beside the variables whose updates it counts
            self.counter = UpdateCounter()
        # What the coordinator learnt of the updates' staleness, per epoch and per call.
        self.staleness = StalenessStats()
        self.scheduled_steps = self._first_step = 0
        self._landed = 0
        self._told_twice = 0  # updates applied twice that a report has warned of

    def _scheduled(self) -> int:
        return self.scheduled_steps

    def _step_with_staleness(self, batch, asked, state, ticket):
        marks = StepMarks(asked, batch)
        step = AsyncStep(ticket)
        # The counter is read before the step reads the weights, and claimed once its
        # gradients exist, just before its update: the updates that landed in between are
        # its staleness. Hooks may wait before either (bounded staleness) and remember what
        # was read.
        read = self._read(step)
        with tf.control_dependencies([read]):
            gradients, state = (
                self._stateless_gradients(batch, state)
                if self.replica is None
                else self.replica.gradients(batch, state)
            )
        chain = [marks.clock, ClaimUpdate(self, step, read), *self.hooks]
        with updates_through(self.model.optimizer, chain):
            self.model.optimizer.apply_gradients(gradients)
        return state, step.staleness, marks.end(after=[state, step.staleness])

    def _user_step_with_staleness(self, batch, asked, state, ticket):
        marks = StepMarks(asked, batch)
        # The model's own train_step applies its gradients itself, through the same chain:
        # its update is claimed there too, once its gradients exist.
        step = AsyncStep(ticket)
        read = self._read(step)
        with tf.control_dependencies([read]):
            outputs, state = self._user_step(
                self.model.train_step, batch, state, clock=marks.clock,
                claim=ClaimUpdate(self, step, read),
            )  # fmt: skip
        if step.staleness is None:  # a step that updated nothing counts as it ends
            self._claim(step, read, after=[*state, *tf.nest.flatten(outputs)])
        staleness = step.staleness
        return outputs, state, staleness, marks.end(after=[outputs, state, staleness])

    def _read(self, step: AsyncStep) -> tf.Tensor:
        """The update counter, read once the hooks' begin_step (a wait, a snapshot) is done."""
        begun = [t for hook in self.hooks for t in hook.begin_step(step)]
        with tf.control_dependencies(begun):
            return self.counter.read()

    def _claim(self, step: AsyncStep, read, *, after) -> tf.Tensor:
        """The step's staleness, claimed once the hooks' before_update (a wait) is done."""
        with tf.control_dependencies(after):
            ready = [t for hook in self.hooks for t in hook.before_update(step)]
        step.staleness = self.counter.claim(read, after=[*after, *ready])
        return step.staleness

    def _closure(self):
        """The traced function a closure runs on a worker: `(iterator, n, first)`, or with the
        model's own step `(iterator, n, first, start)`. It returns (metric state, staleness
        stats, its steps' summed times, and for the model's own step what its last step
        returned); a None among these would fail the fetch. `first` is the ticket
        (AsyncStep) of the closure's first step."""
        if self._steps is None:
            strategy = self.strategy

            def count(stats, tau):  # [sum, max, count] of the closure's staleness
                return tf.stack([stats[0] + tau, tf.maximum(stats[1], tau), stats[2] + 1.0])

            def zeros():
                return tf.zeros([STALENESS_STATS]), tf.zeros([len(PHASES)], tf.float64)

            if not self.custom_train:

                def step(batch, asked, carried):
                    ticket, state, stats, total = carried
                    state, tau, times = strategy.run(
                        self._step_with_staleness, args=(batch, asked, state, ticket)
                    )
                    return ticket + 1, state, count(stats, tau), total + times

                self._steps = StepLoop(
                    step,
                    start=lambda first: (first, self._zero_tensors(), *zeros()),
                    finish=lambda done, carried, outputs, first: carried[1:],
                )
            else:
                # The model's own step starts from the epoch's metric state as the
                # coordinator knew it, so what it returns covers the epoch so far; the
                # closure hands back only what its own steps added.
                def user_step(batch, asked, carried):
                    ticket, state, stats, total = carried
                    outputs, state, tau, times = strategy.run(
                        self._user_step_with_staleness, args=(batch, asked, state, ticket)
                    )
                    return (ticket + 1, state, count(stats, tau), total + times), outputs

                def finish(done, carried, outputs, first, start):
                    _, state, stats, total = carried
                    added = [end - begin for end, begin in zip(state, start, strict=True)]
                    return added, stats, total, outputs

                self._steps = StepLoop(
                    lambda *args: user_step(*args)[0],
                    start=lambda first, start: (first, list(start), *zeros()),
                    last=user_step,
                    finish=finish,
                )
        return self._steps.function(bounded=True)

    # --- the engine ------------------------------------------------------------------------------

    def build(self, sample_batch, step_hooks: Sequence[StepHook] = ()) -> None:
        # A partitioner may have split variables across the ps tasks: the optimizer is then
        # built over their shards (ps_shards.py).
        self._prepare(
            ShardedTraining.attach(self.model, self.strategy, sample_batch),
            step_hooks,
            asynchronous=True,
        )
        if self.replica is not None:
            self.replica.build(self, sample_batch)

    def train(self, iterator, n: int, *, bounded: bool, logs: str | None):
        del bounded  # per-worker data repeats without end
        with_logs = logs is not None
        with self.job.explained():
            first = tf.constant(self.scheduled_steps - self._first_step, tf.int64)
            args = (iterator, n, first, *([self._state] if self.custom_train else []))
            self._pending.append((n, self.coordinator.schedule(self._closure(), args=args)))
            self.scheduled_steps += n
            while len(self._pending) > self._lag or (with_logs and not self._landed):
                # Batch logs wait for the epoch's first closure: before it they would be zeros.
                self._add(*self._pending.popleft())
        return n, (self.logs() if with_logs else None)

    def _add(self, steps: int, remote) -> None:
        """Adds what a closure of `steps` steps returned (`remote`) to the epoch's figures."""
        try:
            values = remote.fetch()
        except CLUSTER_ERRORS as e:
            worker = lost_worker(e, cluster=self.job.cluster())
            if worker is None:
                raise
            worker = self.job.task_name(worker)
            # The steps ran and their updates reached the ps; their metrics died with it.
            log.warning("The metrics of steps that ran on %s were lost with it", worker)
            return
        state, stats, times, *outputs = values  # the model's own step's outputs come last
        self._landed += 1
        self._add_state(state)
        self.times.add(steps, np.asarray(times))
        if outputs:
            self._last_outputs = tf.nest.map_structure(np.asarray, outputs[0])
        self.staleness.add(*np.asarray(stats).tolist())

    def begin(self, global_step: int) -> None:
        """Starts counting at `global_step` (a resumed run counts on from its checkpoint)."""
        # A model's next call counts on from its updates so far, as Keras's fit does: its
        # optimizer's iterations, exact since the last call's settle (or a restore).
        done = int(self.model.optimizer.iterations.numpy())
        self.scheduled_steps = self._first_step = max(global_step, done)
        if self.counter.value() < self.scheduled_steps:
            # A new counter on a trained model: the updates before it count once, so that
            # applied minus scheduled still finds those a re-run closure applied twice.
            self.counter.variable.assign(self.scheduled_steps)
        self.staleness = StalenessStats()  # this call's figures
        for hook in self.hooks:
            hook.start()

    def logs(self) -> dict[str, float]:
        # Staleness is part of what asynchronous training did: logged beside the metrics.
        return {**super().logs(), **self.staleness.epoch_metrics()}

    def reset(self) -> None:
        self._pending.clear()
        self._landed = 0  # closures of this epoch whose results arrived
        self.staleness.reset_epoch()
        super().reset()

    def settle(self) -> None:
        with self.job.explained():
            self.coordinator.join()  # the epoch ends when every scheduled step has run
            while self._pending:
                self._add(*self._pending.popleft())
            for hook in self.hooks:
                hook.settle()
            # Keras's iteration counter loses increments under asynchronous updates; the
            # coordinator's count is exact, and drives the learning-rate schedule.
            self.model.optimizer.iterations.assign(self.scheduled_steps)

    def state(self) -> EngineState:
        # Saved so that updates applied minus steps counts the updates a dead worker's re-run
        # closures applied twice, across restarts too.
        return EngineState({"applied_updates": self.counter.variable})

    def report(self) -> Report:
        mean, largest = self.staleness.run_summary()
        applied, steps = self.counter.value(), self.scheduled_steps
        if applied - steps > self._told_twice:  # said once, where the report is first read
            self._told_twice = applied - steps
            log.warning(
                "%d update(s) reached the parameters twice: a worker died after applying them "
                "and the coordinator ran its closure again elsewhere (%d updates for %d steps)",
                applied - steps, applied, steps,
            )  # fmt: skip
        figures = {"staleness_mean": mean, "staleness_max": largest, "applied_updates": applied}
        hooks = super().report()
        return Report(step_times=hooks.step_times, figures={**figures, **hooks.figures})

    def evaluate(self, data: FitData, steps: int | None) -> dict[str, float]:
        # On the coordinator, reading the variables from the ps tasks: every example once.
        state, outputs = self._zeros(), None
        dataset = data.local()
        if steps is not None:
            dataset = dataset.take(steps)
        with self.job.explained():
            for batch in dataset:
                outputs, state = self._eval_step(batch, state)
        if outputs is None:
            return self._logs_of(state)
        return self._step_logs(tf.nest.map_structure(np.asarray, outputs), state)

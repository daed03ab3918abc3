"""How each kind of strategy runs the Trainer's steps; `Trainer._fit` drives either one.

Both runners offer the same few calls — run(n), peek(), finish_epoch(step), evaluate(),
save(step) — so the loop in tfdist/training/loop.py is written once for every strategy.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import TYPE_CHECKING

import tensorflow as tf

from tfdist.data import distribute_dataset
from tfdist.training.faults import CLUSTER_ERRORS, explain_cluster_error, lost_worker
from tfdist.training.staleness import STALENESS_STATS, StalenessStats

if TYPE_CHECKING:
    from tfdist.training.loop import Trainer

log = logging.getLogger(__name__)


class SyncRunner:
    """Synchronous strategies: every replica runs every step; sums live in ON_READ variables."""

    def __init__(self, run: Trainer, start_step: int):
        self.run_state = run
        strategy = run.strategy
        self.iterator = iter(
            distribute_dataset(
                strategy,
                run.train_dataset_fn(start_step),
                global_batch_size=run.config.global_batch_size,
            )
        )

        def replica_train(images, labels):
            run.train_sums.assign_add(run.replica_step(images, labels))

        def replica_eval(images, labels):
            run.eval_sums.assign_add(run.replica_eval(images, labels))

        @tf.function
        def train_steps(iterator, n):
            for _ in tf.range(n):
                strategy.run(replica_train, args=next(iterator))

        @tf.function
        def train_step(iterator):
            strategy.run(replica_train, args=next(iterator))

        # One step needs no graph loop around it, which spares a small model's step on a CPU
        # the loop's per-iteration overhead.
        self._train_steps = train_steps
        self._train_step = train_step
        self._eval_step = tf.function(lambda batch: strategy.run(replica_eval, args=batch))

    def reset_sums(self):
        self.run_state.train_sums.assign(tf.zeros([3]))

    def run(self, n: int) -> None:
        if n == 1:
            self._train_step(self.iterator)
        else:
            self._train_steps(self.iterator, tf.constant(n, tf.int64))

    def peek(self) -> list[float]:
        # Reading an ON_READ variable sums it over the replicas: every worker must read.
        return self.run_state.train_sums.read_value().numpy().tolist()

    def finish_epoch(self, step: int) -> list[float]:
        self.run_state.step.assign(step)
        return self.run_state.train_sums.read_value().numpy().tolist()

    def evaluate(self) -> list[float]:
        run = self.run_state
        run.eval_sums.assign(tf.zeros([3]))
        dataset = distribute_dataset(
            run.strategy, run.eval_dataset_fn, global_batch_size=run.config.global_batch_size
        )
        for batch in dataset:
            self._eval_step(batch)
        return run.eval_sums.read_value().numpy().tolist()

    def save(self, step: int) -> None:
        self.run_state.step.assign(step)
        self.run_state.checkpoints.save(step)  # every worker saves; only the chief keeps it

    def epoch_metrics(self) -> dict[str, float]:
        return {}  # staleness is 0 by construction: not measured, not reported

    def run_summary(self) -> dict[str, float | int | None]:
        return {}


class ParameterServerRunner:
    """parameter_server: steps are closures the coordinator schedules on any free worker.

    A worker that dies is survived: the coordinator re-queues the closure it was running and
    another worker runs it (its updates that reached the ps before it died are then applied
    twice; `applied_updates` - `steps` in summary.json counts them). A ps that dies ends
    training with ClusterTaskFailed, which says where a restart resumes.
    """

    def __init__(self, run: Trainer, start_step: int):
        self.run_state = run
        strategy = run.strategy
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        per_worker = distribute_dataset(
            strategy,
            run.train_dataset_fn(start_step),
            global_batch_size=run.config.global_batch_size,
            coordinator=self.coordinator,
        )
        self.iterator = iter(per_worker)

        @tf.function
        def train_steps(iterator, n):
            # [loss sum, correct, count] + [staleness sum, staleness max, updates]
            totals = tf.zeros([3])
            staleness = tf.zeros([STALENESS_STATS])
            for _ in tf.range(n):
                out = strategy.run(run.replica_step, args=next(iterator))
                totals += out[:3]
                staleness = tf.stack(
                    [staleness[0] + out[3], tf.maximum(staleness[1], out[3]), staleness[2] + 1.0]
                )
            return tf.concat([totals, staleness], axis=0)

        self._train_steps = train_steps
        # Results are fetched a few closures behind the newest, which keeps the progress bar
        # current without waiting on every step.
        self._lag = 2 * len(run.cluster.cluster["worker"])
        self._pending: collections.deque = collections.deque()
        self._sums = [0.0, 0.0, 0.0]
        self.staleness = StalenessStats()
        self._eval_fn = tf.function(run.replica_eval)
        # For the message if a ps dies: how far training got, and where a restart resumes.
        self._scheduled_step = start_step
        self._saved_step = start_step if run.checkpoints.directory and start_step else None

    @contextlib.contextmanager
    def _explained(self):
        # Every call that waits on the ps tasks goes through here, so that a dead ps ends the
        # run with one message instead of TensorFlow's traceback.
        try:
            yield
        except CLUSTER_ERRORS as e:
            run = self.run_state
            explained = explain_cluster_error(
                e,
                cluster=dict(run.cluster.cluster) if run.cluster else None,
                step=self._scheduled_step,
                total_steps=run.total_steps,
                checkpoint_step=self._saved_step,
                checkpoint_dir=run.checkpoints.directory,
            )
            if explained is None:
                raise
            raise explained from None

    def reset_sums(self):
        self._pending.clear()
        self._sums = [0.0, 0.0, 0.0]
        self.staleness.reset_epoch()

    def run(self, n: int) -> None:
        with self._explained():
            self._pending.append(
                self.coordinator.schedule(
                    self._train_steps, args=(self.iterator, tf.constant(n, tf.int64))
                )
            )
            self._scheduled_step += n
            while len(self._pending) > self._lag:
                self._add(self._pending.popleft())

    def peek(self) -> list[float]:
        return self._sums

    def _add(self, remote) -> None:
        try:
            values = [float(v) for v in remote.fetch()]
        except CLUSTER_ERRORS as e:
            run = self.run_state
            worker = lost_worker(e, cluster=dict(run.cluster.cluster) if run.cluster else None)
            if worker is None:
                raise
            # The steps ran and their updates reached the ps; their sums died with the worker.
            log.warning(
                "The loss and accuracy of steps that ran on %s were lost with it; this "
                "epoch's training metrics leave them out",
                worker,
            )
            return
        self._sums = [a + b for a, b in zip(self._sums, values[:3], strict=True)]
        self.staleness.add(*values[3:])

    def finish_epoch(self, step: int) -> list[float]:
        with self._explained():
            self.coordinator.join()  # the epoch ends when every scheduled step has run
            while self._pending:
                self._add(self._pending.popleft())
            run = self.run_state
            run.step.assign(step)
            # Keep the optimizer's own counter (which drives the learning-rate schedule) on ours.
            run.optimizer.iterations.assign(step)
        return self._sums

    def epoch_metrics(self) -> dict[str, float]:
        return self.staleness.epoch_metrics()

    def run_summary(self) -> dict[str, float | int | None]:
        mean, largest = self.staleness.run_summary()
        with self._explained():
            applied = self.run_state.update_counter.value()
        if applied > self._scheduled_step:
            log.warning(
                "%d update(s) reached the parameters twice: a worker died after applying them "
                "and the coordinator ran its closure again elsewhere (%d updates for %d steps)",
                applied - self._scheduled_step, applied, self._scheduled_step,
            )  # fmt: skip
        return {"staleness_mean": mean, "staleness_max": largest, "applied_updates": applied}

    def evaluate(self) -> list[float]:
        # On the coordinator: it reads the variables from the ps tasks.
        run = self.run_state
        sums = tf.zeros([3])
        with self._explained():
            for batch in run.eval_dataset_fn(None, run.config.global_batch_size):
                sums += self._eval_fn(*batch)
            return sums.numpy().tolist()

    def save(self, step: int) -> None:
        with self._explained():
            self.coordinator.join()
            self.run_state.step.assign(step)
            self.run_state.checkpoints.save(step)
        if self.run_state.checkpoints.directory:
            self._saved_step = step

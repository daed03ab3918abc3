"""central_storage: synchronous replicas, variables once on the CPU, metric state in tensors."""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist import strategy_kinds as kinds
from tfdist.training.fit_data import FitData, unpack
from tfdist.training.hooks import StepHook
from tfdist.training.job import Job
from tfdist.training.loop import NO_LIMIT, StepLoop, call_until_end, each_batch
from tfdist.training.runners.common import batch_size, refuse_staleness_scaling
from tfdist.training.runners.stateless import StatelessMetricsRunner
from tfdist.training.step_times import PHASES
from tfdist.training.steps import traced


class CentralStorageRunner(StatelessMetricsRunner):
    """central_storage: synchronous replicas, variables on one device, metrics in tensors.

    A model's own train_step / test_step runs on every replica with that replica's running
    metric state (carried between steps in a tensor stacked over the replicas), so what it
    returns is what it would return under mirrored, where each replica keeps its own.

    Keras's own train_step is timed (step_times.py): its exchange is the gradients' reduction
    to the variables' device and the update there. A model's own train_step runs a step a
    call and is not timed, as under the synchronous runner on data of unknown length.
    """

    kinds = (kinds.CENTRAL_STORAGE,)

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy):
        super().__init__(model, strategy, Job(strategy))
        self._custom_fns: dict[str, tf.types.experimental.PolymorphicFunction] = {}
        self._stacked: list[tf.Tensor] = []

        def replica_train(batch, asked):
            return self._stateless_train_step(batch, self._zero_tensors(), asked)

        def replica_test(batch):
            x, _, _ = unpack(batch)
            zeros = self._zero_tensors()
            # A replica the last batch left without examples adds nothing.
            return tf.cond(
                batch_size(x) > 0, lambda: self._stateless_test_step(batch, zeros), lambda: zeros
            )

        def train_step(batch, asked, carried):
            state, total = carried
            per_replica, times = self.strategy.run(replica_train, args=(batch, asked))
            local = self.strategy.experimental_local_results(times)
            return self._add_replicas(state, per_replica), total + tf.add_n(list(local)) / len(
                local
            )

        def test_step(batch, state):
            return self._add_replicas(state, self.strategy.run(replica_test, args=(batch,)))

        # (steps run, metric state summed over them and the replicas, and for training their
        # [input, compute, exchange] seconds, summed: mean over the replicas), until the data
        # ends.
        self._train_steps = StepLoop(
            train_step,
            start=lambda: (self._zero_tensors(), tf.zeros([len(PHASES)], tf.float64)),
        )
        self._test_steps = StepLoop(test_step, start=self._zero_tensors, timed=False)

    def _add_replicas(self, state, per_replica) -> list[tf.Tensor]:
        """`state` plus one step's metric state summed over the replicas."""
        return [
            total + self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
            for total, value in zip(state, per_replica, strict=True)
        ]

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

            @traced
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

        done, outputs = each_batch(iterator, n, call)
        return done, outputs, stacked

    def build(self, sample_batch, step_hooks: Sequence[StepHook] = ()) -> None:
        refuse_staleness_scaling(self.model, self.strategy)
        with self.strategy.scope():
            compat.symbolic_build(self.model, sample_batch, build_optimizer=False)
        self._prepare(None, step_hooks)
        self._stacked = self._replica_zeros()

    def train(self, iterator, n: int, *, bounded: bool, logs: str | None):
        # One process: its logs are the job's ("local" and "global" alike).
        if self.custom_train:  # a step a call, untimed
            done, outputs, self._stacked = self._custom_steps("train", iterator, n, self._stacked)
            self._state = [np.asarray(s).sum(axis=0) for s in self._stacked]
            if done:
                self._last_outputs = tf.nest.map_structure(np.asarray, outputs)
            return done, (self.logs() if logs and done else None)
        done, (state, times), _ = self._train_steps(iterator, n, bounded=False)
        done = int(done)
        self._add_state(state)
        self.times.add(done, np.asarray(times))
        return done, (self.logs() if logs else None)

    def reset(self) -> None:
        super().reset()
        self._stacked = self._replica_zeros()

    def evaluate(self, data: FitData, steps: int | None) -> dict[str, float]:
        iterator = iter(data.distribute(self.strategy))
        if self.custom_test:
            done, outputs, stacked = self._custom_steps(
                "test", iterator, steps or NO_LIMIT, self._replica_zeros()
            )
            state = [np.asarray(s).sum(axis=0) for s in stacked]
            if not done:
                return self._logs_of(state)
            return self._step_logs(tf.nest.map_structure(np.asarray, outputs), state)
        total = self._zeros()

        def call(n):
            nonlocal total
            done, state, _ = self._test_steps(iterator, n, bounded=False)
            total = [a + np.asarray(b) for a, b in zip(total, state, strict=True)]
            return int(done)

        call_until_end(call, self.model, steps)
        return self._logs_of(total)

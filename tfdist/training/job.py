"""The job a fit trains in: who is chief, where the replicas are, how the processes that step
together agree, how the data reaches the replicas, and what the job's failures mean.

An engine (engine.py) steps the model; its `job` answers everything else that depends on the
strategy, for the controller, the callbacks and the step hooks:

    job = engine.job
    job.is_chief                  # writes files and reports
    job.placement                 # this process's devices, the processes, its rank
    job.tally([done, stop])       # summed over the processes that step in lockstep
    with job.explained(): ...     # a lost peer or a dead ps as one line, not a traceback

Three kinds, one per way of running steps:
- `Job`: one process runs every replica (one_device, mirrored, central_storage).
- `LockstepJob`: synchronous replicas in one or several processes that step together
  (multi_worker_mirrored, tpu, and one host's mirrored); their tallies are collectives.
- `CoordinatedJob`: a coordinator schedules steps on parameter-server workers, each of which
  streams its own copy of the data.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.cluster import cluster_from_environment
from tfdist.errors import FitError
from tfdist.peers import lost_peers_explained
from tfdist.strategies import task_name_in_tf_config
from tfdist.strategies.replicas import ReplicaPlacement, replica_placement
from tfdist.training import fit_callbacks
from tfdist.training.faults import CLUSTER_ERRORS, explain_cluster_error
from tfdist.training.fit_data import FitData

log = logging.getLogger(__name__)

# How the data reaches the replicas: each step's global batch split by the strategy over
# them, or whole to the engine, which splits it itself (a pipeline's micro-batches).
REPLICAS, GLOBAL_BATCHES = "replicas", "global batches"


class Job:
    """A job of one process that runs every replica (see the module).

    Args:
      strategy: the job's strategy.
      feed: REPLICAS (the strategy splits each batch) or GLOBAL_BATCHES (the engine does).
      callback_checks: what refuses callbacks the engine cannot serve (a pipeline refuses
        step-level backups), each `check(callbacks)`, raising FitError.
    """

    # Whether each worker streams its own copy of the data without end: an epoch needs a
    # length, and one iterator serves every epoch.
    streams: ClassVar[bool] = False
    # Whether an engine's `train` returns once its steps have run, so that its wall time is
    # theirs (steps_per_execution='auto' measures it); False where it only schedules them.
    waits_for_steps: ClassVar[bool] = True

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        *,
        feed: str = REPLICAS,
        callback_checks: Sequence[Callable[[Sequence[keras.callbacks.Callback]], None]] = (),
    ):
        self.strategy, self.feed = strategy, feed
        self.callback_checks = list(callback_checks)
        # What a failure's message says of the run (set where a fit begins).
        self.total_steps: int | None = None
        self.checkpoint_status: Callable[[], tuple[int | None, str | None]] | None = None

    @property
    def is_chief(self) -> bool:
        """Whether this process writes files and reports (one process in a job):
        TensorFlow's should_checkpoint (the chief, else worker 0; under parameter_server the
        coordinator)."""
        return bool(self.strategy.extended.should_checkpoint)

    @property
    def placement(self) -> ReplicaPlacement:
        """Where the replicas are (see tfdist.strategies.ReplicaPlacement)."""
        return replica_placement(self.strategy)

    @property
    def lockstep_workers(self) -> int:
        """How many processes run the loop step for step (1: only this one)."""
        return 1

    def tally(self, counts: Sequence[int]) -> list[int]:
        """`counts` summed element by element over the lockstep workers (a collective when
        there are several: every one calls it at the same point)."""
        return list(counts)

    def agree(self, flag: bool) -> bool:
        """Whether `flag` is true on any lockstep worker (a collective, as `tally`)."""
        return self.tally([int(flag)])[0] > 0

    def describe_batch(self, global_batch: int) -> str:
        """The line that says how a global batch splits over the replicas (logged once)."""
        from tfdist.data.distribute import plan_batches

        return plan_batches(self.strategy, global_batch).describe()

    def begin(
        self,
        *,
        total_steps: int | None,
        checkpoint_status: Callable[[], tuple[int | None, str | None]] | None,
    ) -> None:
        """Where a fit begins: the steps it is to reach, and how to ask where a restart
        would resume (the newest checkpoint's (step, directory); None: nothing saves)."""
        self.total_steps, self.checkpoint_status = total_steps, checkpoint_status

    def iterator(self, data: FitData, *, skip: int = 0) -> Iterator:
        """An iterator over `data` for training, `skip` batches in."""
        if self.feed == GLOBAL_BATCHES:
            if data.dataset is None:
                raise FitError(
                    "A pipeline feeds each stage from the global batches, so it takes a "
                    "dataset batched with the global batch (or arrays with batch_size), not a "
                    "dataset_fn. Received: a dataset_fn"
                )
            return iter(data.dataset.skip(skip) if skip else data.dataset)
        return iter(data.distribute(self.strategy, skip=skip))

    def check_callbacks(self, callbacks: Sequence[keras.callbacks.Callback]) -> None:
        """Warns about, or refuses, callbacks that cannot work as asked in this job."""
        for check in self.callback_checks:
            check(callbacks)

    def explained(self) -> contextlib.AbstractContextManager:
        """A context in which a failure of the job (a lost peer, a dead parameter server)
        becomes tfdist's one-line error naming the task and saying how to resume."""
        return contextlib.nullcontext()

    def _resume_hint(self) -> str:
        step, directory = self.checkpoint_status() if self.checkpoint_status else (None, None)
        if directory is None:
            return "Nothing was saved, so a restart starts over. "
        latest = tf.train.latest_checkpoint(directory)  # tfdist's checkpoints
        if latest is not None:
            return f"A restart resumes from {latest}, the newest checkpoint. "
        if step is None:  # a BackupAndRestore directory
            return f"A restart resumes from the newest backup in {directory}. "
        return f"No checkpoint was saved yet in {directory}: a restart starts over. "


class LockstepJob(Job):
    """Synchronous replicas whose processes step together (see the module)."""

    @property
    def lockstep_workers(self) -> int:
        return compat.sync_worker_count(self.strategy)

    def tally(self, counts: Sequence[int]) -> list[int]:
        if self.lockstep_workers <= 1:
            return list(counts)
        strategy = self.strategy
        with self.explained():
            values = strategy.experimental_distribute_values_from_function(
                lambda _: tf.constant(list(counts), tf.int32)
            )
            total = strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None).numpy()
        # Each of a worker's replicas gave its counts: a worker counts once.
        per_worker = strategy.num_replicas_in_sync // self.lockstep_workers
        return (total // per_worker).tolist()

    def explained(self):
        # A peer that died mid-step surfaces as whatever the collective it was waited for
        # raised; the job's cluster names the task.
        return lost_peers_explained(
            self._cluster, when="during training", resume_hint=self._resume_hint
        )

    @functools.cached_property
    def _cluster(self):
        return cluster_from_environment() if self.lockstep_workers > 1 else None


class CoordinatedJob(Job):
    """Parameter-server training: this process coordinates, the workers run the steps.

    Args:
      strategy: a ParameterServerStrategy.
      scheduled: the steps scheduled so far (what a failure's message counts to).
    """

    streams = True
    waits_for_steps = False  # closures are scheduled on the workers

    def __init__(self, strategy: tf.distribute.Strategy, *, scheduled: Callable[[], int]):
        super().__init__(strategy)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        self._scheduled = scheduled
        # (the call's data, its per-worker iterator): a call's data streams on, a new
        # call's starts afresh on every worker.
        self._streaming: tuple[FitData, Any] | None = None

    @property
    def placement(self) -> ReplicaPlacement:
        # The steps run on the workers, one closure at a time each: none on this process.
        return ReplicaPlacement(devices=(), replicas=self.strategy.num_replicas_in_sync)

    def iterator(self, data: FitData, *, skip: int = 0) -> Iterator:
        del skip  # each worker's copy of the data streams on; nothing to skip
        if self._streaming is None or self._streaming[0] is not data:
            self._streaming = data, iter(data.per_worker(self.coordinator))
        return self._streaming[1]

    def check_callbacks(self, callbacks) -> None:
        super().check_callbacks(callbacks)
        hooked = [type(c).__name__ for c in callbacks if fit_callbacks.reads_batch_logs(c)]
        if hooked:
            log.warning(
                "Under parameter_server, batch-level callbacks (%s) run on the coordinator as "
                "steps are scheduled, not as workers finish them; the logs they get are the "
                "metrics of the steps finished so far. Epoch-level hooks see every step.",
                ", ".join(hooked),
            )

    def cluster(self) -> dict[str, list[str]]:
        """The job's tasks by kind, as TF_CONFIG names them."""
        resolver = compat.strategy_cluster_resolver(self.strategy)
        return resolver.cluster_spec().as_dict() if resolver is not None else {}

    def task_name(self, worker: str) -> str:
        """A worker's device name as TF_CONFIG names its task."""
        return task_name_in_tf_config(self.strategy, worker)

    @contextlib.contextmanager
    def explained(self):
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
                cluster=self.cluster(),
                step=self._scheduled(),
                total_steps=self.total_steps or self._scheduled(),
                checkpoint_step=saved_step,
                checkpoint_dir=directory,
            )
            if explained is None:
                raise
            raise explained from None

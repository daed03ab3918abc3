"""The engine's seam: what a runner offers the loop and the modes, and where a step can be
changed.

Interfaces only (in the spirit of Orbit's runner.py); the implementations live in
tfdist/training/runners/, one file per strategy kind, and the loop that drives them in
controller.py. See tfdist/training/__init__.py for how a new parallel mode plugs in.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import keras
import tensorflow as tf

from tfdist.strategies.replicas import ReplicaPlacement, replica_placement
from tfdist.training.shards import Shards

# (gradient, variable) pairs, as the optimizer's `apply_gradients` takes them.
GradsAndVars = list[tuple[Any, Any]]


@dataclasses.dataclass
class AsyncStep:
    """What one asynchronous (parameter-server) step knows of itself while it is traced, for
    hooks that correct for asynchrony.

    Attributes:
      ticket: the step's place in the run's order of steps (int64, from 0), as the
        coordinator scheduled it; a closure a lost worker ran is run again with its tickets.
      staleness: the updates that reached the parameters between this step's read and its
        own update (float32); set before the update is applied.
    """

    ticket: tf.Tensor
    staleness: tf.Tensor | None = None


class StepHook:
    """A link in the chain between a replica's gradients and the optimizer's update.

    Each training step computes its gradients, then calls the first hook's `apply` with
    them and a function `apply_next` that runs the rest of the chain; the chain ends with
    the optimizer's own `apply_gradients` (which, under a synchronous strategy, all-reduces
    the gradients). A hook may change the gradients and pass them on (clipping, a delay
    correction), hold them and pass them on later (accumulation), or apply them its own way
    and not call `apply_next` at all (sharded optimizer state, local SGD).

    `apply` runs in the replica context of a traced step (inside `strategy.run`), once per
    step, whether the step is Keras's own `train_step` or the model's override: the chain is
    where the model's optimizer applies gradients.

    Example (a chain of one hook that clips by the global norm before the update):

        class ClipGlobalNorm(tfdist.StepHook):
            def __init__(self, norm):
                self.norm = norm

            def apply(self, grads_and_vars, apply_next):
                grads, variables = zip(*grads_and_vars)
                grads, _ = tf.clip_by_global_norm(grads, self.norm)
                apply_next(list(zip(grads, variables)))

        tfdist.fit(model, data, step_hooks=[ClipGlobalNorm(1.0)])
    """

    # True: the hook works on the steps of a synchronous strategy, where every replica runs
    # each step together (a sharded update, micro-batch accumulation); the central_storage
    # and parameter_server runners refuse it.
    synchronous_only: ClassVar[bool] = False
    # True: the hook corrects for asynchronous updates (begin_step / before_update), which
    # only the parameter_server runner makes; the others refuse it.
    asynchronous_only: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """How messages name the hook (the option that made it, where one did)."""
        return type(self).__name__

    # True: the hook applies the update its own way (a sharded update, local SGD, the split
    # layers' parts); a step has one update, so a chain holds at most one such hook.
    applies_update: ClassVar[bool] = False
    # True: the hook does not hand the gradients on (apply_next is never called), so it must
    # be the last of the chain.
    ends_chain: ClassVar[bool] = False
    # True: the hook takes a model built in tfdist.host_scope (whose weights are held in
    # slices, not mirrored): it trains it (ZeRO-3, tensor parallelism from a layout map),
    # or refuses it in its own words (zero1, zero2).
    takes_host_scope_models: ClassVar[bool] = False

    def build(self, model: keras.Model, runner: Runner) -> None:
        """Creates the hook's state (under the strategy's scope), once, before training.

        The model is built; its optimizer is built after every hook's `build`, on the
        model's trainable variables, unless a hook built it (one that keeps the optimizer's
        state itself builds it on the variables it keeps state for).

        Args:
          model: the compiled, built model.
          runner: the runner that trains it: `runner.strategy`, `runner.is_chief` and
            `runner.placement` (this process's devices, the processes, its rank) answer what
            the hook needs to know of the job.
        """

    def already_built(self, model: keras.Model, runner: Runner) -> bool:
        """Whether this hook was built for `model` on a layout like `runner`'s before: a
        later fit of the same model, which goes on from the state the last one left (the
        registry hands a hook that keeps optimizer state to every fit of its model, as
        Keras's optimizer keeps its slots between fit calls). Records this build otherwise;
        a hook with state of its own begins its `build` with it."""
        key = (id(model), runner.placement)
        if getattr(self, "_built_for", None) == key:
            return True
        self._built_for = key
        return False

    def check_batch(self, per_replica_batch: int) -> None:
        """Refuses a per-replica batch the hook cannot work with (one accumulation cannot
        split evenly); called before training wherever the batch is known."""

    def step(self, batch: Any, train_step: Callable[[Any], Any]) -> Any:
        """Runs one replica's training step on `batch` through `train_step` (the model's
        own, or the next hook's `step`) and returns what the last call returned.

        The default calls it once. A hook that changes the step's shape overrides it (one
        that accumulates gradients splits the batch into micro-batches and calls it once
        for each); `apply` then sees one call per micro-batch.
        """
        return train_step(batch)

    def apply(self, grads_and_vars: GradsAndVars, apply_next: Callable[[GradsAndVars], Any]):
        """Applies one step's gradients; call `apply_next(pairs)` to hand them on."""
        return apply_next(grads_and_vars)

    def chain_for(self, optimizer) -> list[StepHook]:
        """The hooks that an optimizer a custom train_step applies itself (a GAN's
        `d_optimizer`) routes its updates through; none by default (it applies them as
        Keras does). A sharded update shards those optimizers' state too."""
        del optimizer
        return []

    def begin_step(self, step: AsyncStep) -> list[tf.Tensor]:
        """An asynchronous step's start, before it reads the weights (in its traced graph):
        a hook may wait here (bounded staleness) or remember what the step reads (a delay
        correction). Returns tensors the step's read of the weights must wait for."""
        del step
        return []

    def before_update(self, step: AsyncStep) -> list[tf.Tensor]:
        """An asynchronous step's gradients are ready and its update not yet counted or
        applied: a hook may wait here. Returns tensors the update must wait for."""
        del step
        return []

    # True: the hook keeps optimizer state apart from the model's optimizer (a sharded
    # update's slices, local SGD's per-replica copies), which Keras's BackupAndRestore
    # does not save.
    keeps_optimizer_state: ClassVar[bool] = False

    def checkpoint_state(self) -> dict[str, Any]:
        """State the hook keeps that a checkpoint must hold to resume exactly (a sharded
        update's optimizer slots), by checkpoint key; the runner adds it to its own."""
        return {}

    def checkpoint_shards(self) -> Shards | None:
        """What each process writes of a sharded checkpoint (the weights it holds in part:
        ZeRO-3's slices), or None; see tfdist.training.shards."""
        return None

    def start(self) -> None:
        """Where training starts, at every fit, after any checkpoint is restored: a hook
        that keeps its own copy of the weights (ZeRO-3's slices) takes them from the model
        here. Every lockstep worker calls it at the same point (parameter_server: the
        coordinator)."""

    def settle(self) -> None:
        """Where the runner settles (each epoch end, before a save): a hook whose replicas'
        weights drift apart (local SGD, gossip) makes them one model again. Every lockstep
        worker calls it at the same point (it may be collective)."""

    def summary(self) -> dict[str, float | int | None]:
        """Run-level figures of what the hook did (bytes it sent), for a run's record."""
        return {}


class Runner(abc.ABC):
    """Runs a compiled model's steps under one kind of strategy.

    A runner owns every fact that depends on the strategy: how the data is iterated, which
    process is the chief, how many processes run the loop in lockstep, how they agree on a
    decision, how the model is built, how evaluation runs, and what its failures mean.
    The loop (controller.py) talks to a runner only through this interface.

    Attributes:
      kinds: the strategy kinds (tfdist.strategy_kind) this runner serves.
    """

    kinds: ClassVar[tuple[str, ...]] = ()
    # What 'auto' means for a mode's keyword under this runner (registry keyword -> value);
    # a keyword not listed means off.
    mode_defaults: ClassVar[dict[str, Any]] = {}
    # Whether `train` returns once its steps have run, so that its wall time is theirs
    # (steps_per_execution='auto' measures it); False where it only schedules them.
    train_waits_for_steps: ClassVar[bool] = True
    # Whether a later fit or evaluate of the same model may take this runner, built, with
    # its traced functions (tfdist.training.kept: nothing they close over changed).
    kept_across_calls: ClassVar[bool] = False

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy):
        self.model, self.strategy = model, strategy

    # --- facts about the job ----------------------------------------------------------------

    @property
    @abc.abstractmethod
    def is_chief(self) -> bool:
        """Whether this process writes files and reports (one process in a job)."""

    @property
    def placement(self) -> ReplicaPlacement:
        """Where the replicas are (see tfdist.strategies.ReplicaPlacement)."""
        return replica_placement(self.strategy)

    @property
    def lockstep_workers(self) -> int:
        """How many processes run this loop step for step (1: only this one)."""
        return 1

    def agree(self, flag: bool) -> bool:
        """Whether `flag` is true on any lockstep worker.

        Every lockstep worker must call this at the same point of the loop (it is a
        collective when there are several).
        """
        return self.tally([int(flag)])[0] > 0

    def tally(self, counts: Sequence[int]) -> list[int]:
        """`counts` summed element by element over the lockstep workers (a collective when
        there are several: every one calls it at the same point)."""
        return list(counts)

    def describe_batch(self, global_batch: int) -> str:
        """The line that says how a global batch splits over what trains it (logged once)."""
        from tfdist.data.distribute import plan_batches

        return plan_batches(self.strategy, global_batch).describe()

    @property
    def needs_epoch_length(self) -> bool:
        """Whether an epoch must be given a length (the data streams without end)."""
        return False

    def check_callbacks(self, callbacks: Sequence[keras.callbacks.Callback]) -> None:  # noqa: B027
        """Warns about, or refuses, callbacks that cannot work as asked under this runner."""

    # --- building and data --------------------------------------------------------------------

    @abc.abstractmethod
    def build(self, sample_batch: Any, step_hooks: Sequence[StepHook] = ()) -> None:
        """Builds the model, its metrics and its optimizer from one batch's shapes."""

    @abc.abstractmethod
    def iterator(self, data, *, skip: int = 0) -> Iterator:
        """An iterator over `data` (a FitData) for training, `skip` batches in."""

    @property
    def iterator_is_shared(self) -> bool:
        """Whether one iterator serves every epoch (it repeats: parameter-server data)."""
        return False

    # --- training ------------------------------------------------------------------------------

    def begin(  # noqa: B027
        self,
        global_step: int,
        *,
        total_steps: int | None = None,
        checkpoint_status: Callable[[], tuple[int | None, str | None]] | None = None,
    ) -> None:
        """Starts counting at `global_step` (a resumed run counts on from its checkpoint).

        Args:
          global_step: the step training starts from.
          total_steps: the steps the run is to reach (for failure messages).
          checkpoint_status: gives (step, directory) of the newest checkpoint, where a
            restart would resume; None if nothing saves checkpoints.
        """

    @abc.abstractmethod
    def reset(self) -> None:
        """Starts a new epoch's metrics."""

    @abc.abstractmethod
    def train(
        self, iterator: Iterator, n: int, *, bounded: bool, logs: str | None
    ) -> tuple[int, dict[str, float] | None]:
        """Runs up to `n` training steps from `iterator`.

        Args:
          iterator: from `iterator()`.
          n: the steps to run in one call.
          bounded: the data has at least `n` more batches (no need to ask for its end).
          logs: None (no logs: nothing is read), "global" (the metrics over every replica
            and worker: collective) or "local" (this process's replicas only: no collective).

        Returns:
          (steps run, fewer than `n` only where the data ended; the logs, or None).
        """

    @abc.abstractmethod
    def logs(self) -> dict[str, float]:
        """The epoch's logs so far, over every replica and worker."""

    def settle(self) -> None:  # noqa: B027
        """Makes the variables what a checkpoint must hold: every step scheduled so far has
        updated them, and the replicas are one model. Called at every epoch end and before
        a save (every lockstep worker at the same step: it may be collective)."""

    def checkpoint_state(self) -> dict[str, tf.Module | tf.Variable]:
        """State the runner keeps beside the model and optimizer that a checkpoint must hold
        to resume exactly (the parameter-server update counter), by checkpoint key."""
        return {}

    def checkpoint_shards(self) -> Shards | None:
        """What each process writes of a sharded checkpoint (a hook's, or a pipeline's
        stages), or None: the chief's checkpoint holds everything."""
        return None

    def summary(self) -> dict[str, float | int | None]:
        """Run-level figures of what this runner did, for a run's record (staleness)."""
        return {}

    @abc.abstractmethod
    def evaluate(self, data, steps: int | None) -> dict[str, float]:
        """Evaluates on `data` (a FitData): every example once, over every replica."""

    def step_times(self) -> dict[str, float] | None:
        """The epoch's measured seconds per step: input, compute, exchange (None: unmeasured)."""
        return None

    # --- failures ------------------------------------------------------------------------------

    def explained(self) -> contextlib.AbstractContextManager:
        """A context in which a failure of the job (a lost peer, a dead parameter server)
        becomes tfdist's one-line error naming the task and saying how to resume."""
        return contextlib.nullcontext()


@runtime_checkable
class RunnerFactory(Protocol):
    """A layout that replaces the runner (tfdist.parallel.Pipeline): `tfdist.fit(...,
    pipeline=factory)` trains with `factory.runner(model, strategy)`; the modes its registry
    entry takes over (a pipeline's shard_optimizer), where on, come as keyword arguments."""

    def runner(self, model: keras.Model, strategy: tf.distribute.Strategy) -> Runner:
        """The runner that trains `model` under `strategy` (not yet built)."""

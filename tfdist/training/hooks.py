"""Where a training step can be changed: the hooks between a replica's gradients and the
optimizer's update (`StepHook`), and what an asynchronous step tells them (`AsyncStep`).

Each mode of tfdist.parallel that changes a step is a hook (tfdist/parallel/registry.py
lists them); users write their own (tfdist.StepHook). The engine (engine.py) runs the chain
in every traced step; the job (job.py) answers what a hook asks of where it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import keras
import tensorflow as tf

from tfdist.training.shards import Shards

if TYPE_CHECKING:
    from tfdist.training.job import Job

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
    # and parameter_server engines refuse it.
    synchronous_only: ClassVar[bool] = False
    # True: the hook corrects for asynchronous updates (begin_step / before_update), which
    # only the parameter_server engine makes; the others refuse it.
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

    def build(self, model: keras.Model, job: Job) -> None:
        """Creates the hook's state (under the strategy's scope), once, before training.

        The model is built; its optimizer is built after every hook's `build`, on the
        model's trainable variables, unless a hook built it (one that keeps the optimizer's
        state itself builds it on the variables it keeps state for).

        Args:
          model: the compiled, built model.
          job: the job it trains in (tfdist.training.job): `job.strategy`, `job.is_chief`,
            `job.placement` (this process's devices, the processes, its rank) and
            `job.tally` answer what the hook needs to know of it.
        """

    def already_built(self, model: keras.Model, job: Job) -> bool:
        """Whether this hook was built for `model` on a layout like `job`'s before: a
        later fit of the same model, which goes on from the state the last one left (the
        registry hands a hook that keeps optimizer state to every fit of its model, as
        Keras's optimizer keeps its slots between fit calls). Records this build otherwise;
        a hook with state of its own begins its `build` with it."""
        key = (id(model), job.placement)
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
        update's optimizer slots), by checkpoint key; the engine adds it to its own."""
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
        """Where the engine settles (each epoch end, before a save): a hook whose replicas'
        weights drift apart (local SGD, gossip) makes them one model again. Every lockstep
        worker calls it at the same point (it may be collective)."""

    def summary(self) -> dict[str, float | int | None]:
        """Run-level figures of what the hook did (bytes it sent), for a run's record."""
        return {}

"""Parallel modes that plug into tfdist.fit's step seam (tfdist.StepHook).

- zero.py: ShardedUpdate, the optimizer's state (ZeRO stage 1) and the gradients (stage 2)
  sharded over the replicas of a synchronous strategy.
- accumulate.py: Accumulate, k micro-batches per step and one exchange.
- asynchronous.py: corrections for parameter-server training's stale updates:
  DelayCompensation (DC-ASGD), MomentumCorrection, BoundedStaleness (max_staleness).
- local_sgd.py: LocalSGD, k local optimizer steps per replica, then one average of the
  weights (post-local SGD too).
- gossip.py: Gossip, a local step, then each replica averages with its peers (a ring, or
  a time-varying exponential graph): no all-reduce, no server.
- schedules.py: pipeline schedules (GPipe, 1F1B) and their simulation: the step's length,
  the bubble, the activations each stage holds.
- stages.py: a model cut into stages at named layers (`split`), or stages chained (`chain`).
- pipeline.py: Pipeline, the stages over the replicas trained in micro-batches (a runner).
- tensor.py: tensor-parallel layers (ColumnParallelDense, RowParallelDense,
  ParallelEmbedding, ParallelMultiHeadAttention), `tensor_parallel` to convert a model,
  `dense_model` to convert it back, and
  TensorParallelUpdate, the hook that updates their parts (added when a model has them).

ZeRO, accumulation, local SGD and gossip are StepHooks: `tfdist.fit(...,
shard_optimizer="zero2", accumulate_steps=4, average_every=4, gossip="ring")` builds them
from keywords (`hooks_for`), or pass them yourself with `step_hooks=[...]`.
A pipeline replaces the runner: `tfdist.fit(..., pipeline=Pipeline(cut_before=[...]))`.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras

from tfdist.parallel.accumulate import Accumulate
from tfdist.parallel.asynchronous import (
    ASYNC_CORRECTIONS,
    AsyncCorrectionError,
    BoundedStaleness,
    DelayCompensation,
    MomentumCorrection,
)
from tfdist.parallel.gossip import Gossip
from tfdist.parallel.local_sgd import LocalSGD, LocalUpdateError, LocalUpdates
from tfdist.parallel.pipeline import Pipeline, PipelineRunner
from tfdist.parallel.stages import Stage, StageError, chain, split
from tfdist.parallel.tensor import (
    ColumnParallelDense,
    ParallelEmbedding,
    ParallelMultiHeadAttention,
    RowParallelDense,
    TensorParallelError,
    TensorParallelUpdate,
    dense_model,
    split_layers,
    tensor_parallel,
)
from tfdist.parallel.zero import Partition, ShardedUpdate, ShardingError
from tfdist.training.config import SHARD_CHOICES
from tfdist.training.fit_data import FitError
from tfdist.training.runner import StepHook


def hooks_for(
    step_hooks: Sequence[StepHook] = (),
    *,
    shard_optimizer: str | None = None,
    accumulate_steps: int = 1,
    average_every: int | None = None,
    gossip: str | None = None,
    async_correction: str | None = None,
    max_staleness: int | None = None,
    model: keras.Model | None = None,
) -> list[StepHook]:
    """The chain of hooks fit's keywords (and the model's split layers) ask for, around the
    user's own `step_hooks`: accumulation first (the user's hooks then see each step's
    summed gradients once), the split layers' update next to last (it applies their parts'
    gradients and hands the rest on), and last the one hook that applies the update itself
    (a sharded update, local SGD or gossip). The asynchronous corrections (a delay or
    momentum correction, then a staleness bound) come after the user's hooks."""
    if shard_optimizer not in (None, *SHARD_CHOICES):
        raise FitError(
            f"shard_optimizer must be None, 'zero1' or 'zero2'. Received: {shard_optimizer!r}"
        )
    hooks: list[StepHook] = []
    if accumulate_steps != 1:
        hooks.append(Accumulate(accumulate_steps))
    hooks.extend(step_hooks)
    if async_correction is not None:
        if async_correction not in ASYNC_CORRECTIONS:
            raise AsyncCorrectionError(
                f"async_correction takes one of {', '.join(ASYNC_CORRECTIONS)} (or None). "
                f"Received: async_correction={async_correction!r}"
            )
        hooks.append(ASYNC_CORRECTIONS[async_correction]())
    if max_staleness is not None:
        hooks.append(BoundedStaleness(max_staleness))
    if model is not None and split_layers(model):
        if shard_optimizer:
            raise FitError(
                "A model with tensor-parallel layers keeps each part's optimizer state on the "
                "part's replica already; drop shard_optimizer. "
                f"Received: shard_optimizer={shard_optimizer!r}"
            )
        hooks.append(TensorParallelUpdate())
    if shard_optimizer:
        hooks.append(ShardedUpdate(stage=int(shard_optimizer[-1])))
    if average_every is not None:
        hooks.append(LocalSGD(average_every))
    if gossip is not None:
        hooks.append(Gossip(gossip))
    _check_one_update(hooks)
    return hooks


def _check_one_update(hooks: Sequence[StepHook]) -> None:
    """Refuses two hooks that each apply the update their own way (the first would end the
    chain, and the second never run), or such a hook before others."""
    own = [h for h in hooks if isinstance(h, (ShardedUpdate, LocalUpdates, TensorParallelUpdate))]
    if len(own) > 1:
        raise FitError(
            "Each of " + ", ".join(h.name for h in own) + " updates the weights its own way, "
            "and a step has one update: choose one. Received: " + ", ".join(h.name for h in own)
        )
    if own and not isinstance(own[0], TensorParallelUpdate) and hooks[-1] is not own[0]:
        raise FitError(
            f"{own[0].name} applies the update itself, so it must be the last of the step "
            "hooks (the hooks after it would never run). "
            f"Received: step_hooks ending with {hooks[-1].name}"
        )


def check_callbacks(hooks: Sequence[StepHook], callbacks) -> None:
    """Refuses a hook that keeps optimizer state of its own (a sharded update, local SGD's
    per-replica copies) beside Keras's BackupAndRestore, which saves the model and its
    optimizer only (Keras's own weights file): that state would be lost, and a resume
    would restart it from zero. tfdist.StepCheckpoint saves it whole."""
    keeper = next((h for h in hooks if h.keeps_optimizer_state), None)
    backups = [c for c in callbacks or () if isinstance(c, keras.callbacks.BackupAndRestore)]
    if keeper is not None and backups:
        raise FitError(
            f"{keeper.name} keeps the optimizer's state apart from the model, and "
            "BackupAndRestore saves only what Keras's weights file holds: a resume would "
            "restart Adam's moments (or momentum) from zero and train differently from the "
            f"run it resumes. Use tfdist.StepCheckpoint(model_dir) instead, which saves that "
            f"state too. Received: {keeper.name} with BackupAndRestore"
        )


def check_batch(hooks: Sequence[StepHook], per_replica_batch: int) -> None:
    """Refuses a per-replica batch that an Accumulate hook cannot split evenly."""
    for hook in hooks:
        if isinstance(hook, Accumulate):
            hook.check_batch(per_replica_batch)


__all__ = [
    "ASYNC_CORRECTIONS",
    "AsyncCorrectionError",
    "BoundedStaleness",
    "DelayCompensation",
    "MomentumCorrection",
    "SHARD_CHOICES",
    "Accumulate",
    "ColumnParallelDense",
    "Gossip",
    "LocalSGD",
    "LocalUpdateError",
    "LocalUpdates",
    "ParallelEmbedding",
    "ParallelMultiHeadAttention",
    "Partition",
    "Pipeline",
    "PipelineRunner",
    "ShardedUpdate",
    "RowParallelDense",
    "ShardingError",
    "Stage",
    "StageError",
    "TensorParallelError",
    "TensorParallelUpdate",
    "chain",
    "dense_model",
    "check_batch",
    "check_callbacks",
    "hooks_for",
    "split",
    "split_layers",
    "tensor_parallel",
]

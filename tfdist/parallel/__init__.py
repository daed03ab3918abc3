"""Parallel modes that plug into tfdist.fit's step seam (tfdist.StepHook).

- zero.py: ShardedUpdate, the optimizer's state (ZeRO stage 1) and the gradients (stage 2)
  sharded over the replicas of a synchronous strategy.
- accumulate.py: Accumulate, k micro-batches per step and one exchange.
- schedules.py: pipeline schedules (GPipe, 1F1B) and their simulation: the step's length,
  the bubble, the activations each stage holds.
- stages.py: a model cut into stages at named layers (`split`), or stages chained (`chain`).
- pipeline.py: Pipeline, the stages over the replicas trained in micro-batches (a runner).
- tensor.py: tensor-parallel layers (ColumnParallelDense, RowParallelDense,
  ParallelEmbedding, ParallelMultiHeadAttention), `tensor_parallel` to convert a model,
  `dense_model` to convert it back, and
  TensorParallelUpdate, the hook that updates their parts (added when a model has them).

The first two are StepHooks: `tfdist.fit(..., shard_optimizer="zero2", accumulate_steps=4)`
builds them from keywords (`hooks_for`), or pass them yourself with `step_hooks=[...]`.
A pipeline replaces the runner: `tfdist.fit(..., pipeline=Pipeline(cut_before=[...]))`.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras

from tfdist.parallel.accumulate import Accumulate
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
    model: keras.Model | None = None,
) -> list[StepHook]:
    """The chain of hooks fit's keywords (and the model's split layers) ask for, around the
    user's own `step_hooks`: accumulation first (the user's hooks then see each step's
    summed gradients once), the split layers' update next to last (it applies their parts'
    gradients and hands the rest on), a sharded update last (it applies them itself)."""
    if shard_optimizer not in (None, *SHARD_CHOICES):
        raise FitError(
            f"shard_optimizer must be None, 'zero1' or 'zero2'. Received: {shard_optimizer!r}"
        )
    hooks: list[StepHook] = []
    if accumulate_steps != 1:
        hooks.append(Accumulate(accumulate_steps))
    hooks.extend(step_hooks)
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
    return hooks


def check_callbacks(hooks: Sequence[StepHook], callbacks) -> None:
    """Refuses a sharded update beside Keras's BackupAndRestore, which saves the model and
    its optimizer only (Keras's own weights file): the slices' optimizer state would be
    lost, and a resume would restart it from zero. tfdist.StepCheckpoint saves it whole."""
    sharded = next((h for h in hooks if isinstance(h, ShardedUpdate)), None)
    backups = [c for c in callbacks or () if isinstance(c, keras.callbacks.BackupAndRestore)]
    if sharded is not None and backups:
        raise FitError(
            f"{sharded.name} keeps each replica's optimizer state apart from the model, and "
            "BackupAndRestore saves only what Keras's weights file holds: a resume would "
            "restart Adam's moments (or momentum) from zero and train differently from the "
            "run it resumes. Use tfdist.StepCheckpoint(model_dir) instead, which saves the "
            f"sharded state whole. Received: {sharded.name} with BackupAndRestore"
        )


def check_batch(hooks: Sequence[StepHook], per_replica_batch: int) -> None:
    """Refuses a per-replica batch that an Accumulate hook cannot split evenly."""
    for hook in hooks:
        if isinstance(hook, Accumulate):
            hook.check_batch(per_replica_batch)


__all__ = [
    "SHARD_CHOICES",
    "Accumulate",
    "ColumnParallelDense",
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

"""What tfdist.fit's log says a model trains as, in the planner's form (tfdist/layout_names.py):

Global batch 32 = 4 replica(s) x 8 per replica (mirrored); trained as tensor 2 x zero3 x
data 2 over 4 devices in 1 process
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras

from tfdist.layout_names import layout_name
from tfdist.parallel.pipeline.runner import PipelineRunner
from tfdist.parallel.tensor.layers import split_layers
from tfdist.parallel.tensor.layout_map import plan_of
from tfdist.training.engine import Engine
from tfdist.training.runners.sync import SyncRunner


def batch_line(runner: Engine, global_batch: int) -> str:
    """How a global batch splits over what trains it (logged once): a pipeline's stages and
    micro-batches, or the strategy's replicas."""
    if isinstance(runner, PipelineRunner):
        return runner.describe_batch(global_batch)
    return runner.job.describe_batch(global_batch)


def trained_as(model: keras.Model, runner: Engine, options: Mapping[str, Any]) -> str | None:
    """The layout `runner` trains `model` in, and over how many devices and processes; None
    on one device, and for the runners that keep the variables apart from the replicas
    (parameter-server and central-storage training: their log line says so)."""
    if not isinstance(runner, (SyncRunner, PipelineRunner)):
        return None
    if isinstance(runner, PipelineRunner):
        pipeline = runner.options
        # Each stage's state is sharded over its pipelines: with one, it is whole.
        zero = _stage(runner.shard) if runner.pipelines > 1 else 0
        name = layout_name(
            data=runner.pipelines, stages=runner.devices_per_pipeline, zero=zero,
            micro_batches=pipeline.micro_batches, chunks=pipeline.chunks_per_device,
            tensor=runner.tensor,
        )  # fmt: skip
    else:
        tensor = tensor_degree(model)
        zero = _stage(options.get("shard_optimizer"))
        name = layout_name(data=runner.job.placement.replicas // tensor, tensor=tensor, zero=zero)
    devices, processes = runner.job.placement.replicas, runner.job.placement.processes
    if isinstance(runner, PipelineRunner):
        devices = runner.devices  # a process's logical CPUs, where it was given several
    if devices == 1:
        return None  # nothing to lay out
    return (
        f"trained as {name} over {devices} device{'s' * (devices != 1)} in {processes} "
        f"process{'es' * (processes != 1)}"
    )


def tensor_degree(model: keras.Model) -> int:
    """Over how many devices the model's weights are split (1: none are)."""
    plan = plan_of(model)
    if plan is not None:
        return plan.degree
    degrees = {layer.tensor_parallel or 1 for layer in split_layers(model)}
    return max(degrees, default=1)


def _stage(shard: Any) -> int:
    """ZeRO's stage from shard_optimizer ('zero3' -> 3; None -> 0)."""
    return int(shard[-1]) if isinstance(shard, str) and shard.startswith("zero") else 0


__all__ = ["tensor_degree", "trained_as"]

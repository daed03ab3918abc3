"""Where a pipeline's stage replicas run: how many pipelines the replicas make, and which
devices of which process each stage replica takes.

Pipeline p's stage k is rank p * stages + k. In one process, its devices are pipeline p's
(k mod width)-th of its width (interleaved: each device holds the stages k, k + width, ...),
a group of `tensor` consecutive devices, as Megatron-LM keeps a tensor group. Across worker
processes either each process holds one stage replica (one device, or one tensor group of a
model not cut: FSDP x TP), its exchanges with its stage's other pipelines rings between
processes; or each process holds whole stages (every pipeline's replica of them), the stages
in order over the processes, as Megatron-LM spreads a pipeline's stages over nodes and keeps
tensor and data groups within one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdist.devices import cpu_device_names
from tfdist.errors import FitError
from tfdist.parallel.pipeline.stages import StageError, devices_for
from tfdist.strategies.replicas import ReplicaPlacement


@dataclasses.dataclass(frozen=True)
class Grid:
    """A pipeline's stage replicas over the job's devices (see the module).

    Attributes:
      pipelines: the pipelines (data-parallel copies of the stages).
      devices_per_pipeline: the devices one pipeline's stages take (its width).
      devices: every process's devices the stage replicas take, in all.
      whole_stages: each process holds every pipeline's replica of its stages (one process;
        worker processes of several devices), so a stage's exchanges stay in the process.
      ranks: this process's stage replicas, by rank.
      rank_devices: each of this process's ranks' devices (one, or a tensor group's).
    """

    pipelines: int
    devices_per_pipeline: int
    devices: int
    whole_stages: bool
    ranks: list[int]
    rank_devices: dict[int, list[str]]


def stage_grid(stages: int, layout: ReplicaPlacement, options: Any, tensor: int) -> Grid:
    """The grid of `stages` stages' replicas under `layout` (a job's placement), each a group
    of `tensor` devices; `options` a Pipeline (micro_batches, chunks_per_device).

    Raises:
      StageError, FitError: the stages cannot share out the devices (in one line).
    """
    devices = devices_here(layout)
    processes = layout.processes
    replicas = processes * len(devices)
    chunks = options.chunks_per_device
    width = devices_for(stages, chunks, options.micro_batches, holder="a pipeline's")
    if chunks > 1 and processes > 1:
        raise FitError(
            "The interleaved schedule runs over one process's devices (each device holds "
            f"{chunks} stages); this job has {processes} worker processes. Use "
            f"schedule='1f1b' across processes. Received: chunks_per_device={chunks}"
        )
    if replicas % (width * tensor):
        split = f" x {tensor} tensor-parallel" if tensor > 1 else ""
        raise StageError(
            f"{stages} stages need a multiple of {width * tensor} replicas (D "
            f"pipelines x {width} devices{split}); the strategy has {replicas}. Cut the "
            "model into a number of stages that divides the replicas, or change the "
            f"devices/workers. Received: {stages} stages over {replicas} replicas"
        )
    pipelines = replicas // (width * tensor)
    if processes > 1 and len(devices) < tensor:
        raise StageError(
            f"A tensor group of {tensor} devices stays within one process, and each "
            f"of these {processes} worker processes has {len(devices)}. Give each "
            f"process a multiple of {tensor} devices (on a CPU host, "
            "tfdist.configure_cpu_devices(N) before the strategy), or drop the "
            f"layout map. Received: tensor {tensor}, {len(devices)} device(s) a process"
        )
    grid = dict(pipelines=pipelines, devices_per_pipeline=width, devices=replicas)
    # A stage replica a process (one device; or one tensor group of a model not cut,
    # FSDP x TP). Tensor groups of several stages are _whole_stages's.
    one_group = tensor > 1 and stages == 1 and pipelines > 1
    if processes > 1 and len(devices) == tensor and (tensor == 1 or one_group):
        rank = layout.process_index
        return Grid(**grid, whole_stages=False, ranks=[rank], rank_devices={rank: devices})
    if processes > 1:
        ranks, rank_devices = _whole_stages(stages, layout, devices, tensor, pipelines)
        return Grid(**grid, whole_stages=True, ranks=ranks, rank_devices=rank_devices)
    # Pipeline p's stage k: its devices are p's (k mod width)-th, a group of `tensor`.
    ranks = list(range(pipelines * stages))
    group = {rank: (rank // stages) * width + (rank % stages) % width for rank in ranks}
    rank_devices = {rank: devices[g * tensor : (g + 1) * tensor] for rank, g in group.items()}
    return Grid(**grid, whole_stages=True, ranks=ranks, rank_devices=rank_devices)


def devices_here(layout: ReplicaPlacement) -> list[str]:
    """The devices this process's stage replicas take: the strategy's here, or, where a
    worker process's strategy holds its one CPU (TensorFlow's multi-worker strategy takes one
    a process on a host without GPUs) and the process was given several logical CPUs
    (tfdist.configure_cpu_devices), those, as a host of that many devices."""
    devices = list(layout.devices)
    if layout.processes == 1 or len(devices) > 1 or "CPU" not in devices[0].upper():
        return devices
    task = devices[0][: devices[0].upper().index("/DEVICE:")]
    # The job's devices are listed too: this task's are named under it.
    cpus = [name for name in cpu_device_names() if name.startswith(f"{task}/device:CPU:")]
    if len(cpus) <= 1:
        return devices
    return [f"{task}/device:CPU:{k}" for k in range(len(cpus))]


def _whole_stages(
    stages: int, layout: ReplicaPlacement, devices: list[str], tensor: int, pipelines: int
) -> tuple[list[int], dict[int, list[str]]]:
    """Worker processes of several devices each: each process holds whole stages (every
    pipeline's replica of them, each over `tensor` consecutive devices), the stages in order
    over the processes. A stage's exchange over its pipelines (and its ZeRO slices) stays in
    the process; only the activations and their gradients cross between processes."""
    local, processes = len(devices), layout.processes
    held = local // tensor  # stage replicas a process holds
    if stages == 1 and tensor > 1 and held != 1:  # a layout map's model, not cut
        raise StageError(
            f"Across worker processes a model split by a layout map trains with one "
            f"tensor group a process (the layout's model axis, {tensor}, is each "
            f"process's devices), its parts sharded over the processes; these processes "
            f"have {local} devices each. Set the mesh's model axis to {local}, or give "
            f"each process {tensor} devices. Received: model axis {tensor}, {local} "
            f"devices in each of {processes} processes"
        )
    if local % tensor or held % pipelines:
        raise StageError(
            f"With several devices a process, each process holds whole stages: its "
            f"{local} devices must hold {pipelines} pipeline(s)' replicas of its stages, "
            f"{tensor} device(s) each, and the {stages} stages must share out evenly "
            f"over the {processes} processes. Use {pipelines * tensor} devices a "
            f"process per stage it holds, or one device a process. Received: {local} "
            f"devices in each of {processes} processes"
        )
    index = layout.process_index
    mine = [(p, s) for s in range(stages) for p in range(pipelines)][
        index * held : (index + 1) * held
    ]
    ranks = [p * stages + s for p, s in mine]
    return ranks, {rank: devices[k * tensor : (k + 1) * tensor] for k, rank in enumerate(ranks)}

"""Where a strategy's replicas are: this process's devices, the processes that step together,
this process's rank among them, and whether the replicas are one compiled program.

tfdist.fit's job answers `job.placement` from here (tfdist.training.job), and layers that split weights
over the replicas read it when they are created; neither asks a strategy's kind.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.strategies.multi_worker import worker_rank
from tfdist.strategies.tpu import runs_on_tpu


@dataclasses.dataclass(frozen=True)
class ReplicaPlacement:
    """Where a runner's replicas are, as the runner sees them: what a mode that keeps or
    exchanges buffers of its own asks, instead of asking the strategy.

    Attributes:
      devices: this process's replica devices, in replica order (empty where the steps run
        on other processes: parameter-server workers).
      processes: the processes that run every step together (1: this one alone).
      process_index: this process's place among them (the chief first).
      replicas: the replicas of every process together.
      single_program: the replicas are one compiled program (TPU cores): a mode cannot
        exchange buffers between them on its own transports.
    """

    devices: tuple[str, ...]
    processes: int = 1
    process_index: int = 0
    replicas: int = 1
    single_program: bool = False

    @property
    def first_replica(self) -> int:
        """The replica number of this process's first device (replicas are numbered process
        by process, as MultiWorkerMirroredStrategy numbers them)."""
        return self.process_index * len(self.devices)


def replica_placement(strategy: tf.distribute.Strategy) -> ReplicaPlacement:
    """The layout of a strategy whose replicas step in this process (and, under
    multi_worker_mirrored, in its peers): every strategy but parameter_server, whose steps
    run on other processes (its runner says so itself)."""
    try:
        devices = tuple(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy (no scope): one replica, where ops land
        devices = ("/cpu:0",) if not tf.config.list_logical_devices("GPU") else ("/gpu:0",)
    return ReplicaPlacement(
        devices=devices,
        processes=compat.sync_worker_count(strategy),
        process_index=worker_rank(strategy),
        replicas=strategy.num_replicas_in_sync,
        single_program=runs_on_tpu(strategy),
    )


def one_replica_per_process(
    layout: ReplicaPlacement, *, who: str, error: type[FitError] = FitError
) -> ReplicaPlacement:
    """`layout` (a job's placement), if a mode that exchanges its own buffers can run on it: not one
    compiled program (TPU cores), and across processes one device each. Raises `error`,
    naming `who`, otherwise."""
    if layout.single_program:
        raise error(
            f"{who} is not built for TPUs (their replicas are one XLA program). "
            "Drop the option on TPU. Received: a TPU strategy"
        )
    devices, workers = len(layout.devices), layout.processes
    if workers > 1 and devices > 1:
        raise error(
            f"{who} across worker processes runs one replica per process; this job has "
            f"{devices} devices in each of {workers} processes. Start one process per "
            "device (tfdist-launch --workers N), or use mirrored in one process. "
            f"Received: {workers} workers x {devices} devices"
        )
    return layout


__all__ = ["ReplicaPlacement", "one_replica_per_process", "replica_placement"]

"""This process's place in the job, and what it prints: the helpers a Horovod user looks for.

    import tfdist
    tfdist.setup_logging(quiet_workers=True)   # tfdist's INFO lines; only the chief prints
    task = tfdist.this_task()                   # TaskInfo(type='worker', index=1, rank=1, ...)
    if tfdist.is_chief():
        model.save("model.keras")

Horovod's `hvd.rank()` and `hvd.size()` are `this_task().rank` and `num_workers()`;
`num_replicas(strategy)` counts the replicas a global batch is split over (workers times
devices). Everything but `num_replicas` reads only the environment (TF_CONFIG, a JobSet
pod's or Slurm's variables: `cluster_from_environment`), without importing TensorFlow.
"""

from __future__ import annotations

import dataclasses

from tfdist import strategy_kinds as kinds
from tfdist.cluster import CHIEF, WORKER, cluster_from_environment


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    """Who this process is in the job.

    Attributes:
      type: 'chief', 'worker', 'ps' or 'evaluator' ('worker' for a process on its own).
      index: its index among the tasks of its type.
      rank: its place among the tasks that run training steps, 0 to num_workers - 1 (the
        chief first, then the workers; under parameter-server training the workers only),
        or None for a task that runs none (a ps, an evaluator, a parameter-server chief).
      num_workers: how many tasks run training steps (1 for a process on its own).
      is_chief: whether this task writes checkpoints, summaries and exports.
    """

    type: str
    index: int
    rank: int | None
    num_workers: int
    is_chief: bool


def this_task() -> TaskInfo:
    """This process's TaskInfo, from the environment's cluster (TF_CONFIG, JobSet, Slurm)."""
    cluster = cluster_from_environment()
    if cluster is None:
        return TaskInfo(WORKER, 0, 0, 1, True)
    workers = len(cluster.cluster.get(WORKER, ()))
    if cluster.cluster_strategy == kinds.PARAMETER_SERVER:
        rank = cluster.task_index if cluster.task_type == WORKER else None
        return TaskInfo(cluster.task_type, cluster.task_index, rank, workers, cluster.is_chief)
    chiefs = len(cluster.cluster.get(CHIEF, ()))
    rank = {CHIEF: cluster.task_index, WORKER: chiefs + cluster.task_index}.get(cluster.task_type)
    return TaskInfo(cluster.task_type, cluster.task_index, rank, chiefs + workers, cluster.is_chief)


def is_chief() -> bool:
    """Whether this task is the one that writes (the chief, else worker 0; alone: True)."""
    return this_task().is_chief


def num_workers() -> int:
    """How many tasks run training steps (Horovod's `size()` when each has one device)."""
    return this_task().num_workers


def num_replicas(strategy=None) -> int:
    """The replicas each global batch is split over under `strategy` (default: the current
    one): workers times devices per worker."""
    import tensorflow as tf  # deferred: the helpers above need no TensorFlow

    return (strategy or tf.distribute.get_strategy()).num_replicas_in_sync

"""Failures parameter-server training cannot ride out, turned into one explained error.

A worker that dies is not one of them: the ClusterCoordinator puts the closure it was
running back in its queue (TensorFlow's WorkerPreemptionHandler treats an UnavailableError
naming /job:worker as a preemption), another worker runs it, and the dead worker's thread
waits for it to come back. A parameter server that dies takes the variables with it: the
coordinator raises UnavailableError (or its own PSUnavailableError, AbortedError, or a
CancelledError for closures cancelled after it) from schedule, join or fetch. Then the job
must be restarted and resume from its last checkpoint, and the user should be told exactly
that, not shown a stack of TensorFlow frames.
"""

from __future__ import annotations

import re

import tensorflow as tf
from tensorflow.python.distribute.coordinator import cluster_coordinator

from tfdist.errors import TfdistError, first_line

# The coordinator wraps a closure's error when it reaches the closures that depended on it.
_WRAPPERS = (cluster_coordinator.ClosureInputError, cluster_coordinator.ClosureAbortedError)
CLUSTER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
    *_WRAPPERS,
)


class ClusterTaskFailed(TfdistError, RuntimeError):
    """A parameter server (or the chief's link to it) failed; training stopped at `step`.

    Attributes:
      task: the task that failed, e.g. "ps:0", or None if the error did not say.
      step: steps scheduled when training stopped.
      checkpoint_step: the step of the last checkpoint, where a restart resumes; None when
        nothing was saved.
      exit_code: what a binary exits with: 1, a failure a restart may cure, not a mistake
        in the command line (2).
    """

    exit_code = 1
    restartable = True  # a restart of the whole job resumes from the last checkpoint
    peers_gone = True  # ends past TensorFlow's shutdown (tfdist.exit_codes.end_process)

    def __init__(
        self,
        *,
        task: str | None,
        step: int,
        total_steps: int,
        checkpoint_step: int | None,
        checkpoint_dir: str | None,
        cause: str,
    ):
        self.task, self.step, self.checkpoint_step = task, step, checkpoint_step
        what = f"parameter server {task}" if task else "a parameter server (or the network to it)"
        if checkpoint_dir is None:
            resume = "no model_dir was given, so nothing was saved and a restart starts at step 0"
        elif checkpoint_step is None:
            resume = f"no checkpoint was written to {checkpoint_dir} yet: a restart starts at 0"
        else:
            resume = (
                f"the last checkpoint in {checkpoint_dir} is at step {checkpoint_step}, where "
                f"a restart resumes ({max(step - checkpoint_step, 0)} steps are run again)"
            )
        super().__init__(
            f"{what} is unreachable, and parameter-server training cannot continue without "
            f"the variables it holds. Training stopped after scheduling step {step} of "
            f"{total_steps}; {resume}. Restart the job with the same command, or let "
            f"`tfdist-launch --max_restarts N ...` restart it. Received: {cause}"
        )


def explain_cluster_error(
    error: BaseException,
    *,
    cluster: dict[str, list[str]] | None,
    step: int,
    total_steps: int,
    checkpoint_step: int | None,
    checkpoint_dir: str | None,
) -> ClusterTaskFailed | None:
    """The ClusterTaskFailed `error` amounts to, or None if it is not a cluster failure."""
    if not isinstance(error, CLUSTER_ERRORS):
        return None
    original = _unwrapped(error)
    text = _message(original)
    return ClusterTaskFailed(
        task=_failed_task(text, cluster or {}),
        step=step,
        total_steps=total_steps,
        checkpoint_step=checkpoint_step,
        checkpoint_dir=checkpoint_dir,
        cause=f"{type(original).__name__}: {first_line(text)}",
    )


def lost_worker(error: BaseException, *, cluster: dict[str, list[str]] | None) -> str | None:
    """The worker ("worker:1") a cluster error names when it names no ps, else None.

    Fetching the result of a step that finished on a worker which died since fails, though the
    step's update reached the ps: training survives that, only the step's metrics are lost.
    """
    if not isinstance(error, CLUSTER_ERRORS):
        return None
    task = _failed_task(_message(_unwrapped(error)), cluster or {})
    return task if task is not None and task.startswith("worker:") else None


def _unwrapped(error: BaseException) -> BaseException:
    return error.original_exception if isinstance(error, _WRAPPERS) else error


def _message(error: BaseException) -> str:
    return getattr(error, "message", None) or str(error)


def _failed_task(text: str, cluster: dict[str, list[str]]) -> str | None:
    # gRPC names the address it could not reach; TensorFlow sometimes names the task instead.
    # A ps first: a worker's report of the ps it lost can name both.
    for task_type in sorted(cluster, key=lambda t: t != "ps"):
        for index, address in enumerate(cluster[task_type]):
            if re.search(rf"(?<![\d.]){re.escape(address)}(?!\d)", text):
                return f"{task_type}:{index}"
    for task_type in ("ps", "worker", "chief"):
        match = re.search(rf"/job:{task_type}/replica:\d+/task:(\d+)", text)
        if match:
            return f"{task_type}:{match.group(1)}"
    return None

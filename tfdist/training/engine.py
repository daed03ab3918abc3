"""The engine's contract: what steps a model, for the loop that drives it (controller.py).

As Orbit's controller drives a trainer of `train(num_steps)` and `evaluate(num_steps)`, the
controller drives an `Engine` of ten members and owns the rest itself: the loop over epochs,
the callbacks, checkpoints, the report and the translation of failures. What depends on the
strategy but is not stepping (the chief, the placement, the tally across workers, the data's
way to the replicas, what a failure means) is the engine's `job` (job.py).

The implementations live in tfdist/training/runners/ (one per kind of strategy) and in the
modes that replace them (tfdist.parallel.pipeline); each supplies its steps to the traced
loop (loop.py), and none builds on another's class.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import keras
import tensorflow as tf

from tfdist.training.hooks import StepHook
from tfdist.training.job import Job
from tfdist.training.shards import Shards


@dataclasses.dataclass
class EngineState:
    """What a checkpoint holds of an engine beside the model and its optimizer.

    Attributes:
      variables: state kept apart from the model and optimizer (a sharded update's slots,
        the parameter-server update counter), by checkpoint key.
      shards: what each process writes of a sharded checkpoint (ZeRO-3's slices, a
        pipeline's stages), or None: the chief's checkpoint holds everything.
    """

    variables: dict[str, tf.Module | tf.Variable] = dataclasses.field(default_factory=dict)
    shards: Shards | None = None


@dataclasses.dataclass
class Report:
    """What an engine measured, for the run's record.

    Attributes:
      step_times: the epoch's seconds per step by phase (input, compute, exchange), or
        None where the steps were not timed.
      figures: run-level figures (bytes a hook sent, the updates' staleness).
    """

    step_times: dict[str, float] | None = None
    figures: dict[str, float | int | None] = dataclasses.field(default_factory=dict)


class Engine(abc.ABC):
    """Steps a compiled model under its job (see the module)."""

    job: Job

    @abc.abstractmethod
    def build(self, sample_batch: Any, step_hooks: Sequence[StepHook] = ()) -> None:
        """Builds the model, its metrics, its optimizer and the hooks from one batch's
        shapes (once: an engine kept on the model serves its next calls built)."""

    def begin(self, global_step: int) -> None:  # noqa: B027
        """Where a fit starts training, after any checkpoint is restored: counts on from
        `global_step`, and the hooks that keep their own copy of the weights take them."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Starts a new epoch's metrics and step times."""

    @abc.abstractmethod
    def train(
        self, iterator: Iterator, n: int, *, bounded: bool, logs: str | None
    ) -> tuple[int, dict[str, float] | None]:
        """Runs up to `n` training steps from `iterator` (the job's).

        Args:
          iterator: from `job.iterator()`.
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

    @abc.abstractmethod
    def evaluate(self, data, steps: int | None) -> dict[str, float]:
        """Evaluates on `data` (a FitData): every example once, over every replica."""

    def state(self) -> EngineState:
        """What a checkpoint must hold of this engine to resume exactly."""
        return EngineState()

    def report(self) -> Report:
        """What this engine measured: the epoch's step times, the run's figures."""
        return Report()


@runtime_checkable
class RunnerFactory(Protocol):
    """A layout that replaces the engine (tfdist.parallel.Pipeline): `tfdist.fit(...,
    pipeline=factory)` trains with `factory.runner(model, strategy)`; the modes its registry
    entry takes over (a pipeline's shard_optimizer), where on, come as keyword arguments."""

    def runner(self, model: keras.Model, strategy: tf.distribute.Strategy) -> Engine:
        """The engine that trains `model` under `strategy` (not yet built)."""

"""Every private TensorFlow / Keras entry point tfdist relies on, each behind a name of its own.

Checked on TensorFlow 2.21 and Keras 3.15. TensorFlow and Keras may rename or remove any of
these in a minor release; when one breaks, this is the only module to change (and
tests/test_compat.py names the entry). Each entry's "Why:" line says why no public API does.
Grouped by topic; add new entries to the section they belong to (or a new section), never
elsewhere in tfdist (tfdist/training's own uses move here with the engine refactor, issue 28).

Sections:
  strategies         building and inspecting tf.distribute strategy objects
  cross-device ops   the CrossDeviceOps protocol tfdist's ring all-reduce implements
  coordination       TensorFlow's coordination service (multi-worker start-up and heartbeats)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf

# `tensorflow.python` is TensorFlow's private tree: these imports stay in this module.
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import values as values_lib

# --- strategies -------------------------------------------------------------------------------


class MirroredStrategy(tf.distribute.MirroredStrategy):
    """tf.distribute.MirroredStrategy whose collective keys start at `collective_key_base`.

    TensorFlow numbers the collective groups of every MirroredStrategy from 1, so a second one
    over another number of devices in the same process aborts with "joining a group with size
    4, but that group has size 2". MirroredExtended's constructor reads the base from the
    strategy object; set on this instance before that runs, it gives this strategy its own
    key range and leaves tf.distribute.MirroredStrategy's class attribute alone. The class
    keeps TensorFlow's name, so messages that name a strategy's type read the same.

    Why: the private `_collective_key_base` is the only way to choose the keys.
    """

    def __init__(self, devices=None, cross_device_ops=None, *, collective_key_base: int = 0):
        self._collective_key_base = collective_key_base
        super().__init__(devices, cross_device_ops=cross_device_ops)


def mirrored_strategy(
    devices: Sequence[str],
    *,
    cross_device_ops: tf.distribute.CrossDeviceOps | None,
    collective_key_base: int,
) -> tf.distribute.MirroredStrategy:
    """A MirroredStrategy over `devices` whose collective group keys start after the base."""
    return MirroredStrategy(
        list(devices), cross_device_ops=cross_device_ops, collective_key_base=collective_key_base
    )


def replace_cross_device_ops(
    strategy: tf.distribute.Strategy,
    build: Callable[[tf.distribute.CrossDeviceOps], tf.distribute.CrossDeviceOps],
) -> None:
    """Replaces the strategy's CrossDeviceOps (what batch_reduce uses) with `build(current)`.

    Why: MultiWorkerMirroredStrategy takes no cross_device_ops argument; its private
    `extended._cross_device_ops` is the only way to route gradients through tfdist's ring.
    """
    extended = strategy.extended
    extended._cross_device_ops = build(extended._cross_device_ops)


def intercept_variable_creation(
    strategy: tf.distribute.Strategy, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Routes this strategy object's variable creation through `wrap(original_creator)`.

    The wrapped creator is called as creator(next_creator, **kwargs), like TensorFlow's; only
    this instance's method is replaced.

    Why: a public tf.variable_creator_scope would have to be entered around every use of the
    scope; the private `extended._create_variable` sees every variable, ps and shards chosen.
    """
    extended = strategy.extended
    extended._create_variable = wrap(extended._create_variable)


def strategy_cluster_resolver(strategy: tf.distribute.Strategy):
    """The cluster resolver a strategy was built with, or None.

    Why: ParameterServerStrategy's public `cluster_resolver` is None; it keeps its resolver
    in the private `_cluster_resolver`.
    """
    return strategy.cluster_resolver or getattr(strategy, "_cluster_resolver", None)


# --- cross-device ops -------------------------------------------------------------------------


class CrossDeviceOps(tf.distribute.CrossDeviceOps):
    """tf.distribute.CrossDeviceOps with its two private hooks under public names.

    Subclasses override `gather_implementation` and `num_between_graph_workers` (above 1, or
    TensorFlow skips reducing a value held on one device) instead of TensorFlow's names.

    Why: the hooks exist only as the private `_gather_implementation` and
    `_num_between_graph_workers`.
    """

    @property
    def num_between_graph_workers(self) -> int:
        return 1

    def gather_implementation(self, per_replica_value, destinations, axis, options):
        raise NotImplementedError(f"{type(self).__name__} does not gather")

    @property
    def _num_between_graph_workers(self) -> int:
        return self.num_between_graph_workers

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        return self.gather_implementation(per_replica_value, destinations, axis, options)


def gather(
    cross_device_ops: tf.distribute.CrossDeviceOps,
    per_replica_value,
    destinations,
    axis: int,
    options=None,
):
    """`cross_device_ops` gathers `per_replica_value` along `axis` onto `destinations`.

    Why: CrossDeviceOps has no public gather; strategies call its private `_gather`.
    """
    return cross_device_ops._gather(per_replica_value, destinations, axis, options)


def mirrored_value(per_device: Sequence[tf.Tensor]) -> tf.distribute.DistributedValues:
    """One Mirrored value from a tensor per device, as TensorFlow's CrossDeviceOps return.

    Why: no public API wraps per-device tensors; TensorFlow's own CrossDeviceOps use the
    private `distribute_utils.regroup` and `values.Mirrored`.
    """
    return distribute_utils.regroup(tuple(per_device), wrap_class=values_lib.Mirrored)


# --- coordination service ---------------------------------------------------------------------


def coordination_service_configured() -> bool:
    """Whether TensorFlow's coordination service has been configured in this process.

    Why: only the private eager context (`tensorflow.python.eager.context`) knows.
    """
    from tensorflow.python.eager import context

    return context.context().coordination_service is not None


def configure_coordination_service(
    *,
    leader: str,
    jobs: Mapping[str, int],
    register_timeout_ms: int,
    heartbeat_timeout_ms: int,
    register_with_barrier: bool,
) -> None:
    """Configures TensorFlow's coordination service before any strategy starts it.

    Args:
      leader: the task hosting the service, e.g. "/job:chief/replica:0/task:0".
      jobs: the number of tasks of each coordinated job.
      register_timeout_ms: how long every task waits for the others to register (0: forever).
      heartbeat_timeout_ms: silence after which a task is declared dead (0: TensorFlow's).
      register_with_barrier: the leader, too, waits at most register_timeout_ms.

    Why: MultiWorkerMirroredStrategy takes no timeouts; the private eager context, its
    CoordinatedJob proto and the barrier field (no argument sets it) are the only way.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=leader,
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=count)
            for job, count in jobs.items()
        ],
        cluster_register_timeout_in_ms=register_timeout_ms,
        heartbeat_timeout_in_ms=heartbeat_timeout_ms,
    )
    ctx.coordination_service.cluster_register_with_barrier = register_with_barrier

"""build_strategy(): a name-keyed registry of builders, and what 'auto' stands for.

Each builder takes (cluster, options) and returns a strategy. 'auto' picks the name from
TF_CONFIG and the hardware present (`resolve_auto`), in the order a user would:

  ps tasks in the cluster        -> parameter_server
  several workers (chief counts) -> multi_worker_mirrored
  a TPU reachable                -> tpu
  several local GPUs             -> mirrored
  otherwise                      -> one_device
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tfdist import devices as _devices
from tfdist import strategy_kinds as kinds
from tfdist.cluster import FROM_ENV, ClusterInfo, cluster_from_environment
from tfdist.strategies import keras_guard
from tfdist.strategies.multi_worker import build_multi_worker_mirrored, joins_worker_processes
from tfdist.strategies.options import (
    StrategyError,
    StrategyOptions,
    check_options_apply,
    merge_options,
)
from tfdist.strategies.parameter_server import build_parameter_server, tf_config_worker_names
from tfdist.strategies.single_host import build_central_storage, build_mirrored, build_one_device
from tfdist.strategies.tpu import build_tpu, detect_tpu

log = logging.getLogger(__name__)

ALIASES = kinds.ALIASES
SINGLE_HOST_STRATEGIES = kinds.SINGLE_HOST
REPLICA_PER_DEVICE_STRATEGIES = kinds.REPLICA_PER_DEVICE

_BUILDERS: dict[str, Callable[[ClusterInfo | None, StrategyOptions], tf.distribute.Strategy]] = {
    kinds.ONE_DEVICE: build_one_device,
    kinds.MIRRORED: build_mirrored,
    kinds.MULTI_WORKER_MIRRORED: build_multi_worker_mirrored,
    kinds.PARAMETER_SERVER: build_parameter_server,
    kinds.CENTRAL_STORAGE: build_central_storage,
    kinds.TPU: build_tpu,
}


def build_strategy(
    name: str = "auto",
    *,
    cluster: ClusterInfo | None = FROM_ENV,
    options: StrategyOptions | None = None,
    **option_values: Any,
) -> tf.distribute.Strategy:
    """Builds the tf.distribute strategy called `name` for this process.

    Building a multi-worker strategy configures TensorFlow's collective runtime, and building
    'tpu' connects to and initialises the TPU; nothing else is changed.

    Args:
      name: 'auto', 'one_device' (alias 'default'), 'mirrored', 'multi_worker_mirrored',
        'parameter_server', 'central_storage' or 'tpu'.
      cluster: the job's cluster. Default: parsed from the TF_CONFIG environment variable;
        None means this host alone.
      options: a StrategyOptions; or pass its fields as keyword arguments instead.
      **option_values: StrategyOptions fields, e.g. ``all_reduce="hierarchical_copy"``.

    Returns:
      The strategy. One log line says what was built. Keras's own `model.fit`, `evaluate`
      and `predict` are guarded from here on (tfdist/strategies/keras_guard.py).

    Raises:
      StrategyError: unknown name, contradictory options, or a strategy the cluster or the
        hardware cannot support (the message says which and how to fix it).
      TFConfigError: TF_CONFIG is malformed.
    """
    options = merge_options(options, option_values)
    if cluster is FROM_ENV:
        cluster = cluster_from_environment()
    requested = ALIASES.get(name, name)
    if requested == "auto":
        requested = resolve_auto(
            cluster, tpu_address=detect_tpu(options.tpu), num_gpus=_devices.num_physical_gpus()
        )
        log.info("Strategy 'auto' resolved to %r", requested)
        if not (cluster is not None and cluster.is_evaluator):  # its one_device is fixed
            check_options_apply(requested, options, chosen_by_auto=True)
    elif requested in _BUILDERS:
        check_options_apply(requested, options)
    else:
        raise StrategyError(
            f"Unknown strategy {name!r}. Valid names: {', '.join(strategy_names())}. "
            f"Received: name={name!r}"
        )
    if (
        requested in SINGLE_HOST_STRATEGIES
        and cluster is not None
        and not cluster.is_evaluator
        and cluster.num_workers > 1
    ):
        raise StrategyError(
            f"{requested!r} trains within one process, but TF_CONFIG describes "
            f"{cluster.num_workers} training tasks ({cluster.describe()}): each would train "
            "on its own, into the same model_dir. Use multi_worker_mirrored (or 'auto') for "
            f"several workers, or start one process. Received: strategy={name!r}"
        )
    strategy = _BUILDERS[requested](cluster, options)
    log.info("%s", describe_strategy(strategy, cluster))
    # From here Keras's own model.fit may meet a strategy it cannot train under: it says so
    # in one line (or, after tfdist.patch_keras(), trains through tfdist.fit).
    keras_guard.install()
    return strategy


def strategy_names() -> list[str]:
    """Every name build_strategy accepts."""
    return [kinds.AUTO, *_BUILDERS, *ALIASES]


def resolve_auto(cluster: ClusterInfo | None, *, tpu_address: str | None, num_gpus: int) -> str:
    """The strategy 'auto' stands for, given the cluster and the hardware (a pure function)."""
    if cluster is not None and cluster.is_evaluator:
        return (
            kinds.ONE_DEVICE
        )  # the evaluator never joins training: it evaluates on its own device
    if cluster is not None and cluster.cluster_strategy is not None:
        return cluster.cluster_strategy
    if tpu_address is not None:
        return kinds.TPU
    if num_gpus > 1:
        return kinds.MIRRORED
    return kinds.ONE_DEVICE


def strategy_kind(strategy: tf.distribute.Strategy) -> str:
    """tfdist's name for a strategy object, e.g. 'multi_worker_mirrored'.

    TensorFlow's class names differ from the public ones (MultiWorkerMirroredStrategy is a
    CollectiveAllReduceStrategy, ParameterServerStrategy a ParameterServerStrategyV2).
    """
    classes = [  # subclasses before their bases
        (kinds.TPU, tf.distribute.TPUStrategy),
        (kinds.PARAMETER_SERVER, tf.distribute.experimental.ParameterServerStrategy),
        (kinds.CENTRAL_STORAGE, tf.distribute.experimental.CentralStorageStrategy),
        (kinds.MULTI_WORKER_MIRRORED, tf.distribute.MultiWorkerMirroredStrategy),
        (kinds.MIRRORED, tf.distribute.MirroredStrategy),
        (kinds.ONE_DEVICE, tf.distribute.OneDeviceStrategy),
    ]
    return next((kind for kind, cls in classes if isinstance(strategy, cls)), kinds.DEFAULT)


def describe_strategy(strategy: tf.distribute.Strategy, cluster: ClusterInfo | None) -> str:
    """One line: the strategy, replicas in sync, devices and this task's role."""
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        # Its "worker_devices" are the chief's; the steps run on the remote workers.
        listed = len(cluster.cluster["worker"])
        used = len(tf_config_worker_names(strategy)) or listed
        workers = f"{used}" if used == listed else f"{used} of {listed}"
        devices = f"{workers} remote worker(s), variables on {cluster.num_ps} ps"
    else:
        devices = ", ".join(_short_device(d) for d in strategy.extended.worker_devices)
    role = cluster.describe() if cluster is not None else "single host"
    return (
        f"Built {strategy_kind(strategy)}: {strategy.num_replicas_in_sync} replica(s) in sync "
        f"on {devices}; task {role}"
    )


def _short_device(name: str) -> str:
    # '/job:localhost/replica:0/task:0/device:CPU:1' -> '/cpu:1' ; keep remote jobs readable.
    tail = name.split("/device:")[-1].lower()
    job = name.split("/")[1] if name.startswith("/job:") else ""
    return f"/{tail}" if not job or job == "job:localhost" else f"/{job}/{tail}"


def check_joins_processes(
    strategy: tf.distribute.Strategy,
    *,
    processes: int,
    started_by: str,
    error: type[Exception] = StrategyError,
) -> None:
    """Refuses a strategy that would train each of the `processes` a launcher started on its
    own (any but multi_worker_mirrored, with several processes).

    Args:
      started_by: the launcher, for the message ("Ray Train").
      error: the error type to raise.
    """
    if processes > 1 and not joins_worker_processes(strategy):
        kind = strategy_kind(strategy)
        raise error(
            f"{started_by} started {processes} workers, but a {kind} strategy trains each of "
            "them alone. Use strategy='auto' (or 'multi_worker_mirrored'), which joins the "
            f"workers through the TF_CONFIG {started_by} set. Received: strategy of kind {kind!r}"
        )

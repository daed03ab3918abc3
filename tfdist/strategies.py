"""build_strategy(): turn a name, the cluster and the hardware into a tf.distribute.Strategy.

Each strategy has one small builder in a name-keyed registry. "auto" picks the name from
TF_CONFIG and the hardware present (`resolve_auto`), in the order a user would:

  ps tasks in the cluster       -> parameter_server
  several workers (chief counts) -> multi_worker_mirrored
  a TPU reachable                -> tpu
  several local GPUs             -> mirrored
  otherwise                      -> one_device

Example:

    >>> import tfdist
    >>> tfdist.configure_cpu_devices(2)
    >>> strategy = tfdist.build_strategy("mirrored", all_reduce="hierarchical_copy")
    >>> strategy.num_replicas_in_sync
    2
"""

from __future__ import annotations

import dataclasses
import glob
import inspect
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf

from tfdist import devices as _devices
from tfdist import signals
from tfdist.cluster import CHIEF, FROM_ENV, WORKER, ClusterInfo, cluster_from_environment
from tfdist.errors import TfdistError
from tfdist.layout import Layout, LayoutError, launch_flags, validate_layout
from tfdist.peers import (
    DEFAULT_STARTUP_TIMEOUT,
    configure_coordination,
    explain_peer_error,
    explain_server_error,
    wait_for_peers,
    wait_for_servers,
)

log = logging.getLogger(__name__)

ALL_REDUCE_CHOICES = ("ring", "nccl", "hierarchical_copy", "reduction_to_one_device")
COMPRESSION_CHOICES = ("float16", "bfloat16")
COLLECTIVE_CHOICES = ("auto", "ring", "nccl")
ALIASES = {"default": "one_device"}
# Parameter-server variables larger than this are split across the ps tasks
# (tf-models-official's default, 256 KiB), so no single ps carries a whole embedding.
DEFAULT_PS_MIN_SHARD_BYTES = 256 << 10


class StrategyError(TfdistError, ValueError):
    """The strategy asked for cannot be built here; the message says why and what to do."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """The knobs of build_strategy, validated once when created.

    Args:
      devices: device names for one_device, mirrored and central_storage, e.g.
        ("/gpu:0", "/gpu:1"). Default: every GPU, else every logical CPU device.
      num_gpus: use the first N GPUs (tf-models-official's --num_gpus); excludes `devices`.
      all_reduce: how gradients are summed. 'ring' is tfdist's ring all-reduce (mirrored:
        over the local devices; multi_worker_mirrored: over the devices, then the worker
        processes). mirrored also takes TensorFlow's 'nccl' (GPUs only), 'hierarchical_copy'
        and 'reduction_to_one_device'. Default: TensorFlow's choice.
      fusion_bytes: with all_reduce='ring', gradients are packed into buffers of up to this
        many bytes before the ring (tensor fusion; 0 turns it off). Default 4 MiB.
      compression: with all_reduce='ring', 'float16' or 'bfloat16' sends float32 gradients
        in that dtype (half the bytes, sums at that precision).
      collective: multi_worker_mirrored's collective implementation: 'auto', 'ring', 'nccl'.
      collective_timeout: seconds a multi-worker collective may wait for its peers before it
        fails (TensorFlow waits forever by default). TensorFlow keeps a watchdog thread per
        collective op for this long, so a step with many all-reduces (the ring without
        fusion) adds threads faster than they end: keep it short, or rely on
        heartbeat_timeout, which detects a dead peer at no such cost.
      startup_timeout: seconds a multi_worker_mirrored task waits for every chief and worker
        task (a parameter_server chief: for every worker and ps) to start before failing with
        an error naming the missing ones; None waits forever (TensorFlow's default).
        Default 600.
      heartbeat_timeout: seconds without a heartbeat before multi_worker_mirrored declares a
        peer dead and stops with an error naming it. Default: TensorFlow's (10 s).
      min_workers: parameter_server: the fewest workers to start training with. The chief
        starts once every ps and this many workers are up (and the others had 15 s more);
        workers missing then take no part in the run. Default 1; None waits for every worker.
      ps_min_shard_bytes: parameter_server splits variables larger than this across the ps
        tasks (at most one shard per ps); 0 keeps every variable whole.
      tpu: the TPU to connect to: 'local' (Colab TPU VM / Cloud TPU VM), a TPU name, or a
        'grpc://host:8470' address. Default: detected from TPU_NAME, COLAB_TPU_ADDR or the
        TPU devices of a TPU VM.
    """

    devices: tuple[str, ...] | None = None
    num_gpus: int | None = None
    all_reduce: str | None = None
    fusion_bytes: int | None = None
    compression: str | None = None
    collective: str = "auto"
    collective_timeout: float | None = None
    startup_timeout: float | None = DEFAULT_STARTUP_TIMEOUT
    heartbeat_timeout: float | None = None
    min_workers: int | None = 1
    ps_min_shard_bytes: int = DEFAULT_PS_MIN_SHARD_BYTES
    tpu: str | None = None

    def __post_init__(self):
        if self.devices is not None:
            if isinstance(self.devices, str) or not all(isinstance(d, str) for d in self.devices):
                raise StrategyError(
                    "devices must be a sequence of device names such as ('/gpu:0', '/gpu:1'). "
                    f"Received: devices={self.devices!r}"
                )
            if not self.devices:
                raise StrategyError("devices must name at least one device. Received: devices=()")
            object.__setattr__(self, "devices", tuple(self.devices))
            if self.num_gpus is not None:
                raise StrategyError(
                    "devices and num_gpus both choose the devices; pass only one of them. "
                    f"Received: devices={self.devices!r}, num_gpus={self.num_gpus!r}"
                )
        if self.num_gpus is not None and (not isinstance(self.num_gpus, int) or self.num_gpus < 0):
            raise StrategyError(
                f"num_gpus must be a whole number >= 0. Received: num_gpus={self.num_gpus!r}"
            )
        _check_choice("all_reduce", self.all_reduce, ALL_REDUCE_CHOICES, optional=True)
        _check_choice("compression", self.compression, COMPRESSION_CHOICES, optional=True)
        if self.fusion_bytes is not None and (
            not isinstance(self.fusion_bytes, int) or self.fusion_bytes < 0
        ):
            raise StrategyError(
                "fusion_bytes must be a whole number of bytes >= 0 (0 turns fusion off). "
                f"Received: fusion_bytes={self.fusion_bytes!r}"
            )
        ring_only = [
            f"{name}={getattr(self, name)!r}"
            for name in ("fusion_bytes", "compression")
            if getattr(self, name) is not None
        ]
        if ring_only and self.all_reduce != "ring":
            raise StrategyError(
                f"{' and '.join(ring_only)} only {'applies' if len(ring_only) == 1 else 'apply'} "
                "to tfdist's ring all-reduce; add "
                f"all_reduce='ring' (--all_reduce=ring). Received: all_reduce={self.all_reduce!r}"
            )
        _check_choice("collective", self.collective, COLLECTIVE_CHOICES)
        for name in ("collective_timeout", "startup_timeout", "heartbeat_timeout"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise StrategyError(
                    f"{name} must be a positive number of seconds, or None for TensorFlow's "
                    f"default. Received: {name}={value!r}"
                )
        if self.min_workers is not None and (
            not isinstance(self.min_workers, int) or self.min_workers < 1
        ):
            raise StrategyError(
                "min_workers must be a whole number >= 1, or None to wait for every worker. "
                f"Received: min_workers={self.min_workers!r}"
            )
        if not isinstance(self.ps_min_shard_bytes, int) or self.ps_min_shard_bytes < 0:
            raise StrategyError(
                "ps_min_shard_bytes must be a whole number of bytes >= 0 (0 disables "
                f"partitioning). Received: ps_min_shard_bytes={self.ps_min_shard_bytes!r}"
            )


def _check_choice(name: str, value: Any, choices: Sequence[str], *, optional: bool = False):
    if (optional and value is None) or value in choices:
        return
    raise StrategyError(
        f"{name} must be one of {', '.join(choices)}{' (or None)' if optional else ''}. "
        f"Received: {name}={value!r}"
    )


# Strategies that train in one process on this host's devices.
SINGLE_HOST_STRATEGIES = ("one_device", "mirrored", "central_storage")

# Which options mean something to which strategy: an option given to a strategy that would
# ignore it is a contradiction worth an error, not a silent no-op.
_OPTION_USERS = {
    "devices": ("one_device", "mirrored", "central_storage"),
    "num_gpus": ("one_device", "mirrored", "central_storage"),
    "all_reduce": ("mirrored", "multi_worker_mirrored"),
    "collective": ("multi_worker_mirrored",),
    "collective_timeout": ("multi_worker_mirrored",),
    "startup_timeout": ("multi_worker_mirrored", "parameter_server"),
    "heartbeat_timeout": ("multi_worker_mirrored",),
    "min_workers": ("parameter_server",),
    "ps_min_shard_bytes": ("parameter_server",),
    "tpu": ("tpu",),
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
      The strategy. One log line says what was built.

    Raises:
      StrategyError: unknown name, contradictory options, or a strategy the cluster or the
        hardware cannot support (the message says which and how to fix it).
      TFConfigError: TF_CONFIG is malformed.
    """
    options = _merge_options(options, option_values)
    if cluster is FROM_ENV:
        cluster = cluster_from_environment()
    requested = ALIASES.get(name, name)
    if requested == "auto":
        requested = resolve_auto(
            cluster, tpu_address=detect_tpu(options.tpu), num_gpus=_devices.num_physical_gpus()
        )
        log.info("Strategy 'auto' resolved to %r", requested)
        if not (cluster is not None and cluster.is_evaluator):  # its one_device is fixed
            _check_options_apply(requested, options, chosen_by_auto=True)
    elif requested in _BUILDERS:
        _check_options_apply(requested, options)
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
    return strategy


def strategy_names() -> list[str]:
    """Every name build_strategy accepts."""
    return ["auto", *_BUILDERS, *ALIASES]


def resolve_auto(cluster: ClusterInfo | None, *, tpu_address: str | None, num_gpus: int) -> str:
    """The strategy 'auto' stands for, given the cluster and the hardware (a pure function)."""
    if cluster is not None and cluster.is_evaluator:
        return "one_device"  # the evaluator never joins training: it evaluates on its own device
    if cluster is not None and cluster.cluster_strategy is not None:
        return cluster.cluster_strategy
    if tpu_address is not None:
        return "tpu"
    if num_gpus > 1:
        return "mirrored"
    return "one_device"


def detect_tpu(explicit: str | None = None) -> str | None:
    """The TPU address to use: `explicit`, else one found in the environment, else None.

    Colab's legacy TPU runtime sets COLAB_TPU_ADDR, Cloud TPU tooling sets TPU_NAME, and a
    TPU VM exposes its chips as /dev/accel* (v2-v4) or /dev/vfio/<n> (v5e and later), where
    TensorFlow reaches them through the 'local' resolver.
    """
    if explicit:
        return explicit
    if os.environ.get("TPU_NAME"):
        return os.environ["TPU_NAME"]
    if os.environ.get("COLAB_TPU_ADDR"):
        return "grpc://" + os.environ["COLAB_TPU_ADDR"]
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return "local"
    return None


def strategy_kind(strategy: tf.distribute.Strategy) -> str:
    """tfdist's name for a strategy object, e.g. 'multi_worker_mirrored'.

    TensorFlow's class names differ from the public ones (MultiWorkerMirroredStrategy is a
    CollectiveAllReduceStrategy, ParameterServerStrategy a ParameterServerStrategyV2).
    """
    kinds = [  # subclasses before their bases
        ("tpu", tf.distribute.TPUStrategy),
        ("parameter_server", tf.distribute.experimental.ParameterServerStrategy),
        ("central_storage", tf.distribute.experimental.CentralStorageStrategy),
        ("multi_worker_mirrored", tf.distribute.MultiWorkerMirroredStrategy),
        ("mirrored", tf.distribute.MirroredStrategy),
        ("one_device", tf.distribute.OneDeviceStrategy),
    ]
    return next((kind for kind, cls in kinds if isinstance(strategy, cls)), "default")


def describe_strategy(strategy: tf.distribute.Strategy, cluster: ClusterInfo | None) -> str:
    """One line: the strategy, replicas in sync, devices and this task's role."""
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        # Its "worker_devices" are the chief's; the steps run on the remote workers.
        listed = len(cluster.cluster["worker"])
        used = len(_WORKER_NAMES.get(strategy, ())) or listed
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


def _merge_options(options: StrategyOptions | None, values: dict[str, Any]) -> StrategyOptions:
    if options is not None and values:
        raise StrategyError(
            "Pass either options=StrategyOptions(...) or option keywords, not both. "
            f"Received: options={options!r}, keywords={sorted(values)}"
        )
    if options is not None:
        return options
    valid = [f.name for f in dataclasses.fields(StrategyOptions)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise StrategyError(
            f"Unknown strategy option {unknown[0]!r}. Valid options: {', '.join(valid)}. "
            f"Received: {unknown[0]}={values[unknown[0]]!r}"
        )
    return StrategyOptions(**values)


def _check_options_apply(name: str, options: StrategyOptions, *, chosen_by_auto=False) -> None:
    defaults = StrategyOptions()
    chosen = (
        f"{name!r}, the strategy 'auto' chose here" if chosen_by_auto else f"the {name!r} strategy"
    )
    for field, users in _OPTION_USERS.items():
        value = getattr(options, field)
        if value != getattr(defaults, field) and name not in users:
            raise StrategyError(
                f"Option {field} does not apply to {chosen} (only to {' and '.join(users)}); "
                "remove it or name one of those strategies. "
                f"Received: {field}={value!r}"
            )


# --- builders: (cluster, options) -> strategy ---------------------------------------------


def _local_devices(options: StrategyOptions) -> list[str]:
    if options.devices is not None:
        return list(options.devices)
    gpus = _devices.gpu_device_names()
    if options.num_gpus is not None:
        if options.num_gpus > len(gpus):
            raise StrategyError(
                f"{options.num_gpus} GPUs were asked for but TensorFlow sees {len(gpus)}. "
                f"Lower num_gpus, or pass num_gpus=0 to run on the CPU. "
                f"Received: num_gpus={options.num_gpus}"
            )
        if options.num_gpus > 0:
            return gpus[: options.num_gpus]
        return _devices.cpu_device_names()
    return gpus or _devices.cpu_device_names()


def _build_one_device(cluster: ClusterInfo | None, options: StrategyOptions):
    chosen = _local_devices(options)
    if options.devices is not None and len(chosen) > 1:
        raise StrategyError(
            f"one_device runs on exactly one device but {len(chosen)} were given; use "
            f"'mirrored' for several. Received: devices={options.devices!r}"
        )
    return tf.distribute.OneDeviceStrategy(chosen[0])


def _build_mirrored(cluster: ClusterInfo | None, options: StrategyOptions):
    chosen = _local_devices(options)
    cross_device_ops = None  # TensorFlow picks NCCL for GPUs and a CPU reduction otherwise
    if options.all_reduce == "nccl":
        if not all("GPU" in d.upper() for d in chosen):
            raise StrategyError(
                "all_reduce='nccl' needs GPUs but the devices are "
                f"{', '.join(chosen)}; use 'hierarchical_copy' or 'reduction_to_one_device' "
                "on CPUs. Received: all_reduce='nccl'"
            )
        cross_device_ops = tf.distribute.NcclAllReduce()
    elif options.all_reduce == "hierarchical_copy":
        cross_device_ops = tf.distribute.HierarchicalCopyAllReduce()
    elif options.all_reduce == "reduction_to_one_device":
        cross_device_ops = tf.distribute.ReductionToOneDevice()
    elif options.all_reduce == "ring":
        cross_device_ops = _ring_cross_device_ops(options)
    # TensorFlow numbers the collective groups of every MirroredStrategy from 1, so a second
    # one over a different number of devices in the same process (a notebook re-run, a test
    # suite) aborts with "joining a group with size 4, but that group has size 2". Each build
    # gets its own key range, the way TensorFlow's own tests separate their strategies.
    tf.distribute.MirroredStrategy._collective_key_base = next(_MIRRORED_KEY_BASES)
    return tf.distribute.MirroredStrategy(chosen, cross_device_ops=cross_device_ops)


_MIRRORED_KEY_BASES = itertools.count(0, 100_000)


def _build_central_storage(cluster: ClusterInfo | None, options: StrategyOptions):
    # Variables live on the CPU, computation is mirrored on the compute devices.
    return tf.distribute.experimental.CentralStorageStrategy(
        compute_devices=_local_devices(options), parameter_device="/cpu:0"
    )


def _require_cluster(
    name: str, cluster: ClusterInfo | None, *, need: str, launch_flags: str
) -> ClusterInfo:
    if cluster is None:
        raise StrategyError(
            f"The {name!r} strategy needs a cluster ({need}) but TF_CONFIG is not set. Start "
            f"the job with a launcher that sets TF_CONFIG for every process, e.g. "
            f"`tfdist-launch {launch_flags} -- python my_train.py`, or "
            f"use 'mirrored' to train on this host alone."
        )
    if cluster.is_evaluator:
        raise StrategyError(
            f"This task is the evaluator, which does not join {name!r} training; build "
            f"'one_device' (or 'auto') in the evaluator. Received: task={cluster.task_name}"
        )
    return cluster


def _check_layout(cluster: ClusterInfo, strategy: str) -> None:
    try:
        validate_layout(Layout.of_cluster(cluster.cluster), strategy=strategy, spell=_launch_spell)
    except LayoutError as error:
        raise StrategyError(f"The cluster in {cluster.source} does not fit: {error}") from None


def _launch_spell(layout: Layout) -> str:
    return f"tfdist-launch {launch_flags(layout)} -- python my_train.py"


def _build_multi_worker_mirrored(cluster: ClusterInfo | None, options: StrategyOptions):
    cluster = _require_cluster(
        "multi_worker_mirrored", cluster, need="2+ workers", launch_flags="--workers 2"
    )
    _check_layout(cluster, "multi_worker_mirrored")
    if options.collective == "nccl" and _devices.num_physical_gpus() == 0:
        raise StrategyError(
            "collective='nccl' runs the all-reduce on GPUs with NCCL, and this host has none. "
            "Use collective='ring' (or 'auto', which picks what the host has), or run on GPU "
            "hosts. Received: collective='nccl'"
        )
    implementation = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[options.collective]
    communication = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation, timeout_seconds=options.collective_timeout
    )
    if options.all_reduce not in (None, "ring"):
        raise StrategyError(
            f"multi_worker_mirrored sums gradients with TensorFlow's collectives or with "
            f"tfdist's ring; all_reduce={options.all_reduce!r} is a mirrored-only choice. Use "
            "all_reduce='ring', or collective='ring'/'nccl' to pick TensorFlow's collective "
            f"implementation. Received: all_reduce={options.all_reduce!r}"
        )
    others = [
        f"{task_type}:{index}"
        for task_type in (CHIEF, WORKER)
        for index, _ in cluster.indexed_addresses(task_type)
        if f"{task_type}:{index}" != cluster.task_name
    ]
    waiting_for = " and ".join(others) if len(others) <= 3 else f"the other {len(others)} tasks"
    with signals.doing(f"waiting for {waiting_for} to start (start-up)"):
        wait_for_peers(cluster, timeout=options.startup_timeout)
    configure_coordination(
        cluster,
        startup_timeout=options.startup_timeout,
        heartbeat_timeout=options.heartbeat_timeout,
    )
    try:
        with signals.doing(f"waiting for {waiting_for} to join the job (start-up)"):
            strategy = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=cluster.cluster_resolver(), communication_options=communication
            )
    except tf.errors.OpError as e:
        explained = explain_server_error(e, cluster) or explain_peer_error(
            e, cluster, starting=True, startup_timeout=options.startup_timeout
        )
        if explained is None:
            raise
        raise explained from None
    except (RuntimeError, ValueError) as e:
        if "startup" not in str(e) and "initialized" not in str(e):
            raise
        raise StrategyError(
            "multi_worker_mirrored must be built before TensorFlow runs anything else: "
            "its collective runtime can only be configured at program start. Build the "
            "strategy first thing in main(), before creating tensors, models or datasets "
            f"(in a notebook, restart the runtime). TensorFlow said: {e}"
        ) from None
    if options.all_reduce == "ring":
        # MultiWorkerMirroredStrategy takes no cross_device_ops argument. Gradients reach the
        # strategy's CrossDeviceOps through batch_reduce (merge_call, as on every CPU or
        # non-XLA replica), so swapping that object reroutes them; anything the ring does not
        # handle still goes to TensorFlow's CollectiveAllReduce. A private attribute, tested
        # with TensorFlow 2.21: tests/test_training.py fails if the swap stops taking effect.
        from tfdist.collective import ProcessRing

        extended = strategy.extended
        ring = ProcessRing(
            rank=_training_rank(cluster),
            ranks=cluster.num_workers,
            timeout_seconds=options.collective_timeout,
        )
        extended._cross_device_ops = _ring_cross_device_ops(
            options, process_ring=ring, fallback=extended._cross_device_ops
        )
    return strategy


def _training_rank(cluster: ClusterInfo) -> int:
    """This task's place among the training tasks: the chief first, then the workers."""
    has_chief = bool(cluster.cluster.get(CHIEF))
    return 0 if cluster.task_type == CHIEF else cluster.task_index + int(has_chief)


def _ring_cross_device_ops(options: StrategyOptions, **kwargs) -> tf.distribute.CrossDeviceOps:
    from tfdist.collective import DEFAULT_BUCKET_BYTES, RingAllReduce

    bucket = DEFAULT_BUCKET_BYTES if options.fusion_bytes is None else options.fusion_bytes
    return RingAllReduce(bucket_bytes=bucket, compression=options.compression, **kwargs)


def _build_parameter_server(cluster: ClusterInfo | None, options: StrategyOptions):
    cluster = _require_cluster(
        "parameter_server",
        cluster,
        need="a chief, 1+ workers and 1+ ps",
        launch_flags="--chief --workers 2 --ps 1",
    )
    _check_layout(cluster, "parameter_server")
    if cluster.task_type != CHIEF:
        raise StrategyError(
            f"In parameter-server training only the chief builds the strategy; this task is "
            f"{cluster.task_name}. Call tfdist.serve_if_needed() at the start of main(): it runs "
            "the worker and ps servers and returns only when the job ends."
        )
    with signals.doing("waiting for the workers and ps to start (parameter-server start-up)"):
        present = wait_for_servers(
            cluster, timeout=options.startup_timeout, min_workers=options.min_workers
        )
    # TensorFlow connects to every worker it is given and waits for each; the workers that
    # are up are given to it under indices 0..n-1 (a server takes the name the chief's
    # connection gives it), and the map keeps their TF_CONFIG names for messages.
    workers = dict(cluster.indexed_addresses(WORKER))
    training = dataclasses.replace(
        cluster,
        cluster={**cluster.cluster, WORKER: tuple(workers[i] for i in present)},
        sparse_indices=None
        if cluster.sparse_indices is None
        else {**cluster.sparse_indices, WORKER: tuple(range(len(present)))},
    )
    partitioner = None
    if options.ps_min_shard_bytes and cluster.num_ps > 1:
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=options.ps_min_shard_bytes, max_shards=cluster.num_ps
        )
    try:
        with signals.doing("connecting to the workers and ps (parameter-server start-up)"):
            strategy = tf.distribute.experimental.ParameterServerStrategy(
                training.cluster_resolver(), variable_partitioner=partitioner
            )
    except tf.errors.OpError as e:
        explained = explain_server_error(e, cluster)
        if explained is None:
            raise
        raise explained from None
    _WORKER_NAMES[strategy] = {f"{WORKER}:{n}": f"{WORKER}:{i}" for n, i in enumerate(present)}
    _initialize_variables_from_the_chief(strategy)
    return strategy


# Rows of an initial value sent to a ps in one message. tools/ps_bench.py, 1M x 64 table:
# with 256 KiB pieces a ps held its shard plus ~10-25 MB when the variables were made; with
# 16 MiB pieces, 1.5-2.5x its shard (the buffers of received pieces stay with the process).
_INIT_PIECE_BYTES = 256 << 10


def _initialize_variables_from_the_chief(strategy) -> None:
    """Creates each variable on its ps as zeros, then sends its initial value in pieces.

    Keras 3 hands TensorFlow an initial value as a callable without a shape. Left alone,
    ParameterServerStrategy computes the value under the device scope of the variable's ps
    (a whole variable: ~3x its size there at once) or, for a split variable, computes it
    whole on the chief and takes each shard's rows on the shard's ps (the whole table then
    travels to every ps, and each holds it: tools/ps_bench.py measured ~2.7x the table on
    every ps, however many there were). Here the chief computes the value once (the same
    values as before, so split and whole variables start alike) and sends each variable or
    shard its own rows, in pieces of _INIT_PIECE_BYTES.
    """
    extended = strategy.extended
    create = extended._create_variable

    def _create_variable(next_creator, **kwargs):
        initial = kwargs.get("initial_value")
        if (
            not callable(initial)
            or tf.inside_function()  # made while tracing: the graph keeps TensorFlow's way
            or kwargs.get("shape") is not None  # the caller's shape (perhaps partly unknown)
            or kwargs.get("per_worker_variable")
            or "colocate_with" in kwargs
            or inspect.signature(initial).parameters  # restore-on-create, or shard-aware
        ):
            return create(next_creator, **kwargs)
        value = tf.convert_to_tensor(initial(), dtype=kwargs.get("dtype"))
        if value.shape.rank == 0 or not (value.dtype.is_floating or value.dtype.is_integer):
            kwargs["initial_value"] = value  # a scalar, or a dtype scatter_update lacks
            return create(next_creator, **kwargs)

        def zeros(partition_shape=None, partition_offset=None):
            return tf.zeros(partition_shape or value.shape, value.dtype)  # made on the ps

        kwargs.update(initial_value=zeros, shape=value.shape, dtype=value.dtype)
        variable = create(next_creator, **kwargs)
        parts = getattr(variable, "variables", None) or [variable]
        row_bytes = max(1, value.shape[1:].num_elements() * value.dtype.size)
        step = max(1, _INIT_PIECE_BYTES // row_bytes)
        offset = 0
        for part in parts:
            rows = int(part.shape[0])
            for start in range(0, rows, step):
                end = min(rows, start + step)
                rows_here = tf.IndexedSlices(
                    value[offset + start : offset + end], tf.range(start, end, dtype=tf.int64)
                )
                part.scatter_update(rows_here)
            offset += rows
        return variable

    extended._create_variable = _create_variable


# ParameterServerStrategy -> {TensorFlow's name of a worker: its name in TF_CONFIG}.
_WORKER_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def task_name_in_tf_config(strategy: tf.distribute.Strategy, name: str) -> str:
    """The TF_CONFIG name ("worker:2") of the task TensorFlow calls `name` ("worker:1").

    They differ when a parameter-server job started without some of its workers (the
    workers present are numbered 0..n-1 for TensorFlow).
    """
    return _WORKER_NAMES.get(strategy, {}).get(name, name)


_TPU_HELP = (
    "On Colab choose Runtime > Change runtime type > TPU and restart; on a Cloud TPU VM pass "
    "tpu='local'; for a TPU Node pass its name or 'grpc://host:8470'. Without a TPU, use "
    "'auto' (--strategy=auto), which falls back to the GPUs or the CPU present."
)
# What a TensorFlow build without TPU support says when asked to initialise a TPU: the op
# that configures the TPU system has no kernel.
_NO_TPU_KERNEL = "ConfigureDistributedTPU"


def _build_tpu(cluster: ClusterInfo | None, options: StrategyOptions):
    address = detect_tpu(options.tpu)
    if address is None:
        raise StrategyError(
            "No TPU found: no tpu option, no TPU_NAME or COLAB_TPU_ADDR in the environment and "
            f"no TPU devices on this machine. {_TPU_HELP}"
        )
    resolver = _tpu_cluster_resolver(address)
    if tpu_node_address(resolver) is not None:
        # A TPU Node is a remote TensorFlow server; a TPU VM's chips are local devices.
        tf.config.experimental_connect_to_cluster(resolver)
    try:
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
        if _NO_TPU_KERNEL in str(e):
            raise StrategyError(
                f"No TPU is attached at {address!r}, or this TensorFlow build cannot drive "
                f"one: it has no TPU kernels ({_NO_TPU_KERNEL} is not registered). On a TPU VM "
                "install TensorFlow's TPU build, the tensorflow-tpu package at the same version "
                f"as tensorflow (it brings libtpu). {_TPU_HELP} Received: tpu={address!r}"
            ) from None
        raise StrategyError(
            f"Could not initialise the TPU at {address!r}: {_first_line(e)}. {_TPU_HELP} "
            f"Received: tpu={address!r}"
        ) from None
    return tf.distribute.TPUStrategy(resolver)


def _tpu_cluster_resolver(address: str) -> tf.distribute.cluster_resolver.TPUClusterResolver:
    """The resolver for `address`, with the ways of failing to find it explained."""
    try:
        return tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
    except (ValueError, RuntimeError, ImportError, OSError, tf.errors.OpError) as e:
        # 'local' and grpc:// addresses need no look-up; any other name is looked up through
        # the Cloud TPU API, which needs Google Cloud's metadata server (the project and zone)
        # and the Google API client, so off Google Cloud it fails with a URL or import error.
        raise StrategyError(
            f"Could not find the TPU {address!r} ({type(e).__name__}: {_first_line(e)}). A TPU "
            "name is looked up through the Cloud TPU API, which works only on a Google Cloud VM "
            "in the TPU's project and zone; pass the TPU's 'grpc://host:8470' address "
            "instead, or tpu='local' on a TPU VM (Colab's TPU runtime). Without a TPU, use "
            f"'auto' (--strategy=auto). Received: tpu={address!r}"
        ) from None


def _first_line(error: Exception) -> str:
    # TensorFlow's messages go on with registered kernels and graph nodes; the first line
    # says what happened.
    text = error.message if isinstance(error, tf.errors.OpError) else str(error)
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def tpu_node_address(
    source: tf.distribute.Strategy | tf.distribute.cluster_resolver.ClusterResolver,
) -> str | None:
    """The grpc:// address of the TPU Node behind a TPUStrategy (or its resolver), else None.

    None for any other strategy and for a TPU VM, whose chips are local devices (the 'local'
    resolver's master is empty).
    """
    resolver = source
    if isinstance(source, tf.distribute.Strategy):
        if not isinstance(source, tf.distribute.TPUStrategy):
            return None
        resolver = source.cluster_resolver
    return resolver.master() or None


def check_tpu_node_paths(tpu_address: str | None, paths: Mapping[str, str | None]) -> None:
    """Raises StrategyError if a TPU Node would have to read or write a non-Cloud-Storage path.

    On the TPU Node architecture (Colab's former TPU runtime, Cloud TPU Nodes) the input
    pipeline runs on, and checkpoints are written by, the TPU's own host, which reaches
    Cloud Storage but not this machine's disk; TensorFlow fails there, after building
    everything, with "File system scheme '[local]' not implemented". A TPU VM has no such
    limit. A pure function: the address comes from `tpu_node_address`.

    Args:
      tpu_address: the TPU Node's address; None or 'local' (a TPU VM) passes every path.
      paths: the paths the run uses by name, e.g. {"model_dir": ..., "data_dir": ...}; None
        stands for a default location on the local disk.

    Raises:
      StrategyError: a path is not a gs:// URL; the message names each one.
    """
    if tpu_address in (None, "", "local"):
        return
    local = {name: path for name, path in paths.items() if not (path or "").startswith("gs://")}
    if local:
        received = ", ".join(
            f"{name}={path!r}" + (" (a default on the local disk)" if path is None else "")
            for name, path in local.items()
        )
        raise StrategyError(
            f"The TPU at {tpu_address!r} is a TPU Node: its own host reads the input and writes "
            f"the checkpoints, and it can only reach Cloud Storage, not this machine's disk, so "
            f"{' and '.join(local)} must be gs:// URLs. Copy the data to a gs://bucket/... "
            "path the TPU's service account can read, and point model_dir at one it can write; "
            "or use a TPU VM (Colab's current TPU runtime, tpu='local'), which reads local "
            f"files. Received: {received}"
        )


_BUILDERS: dict[str, Callable[[ClusterInfo | None, StrategyOptions], tf.distribute.Strategy]] = {
    "one_device": _build_one_device,
    "mirrored": _build_mirrored,
    "multi_worker_mirrored": _build_multi_worker_mirrored,
    "parameter_server": _build_parameter_server,
    "central_storage": _build_central_storage,
    "tpu": _build_tpu,
}

__all__ = [
    "ALL_REDUCE_CHOICES",
    "COLLECTIVE_CHOICES",
    "StrategyError",
    "StrategyOptions",
    "build_strategy",
    "check_tpu_node_paths",
    "describe_strategy",
    "detect_tpu",
    "resolve_auto",
    "strategy_kind",
    "strategy_names",
    "tpu_node_address",
]

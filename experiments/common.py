"""What every tfdist binary does the same way: where it runs, quiet logs, one-line errors."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable

import tensorflow as tf
from absl import app, flags
from absl import logging as absl_logging

import tfdist
from tfdist import logs, signals
from tfdist import strategy_kinds as kinds
from tfdist.cluster import ClusterInfo
from tfdist.errors import TfdistError
from tfdist.exit_codes import EXIT_USAGE, end_process
from tfdist.layout import MULTI_WORKER_STRATEGIES
from tfdist.strategies import (
    ALL_REDUCE_CHOICES,
    COLLECTIVE_CHOICES,
    COMPRESSION_CHOICES,
    REPLICA_PER_DEVICE_STRATEGIES,
    strategy_names,
)

# Where the job runs: the same flags in every binary.
STRATEGY = flags.DEFINE_enum(
    "strategy", "auto", strategy_names(),
    "tf.distribute strategy; 'auto' picks from TF_CONFIG and the hardware present.",
)  # fmt: skip
NUM_CPU_DEVICES = flags.DEFINE_integer(
    "num_cpu_devices", 1,
    "Split the host CPU into this many logical devices (replicas for mirrored and "
    "central_storage without GPUs).",
    lower_bound=1,
)  # fmt: skip
TPU = flags.DEFINE_string(
    "tpu", None, "TPU to use: 'local' (TPU VM), a TPU name or grpc://host:8470. Default: detected."
)
ALL_REDUCE = flags.DEFINE_enum(
    "all_reduce",
    None,
    list(ALL_REDUCE_CHOICES),
    "How gradients are summed: 'ring' is tfdist's ring all-reduce (mirrored and "
    "multi_worker_mirrored); mirrored also takes TensorFlow's nccl, hierarchical_copy and "
    "reduction_to_one_device.",
)
FUSION_MB = flags.DEFINE_float(
    "fusion_mb", None,
    "With --all_reduce=ring: pack gradients into buffers of up to this many MiB before the "
    "ring (tensor fusion; 0 = off; default 4).",
    lower_bound=0,
)  # fmt: skip
COMPRESSION = flags.DEFINE_enum(
    "compression", None, list(COMPRESSION_CHOICES),
    "With --all_reduce=ring: send float32 gradients as float16 or bfloat16.",
)  # fmt: skip
COLLECTIVE = flags.DEFINE_enum(
    "collective",
    None,
    list(COLLECTIVE_CHOICES),
    "Collective implementation of multi_worker_mirrored.",
)
COLLECTIVE_TIMEOUT = flags.DEFINE_float(
    "collective_timeout", None,
    "Seconds a multi-worker collective waits for its peers before failing (default: forever).",
)  # fmt: skip
STARTUP_TIMEOUT = flags.DEFINE_float(
    "startup_timeout", None,
    "multi_worker_mirrored and parameter_server: seconds to wait for every other task to start "
    "before failing with an error naming the missing ones (default 600; 0 waits forever).",
    lower_bound=0,
)  # fmt: skip
MIN_WORKERS = flags.DEFINE_integer(
    "min_workers", None,
    "parameter_server: start training once every ps and this many workers are up (the "
    "others get 15 s more; workers missing then take no part in the run). Default 1.",
    lower_bound=1,
)  # fmt: skip
PS_MIN_SHARD_BYTES = flags.DEFINE_integer(
    "ps_min_shard_bytes", None,
    "parameter_server with 2+ ps: split each variable larger than this many bytes across the "
    "ps tasks (an embedding table bigger than one server, say); 0 keeps every variable "
    "whole. Default 262144 (256 KiB).",
    lower_bound=0,
)  # fmt: skip
HEARTBEAT_TIMEOUT = flags.DEFINE_float(
    "heartbeat_timeout", None,
    "multi_worker_mirrored: seconds without a heartbeat before a peer is declared dead and "
    "the job stops with an error naming it (default: TensorFlow's, 10).",
    lower_bound=0,
)  # fmt: skip


def start_task(argv: list[str]) -> tuple[ClusterInfo | None, tf.distribute.Strategy] | None:
    """Checks the command line, then reads the cluster once (TF_CONFIG, or a JobSet pod's
    environment) and sets this task up for the flags.

    Returns:
      None when this task was a parameter-server worker or ps and has finished serving;
      otherwise (cluster, strategy), the CPU split first if --num_cpu_devices asks.
    """
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    setup_logging()
    cluster = tfdist.cluster_from_environment()
    if cluster is not None:
        signals.set_name(cluster.task_name)
    if tfdist.serve_if_needed(cluster):
        return None
    if NUM_CPU_DEVICES.value > 1:
        _check_cpu_devices_apply(cluster)
        tfdist.configure_cpu_devices(NUM_CPU_DEVICES.value)
    # Only the options the user set, so build_strategy can flag those that don't apply.
    options = {
        "tpu": TPU.value,
        "all_reduce": ALL_REDUCE.value,
        "fusion_bytes": None if FUSION_MB.value is None else int(FUSION_MB.value * 2**20),
        "compression": COMPRESSION.value,
        "collective": COLLECTIVE.value,
        "collective_timeout": COLLECTIVE_TIMEOUT.value,
        "heartbeat_timeout": HEARTBEAT_TIMEOUT.value,
        "min_workers": MIN_WORKERS.value,
        "ps_min_shard_bytes": PS_MIN_SHARD_BYTES.value,
    }
    options = {k: v for k, v in options.items() if v is not None}
    if STARTUP_TIMEOUT.value is not None:
        options["startup_timeout"] = STARTUP_TIMEOUT.value or None  # 0: wait forever
    strategy = tfdist.build_strategy(STRATEGY.value, cluster=cluster, **options)
    return cluster, strategy


def _check_cpu_devices_apply(cluster: ClusterInfo | None) -> None:
    """--num_cpu_devices makes replicas of one process: only mirrored and central_storage
    have them, so anywhere else the flag would be ignored, which is refused."""
    name = STRATEGY.value
    if name == kinds.AUTO:
        # With a cluster, 'auto' is its strategy; alone on a host without GPUs, one_device.
        name = (cluster.cluster_strategy if cluster else None) or kinds.ONE_DEVICE
    if name in REPLICA_PER_DEVICE_STRATEGIES:
        return
    how = (
        "it runs one replica per worker process: start more workers for more replicas "
        "(tfdist-launch --workers N)"
        if name in MULTI_WORKER_STRATEGIES
        else "name --strategy=mirrored (or central_storage) to train on the CPU devices"
    )
    raise tfdist.StrategyError(
        f"--num_cpu_devices={NUM_CPU_DEVICES.value} splits this host's CPU into replicas for "
        f"mirrored and central_storage, but this job runs {name} ({STRATEGY.value!r} asked), "
        f"which would ignore it: {how}. Received: --strategy={STRATEGY.value}, "
        f"--num_cpu_devices={NUM_CPU_DEVICES.value}"
    )


def setup_logging() -> None:
    """Shows tfdist's INFO lines in tfdist's one format (absl's handler takes it: TensorFlow's
    warnings read alike); TensorFlow (which logs through absl) only from WARNING up."""
    absl_logging.set_verbosity(absl_logging.WARNING)
    logs.use_format_of_tfdist()
    logging.getLogger("tfdist").setLevel(logs.level_from_environment())
    logging.getLogger("tensorflow").setLevel(logging.WARNING)


def run(main: Callable[[list[str]], None], *, strategy_flags: bool = True) -> None:
    """absl's app.run with tfdist's errors: a flag mistake or a TfdistError is one line,
    `error: ...`, and exit code 2 (EXIT_USAGE), which the launcher never restarts.

    Args:
      main: the binary's main(argv).
      strategy_flags: the binary takes this module's strategy and cluster flags (through
        start_task); its --help lists them in a group of their own.
    """
    app.run(
        friendly_errors(main),
        flags_parser=functools.partial(parse_flags, strategy_flags=strategy_flags),
    )


_HELP = ("--help", "--helpshort", "-h", "-?")


def print_help() -> None:
    """The binary's docstring, its own flags, then the strategy and cluster flags it shares
    with the other binaries (defined here), each group under a heading of its own."""
    main = sys.modules["__main__"]
    print((main.__doc__ or "").strip(), end="\n\n")
    print("Flags of this binary:\n" + flags.FLAGS.main_module_help(), end="\n\n")
    print("Strategy and cluster flags (experiments/common.py):")
    print(flags.FLAGS.module_help(sys.modules[__name__]))
    print("\n--helpfull lists every flag, TensorFlow's and absl's included.")


def parse_flags(argv: list[str], *, strategy_flags: bool = True) -> list[str]:
    """absl's flag parsing, with its errors as one `error:` line and exit code 2.

    Args:
      strategy_flags: the binary takes the strategy and cluster flags defined here, which
        its --help then lists in a group of their own.
    """
    if strategy_flags and any(arg in _HELP for arg in argv[1:]):
        print_help()
        sys.exit(0)
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}. Run with --help to see the flags.", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    except SystemExit as e:  # absl's --help, --helpshort, --helpfull: asked for, not failed
        asked = any(a.split("=")[0] in ("--help", "--helpshort", "--helpfull", "-h", "-?")
                    for a in argv[1:])  # fmt: skip
        sys.exit(0 if asked and e.code == 1 else e.code)


def friendly_errors(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """Turns a TfdistError into one 'error: ...' line and exit code 2 instead of a traceback.

    Mistakes tfdist can detect (a bad TF_CONFIG, a strategy the cluster cannot run) already
    carry their fix in the message; a traceback would only bury it. A preempted run (SIGTERM,
    checkpoint saved) exits with tfdist.exit_codes.EXIT_PREEMPTED, which launchers restart;
    it and the failures a restart cures (`restartable` errors) use TFDIST_RESTARTABLE_EXIT_CODE
    instead when the launcher sets it.
    """

    @functools.wraps(main)
    def wrapper(argv: list[str]) -> None:
        try:
            main(argv)
        except app.UsageError as e:  # e.g. arguments that are not flags
            print(f"error: {e}. Run with --help to see the flags.", file=sys.stderr, flush=True)
            sys.exit(EXIT_USAGE)
        except TfdistError as e:  # Preempted included: its class names its label and code
            end_process(e)

    return wrapper

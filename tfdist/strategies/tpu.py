"""TPUs: finding one (`detect_tpu`), the tpu builder, what a TPU Node can reach, and what
training on TPU cores asks of the rest (`runs_on_tpu`, `batch_multiple`).

A TPU VM (Colab's current TPU runtime, Cloud TPU VMs) has its chips as local devices; a TPU
Node is a remote TensorFlow server at grpc://host:8470 whose own host reads the input and
writes the checkpoints.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping

import tensorflow as tf

from tfdist.cluster import ClusterInfo
from tfdist.errors import first_line
from tfdist.strategies.options import StrategyError, StrategyOptions


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


_TPU_HELP = (
    "On Colab choose Runtime > Change runtime type > TPU and restart; on a Cloud TPU VM pass "
    "tpu='local'; for a TPU Node pass its name or 'grpc://host:8470'. Without a TPU, use "
    "'auto' (--strategy=auto), which falls back to the GPUs or the CPU present."
)
# What a TensorFlow build without TPU support says when asked to initialise a TPU: the op
# that configures the TPU system has no kernel.
_NO_TPU_KERNEL = "ConfigureDistributedTPU"


# The per-replica batch a TPU core processes without padding comes in multiples of this: a
# TPU core multiplies matrices in 8 x 128 tiles, and XLA pads a batch dimension that does not
# fill them, so the padded rows cost time and memory for nothing.
TPU_BATCH_MULTIPLE = 8


def runs_on_tpu(strategy: tf.distribute.Strategy | str) -> bool:
    """Whether `strategy`'s replicas are TPU cores; `strategy` may also be its kind from
    strategy_kind, e.g. 'tpu' (a plan or a flag may hold only the name).

    The one place that asks: what a TPU changes elsewhere (many steps per call, since each
    call is a round trip to the TPU's host; bfloat16, its matrix units' native type; static
    shapes, since XLA compiles a program per input shape; batches in multiples of
    TPU_BATCH_MULTIPLE) follows from this answer.
    """
    if isinstance(strategy, str):
        return strategy == "tpu"
    return isinstance(strategy, tf.distribute.TPUStrategy)


def batch_multiple(strategy: tf.distribute.Strategy | str) -> int:
    """The multiple a per-replica batch should be of for no replica to pad it:
    TPU_BATCH_MULTIPLE on TPU cores, 1 (any batch) elsewhere; `strategy` as in runs_on_tpu."""
    return TPU_BATCH_MULTIPLE if runs_on_tpu(strategy) else 1


def build_tpu(cluster: ClusterInfo | None, options: StrategyOptions):
    """TPUStrategy on the TPU found (connecting to a TPU Node first), initialised."""
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
            f"Could not initialise the TPU at {address!r}: {first_line(e)}. {_TPU_HELP} "
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
            f"Could not find the TPU {address!r} ({type(e).__name__}: {first_line(e)}). A TPU "
            "name is looked up through the Cloud TPU API, which works only on a Google Cloud VM "
            "in the TPU's project and zone; pass the TPU's 'grpc://host:8470' address "
            "instead, or tpu='local' on a TPU VM (Colab's TPU runtime). Without a TPU, use "
            f"'auto' (--strategy=auto). Received: tpu={address!r}"
        ) from None


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

"""The CrossDeviceOps an `all_reduce` option names: TensorFlow's, or tfdist's ring."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfdist.collective import DEFAULT_BUCKET_BYTES, RingAllReduce
from tfdist.strategies.options import StrategyError, StrategyOptions


def ring_cross_device_ops(options: StrategyOptions, **kwargs) -> RingAllReduce:
    """tfdist's ring with the options' fusion and compression; kwargs go to RingAllReduce."""
    bucket = DEFAULT_BUCKET_BYTES if options.fusion_bytes is None else options.fusion_bytes
    return RingAllReduce(bucket_bytes=bucket, compression=options.compression, **kwargs)


# all_reduce -> the CrossDeviceOps MirroredStrategy gets for it.
_MIRRORED = {
    "nccl": lambda options: tf.distribute.NcclAllReduce(),
    "hierarchical_copy": lambda options: tf.distribute.HierarchicalCopyAllReduce(),
    "reduction_to_one_device": lambda options: tf.distribute.ReductionToOneDevice(),
    "ring": ring_cross_device_ops,
}


def mirrored_cross_device_ops(
    options: StrategyOptions, devices: Sequence[str]
) -> tf.distribute.CrossDeviceOps | None:
    """The CrossDeviceOps for MirroredStrategy over `devices`; None leaves TensorFlow's choice
    (NCCL on GPUs, a CPU reduction otherwise)."""
    if options.all_reduce is None:
        return None
    if options.all_reduce == "nccl" and not all("GPU" in d.upper() for d in devices):
        raise StrategyError(
            "all_reduce='nccl' needs GPUs but the devices are "
            f"{', '.join(devices)}; use 'hierarchical_copy' or 'reduction_to_one_device' "
            "on CPUs. Received: all_reduce='nccl'"
        )
    return _MIRRORED[options.all_reduce](options)

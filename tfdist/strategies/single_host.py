"""Builders of the strategies that train in one process on this host's devices.

one_device, mirrored (a replica per device, gradients summed across them) and central_storage
(variables on the CPU, computation mirrored on the devices).
"""

from __future__ import annotations

import tensorflow as tf

from tfdist import compat
from tfdist import devices as _devices
from tfdist.cluster import ClusterInfo
from tfdist.collective import keys
from tfdist.strategies.all_reduce import mirrored_cross_device_ops
from tfdist.strategies.options import StrategyError, StrategyOptions


def _local_devices(options: StrategyOptions) -> list[str]:
    """The devices the options choose: `devices`, the first `num_gpus` GPUs, or every GPU
    (every logical CPU device when there is none)."""
    if options.devices is not None:
        _check_present(options.devices)
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


def _check_present(named) -> None:
    """Refuses a device TensorFlow does not have: a strategy over it would place its work on
    another and wait in its collectives forever (/cpu:1 before the CPU was split)."""
    present = {
        (spec.device_type, spec.device_index)
        for spec in map(tf.DeviceSpec.from_string, (d.name for d in tf.config.list_logical_devices()))
    }  # fmt: skip
    for name in named:
        spec = tf.DeviceSpec.from_string(name)
        kind = (spec.device_type or "").upper()
        if (kind, spec.device_index or 0) not in present:
            have = ", ".join(f"/{t.lower()}:{i}" for t, i in sorted(present))
            split = (
                " Split the CPU into logical devices first, at the very start of the program: "
                "tfdist.configure_cpu_devices(N)."
                if kind == "CPU"
                else ""
            )
            raise StrategyError(
                f"{name} is not a device of this process (it has {have}).{split} "
                f"Received: devices={list(named)!r}"
            )


def build_one_device(cluster: ClusterInfo | None, options: StrategyOptions):
    """OneDeviceStrategy on the one device the options choose."""
    chosen = _local_devices(options)
    if options.devices is not None and len(chosen) > 1:
        raise StrategyError(
            f"one_device runs on exactly one device but {len(chosen)} were given; use "
            f"'mirrored' for several. Received: devices={options.devices!r}"
        )
    return tf.distribute.OneDeviceStrategy(chosen[0])


def build_mirrored(cluster: ClusterInfo | None, options: StrategyOptions):
    """MirroredStrategy over the local devices, with its own collective key range."""
    chosen = _local_devices(options)
    return compat.mirrored_strategy(
        chosen,
        cross_device_ops=mirrored_cross_device_ops(options, chosen),
        # TensorFlow numbers every MirroredStrategy's groups from 1, so a second one over
        # another number of devices in this process (a notebook re-run, a test suite) would
        # abort with "joining a group with size 4, but that group has size 2": each takes
        # its own block of keys.
        collective_key_base=keys.next_mirrored_base(),
    )


def build_central_storage(cluster: ClusterInfo | None, options: StrategyOptions):
    """CentralStorageStrategy: variables on the CPU, computation on the local devices."""
    return tf.distribute.experimental.CentralStorageStrategy(
        compute_devices=_local_devices(options), parameter_device="/cpu:0"
    )

"""Logical CPU devices, so several replicas can run on one host without accelerators.

MirroredStrategy and CentralStorageStrategy want one device per replica. On a machine with
no GPU, TensorFlow can split the host CPU into N logical devices; the split must happen
before anything initialises TensorFlow's runtime, which is why it is a separate, explicitly
named side effect that a binary's ``main()`` calls first.

Example:

    >>> import tfdist
    >>> tfdist.configure_cpu_devices(2)      # first thing in main()
    >>> strategy = tfdist.build_strategy("mirrored")   # 2 replicas on /cpu:0 and /cpu:1
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfdist.errors import TfdistError

log = logging.getLogger(__name__)


class DeviceConfigurationError(TfdistError, RuntimeError):
    """Devices were asked for after TensorFlow had already fixed them."""


def configure_cpu_devices(count: int) -> list[str]:
    """Splits the host CPU into `count` logical devices (a side effect on TensorFlow's runtime).

    Calling it again with the same count is a no-op, so notebooks can re-run the cell. It
    leaves TensorFlow's runtime uninitialised, so a worker process may split its CPU and
    then build multi_worker_mirrored (which must come before anything runs).

    Args:
      count: how many logical CPU devices to create; 1 leaves the CPU whole.

    Returns:
      The logical CPU device names, e.g. ['/device:CPU:0', '/device:CPU:1'].

    Raises:
      ValueError: `count` is not a positive integer.
      DeviceConfigurationError: TensorFlow had already initialised its devices with another
        layout (a model, tensor or strategy was created first).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive integer. Received: count={count!r}")
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    # The names TensorFlow gives them, without listing them (which starts its runtime).
    names = [f"/device:CPU:{k}" for k in range(count)]
    if len(current or [None]) == count:
        return names
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        raise DeviceConfigurationError(
            f"Cannot split the CPU into {count} logical devices: TensorFlow already initialised "
            f"its devices ({have} logical CPU device(s)). Call tfdist.configure_cpu_devices() "
            "at the very start of the program, before building a strategy, model or tensor; "
            f"in a notebook, restart the runtime first. Received: count={count}"
        ) from None
    log.info("Split the host CPU into %d logical devices: %s", count, ", ".join(names))
    return names


def cpu_device_names() -> list[str]:
    """Names of the logical CPU devices (initialises TensorFlow's runtime)."""
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def gpu_device_names() -> list[str]:
    """Names of the logical GPU devices (initialises TensorFlow's runtime)."""
    return [d.name for d in tf.config.list_logical_devices("GPU")]


def num_physical_gpus() -> int:
    """How many GPUs TensorFlow sees, without initialising the runtime."""
    return len(tf.config.list_physical_devices("GPU"))

"""The strategies' names (what tfdist.strategy_kind returns): the one place they are spelled.

Everything else names a strategy through these constants (tests/test_strategy_names.py
looks for copies). This module imports nothing, so the launcher and the manifest writers,
which start without TensorFlow, read the same names as the builders in tfdist/strategies/.
"""

from __future__ import annotations

AUTO = "auto"
ONE_DEVICE = "one_device"
MIRRORED = "mirrored"
CENTRAL_STORAGE = "central_storage"
MULTI_WORKER_MIRRORED = "multi_worker_mirrored"
PARAMETER_SERVER = "parameter_server"
TPU = "tpu"
# The kind of TensorFlow's default strategy (no scope entered), and an alias of one_device.
DEFAULT = "default"

# Every name build_strategy takes but 'auto' and the alias, in the order help lists them.
NAMES = (ONE_DEVICE, MIRRORED, CENTRAL_STORAGE, MULTI_WORKER_MIRRORED, PARAMETER_SERVER, TPU)
ALIASES = {DEFAULT: ONE_DEVICE}
# Strategies that train in one process on this host's devices.
SINGLE_HOST = (ONE_DEVICE, MIRRORED, CENTRAL_STORAGE)
# Of those, the ones with a replica per local device, so more devices (configure_cpu_devices
# splitting the CPU, say) make more replicas; one_device keeps one.
REPLICA_PER_DEVICE = (MIRRORED, CENTRAL_STORAGE)
# Strategies whose job spans several processes.
MULTI_WORKER = (MULTI_WORKER_MIRRORED, PARAMETER_SERVER)

__all__ = [
    "ALIASES",
    "AUTO",
    "CENTRAL_STORAGE",
    "DEFAULT",
    "MIRRORED",
    "MULTI_WORKER",
    "MULTI_WORKER_MIRRORED",
    "NAMES",
    "ONE_DEVICE",
    "PARAMETER_SERVER",
    "REPLICA_PER_DEVICE",
    "SINGLE_HOST",
    "TPU",
]

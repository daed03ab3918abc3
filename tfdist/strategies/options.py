"""StrategyOptions (the knobs of build_strategy), their choices, and StrategyError.

Options are validated once, when created; which options mean something to which strategy is
checked when a strategy is chosen (`check_options_apply`). Nothing here imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tfdist.errors import TfdistError
from tfdist.peers import DEFAULT_STARTUP_TIMEOUT

ALL_REDUCE_CHOICES = ("ring", "nccl", "hierarchical_copy", "reduction_to_one_device")
COMPRESSION_CHOICES = ("float16", "bfloat16")
COLLECTIVE_CHOICES = ("auto", "ring", "nccl")
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


# Which options mean something to which strategy: an option given to a strategy that would
# ignore it is a contradiction worth an error, not a silent no-op.
OPTION_USERS = {
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


def merge_options(options: StrategyOptions | None, values: dict[str, Any]) -> StrategyOptions:
    """The options build_strategy got: an options object, or its fields as keywords."""
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


def check_options_apply(name: str, options: StrategyOptions, *, chosen_by_auto=False) -> None:
    """Raises StrategyError if an option other than its default means nothing to `name`."""
    defaults = StrategyOptions()
    chosen = (
        f"{name!r}, the strategy 'auto' chose here" if chosen_by_auto else f"the {name!r} strategy"
    )
    for field, users in OPTION_USERS.items():
        value = getattr(options, field)
        if value != getattr(defaults, field) and name not in users:
            raise StrategyError(
                f"Option {field} does not apply to {chosen} (only to {' and '.join(users)}); "
                "remove it or name one of those strategies. "
                f"Received: {field}={value!r}"
            )

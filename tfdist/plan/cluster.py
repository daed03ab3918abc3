"""A cluster as the planner sees it: hosts of devices, each device's speed and memory, and
the links within a host and between hosts (latency and bandwidth).

    cluster = Cluster(hosts=2, devices_per_host=8, device=DEVICES["h100"],
                      intra=Link(latency=3e-6, bandwidth=450e9),
                      inter=Link(latency=10e-6, bandwidth=50e9))
    cluster = Cluster.from_file("cluster.toml")     # the same fields, see `from_mapping`

The devices' peak FLOP/s are given per precision; a training step reaches a share of the
peak, `efficiency` (measured on this machine by calibrate.py, through tools/parallel_bench;
a published figure for a published cluster).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomllib

from tfdist.errors import TfdistError


class PlanError(TfdistError, ValueError):
    """A cluster, model or layout the planner cannot take (the message says which and why)."""


@dataclasses.dataclass(frozen=True)
class Link:
    """A link's alpha-beta model: a message of n bytes takes latency + n / bandwidth.

    `gathers`: the all-gather's own figures, where an implementation runs it on other terms
    than the all-reduce (TensorFlow's collectives between a CPU's logical devices, measured
    by calibrate.py); None where one ring runs both at the link's speed (NCCL's, say).
    """

    latency: float  # seconds
    bandwidth: float  # bytes per second
    gathers: Link | None = None

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    @property
    def for_gather(self) -> Link:
        return self.gathers or self


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator: its peak FLOP/s by compute precision, its memory in bytes and the
    memory's bandwidth (bytes/s: the optimizer's update is bound by it)."""

    name: str
    flops: Mapping[str, float]
    memory: float
    memory_bandwidth: float = 1e12

    def peak(self, precision: str) -> float:
        if precision not in self.flops:
            raise PlanError(
                f"The device {self.name!r} has no peak FLOP/s for {precision!r}; it has "
                f"{', '.join(self.flops)}. Give flops_{precision} for it. Received: "
                f"precision={precision!r}"
            )
        return self.flops[precision]


GIB = 2**30
# Dense peak FLOP/s from the vendors' data sheets (SXM parts; float32 without TF32), and
# memory. "float16" and "bfloat16" are the tensor cores' rates.
DEVICES = {
    "h100": Device(
        "h100", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}, 80 * GIB, 3.35e12
    ),
    "a100": Device(
        "a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}, 80 * GIB, 2.0e12
    ),
    "v100": Device("v100", {"float16": 125e12, "float32": 15.7e12}, 32 * GIB, 0.9e12),
    "p100": Device("p100", {"float16": 21.2e12, "float32": 10.6e12}, 16 * GIB, 0.73e12),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`hosts` x `devices_per_host` devices of one kind, and the links between them.

    Attributes:
      efficiency: the share of the device's peak FLOP/s a training step's compute reaches.
      overlap: whether the gradients' exchange runs during the backward pass, bucket by
        bucket as each bucket's gradients are ready (Horovod, PyTorch DDP), or after it, as
        tfdist's all-reduce does (False).
      fusion_bytes: the exchange's bucket size when it overlaps (Horovod's 64 MiB).
      shared: the host's devices share one pool of compute (logical devices of one CPU):
        its throughput is `shared` times one device's alone, and a step takes at least its
        host's busy device-seconds over that (None: each device computes on its own).
      step_overhead: seconds every step costs whatever its size (the framework's launch
        of the replicas' programs, its bookkeeping): 0 for a cluster's accelerators, measured
        on this machine by tools/parallel_bench.
      tensor_exchange: "tfdist" (a split block's activations gathered over every replica,
        as tfdist's tensor layers do) or "group" (within the T devices of a tensor group
        only, as Megatron-LM's all-reduce: the same bytes as an all-gather and a
        reduce-scatter there).
    """

    hosts: int
    devices_per_host: int
    device: Device
    intra: Link
    inter: Link
    efficiency: float = 0.4
    overlap: bool = False
    fusion_bytes: float = 64 * 2**20
    tensor_exchange: str = "tfdist"
    shared: float | None = None
    step_overhead: float = 0.0
    name: str = "cluster"

    def __post_init__(self):
        for field in ("hosts", "devices_per_host"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"{field} must be a whole number >= 1. Received: {value!r}")
        if self.tensor_exchange not in ("tfdist", "group"):
            raise PlanError(
                f"tensor_exchange is 'tfdist' or 'group'. Received: {self.tensor_exchange!r}"
            )
        if not 0 < self.efficiency <= 1:
            raise PlanError(f"efficiency must be in (0, 1]. Received: {self.efficiency!r}")

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    def link(self, group: int, stride: int = 1) -> Link:
        """The slowest link a ring of `group` devices, `stride` apart, crosses: the host's
        own while the ring stays within one host, else the one between hosts."""
        within = group * stride <= self.devices_per_host
        return self.intra if within or self.hosts == 1 else self.inter

    def describe(self) -> str:
        d = self.device
        return (
            f"{self.name}: {self.hosts} host(s) x {self.devices_per_host} {d.name} "
            f"({d.memory / GIB:.0f} GiB; efficiency {self.efficiency:.2f}), within a host "
            f"{_link(self.intra)}, between hosts {_link(self.inter)}"
        )

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any]) -> Cluster:
        """A cluster from plain fields (a TOML or JSON file's):

        name = "2 x DGX H100"
        hosts = 2
        devices_per_host = 8
        device = "h100"                 # or: flops_bfloat16 = 989e12, memory_gib = 80
        intra_gbps = 3600               # link bandwidth, gigabits per second
        intra_latency_us = 3
        inter_gbps = 400
        inter_latency_us = 10
        efficiency = 0.4
        """
        known = {
            "name", "hosts", "devices_per_host", "device", "memory_gib", "memory_gbps", "intra_gbps",
            "intra_latency_us", "inter_gbps", "inter_latency_us", "efficiency", "overlap",
        }  # fmt: skip
        unknown = [k for k in fields if k not in known and not k.startswith("flops_")]
        if unknown:
            raise PlanError(
                f"A cluster takes {', '.join(sorted(known))} and flops_<precision>. "
                f"Received: {', '.join(unknown)}"
            )
        device = device_of(fields)
        if "intra_gbps" not in fields:
            raise PlanError(f"A cluster needs intra_gbps. Received: {dict(fields)}")
        intra_gbps = _number(fields, "intra_gbps", above_zero=True)
        intra = Link(_number(fields, "intra_latency_us", 5.0) * 1e-6, intra_gbps * 1e9 / 8)
        inter = Link(
            _number(fields, "inter_latency_us", 10.0) * 1e-6,
            _number(fields, "inter_gbps", intra_gbps, above_zero=True) * 1e9 / 8,
        )
        try:
            return cls(
                hosts=int(fields.get("hosts", 1)),
                devices_per_host=int(fields.get("devices_per_host", 1)),
                device=device,
                intra=intra,
                inter=inter,
                efficiency=float(fields.get("efficiency", 0.4)),
                overlap=bool(fields.get("overlap", False)),
                name=str(fields.get("name", "cluster")),
            )
        except PlanError:
            raise
        except (TypeError, ValueError) as e:
            raise PlanError(
                f"A cluster's hosts, devices_per_host and efficiency are numbers: {e}"
            ) from None

    @classmethod
    def from_file(cls, path: str | Path) -> Cluster:
        """A cluster from a TOML (.toml) or JSON file of `from_mapping`'s fields."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise PlanError(f"Cannot read the cluster file {path}: {e.strerror}") from None
        try:
            fields = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as e:
            raise PlanError(f"The cluster file {path} is not valid: {e}") from None
        return cls.from_mapping(fields)


def _number(
    fields: Mapping[str, Any], key: str, default: float | None = None, *, above_zero=False
) -> float:
    """fields[key] (or `default`) as a number: above zero, or at least zero."""
    value = fields.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PlanError(f"{key} must be a number. Received: {key}={value!r}") from None
    if number < 0 or (above_zero and number == 0):
        raise PlanError(
            f"{key} must be {'> 0' if above_zero else '>= 0'}. Received: {key}={value!r}"
        )
    return number


def device_of(fields: Mapping[str, Any]) -> Device:
    """The device `fields` name (a preset of DEVICES), with any flops_<precision> and
    memory_gib given beside it taking precedence."""
    name = fields.get("device")
    base = DEVICES.get(str(name).lower()) if name else None
    if name and base is None and not any(k.startswith("flops_") for k in fields):
        raise PlanError(
            f"device {name!r} is not one the planner knows ({', '.join(DEVICES)}): give its "
            "flops_<precision> (FLOP/s) and memory_gib instead. Received: device="
            f"{name!r}"
        )
    flops = dict(base.flops) if base else {}
    flops.update(
        {k[len("flops_") :]: float(v) for k, v in fields.items() if k.startswith("flops_")}
    )
    memory = float(fields["memory_gib"]) * GIB if "memory_gib" in fields else None
    bandwidth = float(fields.get("memory_gbps", 0)) * 1e9 or (
        base.memory_bandwidth if base else 1e12
    )
    if memory is None:
        if base is None:
            raise PlanError(
                f"A device given by its flops needs memory_gib. Received: {dict(fields)}"
            )
        memory = base.memory
    if not flops:
        raise PlanError(f"A cluster needs its device's FLOP/s. Received: {dict(fields)}")
    return Device(str(name or "device"), flops, memory, bandwidth)


def _link(link: Link) -> str:
    if math.isinf(link.bandwidth):
        return f"{link.latency * 1e6:.1f} us"
    return f"{link.bandwidth * 8 / 1e9:.0f} Gb/s, {link.latency * 1e6:.1f} us"

"""The layouts tfdist runs, as the planner names and enumerates them: a ParallelLayout
(data x ZeRO stage x pipeline stages and micro-batches x tensor), whether tfdist builds it on
a number of hosts, and every layout of a number of devices that a batch and a model's units
allow (layouts_for; hybrid_layouts, the combinations). costs.py prices each.
"""

from __future__ import annotations

import dataclasses

from tfdist.layout_names import layout_name


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How N devices train: `data` replicas of a model that is itself split into `stages`
    pipeline stages (with `micro_batches`) or over `tensor` devices, optionally with
    `zero` (1, 2 or 3) sharding over the data replicas."""

    data: int = 1
    stages: int = 1
    micro_batches: int = 1
    tensor: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    # v, the stages each device holds under the interleaved 1F1B schedule (chunks > 1).
    chunks: int = 1
    # Where stages 1, 2, ... begin (unit names, as Pipeline's cut_before); None: where
    # their work is about equal (stage_units).
    cut_before: tuple[str, ...] | None = None

    @property
    def devices(self) -> int:
        return self.data * self.stages * self.tensor

    @property
    def name(self) -> str:
        """The layout in the form tfdist.fit's log names it in (tfdist/layout_names.py)."""
        return layout_name(
            data=self.data, stages=self.stages, micro_batches=self.micro_batches,
            chunks=self.chunks, tensor=self.tensor, zero=self.zero,
        )  # fmt: skip

    @property
    def combined(self) -> bool:
        """Whether it combines model-parallel axes, or ZeRO with one (a hybrid layout)."""
        return (self.stages > 1) + (self.tensor > 1) + (self.zero > 0) > 1

    def built(self, hosts: int) -> bool:
        """Whether tfdist trains this layout today on `hosts` hosts (a worker process a
        host): every axis alone, and every combination on one host. Over several hosts a
        tensor group stays within a host: it is built where each host holds one tensor
        group of a model not cut (zero x tensor, data x tensor), or whole stages, every
        pipeline's replica of them (pipeline x tensor, all three); the interleaved
        schedule is not (docs/guides/combining-layouts.md)."""
        if hosts == 1:
            return True
        if self.chunks > 1:
            return False
        if self.tensor == 1:
            return True
        per_host, rest = divmod(self.devices, hosts)
        if rest or per_host % self.tensor:
            return False
        if self.stages == 1:
            return per_host == self.tensor
        return (per_host // self.tensor) % self.data == 0


def layouts_for(devices: int, batch: int, units: int, *, hosts: int = 1) -> list[ParallelLayout]:
    """Every layout tfdist runs on `devices` devices (over `hosts` hosts) for a global batch
    of `batch` and a model of `units` layers a pipeline may cut between. Tensor parallelism
    runs within a host: over several, a tensor group a host (ParallelLayout.built)."""
    found = []
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    if batch % devices == 0:
        found.append(ParallelLayout(data=devices))
        if devices > 1:
            found += [ParallelLayout(data=devices, zero=z) for z in (1, 2, 3)]
    for stages in divisors[1:]:
        if stages > units:
            continue
        data = devices // stages
        per_pipeline = batch // data if batch % data == 0 else 0
        for m in (4 * stages, 2 * stages, stages):
            if per_pipeline and per_pipeline % m == 0:
                found.append(ParallelLayout(data=data, stages=stages, micro_batches=m))
                break
    for tensor in divisors[1:]:
        layout = ParallelLayout(data=devices // tensor, tensor=tensor)
        if batch % devices == 0 and layout.built(hosts):
            found.append(layout)
    return found


def hybrid_layouts(
    devices: int, batch: int, units: int, *, devices_per_host: int
) -> list[ParallelLayout]:
    """The layouts that combine axes on `devices` devices: S pipeline stages (1F1B, M of
    S, 2S or 4S micro-batches a pipeline, interleaved over v = 2 stages a device where the
    model has the units) x T tensor devices within a host x D data replicas, each with ZeRO
    1-3 over D or none. A tensor group stays within a host (as Megatron-LM keeps it on
    NVLink)."""
    found = []
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    for t in (t for t in divisors if devices_per_host % t == 0):
        for s in (s for s in divisors if s <= units and devices % (t * s) == 0):
            d = devices // (t * s)
            if batch % d:
                continue
            per_pipeline = batch // d
            micro = [m for m in (s, 2 * s, 4 * s) if per_pipeline % m == 0] if s > 1 else [1]
            chunks = [1, 2] if s > 1 and 2 * s <= units else [1]
            for zero in (0, 1, 2, 3) if d > 1 else (0,):
                for m in micro:
                    for v in chunks:
                        layout = ParallelLayout(
                            data=d, stages=s, micro_batches=m, tensor=t, zero=zero, chunks=v,
                            schedule="interleaved" if v > 1 else "1f1b",
                        )  # fmt: skip
                        # tensor x data alone is layouts_for's on one host; across hosts here
                        if layout.combined or (t > 1 and s == 1 and devices_per_host < devices):
                            found.append(layout)
    return found

"""The one form a layout is named in: by tfdist.fit's log and by the planner (tfdist-plan),
so that what the planner recommends reads as what fit then says it trains.

    pipeline 2 M=4 x tensor 2 x zero3 x data 2
"""

from __future__ import annotations


def layout_name(
    *,
    data: int = 1,
    stages: int = 1,
    micro_batches: int = 1,
    chunks: int = 1,
    tensor: int = 1,
    zero: int = 0,
) -> str:
    """`data` replicas of a model cut into `stages` pipeline stages (`micro_batches` a step,
    `chunks` a device when interleaved) and split over `tensor` devices, with ZeRO stage
    `zero` (0: none) over the data replicas."""
    parts = []
    if stages > 1:
        interleaved = f" v={chunks}" if chunks > 1 else ""
        parts.append(f"pipeline {stages} M={micro_batches}{interleaved}")
    if tensor > 1:
        parts.append(f"tensor {tensor}")
    if zero:
        parts.append(f"zero{zero}")
    if data > 1:
        parts.append(f"data {data}")
    return " x ".join(parts) or "one device"


__all__ = ["layout_name"]

"""tfdist's own ring all-reduce, built from TensorFlow collective ops."""

from tfdist.collective.ring import (
    all_gather_schedule,
    chunk_bounds,
    reduce_scatter_schedule,
    ring_all_reduce,
)
from tfdist.collective.transport import CollectiveMismatchError, ProcessRing

__all__ = [
    "CollectiveMismatchError",
    "ProcessRing",
    "all_gather_schedule",
    "chunk_bounds",
    "reduce_scatter_schedule",
    "ring_all_reduce",
]

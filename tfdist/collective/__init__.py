"""tfdist's own ring all-reduce, built from TensorFlow collective ops.

- ring.py: the algorithm (chunking, the schedule) over any transport.
- transport.py: across worker processes: ProcessRing, and GatherBroadcast (the naive
  gather-to-rank-0 baseline), both from point-to-point collective transfers; and
  ProcessNeighbours, a buffer sent to and received from chosen peers (gossip).
- cross_device.py: RingAllReduce, a tf.distribute.CrossDeviceOps over local devices
  (and, given a ProcessRing, across processes), for MirroredStrategy and the trainer.
- fusion.py: tensor fusion into buckets and float16/bfloat16 wire compression.
"""

from tfdist.collective.cross_device import RingAllReduce
from tfdist.collective.fusion import (
    COMPRESSIONS,
    DEFAULT_BUCKET_BYTES,
    fused_all_reduce,
    pack,
    plan_buckets,
    unpack,
)
from tfdist.collective.ring import (
    all_gather_schedule,
    chunk_bounds,
    local_ring_all_reduce,
    reduce_scatter_schedule,
    ring_all_reduce,
)
from tfdist.collective.transport import (
    CollectiveMismatchError,
    GatherBroadcast,
    ProcessNeighbours,
    ProcessRing,
)

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_BUCKET_BYTES",
    "CollectiveMismatchError",
    "GatherBroadcast",
    "ProcessNeighbours",
    "ProcessRing",
    "RingAllReduce",
    "all_gather_schedule",
    "chunk_bounds",
    "fused_all_reduce",
    "local_ring_all_reduce",
    "pack",
    "plan_buckets",
    "reduce_scatter_schedule",
    "ring_all_reduce",
    "unpack",
]

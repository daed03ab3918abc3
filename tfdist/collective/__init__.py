"""tfdist's own ring all-reduce, built from TensorFlow collective ops.

- ring.py: the algorithm (chunking, the schedule) over any transport.
- transport.py: the one transport across worker processes, point-to-point collective
  transfers (bfloat16 included): ProcessRing, GatherBroadcast (the naive gather-to-rank-0
  baseline), ProcessNeighbours (a buffer to and from chosen peers: gossip), and
  ProcessLinks (sends and receives inside a program the caller builds: a pipeline).
- keys.py: every collective group-key range tfdist uses, in one table.
- cross_device.py: RingAllReduce, a tf.distribute.CrossDeviceOps over local devices
  (and, given a ProcessRing, across processes), for MirroredStrategy and the trainer.
- fusion.py: tensor fusion into buckets and float16/bfloat16 wire compression.
- replicas.py: a step's all-gather among the replicas of one process, read where the
  parts lie (one merge_call) rather than by collectives.
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
from tfdist.collective.keys import RANGES, group_key_base
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
    ProcessLinks,
    ProcessNeighbours,
    ProcessRing,
    Transfers,
)

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_BUCKET_BYTES",
    "RANGES",
    "CollectiveMismatchError",
    "GatherBroadcast",
    "ProcessLinks",
    "ProcessNeighbours",
    "ProcessRing",
    "RingAllReduce",
    "Transfers",
    "all_gather_schedule",
    "chunk_bounds",
    "fused_all_reduce",
    "group_key_base",
    "local_ring_all_reduce",
    "pack",
    "plan_buckets",
    "reduce_scatter_schedule",
    "ring_all_reduce",
    "unpack",
]

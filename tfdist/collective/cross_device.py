"""tfdist's ring as a tf.distribute.CrossDeviceOps, so strategies exchange gradients over it.

`MirroredStrategy(cross_device_ops=RingAllReduce())` sums gradients with a ring over the
local devices; Keras' `model.fit` and tfdist's trainer both reach it through the strategy's
batch_reduce. Given a ProcessRing, the same class also carries the sum across worker
processes: local devices first reduce among themselves, the first one then runs the
process ring, and the result is copied back to the others. `build_strategy(...,
all_reduce="ring")` wires this up for mirrored and multi_worker_mirrored.

Reductions the ring does not cover (to a device the values are not on, sparse gradients,
gathers, broadcasts) go to `fallback`.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfdist import compat
from tfdist.collective.fusion import DEFAULT_BUCKET_BYTES, check_compression, fused_all_reduce
from tfdist.collective.ring import local_ring_all_reduce, mean_of_sum
from tfdist.collective.transport import ProcessRing

log = logging.getLogger(__name__)


class RingAllReduce(compat.CrossDeviceOps):
    """Ring all-reduce of gradients over local devices and, optionally, worker processes.

    Args:
      bucket_bytes: tensor fusion threshold: gradients are packed into buffers of up to this
        many bytes, one ring each. 0 turns fusion off.
      compression: None, 'float16' or 'bfloat16': float32 buffers of batched all-reduces
        (the gradients) travel in that dtype; a single `strategy.reduce` (a metric) does not.
      process_ring: the ring across worker processes (multi-worker jobs), or None.
      fallback: the CrossDeviceOps for what the ring does not do; by default
        ReductionToOneDevice.
    """

    def __init__(
        self,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        compression: str | None = None,
        process_ring: ProcessRing | None = None,
        fallback: tf.distribute.CrossDeviceOps | None = None,
    ):
        super().__init__()
        check_compression(compression)
        if bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0. Received: {bucket_bytes}")
        self.bucket_bytes, self.compression = bucket_bytes, compression
        self.process_ring = process_ring
        self.fallback = fallback or tf.distribute.ReductionToOneDevice()
        # How many batches of tensors were reduced over the ring (counted as programs are
        # built, so a tf.function counts once per trace), and the layouts already logged.
        self.rings_built = 0
        self._logged: set[tuple] = set()

    @property
    def num_between_graph_workers(self) -> int:
        return self.process_ring.ranks if self.process_ring else 1

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        if _ring_applies([(per_replica_value, destinations)]):
            # A single reduce is a metric or a sync-on-read variable being read, never the
            # gradients (those come batched): it is not compressed.
            return self._all_reduce_values(reduce_op, [per_replica_value], compression=None)[0]
        return self.fallback.reduce(reduce_op, per_replica_value, destinations, options)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        pairs = list(value_destination_pairs)
        if _ring_applies(pairs):
            values = [value for value, _ in pairs]
            return self._all_reduce_values(reduce_op, values, compression=self.compression)
        return self.fallback.batch_reduce(reduce_op, pairs, options)

    def broadcast_implementation(self, tensor, destinations):
        return self.fallback.broadcast(tensor, destinations)

    def gather_implementation(self, per_replica_value, destinations, axis, options):
        return compat.gather(self.fallback, per_replica_value, destinations, axis, options)

    def _all_reduce_values(self, reduce_op, per_replica_values, *, compression):
        devices = [v.device for v in per_replica_values[0].values]
        per_replica = [
            [value.values[d] for value in per_replica_values] for d in range(len(devices))
        ]
        summed = fused_all_reduce(
            per_replica,
            lambda flats: self._sum_flats(flats, devices),
            bucket_bytes=self.bucket_bytes,
            compression=compression,
        )
        replicas = len(devices) * self.num_between_graph_workers
        layout = tuple((t.dtype.name, tuple(t.shape)) for t in per_replica[0])
        if layout not in self._logged:
            self._logged.add(layout)
            nbytes = sum(t.shape.num_elements() * t.dtype.size for t in per_replica[0])
            log.info(
                "Ring all-reduce: %d tensor(s), %.2f MiB per replica, over %d device(s)%s; "
                "fusion into %s buckets, compression %s",
                len(per_replica[0]), nbytes / 2**20, len(devices),
                f" x {self.process_ring.ranks} processes" if self.process_ring else "",
                f"{self.bucket_bytes / 2**20:g} MiB" if self.bucket_bytes else "no",
                compression or "off",
            )  # fmt: skip
        self.rings_built += 1
        results = []
        for i in range(len(per_replica_values)):
            on_devices = []
            for d, device in enumerate(devices):
                with tf.device(device):
                    value = summed[d][i]
                    on_devices.append(
                        mean_of_sum(value, replicas)
                        if reduce_op == tf.distribute.ReduceOp.MEAN
                        else value
                    )
            results.append(compat.mirrored_value(on_devices))
        return results

    def _sum_flats(self, flats: list[tf.Tensor], devices: list[str]) -> list[tf.Tensor]:
        local = local_ring_all_reduce(flats, devices)
        if not self.process_ring:
            return local
        with tf.device(devices[0]):
            total = self.process_ring.all_reduce(local[0])
        out = [total]
        for device in devices[1:]:
            with tf.device(device):
                out.append(tf.identity(total))
        return out


def _ring_applies(pairs) -> bool:
    """All values are dense per-replica tensors on the same devices as their destinations."""
    first = _devices(pairs[0][0]) if pairs else None
    return bool(pairs) and all(
        isinstance(value, tf.distribute.DistributedValues)
        and not isinstance(value.values[0], tf.IndexedSlices)
        and _devices(value) == first
        and _devices(destination) == first
        for value, destination in pairs
    )


def _devices(value) -> frozenset[str] | None:
    if isinstance(value, tf.distribute.DistributedValues):
        return frozenset(tf.DeviceSpec.from_string(v.device).to_string() for v in value.values)
    if isinstance(value, str):
        return frozenset([tf.DeviceSpec.from_string(value).to_string()])
    device = getattr(value, "device", None)
    return frozenset([tf.DeviceSpec.from_string(device).to_string()]) if device else None

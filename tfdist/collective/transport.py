"""Point-to-point transfers between worker processes, built from TensorFlow collective ops.

Each edge of the ring, rank r -> rank r+1, is a 2-member collective group; a transfer is a
CollectiveBcastSendV2 on the sender and a CollectiveBcastRecvV2 on the receiver with the same
group and instance keys. This needs TensorFlow's collective runtime configured for the
cluster, which building MultiWorkerMirroredStrategy does.

The ring's program is built with tf.compat.v1.wrap_function, not tf.function: tf.function
orders stateful ops in program order, so every rank would wait to send before it receives —
around a ring that is a deadlock. Without that ordering a step's send and receive run at
once, and the next step starts as soon as its chunk has arrived.
"""

from __future__ import annotations

import itertools
import logging
import re

import tensorflow as tf

from tfdist.collective.ring import chunk_bounds, mean_of_sum, ring_all_reduce
from tfdist.errors import TfdistError

log = logging.getLogger(__name__)

# Far above the group keys MultiWorkerMirroredStrategy hands out (it counts up from 1).
GROUP_KEY_BASE = 1_000_000
# Instance keys reserved per built program: one per ring step.
_KEYS_PER_PROGRAM = 1 << 16


class CollectiveMismatchError(TfdistError, ValueError):
    """Ranks called the all-reduce with different shapes or dtypes."""


class ProcessRing:
    """The ring of this job's worker processes, for tfdist's ring all-reduce.

    Every rank must call `all_reduce` with tensors of the same shape and dtype, in the same
    order — as with any collective.

    Example (inside a multi_worker_mirrored program, on every worker):

        ring = ProcessRing(rank=cluster.task_index, ranks=cluster.num_workers)
        total = ring.all_reduce(tf.ones([1000]))     # == num_workers everywhere

    Args:
      rank: this worker's position (its index among the training tasks).
      ranks: the number of worker processes.
      timeout_seconds: how long a transfer may wait for its peer; None waits forever.
      group_key_base: the first of the `ranks` group keys the ring's edges use.
    """

    def __init__(
        self,
        *,
        rank: int,
        ranks: int,
        timeout_seconds: float | None = None,
        group_key_base: int = GROUP_KEY_BASE,
        max_pieces: int = 4,
        min_piece_bytes: int = 1 << 20,
    ):
        if not 0 <= rank < ranks:
            raise ValueError(f"rank must be in [0, {ranks}). Received: rank={rank}")
        self.rank, self.ranks = rank, ranks
        self._timeout = float(timeout_seconds or 0)
        self._group_base = group_key_base
        self.max_pieces, self.min_piece_bytes = max_pieces, min_piece_bytes
        self._programs: dict[tuple, tf.types.experimental.ConcreteFunction] = {}
        self._next_program = itertools.count()

    def all_reduce(self, tensor: tf.Tensor, reduction: str = "sum") -> tf.Tensor:
        """The element-wise sum (or mean) of `tensor` over every rank, on every rank.

        Raises:
          CollectiveMismatchError: another rank passed a different shape or dtype.
        """
        tensor = tf.convert_to_tensor(tensor)
        flat = tf.reshape(tensor, [-1])
        if self.ranks == 1 or flat.shape[0] == 0:
            return mean_of_sum(tensor, self.ranks) if reduction == "mean" else tensor
        program = self._program(int(flat.shape[0]), tensor.dtype, reduction)
        try:
            return tf.reshape(program(flat), tensor.shape)
        except (tf.errors.InvalidArgumentError, tf.errors.InternalError) as e:
            mismatch = re.search(r"(Shape mismatch|[Dd]ata ?type mismatch)[^\n]*", e.message)
            if not mismatch:
                raise
            raise CollectiveMismatchError(
                f"Rank {self.rank} all-reduced a {tensor.dtype.name} tensor of shape "
                f"{tensor.shape.as_list()}, but another rank passed a different shape or dtype "
                f"({mismatch.group(0).strip()}). Every rank must all-reduce the same tensors "
                "in the same order; TensorFlow's collective runtime is now aborted, so "
                "restart the job after fixing the caller."
            ) from None

    def _program(self, length: int, dtype: tf.DType, reduction: str):
        signature = (length, dtype, reduction)
        if signature not in self._programs:
            # Ranks build programs in the same order, so they agree on each one's keys.
            keys = next(self._next_program) * _KEYS_PER_PROGRAM + 1
            exchange = self._exchange(dtype, keys)
            pieces = self._pieces(length * dtype.size)

            def build(flat):
                # Several rings over slices of the buffer run at once: while one slice is on
                # the wire, another is being added, so transfer and arithmetic overlap.
                steps = 2 * (self.ranks - 1)
                outs = []
                for i, (start, end) in enumerate(chunk_bounds(length, pieces)):
                    outs.append(
                        ring_all_reduce(
                            flat[start:end],
                            rank=self.rank,
                            ranks=self.ranks,
                            exchange=_offset(exchange, i * steps),
                            reduction=reduction,
                        )  # fmt: skip
                    )
                return tf.concat(outs, axis=0)

            self._programs[signature] = tf.compat.v1.wrap_function(
                lambda flat: _with_sends(lambda: build(flat), exchange),
                [tf.TensorSpec([length], dtype)],
            )
        return self._programs[signature]

    def _pieces(self, nbytes: int) -> int:
        return max(1, min(self.max_pieces, nbytes // self.min_piece_bytes))

    def _exchange(self, dtype: tf.DType, first_key: int):
        right_edge = self._group_base + self.rank  # this rank -> rank + 1
        left_edge = self._group_base + (self.rank - 1) % self.ranks  # rank - 1 -> this rank
        sends: list[tf.Tensor] = []

        # TensorFlow's collectives do not take bfloat16; its bits travel as float16, which a
        # broadcast copies without looking at them.
        wire = tf.float16 if dtype == tf.bfloat16 else dtype

        def exchange(send, recv_size, step):
            key = first_key + step
            if send is not None:
                sends.append(
                    tf.raw_ops.CollectiveBcastSendV2(
                        input=tf.bitcast(send, wire) if wire != dtype else send,
                        group_size=2,
                        group_key=right_edge,
                        instance_key=key,
                        communication_hint="auto",
                        timeout_seconds=self._timeout,
                    )  # fmt: skip
                )
            if not recv_size:
                return None
            received = tf.raw_ops.CollectiveBcastRecvV2(
                group_size=2, group_key=left_edge, instance_key=key, shape=[recv_size], T=wire,
                communication_hint="auto", timeout_seconds=self._timeout,
            )  # fmt: skip
            return tf.bitcast(received, dtype) if wire != dtype else received

        exchange.sends = sends
        return exchange


def _offset(exchange, first_step: int):
    return lambda send, recv_size, step: exchange(send, recv_size, first_step + step)


def _with_sends(build, exchange):
    # A send's output feeds nothing, and a graph function prunes what its outputs do not need.
    result = build()
    with tf.control_dependencies(exchange.sends):
        return tf.identity(result)

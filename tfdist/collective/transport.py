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

import collections
import contextlib
import itertools
import logging
import re
import weakref
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfdist.collective.fusion import DEFAULT_BUCKET_BYTES, fused_all_reduce
from tfdist.collective.keys import group_key_base
from tfdist.collective.ring import (
    REDUCTIONS,
    chunk_bounds,
    mean_of_sum,
    owned_chunk,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from tfdist.errors import TfdistError

log = logging.getLogger(__name__)

# The group-key ranges of the exchanges built here (collective/keys.py holds every range).
GROUP_KEY_BASE = group_key_base("ring")
NAIVE_GROUP_KEY_BASE = group_key_base("naive")
NEIGHBOUR_GROUP_KEY_BASE = group_key_base("neighbours")
# Instance keys reserved per built program: one per ring step.
_KEYS_PER_PROGRAM = 1 << 16
# Programs built so far on each set of group keys, over every ring object of this process.
# TensorFlow's collective runtime is per process and remembers each instance key's shape, so
# a second ring on the same group keys (a later fit's) must not reuse the first's keys.
# Every rank builds its rings and programs in the same order, so the counts agree.
_PROGRAMS_BUILT: dict[int, itertools.count] = {}


class CollectiveMismatchError(TfdistError, ValueError):
    """Ranks called the all-reduce with different shapes or dtypes."""


class _PointToPoint:
    """What every exchange built from point-to-point collective transfers shares: programs
    compiled once per signature, with instance keys that every rank assigns alike."""

    def __init__(
        self,
        *,
        rank: int,
        ranks: int,
        timeout_seconds: float | None,
        group_key_base: int,
        device: str | None = None,
    ):
        if not 0 <= rank < ranks:
            raise ValueError(f"rank must be in [0, {ranks}). Received: rank={rank}")
        self.rank, self.ranks = rank, ranks
        self._timeout = float(timeout_seconds or 0)
        self._group_base = group_key_base
        # Where the transfers run (None: where the caller places them). A collective group
        # takes one device a process, so the rings of a process's several devices (a
        # tensor group's members) each name theirs.
        self.device = device
        self._programs: dict[tuple, tf.types.experimental.ConcreteFunction] = {}
        self._next_program = _PROGRAMS_BUILT.setdefault(group_key_base, itertools.count())
        # Graph being traced -> how many calls of each signature it already holds.
        self._uses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _compiled(self, signature: tuple, spec: tf.TensorSpec, build):
        """The program `build(input, transfers)` for `signature`, compiled once per use.

        Calls in one traced graph run concurrently (a step's gradients, fusion off), and two
        transfers in flight under the same instance key collide ("BufRendezvous::ProvideBuf
        already called"): the n-th call of a signature in a graph gets the n-th program of
        that signature, keys of its own. Eager calls run one after another and share one.
        """
        use = 0
        if not tf.executing_eagerly():
            # Counted over the outermost graph: a tf.cond branch or a nested tf.function is a
            # graph of its own whose transfers run beside the enclosing graph's.
            graph = tf.compat.v1.get_default_graph()
            while getattr(graph, "outer_graph", None) is not None:
                graph = graph.outer_graph
            uses = self._uses.setdefault(graph, collections.Counter())
            use = uses[signature]
            uses[signature] += 1
        key = (*signature, use)
        if key not in self._programs:
            # Ranks build programs in the same order, so they agree on each one's keys.
            transfers = Transfers(
                first_key=next(self._next_program) * _KEYS_PER_PROGRAM + 1,
                timeout_seconds=self._timeout,
                dtype=spec.dtype,
            )

            def program(tensor):
                with tf.device(self.device) if self.device else contextlib.nullcontext():
                    return transfers.after_sends(build(tensor, transfers))

            self._programs[key] = tf.compat.v1.wrap_function(program, [spec])
        return self._programs[key]


class _PointToPointAllReduce(_PointToPoint):
    """What every all-reduce built from point-to-point transfers shares: one program per
    (length, dtype, reduction), fusion of many tensors, and a clear error when ranks
    disagree."""

    def all_reduce(self, tensor: tf.Tensor, reduction: str = "sum") -> tf.Tensor:
        """The element-wise sum (or mean) of `tensor` over every rank, on every rank.

        Raises:
          CollectiveMismatchError: another rank passed a different shape or dtype.
        """
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be 'sum' or 'mean'. Received: {reduction!r}")
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

    def all_reduce_many(
        self,
        tensors: Sequence[tf.Tensor],
        reduction: str = "sum",
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        compression: str | None = None,
    ) -> list[tf.Tensor]:
        """All-reduces a list of tensors (a model's gradients), fused into buckets.

        Args:
          tensors: the tensors; every rank passes the same shapes and dtypes in the same order.
          reduction: 'sum' or 'mean'.
          bucket_bytes: tensors are packed into buffers of up to this many bytes, one
            all-reduce each; 0 reduces every tensor on its own.
          compression: None, 'float16' or 'bfloat16': float32 buffers travel (and are summed)
            in that dtype.
        """
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        (summed,) = fused_all_reduce(
            [tensors],
            lambda flats: [self.all_reduce(flats[0])],
            bucket_bytes=bucket_bytes,
            compression=compression,
        )
        return [mean_of_sum(t, self.ranks) for t in summed] if reduction == "mean" else summed

    def _program(self, length: int, dtype: tf.DType, reduction: str):
        return self._compiled(
            (length, dtype, reduction),
            tf.TensorSpec([length], dtype),
            lambda flat, transfers: self._build(flat, reduction, transfers),
        )

    def _build(self, flat: tf.Tensor, reduction: str, transfers: Transfers) -> tf.Tensor:
        raise NotImplementedError


class ProcessRing(_PointToPointAllReduce):
    """The ring of this job's worker processes, for tfdist's ring all-reduce.

    Every rank must call `all_reduce` with tensors of the same shape and dtype, in the same
    order — as with any collective.

    Example (inside a multi_worker_mirrored program, on every worker):

        ring = ProcessRing(rank=cluster.task_index, ranks=cluster.num_workers)
        total = ring.all_reduce(tf.ones([1000]))     # == num_workers everywhere
        grads = ring.all_reduce_many(grads, compression="bfloat16")

    Args:
      rank: this worker's position (its index among the training tasks).
      ranks: the number of worker processes.
      timeout_seconds: how long a transfer may wait for its peer; None waits forever.
      group_key_base: the first of the `ranks` group keys the ring's edges use.
      max_pieces: a large buffer is cut into up to this many slices, each reduced by its own
        ring at the same time, so one slice's transfer overlaps another's additions.
      min_piece_bytes: no slice is smaller than this.
      device: where its transfers run (None: where the caller places them); a process's
        rings on several of its devices each name theirs (a collective group takes one
        device a process).
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
        device: str | None = None,
    ):
        super().__init__(
            rank=rank, ranks=ranks, timeout_seconds=timeout_seconds,
            group_key_base=group_key_base, device=device,
        )  # fmt: skip
        self.max_pieces, self.min_piece_bytes = max_pieces, min_piece_bytes

    def _build(self, flat, reduction, transfers):
        length = int(flat.shape[0])
        pieces = max(1, min(self.max_pieces, length * flat.dtype.size // self.min_piece_bytes))
        steps = 2 * (self.ranks - 1)
        outs = []
        for i, (start, end) in enumerate(chunk_bounds(length, pieces)):
            outs.append(
                ring_all_reduce(
                    flat[start:end],
                    rank=self.rank,
                    ranks=self.ranks,
                    exchange=self._exchange(transfers, first=i * steps),
                    reduction=reduction,
                )
            )
        return tf.concat(outs, axis=0)

    def reduce_scatter(self, flat: tf.Tensor, bounds: Sequence[tuple[int, int]]) -> tf.Tensor:
        """The sum over every rank of this rank's chunk of `flat` (ZeRO's first half).

        Args:
          flat: this rank's 1-D buffer; every rank passes the same length and dtype.
          bounds: [start, end) of each rank's chunk, in rank order, covering `flat`.

        Returns:
          The summed chunk `owned_chunk(rank, ranks)` of `flat`.
        """
        bounds = tuple(tuple(b) for b in bounds)
        owned = owned_chunk(self.rank, self.ranks)
        if self.ranks == 1:
            return flat
        program = self._compiled(
            ("reduce_scatter", bounds, flat.dtype),
            tf.TensorSpec([bounds[-1][1]], flat.dtype),
            lambda tensor, transfers: ring_reduce_scatter(
                [tensor[start:end] for start, end in bounds],
                rank=self.rank,
                ranks=self.ranks,
                exchange=self._exchange(transfers),
            )[owned],
        )
        return program(flat)

    def all_gather(self, chunk: tf.Tensor, bounds: Sequence[tuple[int, int]]) -> tf.Tensor:
        """Every rank's chunk, end to end (ZeRO's second half).

        Args:
          chunk: this rank's chunk `owned_chunk(rank, ranks)`, sized as `bounds` say.
          bounds: [start, end) of each rank's chunk in the whole buffer, in rank order.

        Returns:
          The whole 1-D buffer, on every rank.
        """
        bounds = tuple(tuple(b) for b in bounds)
        owned = owned_chunk(self.rank, self.ranks)
        if self.ranks == 1:
            return chunk

        def build(tensor, transfers):
            chunks = [tf.zeros([end - start], tensor.dtype) for start, end in bounds]
            chunks[owned] = tensor
            chunks = ring_all_gather(
                chunks, rank=self.rank, ranks=self.ranks, exchange=self._exchange(transfers)
            )
            return tf.concat(chunks, axis=0)

        start, end = bounds[owned]
        program = self._compiled(
            ("all_gather", bounds, chunk.dtype), tf.TensorSpec([end - start], chunk.dtype), build
        )
        return program(chunk)

    def all_gather_rows(self, rows: tf.IndexedSlices) -> tf.IndexedSlices:
        """Every rank's rows of a sparse gradient, end to end in rank order, on every rank.

        One device's tape holds a row per lookup (a token repeated in a batch has several),
        and Adam squares each row apart: summing the ranks' rows into a dense gradient would
        square their sum. So the rows travel as they are: around the ring, each step passes
        on the block received last, its row count first (ranks hold different numbers of
        rows: a stage that holds a table it does not read holds none).

        Args:
          rows: this rank's rows; every rank passes the same dense_shape and dtype.

        Returns:
          An IndexedSlices of every rank's rows (values and indices), in rank order.
        """
        values, dense_shape = rows.values, rows.dense_shape
        if self.ranks == 1:
            return rows
        width = int(np.prod(values.shape[1:]))  # a row's elements
        # A row travels as its elements and its index, bit for bit, in one buffer: float64
        # values with an int64 index, anything narrower as float32 with an int32 index.
        wide = values.dtype == tf.float64
        wire, index_dtype = (tf.float64, tf.int64) if wide else (tf.float32, tf.int32)
        index = tf.bitcast(tf.cast(rows.indices, index_dtype), wire)[:, None]
        packed = tf.concat([tf.reshape(tf.cast(values, wire), [-1, width]), index], axis=1)

        def build(flat, transfers):
            blocks = {self.rank: flat}
            left = (self.rank - 1) % self.ranks
            for step in range(self.ranks - 1):
                sent = blocks[(self.rank - step) % self.ranks]
                # The count of rows (exact in float32 below 2**24 rows), then the rows.
                count = tf.cast(tf.shape(sent)[:1] // (width + 1), wire)
                transfers.send(count, group_key=self._group_base + self.rank, key=2 * step)
                transfers.send(sent, group_key=self._group_base + self.rank, key=2 * step + 1)
                size = transfers.receive([1], group_key=self._group_base + left, key=2 * step)
                blocks[(self.rank - step - 1) % self.ranks] = transfers.receive(
                    tf.cast(size, tf.int32) * (width + 1), group_key=self._group_base + left,
                    key=2 * step + 1, after=sent,
                )  # fmt: skip
            return tf.concat([blocks[r] for r in range(self.ranks)], axis=0)

        program = self._compiled(
            ("all_gather_rows", width, wire), tf.TensorSpec([None], wire), build
        )
        gathered = tf.reshape(program(tf.reshape(packed, [-1])), [-1, width + 1])
        indices = tf.bitcast(gathered[:, width], index_dtype)
        shape = tf.concat([[-1], tf.shape(values)[1:]], axis=0)
        return tf.IndexedSlices(
            tf.cast(tf.reshape(gathered[:, :width], shape), values.dtype),
            tf.cast(indices, rows.indices.dtype),
            dense_shape,
        )

    def _exchange(self, transfers: Transfers, first: int = 0):
        """The ring's transport: send right, receive from the left, one instance key a step."""
        right_edge = self._group_base + self.rank  # this rank -> rank + 1
        left_edge = self._group_base + (self.rank - 1) % self.ranks  # rank - 1 -> this rank

        def exchange(send, recv_size, step):
            if send is not None:
                transfers.send(send, group_key=right_edge, key=first + step)
            if recv_size:  # taken when this step's chunk is ready to go, not all at once
                return transfers.receive(
                    [recv_size], group_key=left_edge, key=first + step, after=send
                )
            return None

        return exchange


class GatherBroadcast(_PointToPointAllReduce):
    """The naive all-reduce, for comparison: every rank sends its whole buffer to rank 0,
    which adds them up and broadcasts the sum back. Rank 0 receives (N-1) buffers and sends
    one to N-1 ranks, so its link carries N-1 times what a ring rank's does.

    Takes the same arguments as ProcessRing (without the slicing ones) and uses its own
    group keys: one 2-member group per (0, r) pair and one N-member broadcast group.
    """

    def __init__(
        self,
        *,
        rank: int,
        ranks: int,
        timeout_seconds: float | None = None,
        group_key_base: int = NAIVE_GROUP_KEY_BASE,
    ):
        super().__init__(
            rank=rank, ranks=ranks, timeout_seconds=timeout_seconds, group_key_base=group_key_base
        )

    def _build(self, flat, reduction, transfers):
        length = int(flat.shape[0])
        everyone = self._group_base  # the broadcast group; pairs (0, r) use base + r
        if self.rank == 0:
            total = flat
            for r in range(1, self.ranks):
                total = total + transfers.receive(
                    [length], group_key=self._group_base + r, key=0, after=total
                )
            if reduction == "mean":
                total = mean_of_sum(total, self.ranks)
            transfers.send(total, group_key=everyone, group_size=self.ranks, key=1)
            return total
        transfers.send(flat, group_key=self._group_base + self.rank, key=0)
        return transfers.receive(
            [length], group_key=everyone, group_size=self.ranks, key=1, after=flat
        )


class ProcessNeighbours(_PointToPoint):
    """Sends a buffer to chosen peer processes and receives theirs: gossip's exchange.

    Each directed edge (sender -> receiver) is a 2-member collective group of its own, so
    any graph of peers can be used, and a step's sends and receives all run at once.

    Example (a ring: each rank swaps its weights with both neighbours):

        peers = ProcessNeighbours(rank=r, ranks=n)
        left, right = (r - 1) % n, (r + 1) % n
        from_left, from_right = peers.exchange(flat, send_to=[left, right],
                                               receive_from=[left, right])

    Every rank calls `exchange` at the same point with buffers of the same length and
    dtype, and the edges must match: r sends to s exactly when s receives from r.

    Args:
      rank: this worker's position among the worker processes.
      ranks: the number of worker processes.
      timeout_seconds: how long a transfer may wait for its peer; None waits forever.
      group_key_base: the first of the ranks**2 group keys its edges use.
    """

    def __init__(
        self,
        *,
        rank: int,
        ranks: int,
        timeout_seconds: float | None = None,
        group_key_base: int = NEIGHBOUR_GROUP_KEY_BASE,
    ):
        super().__init__(
            rank=rank, ranks=ranks, timeout_seconds=timeout_seconds, group_key_base=group_key_base
        )

    def exchange(
        self, flat: tf.Tensor, *, send_to: Sequence[int], receive_from: Sequence[int]
    ) -> list[tf.Tensor]:
        """Sends 1-D `flat` to each rank of `send_to`; returns what each rank of
        `receive_from` sent, in that order."""
        send_to, receive_from = tuple(send_to), tuple(receive_from)
        for peer in (*send_to, *receive_from):
            if not 0 <= peer < self.ranks or peer == self.rank:
                raise ValueError(
                    f"Peers are other ranks in [0, {self.ranks}). Received: {peer} on rank "
                    f"{self.rank}"
                )
        if not receive_from and not send_to:
            return []
        length = int(flat.shape[0])

        def build(tensor, transfers):
            for peer in send_to:
                transfers.send(tensor, group_key=self._edge(self.rank, peer), key=0)
            received = [
                transfers.receive(
                    [length], group_key=self._edge(peer, self.rank), key=0, after=tensor
                )
                for peer in receive_from
            ]
            # One output for the program: the received buffers end to end (or nothing).
            return tf.concat(received, 0) if received else tf.zeros([0], tensor.dtype)

        program = self._compiled(
            ("exchange", send_to, receive_from, length, flat.dtype),
            tf.TensorSpec([length], flat.dtype),
            build,
        )
        out = program(flat)
        return [out[i * length : (i + 1) * length] for i in range(len(receive_from))]

    def _edge(self, sender: int, receiver: int) -> int:
        return self._group_base + sender * self.ranks + receiver


class Transfers:
    """The sends and receives of one program, on a block of instance keys of its own.

    A transfer is a CollectiveBcastSendV2 on the sender and a CollectiveBcastRecvV2 on the
    receiver under the same group key (the pair, or the broadcast group) and instance key
    (`first_key + key`); a program's transfers must use distinct `key`s within a group.
    TensorFlow's collectives do not take bfloat16, so its bits travel as float16, which a
    broadcast copies without looking at them. A send's output feeds nothing, and a graph
    function prunes whatever its result does not depend on: `after_sends` ties the result
    to every send.

    Args:
      first_key: the program's first instance key.
      timeout_seconds: how long a transfer may wait for its peer; 0 or None waits forever.
      dtype: the dtype of receives that name none.
    """

    def __init__(
        self, *, first_key: int, timeout_seconds: float | None, dtype: tf.DType | None = None
    ):
        self.first_key, self.timeout = first_key, float(timeout_seconds or 0)
        self.dtype = dtype
        self.sends: list[tf.Tensor] = []

    def send(self, tensor, *, group_key: int, key: int, group_size: int = 2) -> None:
        """Sends `tensor` (any shape and dtype) to the other members of `group_key`."""
        tensor = tf.convert_to_tensor(tensor)
        wire = _WIRE.get(tensor.dtype, tensor.dtype)
        self.sends.append(
            tf.raw_ops.CollectiveBcastSendV2(
                input=tf.bitcast(tensor, wire) if wire != tensor.dtype else tensor,
                group_size=group_size,
                group_key=group_key,
                instance_key=self.first_key + key,
                communication_hint="auto",
                timeout_seconds=self.timeout,
            )  # fmt: skip
        )

    def receive(
        self,
        shape,
        *,
        group_key: int,
        key: int,
        group_size: int = 2,
        dtype: tf.DType | None = None,
        after: tf.Tensor | None = None,
    ) -> tf.Tensor:
        """What the sender of `group_key` sent under `key`: a tensor of `shape` and `dtype`
        (default: the program's).

        A receive takes its whole buffer from the allocator when it starts, and one that
        waits for nothing starts with its program, long before its bytes arrive: a program
        of many steps would hold every step's buffer at once (and a step's program, each
        of its buckets'). `after` is what this receive waits for before it starts: the
        tensor sent in the same step, say, so that each step's buffer is taken in turn.
        """
        dtype = tf.as_dtype(dtype or self.dtype)
        wire = _WIRE.get(dtype, dtype)
        with tf.control_dependencies([] if after is None else [after]):
            received = tf.raw_ops.CollectiveBcastRecvV2(
                group_size=group_size, group_key=group_key, instance_key=self.first_key + key,
                shape=shape, T=wire, communication_hint="auto", timeout_seconds=self.timeout,
            )  # fmt: skip
        return tf.bitcast(received, dtype) if wire != dtype else received

    def after_sends(self, result):
        """`result` (a tensor or a nest of them), computed only after every send."""
        with tf.control_dependencies(self.sends):
            return tf.nest.map_structure(tf.identity, result)


class ProcessLinks:
    """Point-to-point transfers between worker processes inside programs the caller builds
    (a pipeline's passes): each program takes a block of instance keys of its own, in an
    order every process shares.

    Example (stage 0 sends an activation to stage 1 of the same program):

        links = ProcessLinks(group_key_base=group_key_base("pipeline_links"))
        transfers = links.program()              # once per built program, on every process
        transfers.send(activation, group_key=links.group_key_base + edge, key=0)   # stage 0
        x = transfers.receive(shape, dtype=tf.bfloat16, group_key=..., key=0)     # stage 1

    Args:
      group_key_base: the first group key of the caller's range (collective/keys.py).
      timeout_seconds: how long a transfer may wait for its peer; None waits forever.
    """

    def __init__(self, *, group_key_base: int, timeout_seconds: float | None = None):
        self.group_key_base, self.timeout_seconds = group_key_base, timeout_seconds
        self._next_program = _PROGRAMS_BUILT.setdefault(group_key_base, itertools.count())

    def program(self) -> Transfers:
        """The transfers of one new program (every process builds its programs in the same
        order, so they agree on each program's keys)."""
        return Transfers(
            first_key=next(self._next_program) * _KEYS_PER_PROGRAM + 1,
            timeout_seconds=self.timeout_seconds,
        )


# What a dtype travels as: the collectives take no bfloat16.
_WIRE = {tf.bfloat16: tf.float16}

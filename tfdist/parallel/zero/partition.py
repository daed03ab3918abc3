"""ZeRO's packed weights cut into one chunk per replica (Partition: by elements or by whole
variables, bucket by bucket), the piece of each variable a replica updates (Piece), and a
replica's own copy of the optimizer over its pieces (its slots: 1/N of the state).
"""

from __future__ import annotations

import dataclasses
import re

import keras
import numpy as np
import tensorflow as tf

from tfdist.collective.ring import (
    chunk_bounds,
    owned_chunk,
)
from tfdist.parallel import optimizer_copies


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of one model variable a replica updates.

    Attributes:
      index: the variable's position in `model.trainable_variables`.
      start: its first element (flattened) in the piece.
      end: one past its last.
      shape: the shape the optimizer sees: the variable's own for a whole variable, else
        [end - start].
    """

    index: int
    start: int
    end: int
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Partition:
    """How one bucket of variables, packed end to end, is cut into one chunk per replica.

    Attributes:
      order: the variables' indices (in model.trainable_variables) in packing order.
      offsets: each variable's first element in the packed buffer, by variable index.
      sizes: each variable's number of elements, by variable index.
      shapes: each variable's shape, by variable index.
      bounds: [start, end) of each chunk in the buffer; chunk c belongs to the replica r
        with owned_chunk(r, N) == c.
      whole: whether every chunk holds whole variables.
    """

    order: tuple[int, ...]
    offsets: dict[int, int]
    sizes: dict[int, int]
    shapes: dict[int, tuple[int, ...]]
    bounds: tuple[tuple[int, int], ...]
    whole: bool

    def pieces(self, chunk: int) -> list[Piece]:
        """The pieces of the variables chunk `chunk` covers, in buffer order."""
        start, end = self.bounds[chunk]
        pieces = []
        for i in self.order:
            lo, hi = max(start, self.offsets[i]), min(end, self.offsets[i] + self.sizes[i])
            if lo < hi:
                local = (lo - self.offsets[i], hi - self.offsets[i])
                shape = self.shapes[i] if self.whole else (hi - lo,)
                pieces.append(Piece(i, *local, shape))
        return pieces

    @classmethod
    def flat(cls, shapes: dict[int, tuple[int, ...]], ranks: int) -> Partition:
        """N ranges of equal length (to one element) over the variables, in index order."""
        order = tuple(sorted(shapes))
        sizes = {i: int(np.prod(shapes[i], dtype=np.int64)) for i in order}
        offsets, at = {}, 0
        for i in order:
            offsets[i], at = at, at + sizes[i]
        return cls(order, offsets, sizes, dict(shapes), tuple(chunk_bounds(at, ranks)), False)

    @classmethod
    def by_variable(cls, shapes: dict[int, tuple[int, ...]], ranks: int) -> Partition:
        """Whole variables per chunk: largest first, each to the chunk with the fewest
        elements so far (ties: the lower chunk)."""
        sizes = {i: int(np.prod(s, dtype=np.int64)) for i, s in shapes.items()}
        loads, members = [0] * ranks, [[] for _ in range(ranks)]
        for i in sorted(sizes, key=lambda i: (-sizes[i], i)):
            chunk = min(range(ranks), key=lambda c: (loads[c], c))
            loads[chunk] += sizes[i]
            members[chunk].append(i)
        order = tuple(i for chunk in members for i in sorted(chunk))
        offsets, at = {}, 0
        for i in order:
            offsets[i], at = at, at + sizes[i]
        bounds, at = [], 0
        for load in loads:
            bounds.append((at, at + load))
            at += load
        return cls(order, offsets, sizes, dict(shapes), tuple(bounds), True)


def bucket_variables(sizes: list[int], bucket_elements: int) -> list[list[int]]:
    """Consecutive variable indices grouped into buckets of at most `bucket_elements`
    elements (a larger variable gets a bucket of its own)."""
    buckets: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if not buckets or used + size > bucket_elements:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += size
    return buckets


class LocalReplica:
    """One local replica's slices (one per bucket): its pieces of the weights (variables on
    its device), and a copy of the user's optimizer whose slots are built for those pieces
    alone."""

    def __init__(self, optimizer, partitions, *, rank, ranks, device, variables, decays):
        self.rank, self.device = rank, device
        self.chunk = owned_chunk(rank, ranks)
        self.pieces = [partition.pieces(self.chunk) for partition in partitions]
        dtype = self.dtype = variables[0].dtype
        self.decays = {p.index: decays[p.index] for p in self.all_pieces()}
        with tf.device(device):
            self.variables = {
                p.index: keras.Variable(
                    np.zeros(p.shape, dtype), dtype=dtype, name=f"zero_v{p.index}"
                )
                for p in self.all_pieces()
            }
            # The same class and config: only its update_step and slots are used (the hook
            # clips, decays and counts through the user's optimizer).
            self.optimizer = optimizer_copies.optimizer_copy(
                optimizer, list(self.variables.values())
            )
        # Each piece's slots by name (Keras names a slot "<reference>_<slot>").
        self.slots: dict[tuple[int, str], keras.Variable] = {}
        for slot in self.optimizer.variables:
            found = re.search(r"zero_v(\d+)_(\w+)$", slot.path)
            if found:
                self.slots[int(found.group(1)), found.group(2)] = slot

    def all_pieces(self) -> list[Piece]:
        return [piece for pieces in self.pieces for piece in pieces]

    def begin_step(self, iterations):
        """The copy counts the user's optimizer's steps (Adam's bias correction reads it)."""
        count = self.optimizer.iterations
        return count.value.assign(tf.cast(iterations, count.dtype), read_value=False)

    def update(
        self, bucket, grad, weights, present, learning_rate, weight_decay, finite=None, rows=None
    ):
        """Applies `grad` (this replica's summed chunk of `bucket`) to its pieces of `weights`
        (the model's variables on this device) and returns the updated chunk, packed. The
        pieces take the weights' values first, so whatever set the weights (a restore,
        set_weights) holds. A piece of a variable without a gradient keeps its value; with
        `finite` False (an overflow under loss scaling) every piece does."""
        pieces = self.pieces[bucket]
        for piece in pieces:
            source = tf.reshape(weights[piece.index], [-1])
            current = tf.reshape(source[piece.start : piece.end], piece.shape)
            self.variables[piece.index].assign(current)

        def step():
            at = 0
            for piece in pieces:
                variable = self.variables[piece.index]
                size = piece.end - piece.start
                if present[piece.index]:
                    g = tf.reshape(grad[at : at + size], piece.shape)
                    if rows and piece.index in rows:  # every replica's rows, kept apart
                        g = _rows_of_piece(*rows[piece.index], piece, weights[piece.index])
                    lr = tf.cast(learning_rate, variable.dtype)
                    if self.decays[piece.index]:  # decoupled decay, first (Keras's order)
                        wd = tf.cast(weight_decay, variable.dtype)
                        variable.assign(variable - variable * wd * lr)
                    self.optimizer.update_step(g, variable, lr)
                at += size
            return tf.constant(True)

        done = step() if finite is None else tf.cond(finite, step, lambda: tf.constant(False))
        with tf.control_dependencies([done]):
            out = [tf.reshape(self.variables[p.index].value, [-1]) for p in pieces]
        return tf.concat(out, axis=0) if out else tf.zeros([0], self.dtype)

    def slot_bytes(self) -> int:
        return slot_bytes(self.optimizer)

    def piece_bytes(self) -> int:
        return sum(
            int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in self.variables.values()
        )


def _rows_of_piece(values, indices, piece: Piece, variable) -> tf.IndexedSlices:
    """A sparse gradient's rows (every replica's, gathered) as the gradient of `piece`: the
    rows themselves for a whole variable; for a flat range, each looked-up element that
    falls in it, kept apart (an elementwise optimizer takes them as it takes the rows)."""
    shape = tuple(variable.shape)
    if piece.shape == shape:
        return tf.IndexedSlices(values, indices, tf.constant(shape, tf.int64))
    width = int(np.prod(shape[1:], dtype=np.int64))
    where = tf.reshape(indices[:, None] * width + tf.range(width, dtype=tf.int64)[None, :], [-1])
    flat = tf.reshape(values, [-1])
    keep = (where >= piece.start) & (where < piece.end)
    return tf.IndexedSlices(
        tf.boolean_mask(flat, keep),
        tf.boolean_mask(where, keep) - piece.start,
        tf.constant([piece.end - piece.start], tf.int64),
    )


def slot_bytes(optimizer) -> int:
    """Bytes of an optimizer's state beside its step count and learning rate (its slots)."""
    own = {id(optimizer.iterations), id(getattr(optimizer, "_learning_rate", None))}
    return sum(
        int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
        for v in optimizer.variables
        if id(v) not in own
    )

"""A weight as flat slices (ZeRO's shards of a layout's parts and of a pipeline's stages):
each slice's size, slice k of n (padded with zeros), and the slices joined back.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def slice_size(shape, count: int) -> int:
    """The length of each of `count` flat slices of a weight of `shape` (the last padded
    with zeros): ceil(elements / count)."""
    return -(-int(np.prod(shape, dtype=np.int64)) // count)


def flat_slice(value, count: int, k: int, shape=None) -> tf.Tensor:
    """Slice `k` of `count` of `value` (of `shape`, by default its own), flattened and
    padded with zeros; a gradient of rows (IndexedSlices) is made dense first."""
    shape = tf.TensorShape(value.shape if shape is None else shape)
    elements = int(np.prod(shape.as_list(), dtype=np.int64))
    flat = tf.reshape(tf.convert_to_tensor(value), [elements])
    size = slice_size(shape, count)
    flat = tf.pad(flat, [[0, size * count - elements]])
    return flat[k * size : (k + 1) * size]


def joined(pieces, shape) -> tf.Tensor:
    """A value of `shape` from its flat slices, in order (the padding dropped)."""
    flat = tf.concat([tf.convert_to_tensor(p) for p in pieces], 0)
    return tf.reshape(flat[: int(np.prod(shape, dtype=np.int64))], shape)

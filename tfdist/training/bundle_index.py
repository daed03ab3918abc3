"""Where each tensor of a TensorFlow checkpoint bundle lies in its data files, from the
bundle's index, so that a process reads exactly the bytes it needs (shards.py).

TensorFlow's own reader fills a 1 MiB buffer from each data file a read touches: a 16-float
slice saved by each of 4 processes costs a 4 MiB read, and a resume of small slices reads
2-3 times what it asks for. The index is a sorted string table (LevelDB's format, blocks
uncompressed) of `BundleEntryProto`s: for each tensor saved whole, and for each slice of a
tensor saved in slices, its data file (shard), offset and size. A slice's key is the
tensor's name followed by the slice's extents in an order-preserving code, so a tensor's
slices come in the order of their starts; the key of the header (the number of data files)
is empty.
"""

from __future__ import annotations

import dataclasses
import struct

import tensorflow as tf
from tensorflow.core.protobuf import tensor_bundle_pb2

# The table's footer: two block handles (varints) padded to 40 bytes, then the magic number.
_FOOTER_BYTES = 48
_MAGIC = 0xDB4775248B80FB57
_BLOCK_TRAILER_BYTES = 5  # the block's compression type (a byte) and its checksum


@dataclasses.dataclass(frozen=True)
class Located:
    """Where a tensor's (or a slice's) bytes are: data file `shard`, [offset, offset+size)."""

    shard: int
    offset: int
    size: int


class BundleIndex:
    """The index of the bundle `prefix` (`<prefix>.index`), read once.

    Attributes:
      whole: {name: Located} of the tensors saved whole.
      slices: {name: [Located, ...]} of the tensors saved in slices, in the order of the
        slices' starts.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        with tf.io.gfile.GFile(prefix + ".index", "rb") as f:
            data = f.read()
        self.whole: dict[str, Located] = {}
        self.slices: dict[str, list[Located]] = {}
        self.shards = 1
        for key, value in _table(data):
            if not key:
                header = tensor_bundle_pb2.BundleHeaderProto.FromString(value)
                self.shards = header.num_shards
                continue
            entry = tensor_bundle_pb2.BundleEntryProto.FromString(value)
            if key[0] == 0:  # a slice: \x00, the tensor's name, then its extents
                name = _name_of_slice(key)
                self.slices.setdefault(name, []).append(
                    Located(entry.shard_id, entry.offset, entry.size)
                )
            elif not entry.slices:  # a tensor saved whole (one saved in slices lists them)
                self.whole[key.decode()] = Located(entry.shard_id, entry.offset, entry.size)

    def data_file(self, shard: int) -> str:
        return f"{self.prefix}.data-{shard:05d}-of-{self.shards:05d}"


def _table(data: bytes):
    """Every (key, value) of the sorted string table `data`."""
    if len(data) < _FOOTER_BYTES:
        raise ValueError("the index is shorter than its footer")
    footer = data[-_FOOTER_BYTES:]
    if struct.unpack("<Q", footer[-8:])[0] != _MAGIC:
        raise ValueError("the index does not end in a table's magic number")
    _, at = _handle(footer, 0)  # the meta-index: empty in a bundle's index
    (offset, size), _ = _handle(footer, at)
    for _, handle in _block(data, offset, size):
        (block_offset, block_size), _ = _handle(handle, 0)
        yield from _block(data, block_offset, block_size)


def _block(data: bytes, offset: int, size: int):
    """The (key, value) entries of the block at [offset, offset + size)."""
    if data[offset + size] != 0:  # the trailer's compression type: none
        raise ValueError("the index's blocks are compressed")
    block = data[offset : offset + size]
    (restarts,) = struct.unpack("<I", block[-4:])
    end, at, key = len(block) - 4 - 4 * restarts, 0, b""
    while at < end:
        shared, at = _varint(block, at)
        unshared, at = _varint(block, at)
        length, at = _varint(block, at)
        key = key[:shared] + block[at : at + unshared]
        at += unshared
        yield key, block[at : at + length]
        at += length


def _handle(data: bytes, at: int) -> tuple[tuple[int, int], int]:
    offset, at = _varint(data, at)
    size, at = _varint(data, at)
    return (offset, size), at


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def _name_of_slice(key: bytes) -> str:
    """The tensor name in a slice's key: after its leading 0, a string escaped as
    \\x00 -> \\x00\\xff and \\xff -> \\xff\\x00, ended by \\x00\\x01."""
    out, at = bytearray(), 1
    while True:
        byte = key[at]
        if byte == 0 and key[at + 1] == 1:
            return out.decode()
        out.append(byte)
        at += 2 if byte in (0, 0xFF) else 1


__all__ = ["BundleIndex", "Located"]

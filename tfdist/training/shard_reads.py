"""Reading a sharded checkpoint back (see shards.py for what one holds): each process reads
the entries its part wants, whatever layout wrote them, by exact byte ranges of the merged
bundle's data files (bundle_index.py) where it can, in buckets of at most shards.BUCKET_BYTES, each
assigned before the next; an entry held whole is read whole, a slice from the flattened
values of any layout's slices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.training import shards as shard_files
from tfdist.training.bundle_index import BundleIndex
from tfdist.training.shards import (
    Shards,
    Wanted,
    buckets,
    flat_slice,
    merged,
    metadata_of,
    parsed_spec,
    uncovered,
)


@dataclasses.dataclass(frozen=True)
class ReadBack:
    """What a process's read of its part took: the bytes of its slices, and the bytes it
    read from storage for them (/proc/self/io's count; None where the system keeps none)."""

    wanted_bytes: int
    read_bytes: int | None
    reads: int


def read(shards: Shards, prefix: str) -> ReadBack | None:
    """Reads this process's part of checkpoint `prefix` back, whatever layout wrote it, in
    reads of at most shards.BUCKET_BYTES (an entry larger alone), each assigned before the next.

    Raises:
      KeyError: the checkpoint holds no entry, or not every element, this process needs.
      tf.errors.DataLossError: a file's checksum fails where this process reads it.
    """
    wanted = shards.wanted()
    if not wanted:
        return None
    described = metadata_of(prefix)
    metadata = None if described is None else described["entries"]
    reshaped = [] if metadata is None else _reshaped(metadata, wanted)
    if reshaped:
        raise KeyError(
            f"The checkpoint {prefix} was saved from a model of other shapes: "
            f"{', '.join(reshaped[:3])}"
            + (f" (and {len(reshaped) - 3} more)" if len(reshaped) > 3 else "")
        )
    wanted = [_resolved(w, metadata) for w in wanted]
    missing = _missing(prefix, wanted) if metadata is None else _not_held(metadata, wanted)
    if shards.takes_everything:
        saved = set(metadata) if metadata is not None else set(_index(prefix))
        unplaced = sorted(
            saved - {w.key for w in wanted} - {k for k in saved if k.startswith(".empty/")}
        )
        if unplaced:
            raise KeyError(
                f"The checkpoint {prefix} holds state this job has no place for: "
                f"{', '.join(unplaced[:3])}"
                + (f" (and {len(unplaced) - 3} more)" if len(unplaced) > 3 else "")
                + " (an optimizer's slots kept by a mode: resume with the mode it was saved with)"
            )
    if missing:
        raise KeyError(
            f"The checkpoint {prefix}'s shards hold no {', '.join(missing[:3])}"
            + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
        )
    sizes = [_wanted_bytes(w, metadata) for w in wanted]
    before = _bytes_read()
    reads = 0
    with _ExactReads.of(prefix, described) as exact:
        for bucket in buckets(wanted, sizes, shard_files.BUCKET_BYTES):
            if exact is not None:
                values = [tf.convert_to_tensor(exact.read(w)) for w in bucket]
            else:  # shards an earlier tfdist wrote: TensorFlow's reader
                values = tf.raw_ops.RestoreV2(
                    prefix=merged(prefix),
                    tensor_names=[w.key for w in bucket],
                    shape_and_slices=[w.spec for w in bucket],
                    dtypes=[w.dtype for w in bucket],
                )
            for w, value in zip(bucket, values, strict=True):
                w.assign(value)
            del values
            reads += 1
    after = _bytes_read()
    read_bytes = None if before is None or after is None else after - before
    return ReadBack(sum(s or 0 for s in sizes), read_bytes, reads)


def _resolved(w: Wanted, metadata: dict | None) -> Wanted:
    """`w` with the spec that reads its entry whole as it was saved, and an assign that
    hands it over in `w.shape` (unchanged for a wanted slice)."""
    if w.shape is None:
        return w
    held = (metadata or {}).get(w.key)
    spec = ""
    if held is not None and held["slices"]:  # slices of the flattened values
        (size,) = held["shape"]
        spec = flat_slice(size, 0, size)
    shape, assign = w.shape, w.assign
    return dataclasses.replace(
        w, spec=spec, assign=lambda value: assign(tf.reshape(value, shape)), shape=None
    )


def _not_held(metadata: dict, wanted: list[Wanted]) -> list[str]:
    """The wanted entries (or slices of them) the metadata says were not saved."""
    missing = []
    for w in wanted:
        held = metadata.get(w.key)
        extent = parsed_spec(w.spec)
        if held is None:
            missing.append(w.key)
        elif extent is not None and held["slices"]:
            size, offset, length = extent
            if held["shape"] != [size] or uncovered(held["slices"], offset, offset + length):
                missing.append(f"{w.key} [{offset}, {offset + length})")
    return missing


def _reshaped(metadata: dict, wanted: list[Wanted]) -> list[str]:
    """The wanted weights (and slots) whose shape here is not the shape saved: a weight
    saved whole has its own shape in the metadata, a slice of one its weight's (checkpoints
    an earlier tfdist wrote only its element count)."""
    out = []
    for w in wanted:
        held, here = metadata.get(w.key), w.shape or w.weight_shape
        if held is None or here is None:
            continue
        saved = held.get("weight_shape") or (None if held["slices"] else held["shape"])
        if saved is not None:
            if tuple(saved) != tuple(here):
                out.append(f"{w.key} saved {tuple(saved)}, here {tuple(here)}")
        elif held["shape"][0] != int(np.prod(here, dtype=np.int64)):
            out.append(f"{w.key} saved with {held['shape'][0]} elements, here {tuple(here)}")
    return out


class _ExactReads:
    """Reads a wanted tensor, or slice of one, from the merged bundle where its index says
    its bytes are: only the runs of SUM_BYTES of each saved slice it overlaps (TensorFlow's
    reader would fill a 1 MiB buffer from each data file it touches), each run checked
    against the checksum the metadata holds for it."""

    def __init__(self, prefix: str, described: dict):
        self.index = BundleIndex(merged(prefix))
        self.entries, self.run = described["entries"], int(described["sum_bytes"])
        self._files: dict[int, Any] = {}

    @classmethod
    @contextlib.contextmanager
    def of(cls, prefix: str, described: dict | None) -> Iterator[_ExactReads | None]:
        """The exact reads of checkpoint `prefix`, or None where its metadata holds no
        checksums (shards an earlier tfdist wrote) or its index is of an unknown form."""
        reads = None
        if described is not None and "sum_bytes" in described:
            sums = [s for held in described["entries"].values() for s in held.get("sums", [None])]
            if all(s is not None for s in sums):
                try:
                    reads = cls(prefix, described)
                except ValueError:
                    reads = None
        try:
            yield reads
        finally:
            if reads is not None:
                reads.close()

    def read(self, w: Wanted) -> np.ndarray:
        held = self.entries[w.key]
        dtype = tf.as_dtype(held["dtype"])
        item, extent = dtype.size, parsed_spec(w.spec)
        if len(held["sums"]) != max(1, len(held["slices"])):
            raise tf.errors.DataLossError(None, None, f"the metadata of {w.key} is malformed")
        if held["slices"]:
            (size,) = held["shape"]
            saved = sorted(zip((tuple(s) for s in held["slices"]), held["sums"], strict=True))
        else:
            size = int(np.prod(held["shape"], dtype=np.int64))
            saved = [((0, size), held["sums"][0])]
        # TensorFlow keeps one slice that covers its whole tensor as a whole tensor.
        located = self.index.slices.get(w.key) or (
            [self.index.whole[w.key]] if w.key in self.index.whole else []
        )
        if len(located) != len(saved):
            raise tf.errors.DataLossError(
                None, None, f"the index lists {len(located)} slice(s) of {w.key}, the "
                f"metadata {len(saved)}",
            )  # fmt: skip
        lo, hi = (0, size) if extent is None else (extent[1], extent[1] + extent[2])
        out = np.empty(hi - lo, dtype.as_numpy_dtype)
        raw = out.reshape(-1).view(np.uint8)
        for ((start, length), sums), where in zip(saved, located, strict=True):
            a, b = max(lo, start), min(hi, start + length)
            if a >= b:
                continue
            first, last = (a - start) * item, (b - start) * item  # bytes in the saved slice
            into = (a - lo) * item - first  # where the saved slice's byte 0 lands in `raw`
            # A run at a time (what the read holds besides `out`), each checked as it comes.
            for at in range(first // self.run * self.run, last, self.run):
                data = self._pread(where, at, min(self.run, length * item - at))
                if zlib.crc32(data) != sums[at // self.run]:
                    raise tf.errors.DataLossError(
                        None, None, f"{w.key}: a checksum of the bytes at {where.offset + at} "
                        f"of {self.index.data_file(where.shard)} does not match",
                    )  # fmt: skip
                lo_byte, hi_byte = max(at, first), min(at + len(data), last)
                raw[into + lo_byte : into + hi_byte] = np.frombuffer(
                    data, np.uint8, hi_byte - lo_byte, lo_byte - at
                )
        if extent is None and not held["slices"]:
            return out.reshape(held["shape"])
        return out

    def _pread(self, where, offset: int, length: int) -> bytes:
        path = self.index.data_file(where.shard)
        if where.shard not in self._files:
            if "://" in path:
                self._files[where.shard] = tf.io.gfile.GFile(path, "rb")
            else:
                try:
                    self._files[where.shard] = os.open(path, os.O_RDONLY)
                except FileNotFoundError as e:
                    raise tf.errors.NotFoundError(None, None, f"{path}: {e}") from e
        f = self._files[where.shard]
        if isinstance(f, int):
            data = os.pread(f, length, where.offset + offset)
        else:
            f.seek(where.offset + offset)
            data = f.read(length)
        if len(data) != length:
            raise tf.errors.DataLossError(
                None, None, f"{path} ends before the {length} bytes at {where.offset + offset}"
            )
        return data

    def close(self) -> None:
        for f in self._files.values():
            if isinstance(f, int):
                os.close(f)
            else:
                f.close()
        self._files.clear()


def _wanted_bytes(w: Wanted, metadata: dict | None) -> int | None:
    extent, item = parsed_spec(w.spec), tf.as_dtype(w.dtype).size
    if extent is not None:
        return extent[2] * item
    if metadata is None or w.key not in metadata:
        return None
    return int(np.prod(metadata[w.key]["shape"], dtype=np.int64)) * item


def _bytes_read() -> int | None:
    """The bytes this process has read so far (Linux's /proc/self/io), or None."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _missing(prefix: str, wanted: list[Wanted]) -> list[str]:
    held = _index(prefix)
    return [w.key for w in wanted if w.key not in held]


def _index(prefix: str) -> dict:
    """The merged shards' keys and shapes, from their index (no tensor read)."""
    return tf.compat.v1.train.NewCheckpointReader(merged(prefix)).get_variable_to_shape_map()

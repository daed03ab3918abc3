"""Sharded checkpoints: each process writes the part of the model it holds, and a resume on
any other layout reads the part it will hold.

A mode whose processes each hold part of the weights (ZeRO-3's slices, a pipeline's stages)
gives `tfdist.StepCheckpoint` a `Shards` (Engine.state().shards). At a save, beside the
chief's checkpoint `ckpt-N` (the step, the optimizer's counters, the statistics: everything
small), every process writes its part to `ckpt-N.shards/part-<rank>-of-<n>`, a TensorFlow
checkpoint bundle. Once every process has written (a barrier), the chief merges the parts
into one bundle, `ckpt-N.shards/merged`, then writes `ckpt-N` itself: a complete `ckpt-N`
means complete shards.

Each entry is keyed by the weight's place among the model's trainable weights
(`trainable/<i>`; a slot: `trainable/<i>/.slot/<name>`). A ZeRO-3 slice is
saved as a slice of the weight's flattened values (TensorFlow's partitioned-variable
format, `"<size> <offset>,<length>"`), so a process of another layout reads exactly its own
new slice, put together from whichever saved slices overlap it.
A pipeline's stage writes each weight it is the source of whole, and a process of another
cut reads the weights its stages hold. So a job saved by 4 processes resumes on 2 or 3, and
no process ever reads or writes the whole model.

Both ways go in bounded buffers, as PyTorch's Distributed Checkpoint plans its reads and
writes: a process writes its part as bundles of at most WRITE_BUCKET_BYTES each (an entry
larger than that alone), each entry's tensor made only when its bundle is written, and reads
its slices back in reads of at most BUCKET_BYTES, each read's values assigned before the
next read is made. Beside the merged bundle the chief writes `merged.json`, the
checkpoint's metadata: every entry's dtype, saved shape, the slices saved of it and a
CRC-32 of each SUM_BYTES of each slice. A resume checks from it that its slices are all
there without reading a tensor (reading every tensor of the merged bundle to check it once
made every process of a 4 -> 2 resume read 5.9 times the weights' bytes). It then reads
its slices' bytes where the merged index says they lie (bundle_index.py): the runs of
SUM_BYTES they overlap, no more (TensorFlow's reader, kept for shards an earlier tfdist
wrote, fills a 1 MiB buffer from each data file it touches). A damaged file shows as a
run's checksum fails where a process reads it, and every process then passes the
checkpoint over together.

This module writes and describes the parts; shard_reads.py reads them back.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import tensorflow as tf

from tfdist.storage import write_atomically

SHARDS_SUFFIX = ".shards"
MERGED = "merged"
METADATA_SUFFIX = ".json"
# The most bytes a process reads back in one read, and writes in one bundle (an entry larger
# than that goes alone): what resuming or saving adds to its peak, beside the entry itself.
# A bundle is a data file of the merged checkpoint, so writes take larger runs: a 1.6 GB
# part is 25 files.
BUCKET_BYTES = 4 * 2**20
WRITE_BUCKET_BYTES = 64 * 2**20
# Each saved tensor's checksums, one for each run of this many bytes: a read of part of a
# tensor reads the runs it overlaps and checks them (bundle_index.py reads exact bytes).
SUM_BYTES = 64 * 2**10

_saving = threading.local()


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a process's part: `value` under `key`, whole (`spec` "") or a slice of
    the flattened weight (`spec` "<size> <offset>,<length>").

    `value` is the tensor, or a function that makes it when its bundle is written (then
    `dtype` and `shape`, the tensor's own, say what it will be).
    """

    key: str
    value: tf.Tensor | Callable[[], tf.Tensor]
    spec: str = ""
    dtype: tf.DType | None = None
    shape: tuple[int, ...] | None = None
    # The weight's own shape, for a slice of its flattened values (a resume under another
    # layout checks that its model's weight has it).
    weight_shape: tuple[int, ...] | None = None

    def made(self) -> tf.Tensor:
        return self.value() if callable(self.value) else self.value

    def facts(self) -> tuple[tf.DType, tuple[int, ...]]:
        """(dtype, shape) of the tensor, without making it."""
        if callable(self.value):
            return tf.as_dtype(self.dtype), tuple(self.shape)
        return tf.as_dtype(self.value.dtype), tuple(self.value.shape)

    def nbytes(self) -> int:
        dtype, shape = self.facts()
        return int(np.prod(shape, dtype=np.int64)) * dtype.size


@dataclasses.dataclass(frozen=True)
class Wanted:
    """What a process reads back: `key` (whole, or the slice `spec`) handed to `assign`.

    With `shape`, the entry is read whole however it was saved (whole, or as slices of its
    flattened values by another layout) and handed over in that shape. `weight_shape`: the
    shape of the weight a wanted slice is of (checked against the one saved).
    """

    key: str
    dtype: tf.DType
    assign: Callable[[tf.Tensor], None]
    spec: str = ""
    shape: tuple[int, ...] | None = None
    weight_shape: tuple[int, ...] | None = None


class Shards(abc.ABC):
    """What a mode that holds the model in parts gives a checkpoint (see the module)."""

    # Whether this part must take every entry the checkpoint holds (a job holding the whole
    # model: an entry it has no place for, another mode's state, would be lost).
    takes_everything = False

    @abc.abstractmethod
    def entries(self) -> list[Entry]:
        """This process's part, to write."""

    @abc.abstractmethod
    def wanted(self) -> list[Wanted]:
        """What this process reads back at a resume, and where each goes."""


def flat_slice(size: int, lo: int, hi: int) -> str:
    """The spec of elements [lo, hi) of a weight of `size` elements, flattened."""
    return f"{size} {lo},{hi - lo}"


def parsed_spec(spec: str) -> tuple[int, int, int] | None:
    """(size, offset, length) of a flat slice's spec; None for a whole tensor's ("")."""
    if not spec:
        return None
    size, extent = spec.split(" ")
    offset, length = extent.split(",")
    return int(size), int(offset), int(length)


def weight_key(index: int) -> str:
    """The key of the model's trainable weight `index` (its place in
    `model.trainable_variables`: names may differ between two builds of one model)."""
    return f"trainable/{index}"


def slot_key(index: int, slot: str) -> str:
    """The key of trainable weight `index`'s optimizer slot `slot` ("momentum")."""
    return f"{weight_key(index)}/.slot/{slot}"


def saving() -> bool:
    """Whether a sharded checkpoint's main part is being written: the weights its shards
    hold serialize to nothing there (they are in the shards)."""
    return getattr(_saving, "on", False)


@contextlib.contextmanager
def main_part() -> Iterator[None]:
    """Where the chief's (small) checkpoint is written beside the shards."""
    _saving.on = True
    try:
        yield
    finally:
        _saving.on = False


def directory(prefix: str) -> str:
    """Where checkpoint `prefix`'s shards are."""
    return prefix + SHARDS_SUFFIX


def merged(prefix: str) -> str:
    """The prefix of checkpoint `prefix`'s merged shards."""
    return f"{directory(prefix)}/{MERGED}"


def has_shards(prefix: str) -> bool:
    return tf.io.gfile.exists(merged(prefix) + ".index")


class PeerFailed(Exception):
    """Another process could not write its part of a checkpoint: this one wrote nothing more."""


def write(shards: Shards, prefix: str, *, rank: int, ranks: int,
          barrier: Callable[[bool], bool], is_chief: bool) -> None:  # fmt: skip
    """Every process writes its part of checkpoint `prefix`, in bundles of at most
    WRITE_BUCKET_BYTES; the chief merges them once all have, and writes the metadata (every
    process calls it at the same step).

    Every process passes both barriers even when its part fails, whatever the error (the
    others would wait for it): the one that failed raises its error, the others PeerFailed.
    """
    error = None
    where = directory(prefix)
    try:
        tf.io.gfile.makedirs(where)
        part = f"{where}/part-{rank:05d}-of-{ranks:05d}"
        entries = shards.entries() or [  # a bundle all the same: the merge takes every rank's
            Entry(f".empty/{rank}", tf.zeros([0]))
        ]
        bundles, described = [], []
        sizes = [e.nbytes() for e in entries]
        for b, bucket in enumerate(buckets(entries, sizes, WRITE_BUCKET_BYTES)):
            bundles.append(f"{part}-{b:05d}")
            tensors = [e.made() for e in bucket]
            tf.raw_ops.SaveV2(
                prefix=bundles[-1],
                tensor_names=[e.key for e in bucket],
                shape_and_slices=[e.spec for e in bucket],
                tensors=tensors,
            )
            described += [_described(e, _sums(t)) for e, t in zip(bucket, tensors, strict=True)]
            del tensors
        # What this part holds (the merge's metadata), written last: a part whose list is
        # there is whole.
        listed = {"bundles": [os.path.basename(b) for b in bundles], "entries": described}
        write_atomically(part + METADATA_SUFFIX, json.dumps(listed))
    except Exception as e:  # noqa: BLE001 - raised after the barrier every process passes
        error = e
    if barrier(error is not None):
        raise error or PeerFailed()
    if is_chief:
        try:
            _merge(prefix, ranks)
        except Exception as e:  # noqa: BLE001 - as above
            error = e
    if barrier(error is not None):
        raise error or PeerFailed()


def _merge(prefix: str, ranks: int) -> None:
    """The chief's merge of every rank's bundles into one, and the checkpoint's metadata."""
    where = directory(prefix)
    lists = []
    for r in range(ranks):
        with tf.io.gfile.GFile(f"{where}/part-{r:05d}-of-{ranks:05d}{METADATA_SUFFIX}") as f:
            lists.append(json.load(f))
    bundles = [f"{where}/{name}" for listed in lists for name in listed["bundles"]]
    # What a save of this step cut short left (a job stopped after its merge, before its
    # ckpt-N), never mixed into this one.
    for stale in tf.io.gfile.glob(merged(prefix) + ".*"):
        _remove(stale)
    tf.raw_ops.MergeV2Checkpoints(
        checkpoint_prefixes=bundles, destination_prefix=merged(prefix), delete_old_dirs=False
    )
    metadata: dict[str, dict] = {}
    for listed in lists:
        for key, dtype, shape, extent, weight_shape, sums in listed["entries"]:
            held = metadata.setdefault(
                key, {"dtype": dtype, "shape": shape, "slices": [], "sums": []}
            )
            if extent is not None:
                held["slices"].append(extent)
            held["sums"].append(sums)  # by slice, in the slices' order (a whole tensor: one)
            if weight_shape is not None:
                held["weight_shape"] = weight_shape
    # The merged data files and their sizes: a file gone or cut short shows without a read.
    files = {
        os.path.basename(path): tf.io.gfile.stat(path).length
        for path in sorted(tf.io.gfile.glob(merged(prefix) + ".data-*"))
    }
    described = {"entries": metadata, "files": files, "sum_bytes": SUM_BYTES}
    write_atomically(merged(prefix) + METADATA_SUFFIX, json.dumps(described, sort_keys=True))
    for b in bundles:  # the merge moved their data files; their indexes are left
        _remove(b + ".index")
    for r in range(ranks):
        _remove(f"{where}/part-{r:05d}-of-{ranks:05d}{METADATA_SUFFIX}")


def _described(entry: Entry, sums: list[int] | None) -> list:
    """[key, dtype, saved shape, [offset, length] or None, the weight's shape or None, the
    checksums of its bytes (None for a tensor not of numbers)] of an entry, for the
    metadata."""
    dtype, shape = entry.facts()
    extent = parsed_spec(entry.spec)
    weight = None if entry.weight_shape is None else list(entry.weight_shape)
    if extent is None:
        return [entry.key, dtype.name, list(shape), None, weight, sums]
    size, offset, length = extent
    return [entry.key, dtype.name, [size], [offset, length], weight, sums]


def _sums(tensor: tf.Tensor) -> list[int] | None:
    """The CRC-32 of each SUM_BYTES of the tensor's bytes, as a data file holds them."""
    if tensor.dtype == tf.string or tensor.dtype.is_quantized:
        return None
    raw = memoryview(np.ascontiguousarray(tensor.numpy()).reshape(-1).view(np.uint8))
    return [zlib.crc32(raw[at : at + SUM_BYTES]) for at in range(0, len(raw), SUM_BYTES)]


def buckets(items: Sequence, sizes: Sequence[int | None], most: int) -> Iterator[list]:
    """`items` in runs of at most `most` bytes (an item larger, or of unknown size, alone)."""
    bucket, held = [], 0
    for item, size in zip(items, sizes, strict=True):
        if bucket and (size is None or held + size > most):
            yield bucket
            bucket, held = [], 0
        bucket.append(item)
        held += size or 0
        if size is None:
            yield bucket
            bucket, held = [], 0
    if bucket:
        yield bucket


def metadata_of(prefix: str) -> dict | None:
    """Checkpoint `prefix`'s metadata (see the module docstring): {"entries": {key: {dtype,
    shape, slices}}, "files": {data file: bytes}}; None for shards an earlier tfdist wrote,
    which have none.

    Raises:
      ValueError: the metadata file is there but cannot be read as metadata.
    """
    path = merged(prefix) + METADATA_SUFFIX
    if not tf.io.gfile.exists(path):
        return None
    try:
        with tf.io.gfile.GFile(path) as f:
            metadata = json.load(f)
        if not isinstance(metadata.get("entries"), dict) or not isinstance(
            metadata.get("files"), dict
        ):
            raise ValueError("it lacks its entries or files")
    except (tf.errors.OpError, OSError, ValueError, AttributeError) as e:
        raise ValueError(f"its metadata {os.path.basename(path)} cannot be read: {e}") from e
    return metadata


def has_metadata(prefix: str) -> bool:
    """Whether checkpoint `prefix`'s shards carry metadata (an earlier tfdist wrote none)."""
    return tf.io.gfile.exists(merged(prefix) + METADATA_SUFFIX)


def incomplete(prefix: str) -> str | None:
    """Why checkpoint `prefix`'s shards are not whole (None: they are), from its metadata,
    reading no tensor: every data file is there at its size, every entry is in the merged
    index, and the slices saved of a weight cover all of it. (Damage inside a file shows as
    its checksum fails where a process reads it.)"""
    try:
        metadata = metadata_of(prefix)
        if metadata is None:
            return "its shards carry no metadata"
        for name, length in sorted(metadata["files"].items()):
            path = f"{directory(prefix)}/{name}"
            if not tf.io.gfile.exists(path):
                return f"its data file {name} is missing"
            if tf.io.gfile.stat(path).length != length:
                return f"its data file {name} holds {tf.io.gfile.stat(path).length} bytes, not {length}"
        reader = tf.compat.v1.train.NewCheckpointReader(merged(prefix))
        indexed = reader.get_variable_to_shape_map()
    except (tf.errors.OpError, ValueError, RuntimeError) as e:
        message = getattr(e, "message", str(e)).strip().splitlines()[0]
        return f"{type(e).__name__}: {message[:200]}"
    try:
        for key, held in sorted(metadata["entries"].items()):
            if key not in indexed:
                return f"its merged shards' index lacks {key}, which its metadata lists"
            if held["slices"]:
                (size,) = held["shape"]
                if uncovered(held["slices"], 0, size):
                    return f"the slices saved of {key} do not cover its {size} elements"
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return f"its metadata is malformed ({type(e).__name__}: {e})"
    return None


def uncovered(slices: list[list[int]], lo: int, hi: int) -> bool:
    """Whether the saved [offset, length] slices leave any element of [lo, hi) out."""
    at = lo
    for offset, length in sorted(slices):
        if offset > at:
            break
        at = max(at, offset + length)
    return at < hi


class WholeModel(Shards):
    """What a job that holds the whole model reads of a sharded checkpoint: every trainable
    weight and every optimizer slot whole, however the writing layout cut them (zero3's
    slices, a pipeline's stages). Slots are matched by Keras's names for them (an
    optimizer names weight `v`'s slot `s` as `<v.path with _ for />_<s>`)."""

    takes_everything = True

    def __init__(self, model):
        self.model = model

    def entries(self) -> list[Entry]:
        return []  # such a job saves the whole model in its main checkpoint

    def wanted(self) -> list[Wanted]:
        trainable = list(self.model.trainable_variables)
        out = [_whole(weight_key(i), v) for i, v in enumerate(trainable)]
        paths = {v.path.replace("/", "_"): i for i, v in enumerate(trainable)}
        optimizer = self.model.optimizer
        for slot in [] if optimizer is None else optimizer.variables:
            i = weight_of_slot(slot.name, paths)
            if i is not None:
                name = slot.name[len(trainable[i].path) + 1 :]  # "momentum"
                out.append(_whole(slot_key(i, name), slot))
        return out


def weight_of_slot(slot: str, paths: dict[str, int]) -> int | None:
    """The weight (its index in `paths`: weight path with '/' as '_' -> index) a Keras
    optimizer's slot variable named `slot` was made for: Keras names it
    "<weight path, '/' as '_'>_<slot>"; the longest such path."""
    found = [p for p in paths if slot.startswith(p + "_")]
    return paths[max(found, key=len)] if found else None


def _whole(key: str, variable) -> Wanted:
    return Wanted(key, tf.as_dtype(variable.dtype), variable.assign, shape=tuple(variable.shape))


def remove(prefix: str) -> None:
    """Removes checkpoint `prefix`'s shards (the chief, for a checkpoint no longer kept)."""
    where = directory(prefix)
    if tf.io.gfile.isdir(where):
        tf.io.gfile.rmtree(where)


def _remove(path: str) -> None:
    if tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)


def barrier(strategy: tf.distribute.Strategy, processes: int) -> Callable[[bool], bool]:
    """A function that returns once every worker process has called it (a collective), and
    says whether any of them passed `failed`."""

    def wait(failed: bool = False) -> bool:
        if processes <= 1:
            return failed
        flags = strategy.experimental_distribute_values_from_function(
            lambda _: tf.constant(float(failed))
        )
        return float(strategy.reduce(tf.distribute.ReduceOp.SUM, flags, axis=None)) > 0

    return wait


def padded(value: tf.Tensor, length: int) -> tf.Tensor:
    """A slice read back, padded with zeros to a replica's slice `length`."""
    missing = length - int(value.shape[0])
    return tf.pad(value, [[0, missing]]) if missing else value

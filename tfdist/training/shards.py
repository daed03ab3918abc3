"""Sharded checkpoints: each process writes the part of the model it holds, and a resume on
any other layout reads the part it will hold.

A mode whose processes each hold part of the weights (ZeRO-3's slices, a pipeline's stages)
gives `tfdist.StepCheckpoint` a `Shards` (Runner.checkpoint_shards). At a save, beside the
chief's checkpoint `ckpt-N` (the step, the optimizer's counters, the statistics: everything
small), every process writes its part to `ckpt-N.shards/part-<rank>-of-<n>`, a TensorFlow
checkpoint bundle. Once every process has written (a barrier), the chief merges the parts
into one bundle, `ckpt-N.shards/merged`, then writes `ckpt-N` itself: a complete `ckpt-N`
means complete shards.

Each entry is keyed by the weight's place among the model's trainable weights
(`trainable/<i>`; a slot: `trainable/<i>/.slot/<name>`). A ZeRO-3 slice is
saved as a slice of the weight's flattened values (TensorFlow's partitioned-variable
format, `"<size> <offset>,<length>"`), so a process of another layout reads exactly its own
new slice: TensorFlow's bundle reader assembles it from whichever saved slices overlap it.
A pipeline's stage writes each weight it is the source of whole, and a process of another
cut reads the weights its stages hold. So a job saved by 4 processes resumes on 2 or 3, and
no process ever reads or writes the whole model.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import tensorflow as tf

SHARDS_SUFFIX = ".shards"
MERGED = "merged"

_saving = threading.local()


@dataclass(frozen=True)
class Entry:
    """One tensor of a process's part: `value` under `key`, whole (`spec` "") or a slice of
    the flattened weight (`spec` "<size> <offset>,<length>")."""

    key: str
    value: tf.Tensor
    spec: str = ""


@dataclass(frozen=True)
class Wanted:
    """What a process reads back: `key` (whole, or the slice `spec`) handed to `assign`."""

    key: str
    dtype: tf.DType
    assign: Callable[[tf.Tensor], None]
    spec: str = ""


class Shards:
    """What a mode that holds the model in parts gives a checkpoint (see the module)."""

    def entries(self) -> list[Entry]:
        """This process's part, to write."""
        raise NotImplementedError

    def wanted(self) -> list[Wanted]:
        """What this process reads back at a resume, and where each goes."""
        raise NotImplementedError


def flat_slice(size: int, lo: int, hi: int) -> str:
    """The spec of elements [lo, hi) of a weight of `size` elements, flattened."""
    return f"{size} {lo},{hi - lo}"


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
    """Every process writes its part of checkpoint `prefix`; the chief merges them once all
    have (every process calls it at the same step).

    Every process passes both barriers even when a write fails (the others would wait for
    it): the one that failed raises its error, the others PeerFailed.
    """
    error = None
    try:
        where = directory(prefix)
        tf.io.gfile.makedirs(where)
        part = f"{where}/part-{rank:05d}-of-{ranks:05d}"
        entries = shards.entries() or [  # a bundle all the same: the merge takes every rank's
            Entry(f".empty/{rank}", tf.zeros([0]))
        ]
        tf.raw_ops.SaveV2(
            prefix=part,
            tensor_names=[e.key for e in entries],
            shape_and_slices=[e.spec for e in entries],
            tensors=[e.value for e in entries],
        )
    except (tf.errors.OpError, OSError) as e:
        error = e
    if barrier(error is not None):
        raise error or PeerFailed()
    if is_chief:
        try:
            parts = [f"{where}/part-{r:05d}-of-{ranks:05d}" for r in range(ranks)]
            # What a save of this step cut short left (a job stopped after its merge, before
            # its ckpt-N), never mixed into this one.
            for stale in tf.io.gfile.glob(merged(prefix) + ".*"):
                _remove(stale)
            tf.raw_ops.MergeV2Checkpoints(
                checkpoint_prefixes=parts, destination_prefix=merged(prefix),
                delete_old_dirs=False,
            )  # fmt: skip
            for p in parts:  # the merge moved their data files; their indexes are left
                _remove(p + ".index")
        except (tf.errors.OpError, OSError) as e:
            error = e
    if barrier(error is not None):
        raise error or PeerFailed()


def read(shards: Shards, prefix: str) -> None:
    """Reads this process's part of checkpoint `prefix` back, whatever layout wrote it."""
    wanted = shards.wanted()
    if not wanted:
        return
    missing = _missing(prefix, wanted)
    if missing:
        raise KeyError(
            f"The checkpoint {prefix}'s shards hold no {', '.join(missing[:3])}"
            + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
        )
    values = tf.raw_ops.RestoreV2(
        prefix=merged(prefix),
        tensor_names=[w.key for w in wanted],
        shape_and_slices=[w.spec for w in wanted],
        dtypes=[w.dtype for w in wanted],
    )
    for w, value in zip(wanted, values, strict=True):
        w.assign(value)


def remove(prefix: str) -> None:
    """Removes checkpoint `prefix`'s shards (the chief, for a checkpoint no longer kept)."""
    where = directory(prefix)
    if tf.io.gfile.isdir(where):
        tf.io.gfile.rmtree(where)


def _missing(prefix: str, wanted: list[Wanted]) -> list[str]:
    reader = tf.compat.v1.train.NewCheckpointReader(merged(prefix))
    held = reader.get_variable_to_shape_map()
    return [w.key for w in wanted if w.key not in held]


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

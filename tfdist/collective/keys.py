"""Every collective group-key range tfdist uses, in one table, and the one allocator of keys.

TensorFlow's collective ops name a group by an integer key: the members of a group use the
same key, and two groups that share one would mix their transfers. MultiWorkerMirroredStrategy
hands out its own keys counting up from 1, so tfdist's start far above them; each exchange of
tfdist's takes its keys from its own range here, and a range cut into blocks (a ring per
stage, a key range per MirroredStrategy) is cut by `block`, which refuses a block past its
range's end. So no two can meet (tests/test_collective_keys.py checks the table).

    ring = ProcessRing(rank=r, ranks=n, group_key_base=group_key_base("local_sgd"))
    ring = ProcessRing(..., group_key_base=block("pipeline_stage_rings", stage, size=1000))
"""

from __future__ import annotations

import itertools

from tfdist.errors import TfdistError

# TensorFlow's own keys (MultiWorkerMirroredStrategy's, counting from 1) stay below this.
FIRST_KEY = 1_000_000
# Group keys are int32 in TensorFlow's collective ops.
LAST_KEY = 2**31 - 1
# Keys one MirroredStrategy numbers its groups with (from its base + 1).
MIRRORED_BLOCK = 100_000


class KeyRangeError(TfdistError, ValueError):
    """A block of collective keys past the end of its range."""


# name -> (first key, keys reserved). One group per edge or pair; the comment says how many
# keys the user takes of its range.
RANGES: dict[str, tuple[int, int]] = {
    # ProcessRing's edges for gradients (rank r -> r + 1): `ranks` keys.
    "ring": (1_000_000, 100_000),
    # GatherBroadcast, the naive all-reduce: a pair (0, r) per rank and one broadcast group.
    "naive": (1_100_000, 100_000),
    # ZeRO's reduce-scatter and all-gather rings: a block of 1000 keys per ring (compile's
    # optimizer's, then each optimizer a custom train_step applies), `ranks` keys of each.
    "zero": (1_200_000, 100_000),
    # Pipeline stage-to-stage links: one per (pipeline, stage boundary).
    "pipeline_links": (1_300_000, 100_000),
    # Pipeline rings averaging a stage's gradients over the pipelines: 1000 keys per stage.
    "pipeline_stage_rings": (1_400_000, 100_000),
    # Local SGD's averaging ring: `ranks` keys.
    "local_sgd": (1_500_000, 100_000),
    # Gossip's directed edges (sender -> receiver): `ranks**2` keys.
    "neighbours": (1_600_000, 100_000),
    # Pipeline rings summing a tied weight's gradient over its holders: 1000 keys per set.
    "pipeline_tied_rings": (1_700_000, 100_000),
    # tools/allreduce_bench.py's use of TensorFlow's own all-reduce, as the baseline.
    "benchmarks": (2_000_000, 100_000),
    # Each MirroredStrategy built in this process, a block of MIRRORED_BLOCK keys: TensorFlow
    # numbers every one's groups from 1, so a second one over another number of devices (a
    # notebook re-run, a test suite) would join the first one's groups.
    "mirrored_strategies": (100_000_000, 2_000_000_000),
}


def group_key_base(name: str) -> int:
    """The first group key of the range `name`."""
    if name not in RANGES:
        raise KeyError(f"No collective key range {name!r}. Known: {', '.join(RANGES)}")
    return RANGES[name][0]


def range_of(name: str) -> range:
    """Every group key `name` may use."""
    first, size = RANGES[name]
    return range(first, first + size)


def block(name: str, index: int, *, size: int) -> int:
    """The first key of block `index` (from 0) of `size` keys in the range `name`."""
    first, reserved = RANGES[name]
    if index < 0 or (index + 1) * size > reserved:
        raise KeyRangeError(
            f"The collective key range {name!r} holds {reserved // size} block(s) of {size} "
            f"keys; block {index} is past its end. Fewer of them per process, or a larger "
            f"range in tfdist/collective/keys.py, would do."
        )
    return first + index * size


_MIRRORED_BUILT = itertools.count()


def next_mirrored_base() -> int:
    """The collective key base of the next MirroredStrategy built in this process."""
    return block("mirrored_strategies", next(_MIRRORED_BUILT), size=MIRRORED_BLOCK) - 1


__all__ = [
    "FIRST_KEY",
    "LAST_KEY",
    "MIRRORED_BLOCK",
    "RANGES",
    "KeyRangeError",
    "block",
    "group_key_base",
    "next_mirrored_base",
    "range_of",
]

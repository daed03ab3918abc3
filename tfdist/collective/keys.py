"""Every collective group-key range tfdist uses, in one table.

TensorFlow's collective ops name a group by an integer key: the members of a group use the
same key, and two groups that share one would mix their transfers. MultiWorkerMirroredStrategy
hands out its own keys counting up from 1, so tfdist's start far above them; each exchange of
tfdist's takes its keys from its own range here, so no two can meet.

    ring = ProcessRing(rank=r, ranks=n, group_key_base=group_key_base("zero"))
"""

from __future__ import annotations

# name -> (first key, keys reserved). One group per edge or pair; the comment says how many
# keys the user takes of its range.
RANGES: dict[str, tuple[int, int]] = {
    # ProcessRing's edges for gradients (rank r -> r + 1): `ranks` keys.
    "ring": (1_000_000, 100_000),
    # GatherBroadcast, the naive all-reduce: a pair (0, r) per rank and one broadcast group.
    "naive": (1_100_000, 100_000),
    # ZeRO's reduce-scatter and all-gather ring: `ranks` keys.
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


__all__ = ["RANGES", "group_key_base", "range_of"]

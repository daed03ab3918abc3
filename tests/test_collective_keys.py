"""Every collective group key tfdist uses comes from one table (tfdist/collective/keys.py),
whose ranges never meet each other or the keys MultiWorkerMirroredStrategy hands out, and
one allocator (`block`) cuts a range into blocks, MirroredStrategy's own keys included."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO
from tfdist.collective import keys
from tfdist.collective.keys import RANGES, group_key_base, range_of

pytestmark = pytest.mark.fast


def test_the_ranges_are_apart_from_each_other_and_from_tensorflow_s_own_keys():
    ranges = sorted((range_of(name) for name in RANGES), key=lambda r: r.start)
    for low, high in zip(ranges, ranges[1:], strict=False):
        assert low.stop <= high.start, (low, high)
    # MultiWorkerMirroredStrategy counts its group keys up from 1, a few per collective;
    # TensorFlow's collective ops take int32 keys.
    assert ranges[0].start >= keys.FIRST_KEY
    assert ranges[-1].stop - 1 <= keys.LAST_KEY


def test_a_block_lies_in_its_range_or_is_refused():
    assert (
        keys.block("pipeline_stage_rings", 3, size=1000)
        == group_key_base("pipeline_stage_rings") + 3000
    )
    blocks = len(range_of("pipeline_stage_rings")) // 1000
    keys.block("pipeline_stage_rings", blocks - 1, size=1000)  # the last one fits
    with pytest.raises(keys.KeyRangeError, match=f"block {blocks} is past its end"):
        keys.block("pipeline_stage_rings", blocks, size=1000)


def test_every_mirrored_strategy_takes_a_block_of_its_own_apart_from_the_exchanges():
    import tfdist

    built = [tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:0"]) for _ in range(12)]
    bases = [s.extended._collective_keys._group_key for s in built]
    # Twelve strategies (the 11th once fell into the ring's range): each in its own block.
    mirrored = range_of("mirrored_strategies")
    assert all(b in mirrored for b in bases), bases
    assert all(b - a >= keys.MIRRORED_BLOCK for a, b in zip(bases, bases[1:], strict=False))


def test_no_group_key_is_written_down_outside_the_table():
    # A literal key of a million or more anywhere else would be a range the table misses.
    literal = re.compile(r"\b\d{1,2}_?\d{3}_?\d{3}\b")
    found = []
    for folder in ("tfdist", "tools"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "keys.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "group_key" in line.lower() and literal.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "group keys outside collective/keys.py:\n" + "\n".join(found)


def test_an_unknown_range_is_named_with_the_known_ones():
    with pytest.raises(KeyError, match="Known: ring, naive, zero"):
        group_key_base("pipelines")

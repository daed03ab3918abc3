"""Every collective group key tfdist uses comes from one table (tfdist/collective/keys.py),
whose ranges never meet each other or the keys MultiWorkerMirroredStrategy hands out."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO
from tfdist.collective.keys import RANGES, group_key_base, range_of

pytestmark = pytest.mark.fast


def test_the_ranges_are_apart_from_each_other_and_from_tensorflow_s_own_keys():
    ranges = sorted((range_of(name) for name in RANGES), key=lambda r: r.start)
    for low, high in zip(ranges, ranges[1:], strict=False):
        assert low.stop <= high.start, (low, high)
    # MultiWorkerMirroredStrategy counts its group keys up from 1, a few per collective.
    assert ranges[0].start >= 1_000_000


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

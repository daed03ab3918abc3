"""tfdist's ring all-reduce: the schedule on paper, then real worker processes against
TensorFlow's own all-reduce for every dtype, awkward lengths and 2, 3 and 4 workers."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.conftest import run_module
from tfdist.collective import all_gather_schedule, chunk_bounds, reduce_scatter_schedule

# Largest difference from TensorFlow's result, relative to the result's magnitude: a few
# units in the last place of each dtype (the ring adds in another order). Integers: exact.
TOLERANCE = {
    "float16": 4e-3,
    "bfloat16": 3e-2,
    "float32": 1e-6,
    "float64": 1e-14,
    "int32": 0,
    "int64": 0,
}


@pytest.mark.parametrize("length", [0, 1, 2, 3, 7, 10, 1001])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_chunks_cover_the_buffer_and_differ_by_at_most_one(length, ranks):
    bounds = chunk_bounds(length, ranks)
    sizes = [end - start for start, end in bounds]
    assert len(bounds) == ranks and sum(sizes) == length
    assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_the_schedule_sums_every_chunk_on_every_rank(ranks):
    """Plays the ring by hand: what each rank sends in a step is what its neighbour expects."""
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 100, size=ranks) for _ in range(ranks)]  # one element per chunk
    held = [list(d) for d in data]
    for schedule, combine in (
        (reduce_scatter_schedule, lambda mine, got: mine + got),
        (all_gather_schedule, lambda mine, got: got),
    ):
        steps = [schedule(r, ranks) for r in range(ranks)]
        for s in range(ranks - 1):
            outgoing = [held[r][steps[r][s][0]] for r in range(ranks)]
            for r in range(ranks):
                sent_by_left, wanted = steps[(r - 1) % ranks][s][0], steps[r][s][1]
                assert sent_by_left == wanted  # the left neighbour sends the chunk r expects
                held[r][wanted] = combine(held[r][wanted], outgoing[(r - 1) % ranks])
    total = np.sum(data, axis=0)
    assert all(list(h) == list(total) for h in held)


def results(stdout: str) -> list[dict]:
    return [
        json.loads(line.split("ALLREDUCE_RESULT ", 1)[1])
        for line in stdout.splitlines()
        if "ALLREDUCE_RESULT " in line
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [2, 3, 4])
def test_ring_matches_tensorflows_all_reduce(workers):
    result = run_module(
        "tools.launch",
        "--workers",
        str(workers),
        "--timeout",
        "240",
        "--",
        sys.executable,
        "-m",
        "tests.workers.allreduce_worker",
    )
    assert result.returncode == 0, result.stdout[-3000:]
    cases = results(result.stdout)
    assert len(cases) == workers * 6 * 6 * 2  # ranks x dtypes x lengths x reductions
    for case in cases:
        assert case["shape_ok"], case
        assert case["diff"] <= TOLERANCE[case["dtype"]] * max(case["scale"], 1.0), case


@pytest.mark.multiprocess
def test_mismatched_shapes_fail_clearly_instead_of_hanging():
    result = run_module(
        "tools.launch",
        "--workers",
        "2",
        "--timeout",
        "150",
        "--",
        sys.executable,
        "-m",
        "tests.workers.allreduce_worker",
        "--mismatch",
    )
    assert "timed out" not in result.stdout
    errors = [case["error"] for case in results(result.stdout)]
    assert any(
        "another rank passed a different shape or dtype (Shape mismatch" in e for e in errors
    ), result.stdout[-3000:]

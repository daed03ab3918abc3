"""tools/harness.py: what the benchmarks share."""

from __future__ import annotations

import pytest

from tools import harness

pytestmark = pytest.mark.fast


def test_a_benchmark_run_again_keeps_every_earlier_run_s_file(tmp_path):
    path = tmp_path / "bench.csv"
    assert harness.keep_earlier(path) is None  # a first run: nothing to keep
    for run in range(3):
        harness.keep_earlier(path)
        harness.write_csv(path, [{"run": run}])
    assert path.read_text().splitlines() == ["run", "2"]
    assert (tmp_path / "bench.1.csv").read_text().splitlines() == ["run", "0"]
    assert (tmp_path / "bench.2.csv").read_text().splitlines() == ["run", "1"]

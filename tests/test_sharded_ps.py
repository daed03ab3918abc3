"""Variables split across ps tasks train under parameter_server (issue 19), with real processes.

One worker keeps the order of the updates fixed, so a model whose embedding table and Dense
kernel are split over 2 or 3 ps must end with exactly the weights of the same model on one
ps with whole variables, for each optimizer.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.conftest import run_module

pytestmark = pytest.mark.multiprocess

SHARD_BYTES = 16 * 1024


def launch(ps: int, shard_bytes: int, out) -> str:
    result = run_module(
        "tools.launch", "--chief", "--workers", "1", "--ps", str(ps), "--timeout", "240", "--",
        sys.executable, "-m", "tests.workers.sharded_worker", str(shard_bytes), str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stdout
    return result.stdout


def weights(out, name: str) -> list[np.ndarray]:
    arrays = np.load(out / f"{name}.npz")
    return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    launch(1, 0, out)
    return out


@pytest.mark.parametrize("ps", [2, 3])
def test_sharded_variables_train_to_the_weights_of_whole_ones(reference, tmp_path, ps):
    launch(ps, SHARD_BYTES, tmp_path)
    for name in ("sgd_momentum", "adam", "rmsprop", "adagrad"):
        written = json.loads((tmp_path / f"{name}.json").read_text())
        table = written["variables"]["model/table/embeddings"]
        kernel = written["variables"]["model/hidden/kernel"]
        # The partitioner split both across every ps, in row blocks, one per ps.
        assert [s["shape"][0] for s in table] == [1000 // ps + (i < 1000 % ps) for i in range(ps)]
        assert len(kernel) == ps and sum(s["shape"][0] for s in kernel) == 64
        assert sorted(s["device"].split("/")[3] for s in table) == [f"task:{i}" for i in range(ps)]
        # The optimizer's state is per shard, on the ps that holds the shard.
        for i, shard in enumerate(table):
            slots = [
                d
                for p, d in written["slots"].items()
                if p.startswith(f"{written['optimizer']}/embeddings_shard_{i}_")
            ]
            assert slots and all(d == shard["device"] for d in slots), written["slots"]
        diff = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(weights(tmp_path, name), weights(reference, name), strict=True)
        )
        assert diff <= 1e-5, (name, diff)
        assert (
            written["history"]["loss"]
            == json.loads((reference / f"{name}.json").read_text())["history"]["loss"]
        )

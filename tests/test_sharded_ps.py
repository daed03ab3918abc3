"""Variables split across ps tasks train under parameter_server (issue 19), with real processes.

One worker keeps the order of the updates fixed, so a model whose embedding table and Dense
kernel are split over 2 or 3 ps must end with exactly the weights of the same model on one
ps with whole variables, for each optimizer (on 3 ps with the user's own strategy and
partitioner, not tfdist's builder); and a job saved with 2 ps that resumes with 3,
or with 1 and whole variables, must continue as that reference did.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.conftest import run_module, run_python

pytestmark = pytest.mark.multiprocess

SHARD_BYTES = 16 * 1024


def launch(ps: int, shard_bytes: int | str, out, *resume_from) -> str:
    result = run_module(
        "tools.launch", "--chief", "--workers", "1", "--ps", str(ps), "--timeout", "240", "--",
        sys.executable, "-m", "tests.workers.sharded_worker", str(shard_bytes), str(out),
        *map(str, resume_from),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stdout
    return result.stdout


def weights(out, name: str) -> list[np.ndarray]:
    arrays = np.load(out / f"{name}.npz")
    return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def largest_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def history(out, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())["history"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    launch(1, 0, out)
    return out


@pytest.fixture(scope="module")
def on_two_ps(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ps")
    launch(2, SHARD_BYTES, out)
    return out


@pytest.mark.xdist_group("sharded_ps_two_ps")
@pytest.mark.parametrize("ps", [2, 3])
def test_sharded_variables_train_to_the_weights_of_whole_ones(
    reference, on_two_ps, tmp_path_factory, ps
):
    if ps == 2:
        tmp_path = on_two_ps
    else:
        # Built by the user (TensorFlow's tutorial's way), not tfdist: their own partitioner.
        tmp_path = tmp_path_factory.mktemp(f"ps{ps}")
        launch(ps, f"own:{SHARD_BYTES}", tmp_path)
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
        diff = largest_difference(weights(tmp_path, name), weights(reference, name))
        assert diff <= 1e-5, (name, diff)
        assert written["history"]["loss"] == history(reference, name)["loss"]


@pytest.mark.xdist_group("sharded_ps_two_ps")
@pytest.mark.parametrize("ps", [1, 3])
def test_a_job_saved_with_two_ps_resumes_with_another_number(reference, on_two_ps, tmp_path, ps):
    # Saved after the first epoch with 2 ps; resumed with 3 ps, or 1 ps and whole variables.
    launch(ps, SHARD_BYTES if ps > 1 else 0, tmp_path, on_two_ps)
    for name in ("sgd_momentum", "adam"):
        # The backup (.weights.h5) restored weights and optimizer state: only the second
        # epoch ran, and it ended where the uninterrupted reference did.
        assert history(tmp_path, name)["loss"] == history(reference, name)["loss"][1:]
        diff = largest_difference(weights(tmp_path, name), weights(reference, name))
        assert diff <= 1e-5, (name, diff)
        # The tf.train.Checkpoint (the binary's) restored the first epoch's weights and
        # optimizer state whole, as the reference held them then.
        restored = weights(tmp_path, f"{name}.restored")
        assert len(restored) > len(weights(reference, name))  # optimizer state included
        assert largest_difference(restored, weights(reference, f"{name}.epoch1")) <= 1e-6


@pytest.mark.xdist_group("sharded_ps_two_ps")
def test_the_exported_model_holds_whole_tensors_and_loads_without_tfdist(on_two_ps):
    # The sharded run's model, saved with model.save, in a process that never imports tfdist.
    script = (
        "import sys, keras, numpy as np\n"
        f"model = keras.saving.load_model({str(on_two_ps / 'sgd_momentum.keras')!r})\n"
        "assert not any(m.startswith('tfdist') for m in sys.modules)\n"
        f"np.savez({str(on_two_ps / 'loaded.npz')!r}, *[w.numpy() for w in model.trainable_weights])\n"
        "print(model.get_layer('table').embeddings.shape)\n"
    )
    result = run_python([sys.executable, "-c", script], timeout=120, fresh=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(1000, 16)" in result.stdout
    assert largest_difference(weights(on_two_ps, "loaded"), weights(on_two_ps, "sgd_momentum")) == 0


@pytest.mark.xdist_group("sharded_ps_two_ps")
def test_an_optimizer_that_needs_whole_variables_is_refused_with_the_fix(on_two_ps):
    refused = json.loads((on_two_ps / "refused.json").read_text())
    # keras's Lamb scales each update by the variable's whole norm; clipnorm clips by it.
    assert refused["lamb"].startswith(
        "model/table/embeddings (64,000 bytes) is split across the ps tasks in shards of up to "
        "32,000 bytes, and Lamb updates each variable from all of its values"
    ), refused
    assert "--ps_min_shard_bytes) above 64000" in refused["lamb"]
    assert "Use global_clipnorm or clipvalue instead of clipnorm" in refused["clipnorm"]

"""tfdist.ray: tfdist.fit as the loop of Ray Train's TensorflowTrainer, on a real local Ray cluster.

One training function (tests/workers/ray_worker.py) runs in 2 processes of tfdist's own
launcher and in a TensorflowTrainer with 2 workers on a Ray cluster this test starts on this
machine (`ray.init()`); both must train the same weights. A run whose worker is killed is
restarted by Ray and resumes from the checkpoint tfdist.ray reported, to the same weights
again. Ray Data shards feed the workers too.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import numpy as np
import pytest

from tests.conftest import run_module

ray = pytest.importorskip("ray", reason='tfdist.ray needs Ray Train: pip install "tfdist[ray]"')
pytest.importorskip("ray.train", reason='tfdist.ray needs Ray Train: pip install "tfdist[ray]"')

import tfdist.ray  # noqa: E402
from tests.workers import ray_worker  # noqa: E402
from tfdist.training.fit_data import FitError  # noqa: E402

# Ray Data's context warns of its own deprecated settings when the trainer sets it up.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"),
]

WEIGHTS_TOLERANCE = 1e-5
WORKERS = ("worker_0", "worker_1")


def written(out, task: str) -> tuple[list[np.ndarray], dict]:
    arrays = np.load(os.path.join(out, f"{task}.npz"))
    weights = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    with open(os.path.join(out, f"{task}.json")) as f:
        return weights, json.load(f)


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster on this machine: 2 CPUs for the 2 training workers, no dashboard.

    ray.init installs its own SIGTERM and SIGINT handlers in this (the pytest) process and
    leaves them after shutdown; they are put back, so later tests see the process as it was.
    """
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    ray.init("local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """What the 2 workers of tfdist's launcher trained with ray_worker.train_loop."""
    out = tmp_path_factory.mktemp("launched")
    result = run_module(
        "tools.launch", "--workers", "2", "--timeout", "200", "--",
        sys.executable, "-m", "tests.workers.ray_worker", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return {task: written(out, task) for task in WORKERS}


def train_on_ray(loop, config: dict, storage, *, max_failures: int = 0, datasets=None):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    trainer = TensorflowTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="run",
            storage_path=str(storage),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
        datasets=datasets,
    )
    return trainer.fit()


@pytest.mark.xdist_group("ray_cluster")
@pytest.mark.multiprocess
def test_ray_train_trains_the_weights_of_tfdists_launcher(ray_cluster, launched, tmp_path):
    out = tmp_path / "out"
    result = train_on_ray(ray_worker.train_loop, {"out": str(out)}, tmp_path / "storage")
    reference, launched_logs = launched["worker_0"]
    assert max_diff(launched["worker_1"][0], reference) == 0.0  # the launcher's workers agree
    for task in WORKERS:
        weights, logs = written(out, task)
        assert max_diff(weights, reference) <= WEIGHTS_TOLERANCE, task
        assert logs["epochs"] == [0, 1, 2, 3]
        np.testing.assert_allclose(logs["loss"], launched_logs["loss"], atol=1e-4)
    # Every epoch was reported with a checkpoint; the last is the result's.
    assert result.metrics["epoch"] == ray_worker.EPOCHS
    assert result.metrics["loss"] == pytest.approx(launched_logs["loss"][-1], abs=1e-4)
    assert len(result.best_checkpoints) == ray_worker.EPOCHS
    with result.checkpoint.as_directory() as directory:
        # Only worker 0 handed files to Ray (Ray merges every worker's into one directory).
        assert sorted(os.listdir(directory)) == [tfdist.ray.WEIGHTS_FILE, tfdist.ray.STATE_FILE]
        assert tfdist.ray.read_state(directory) == {
            "epoch": ray_worker.EPOCHS,
            "steps_per_epoch": ray_worker.STEPS_PER_EPOCH,
        }
        model = ray_worker.build_model()
        model.optimizer.build(model.trainable_variables)  # its state is in the file too
        model.load_weights(os.path.join(directory, tfdist.ray.WEIGHTS_FILE))
    assert max_diff(model.get_weights(), reference) <= WEIGHTS_TOLERANCE
    steps = ray_worker.EPOCHS * ray_worker.STEPS_PER_EPOCH
    assert int(model.optimizer.iterations.numpy()) == steps


@pytest.mark.xdist_group("ray_cluster")
@pytest.mark.multiprocess
def test_a_run_ray_restarts_resumes_from_its_last_checkpoint(ray_cluster, launched, tmp_path):
    """worker_1 is SIGKILLed as epoch 3 begins; Ray restarts both workers from epoch 2's checkpoint."""
    out, marker = tmp_path / "out", tmp_path / "killed"
    kill = {"task": "worker_1", "epoch": 2, "marker": str(marker)}
    result = train_on_ray(
        ray_worker.train_loop, {"out": str(out), "kill": kill}, tmp_path / "storage",
        max_failures=1,
    )  # fmt: skip
    assert marker.exists()  # the kill happened
    reference, _ = launched["worker_0"]
    for task in WORKERS:
        weights, logs = written(out, task)
        assert logs["epochs"] == [2, 3], task  # resumed after epoch 2, not from scratch
        # Weights, Adam's state and the data position were all restored.
        assert max_diff(weights, reference) <= WEIGHTS_TOLERANCE, task
    assert result.metrics["epoch"] == ray_worker.EPOCHS


@pytest.mark.xdist_group("ray_cluster")
@pytest.mark.multiprocess
def test_ray_data_shards_feed_the_workers(ray_cluster, tmp_path):
    x, y = ray_worker.examples()
    rows = ray.data.from_items([{"x": x[i], "y": int(y[i])} for i in range(len(y))])
    out = tmp_path / "out"
    result = train_on_ray(
        ray_worker.train_on_ray_data, {"out": str(out)}, tmp_path / "storage",
        datasets={"train": rows},
    )  # fmt: skip
    (weights_0, logs_0), (weights_1, logs_1) = (written(out, task) for task in WORKERS)
    assert max_diff(weights_0, weights_1) == 0.0  # one model, trained in sync
    # Each worker read its half (128 rows) in per-replica batches of 16, once an epoch.
    steps = 2 * (len(y) // 2) // (ray_worker.GLOBAL_BATCH // 2)
    assert logs_0["steps"] == logs_1["steps"] == steps
    assert logs_0["loss"][1] < logs_0["loss"][0]
    assert result.metrics["epoch"] == 2


# --- mistakes, without a Ray cluster ------------------------------------------------------------


def test_a_model_instead_of_a_builder_is_refused_in_one_line():
    model = ray_worker.build_model()
    with pytest.raises(FitError, match=r"takes a function that builds and compiles the model"):
        tfdist.ray.fit(model, ray_worker.make_dataset)


def test_checkpoint_every_must_be_a_count():
    with pytest.raises(
        FitError, match=r"checkpoint_every must be a whole number.*Received: checkpoint_every=-1"
    ):
        tfdist.ray.fit(ray_worker.build_model, ray_worker.make_dataset, checkpoint_every=-1)


def test_a_dataset_shard_needs_a_ray_train_worker():
    data = tfdist.ray.dataset_shard(
        "train", feature_columns="x", label_columns="y", global_batch_size=32
    )
    with pytest.raises(FitError, match=r"exists only inside a Ray Train worker"):
        tfdist.ray.fit(ray_worker.build_model, data, strategy="one_device")


def test_a_checkpoint_of_another_program_is_named(tmp_path):
    (tmp_path / "model.pt").write_text("")
    with pytest.raises(
        FitError, match=r"is not one of tfdist.ray.fit's.*Received: files \['model.pt'\]"
    ):
        tfdist.ray.read_state(str(tmp_path))


def test_outside_ray_it_is_tfdist_fit():
    history = tfdist.ray.fit(
        ray_worker.build_model, ray_worker.make_dataset, strategy="one_device",
        epochs=2, steps_per_epoch=3, verbose=0,
    )  # fmt: skip
    assert history.epoch == [0, 1]
    assert int(history.model.optimizer.iterations.numpy()) == 6

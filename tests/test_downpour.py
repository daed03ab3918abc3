"""Downpour's model-parallel replicas (tfdist/parallel/pipeline/downpour.py): under parameter-server
training each worker's replica is cut into stages over that worker's 2 logical devices.

With one worker (and 2 ps) the replica trains as the unsplit model does under Keras's own fit
on one device, for 1F1B, GPipe and the interleaved schedule, and over two fits as over Keras's
two (tests/workers/downpour_worker.py one); with 3 workers it trains asynchronously against the 2 ps, and a replica wider than a
worker's devices is refused with one message (many).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import pipeline_cases, test_optimizer_changes
from tests.conftest import launch_downpour
from tests.workers.downpour_worker import CALLBACK_CASES, CASES, FITS

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("downpour")]


@pytest.fixture
def one_worker(downpour_one_worker):
    return downpour_one_worker


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_split_replica_under_one_ps_worker_trains_as_the_unsplit_model(one_worker, case):
    expected, history = pipeline_cases.reference(fits=FITS.get(case, 1))
    arrays = np.load(one_worker / f"{case}.npz")
    got = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    record = json.loads((one_worker / f"{case}.json").read_text())
    np.testing.assert_allclose(record["history"]["loss"], history["loss"], rtol=1e-5)
    # The program asked for both of the worker's devices: the stages are split over them.
    stage_devices = {d.rsplit("/", 1)[-1] for d in record["devices"] if "device:" in d}
    assert {"device:CPU:0", "device:CPU:1"} <= stage_devices, record["devices"]


@pytest.mark.parametrize("case", sorted(CALLBACK_CASES))
def test_every_callback_s_rate_reaches_the_parameter_servers_as_keras_applies_it(one_worker, case):
    """LearningRateScheduler, ReduceLROnPlateau and a callback assigning the rate, with the
    step count read at each epoch's end: the ps replica, plain and split, as Keras's own fit
    with the same callbacks on one device (batch-level callbacks run as steps are
    scheduled under parameter_server: the README says so)."""
    want, history, steps = test_optimizer_changes.reference(
        None, test_optimizer_changes.epoch_callbacks
    )
    arrays = np.load(one_worker / f"{case}.npz")
    got = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(want, got, strict=True))
    assert diff <= test_optimizer_changes.TOLERANCE, f"{case}: max |dw| {diff:.2e}"
    record = json.loads((one_worker / f"{case}.json").read_text())
    assert record["history"]["learning_rate"] == pytest.approx(history["learning_rate"], rel=1e-6)
    assert record["history"]["loss"] == pytest.approx(history["loss"], abs=1e-5)
    assert record["steps"] == steps


def test_split_replicas_train_asynchronously_on_three_workers_and_two_ps(tmp_path):
    launch_downpour(tmp_path, 3, "many")
    history = json.loads((tmp_path / "many.json").read_text())["history"]
    assert history["loss"][-1] < 0.9 * history["loss"][0], history
    assert max(history["staleness_max"]) >= 1, history  # three workers in flight at once
    refused = json.loads((tmp_path / "refused.json").read_text())["error"]
    assert refused.startswith("Each worker's replica is split over 3 devices"), refused
    assert "worker:0 2 CPU" in refused and "configure_cpu_devices(3)" in refused, refused

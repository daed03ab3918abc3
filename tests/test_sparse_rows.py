"""Sparse rows across worker processes: every path on which an Embedding's looked-up rows
cross between processes trains keras-hub's causal LMs as Keras's fit on one device does.

A token repeated within a batch gives one device's tape a row per occurrence, and Adam
squares each row apart, so rows summed into a dense gradient anywhere on the way train
differently (a 2-stage pipeline over 2 processes did: 3.3e-2 on Mistral, whose untied
tables both stages hold but only one reads). One job of 2 worker processes trains every run
of tests/workers/sparse_rows_worker.py; the parameter-server paths (a plain replica, and
Downpour's split one) run in the shared Downpour job; a 2 x 2 pipeline in tests/test_pipeline.py's
four-process job.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from tests.workers import downpour_worker, sparse_rows_worker
from tfdist.parallel.pipeline.stages import split
from tfdist.parallel.pipeline.tied import shared
from tools import keras_hub_models

pytest.importorskip("keras_hub")

TOLERANCE = 1e-5


@functools.cache
def reference(model: str, optimizer: str) -> tuple[list[np.ndarray], dict]:
    """Keras's own fit on one device: (weights, history)."""
    built = sparse_rows_worker.build(model, optimizer)
    history = built.fit(keras_hub_models.token_data(), verbose=0, shuffle=False).history
    return built.get_weights(), history


def max_diff(want, got) -> float:
    assert [w.shape for w in want] == [g.shape for g in got]
    return max(float(np.max(np.abs(w - g))) for w, g in zip(want, got, strict=True))


def written(here, task: str) -> tuple[list[np.ndarray], dict]:
    arrays = np.load(here / f"{task}.npz")
    return [arrays[f"arr_{i}"] for i in range(len(arrays.files))], json.loads(
        (here / f"{task}.json").read_text()
    )


@pytest.fixture
def two_workers(sparse_rows_job):
    return sparse_rows_job


@pytest.mark.multiprocess
@pytest.mark.xdist_group("sparse_rows")
@pytest.mark.parametrize(
    "run", sparse_rows_worker.RUNS, ids=lambda run: sparse_rows_worker.run_name(*run)
)
def test_rows_repeated_in_a_batch_cross_processes_as_one_device_keeps_them(two_workers, run):
    """The pipeline (2 stages over the 2 processes), plain data parallelism, zero1, zero2,
    zero3 and local SGD: both workers end with one device's weights and log its loss."""
    out, _ = two_workers
    want, history = reference(run[0], run[2])
    for task in ("worker_0", "worker_1"):
        got, logs = written(out / sparse_rows_worker.run_name(*run), task)
        assert max_diff(want, got) <= TOLERANCE, task
        assert logs["loss"] == pytest.approx(history["loss"], abs=1e-5), task


@pytest.mark.multiprocess
@pytest.mark.xdist_group("sparse_rows")
def test_the_log_calls_tied_only_weights_that_several_stages_read(two_workers):
    _, stdout = two_workers
    assert "(tied)" not in stdout
    assert (
        "read by one stage only (not tied), are held by each stage that calls the layer, and "
        "take the reading stage's gradient: token_embedding/embeddings (read by stage 0), "
        "token_embedding/reverse_embeddings (read by stage 1)"
    ) in stdout


@pytest.mark.multiprocess
@pytest.mark.xdist_group("downpour")
@pytest.mark.parametrize("case", sorted(downpour_worker.SPARSE_ROWS_CASES))
def test_rows_reach_the_parameter_servers_as_one_device_applies_them(downpour_one_worker, case):
    """Under parameter_server with one worker (updates in order): the plain replica's rows,
    and Downpour's split replica's (summed over its stages in the worker), applied on the ps."""
    want, history = reference("mistral", "adam")
    got, record = written(downpour_one_worker, case)
    assert max_diff(want, got) <= TOLERANCE
    assert record["history"]["loss"] == pytest.approx(history["loss"], abs=1e-5)


@pytest.mark.parametrize(
    "build, expected",
    [
        # Untied: the lookup table read by the first stage, the logits' table by the last.
        (
            keras_hub_models.mistral_causal_lm,
            {"embeddings": ((0,), True), "reverse_embeddings": ((1,), False)},
        ),
        # Tied: one table, looked up by the first stage and read dense by the last.
        (keras_hub_models.gemma_causal_lm, {"embeddings": ((0, 1), False)}),
    ],
    ids=["mistral", "gemma"],
)
def test_the_stages_probe_says_which_stage_reads_a_shared_weight_and_how(build, expected):
    model = build()
    cut = {"mistral": "transformer_layer_1", "gemma": "decoder_block_1"}[
        "mistral" if "Mistral" in type(model).__name__ else "gemma"
    ]
    stages = split(model, [f"{model.backbone.name}/{cut}"])
    found = {
        model.trainable_variables[i].name: (s.users, s.rows) for i, s in shared(stages).items()
    }
    assert found == expected
    assert all(s.holders == (0, 1) for s in shared(stages).values())

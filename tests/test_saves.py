"""`model.save` keeps what Keras keeps, under every mode that holds the optimizer's state its own
way: the `.keras` file, loaded by plain Keras in a fresh process without tfdist and trained
on, lands where a run that never stopped lands (Keras's fit on one device).

Under zero1, zero2 and zero3 the user's optimizer held no slots (they live in slices), and
Keras's save wrote its two variables: loaded, Adam restarted from zero moments at step 0
(4.9e-2 from the unbroken run after one more epoch). Tensor parallelism by a layout map
(each replica's parts updated by its own copy of the optimizer) is held to the same.
"""

from __future__ import annotations

import json
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests import pipeline_cases
from tests.conftest import run_python
from tests.workers import sparse_rows_worker
from tfdist.parallel import Pipeline, tensor_parallel
from tools import keras_hub_models

MODES = ["zero1", "zero2", "zero3", "pipeline", "tensor"]
TOLERANCE = 1e-5

# Run in a fresh interpreter: load each file with Keras alone, train one more epoch as
# Keras's fit does, and write the weights and the optimizer's step count.
_TRAIN_ON = textwrap.dedent(
    """
    import json, sys
    import keras, numpy as np
    from tests import pipeline_cases
    out = {}
    for path in sys.argv[1:]:
        model = keras.saving.load_model(path)
        steps = int(model.optimizer.iterations.numpy())
        model.fit(pipeline_cases.data(), epochs=1, verbose=0, shuffle=False)
        np.savez(path + ".npz", *model.get_weights())
        out[path] = {"steps_when_loaded": steps}
    assert not [m for m in sys.modules if m.split(".")[0] == "tfdist"], "tfdist was imported"
    print(json.dumps(out))
    """
)


def mirrored(devices: int = 2) -> tf.distribute.MirroredStrategy:
    """tfdist's (each strategy its own collective keys: raw MirroredStrategies in one process
    share them, and a gather after another strategy's all-reduce of the same key aborts)."""
    return tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(devices)]
    )


def saved_after_one_epoch(mode: str, path) -> None:
    strategy = mirrored()
    keywords: dict = {}
    if mode == "pipeline":
        keywords["pipeline"] = Pipeline(cut_before=pipeline_cases.CUTS[2], micro_batches=2)
    elif mode != "tensor":
        keywords["shard_optimizer"] = mode
    hosted = mode in ("zero3", "pipeline", "tensor")
    with tfdist.host_scope(strategy) if hosted else strategy.scope():
        model = pipeline_cases.mlp()
    if mode == "tensor":  # d3 by its columns, d4 by its rows: Keras's layers, split by a map
        mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], ["cpu:0", "cpu:1"])
        layout = keras.distribution.LayoutMap(mesh)
        # A Sequential's weight paths start with its name ("sequential/d3/kernel").
        layout[".*d3/kernel"], layout[".*d4/kernel"] = (None, "model"), ("model", None)
        tensor_parallel(model, layout_map=layout)
    tfdist.fit(model, pipeline_cases.data(), verbose=0, **keywords)
    model.save(path)


@pytest.fixture(scope="module")
def trained_on(tmp_path_factory):
    """{mode: (weights after one more epoch of plain Keras, what the loader saw)}."""
    out = tmp_path_factory.mktemp("saves")
    paths = {mode: str(out / f"{mode}.keras") for mode in MODES}
    for mode, path in paths.items():
        saved_after_one_epoch(mode, path)
    result = run_python([sys.executable, "-c", _TRAIN_ON, *paths.values()], fresh=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    found = {}
    for mode, path in paths.items():
        arrays = np.load(path + ".npz")
        found[mode] = ([arrays[f"arr_{i}"] for i in range(len(arrays.files))], seen[path])
    return found


@pytest.mark.xdist_group("saves_trained_on")  # trained_on's jobs run once
@pytest.mark.parametrize("mode", MODES)
def test_a_save_loaded_by_keras_alone_trains_on_as_a_run_that_never_stopped(trained_on, mode):
    want, _ = pipeline_cases.reference(fits=2)
    got, seen = trained_on[mode]
    assert seen["steps_when_loaded"] == pipeline_cases.STEPS
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(want, got, strict=True)) <= TOLERANCE


@pytest.mark.multiprocess
@pytest.mark.xdist_group("sparse_rows")
@pytest.mark.parametrize("mode", sparse_rows_worker.SAVED)
def test_a_save_made_by_two_worker_processes_trains_on_as_a_run_that_never_stopped(
    sparse_rows_job, mode
):
    """keras-hub's Mistral (Llama for the pipeline) trained by 2 worker processes (the slices
    gathered from both for the save), read by Keras into a freshly compiled model and trained
    one more epoch by Keras's fit, against two epochs of Keras's fit on one device.
    (keras-hub's CausalLM overrides compile, so Keras's load_model skips the optimizer of
    any save, Keras's own too; `load_weights` of the .keras file restores it.)"""
    pytest.importorskip("keras_hub")
    out, _ = sparse_rows_job
    model_name = "llama" if mode == "pipeline" else "mistral"
    folder = out / sparse_rows_worker.run_name(model_name, mode, "adam")
    loaded = sparse_rows_worker.build(model_name, "adam")
    loaded.optimizer.build(loaded.trainable_variables)
    loaded.load_weights(folder / "worker_0.keras")
    steps = keras_hub_models.EXAMPLES // keras_hub_models.GLOBAL_BATCH
    assert int(loaded.optimizer.iterations.numpy()) == steps
    loaded.fit(keras_hub_models.token_data(), verbose=0, shuffle=False)
    reference = sparse_rows_worker.build(model_name, "adam")
    reference.fit(keras_hub_models.token_data(), epochs=2, verbose=0, shuffle=False)
    got, want = loaded.get_weights(), reference.get_weights()
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(want, got, strict=True)) <= TOLERANCE

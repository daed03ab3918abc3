"""What each device holds during fit: the bytes of the variables on it, counted by
tfdist.DeviceBytes, against the share each layout promises (Adam: weights and 2 slots).

plain data parallelism   3 W on every device
zero1 / zero2            W + 3 W / N (the whole weights, 1/N of a weight copy and the slots)
zero3                    3 W / N (1/N of the weights and of the slots; the whole on the host)
tensor parallelism       3 (U + S / T): the weights it leaves whole (U) and its 1/T of those
                         it splits (S); keras-hub's Gemma split by its own layout map is
                         counted in tests/test_tensor.py, during the fit held against Keras's
"""

from __future__ import annotations

import gc

import keras
import numpy as np
import pytest

import tfdist
from tests.conftest import collect_everything
from tfdist.parallel import tensor_parallel
from tfdist.training.memory import device_name, variable_bytes

# Extras (iteration counters, the learning rate, metric totals) are under 1% of these
# models; the issue allows 15%.
TOLERANCE = 0.05


@pytest.fixture(autouse=True)
def _earlier_tests_variables_freed():
    """Frees what earlier tests in this process left for the garbage collector (a model's
    variables in a reference cycle), frozen ones too (the harness freezes what survives
    between tests: tests/conftest.py), so none is freed during a count and taken off it."""
    collect_everything()


def mirrored(devices: int):
    return tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(devices)]
    )


def mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256),
            keras.layers.Dense(10),
        ]
    )


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 64)).astype("float32"), rng.integers(0, 10, size=64)


def weight_bytes(model) -> int:
    return sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in model.get_weights())


def held_during_fit(strategy, build, **keywords) -> tuple[dict[str, int], keras.Model]:
    record = tfdist.DeviceBytes()
    with strategy.scope():
        model = build()
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    x, y = data()
    tfdist.fit(model, x, y, batch_size=16, verbose=0, callbacks=[record], **keywords)
    return record.added, model


def test_device_names_are_short_for_this_process_and_keep_the_task_for_others():
    assert device_name("/job:localhost/replica:0/task:0/device:CPU:1") == "CPU:1"
    assert device_name("/job:worker/replica:0/task:2/device:GPU:0") == "/job:worker/task:2/GPU:0"
    assert device_name("") == "CPU:0"


def test_a_variable_counts_on_its_device_and_a_mirrored_one_on_each_of_its_devices():
    strategy = mirrored(2)
    before = variable_bytes()
    with strategy.scope():
        held = keras.Variable(np.zeros((1000,), "float32"))  # noqa: F841 (kept alive)
    after = variable_bytes()
    grown = {d: after.get(d, 0) - before.get(d, 0) for d in after}
    assert grown["CPU:0"] == grown["CPU:1"] == 4000


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("mode", [None, "zero1", "zero2"])
def test_each_device_holds_the_share_of_its_layout(devices, mode):
    held, model = held_during_fit(mirrored(devices), mlp, shard_optimizer=mode)
    weights = weight_bytes(model)
    share = 3.0 if mode is None else 1.0 + 3.0 / devices
    assert sorted(held) == [f"CPU:{i}" for i in range(devices)]
    for device, size in held.items():
        assert size / weights == pytest.approx(share, rel=TOLERANCE), (device, size / weights)


@pytest.mark.parametrize("devices", [2, 4])
def test_zero3_holds_its_slices_and_their_slots_and_drops_the_whole_model(devices):
    """Built under tfdist.host_scope: each replica holds its slice of every weight, 1/N of
    the weights, and the whole model exists nowhere, the host (CPU:0) included. Once fit has
    begun each replica holds 1/N of the weights and of Adam's two slots, 3W/N: zero3 adopts
    the slices host_scope made. Over 2 replicas (CPU:1,2) the host is apart; over 4
    (CPU:0-3) CPU:0 is the host and replica 0 both."""
    replicas = range(1, 3) if devices == 2 else range(4)
    strategy = tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in replicas]
    )  # fmt: skip
    before = variable_bytes()
    with tfdist.host_scope(strategy):
        model = mlp()
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    built = variable_bytes()
    weights = weight_bytes(model)
    for i in range(4):
        share = (built.get(f"CPU:{i}", 0) - before.get(f"CPU:{i}", 0)) / weights
        expected = 1.0 / devices if i in replicas else 0.0
        assert share == pytest.approx(expected, abs=1e-3), ("built", i, share)
    x, y = data()
    tfdist.fit(model, x, y, batch_size=16, verbose=0, shard_optimizer="zero3")
    after = variable_bytes()
    for i in range(4):
        share = (after.get(f"CPU:{i}", 0) - before.get(f"CPU:{i}", 0)) / weights
        expected = 3.0 / devices if i in replicas else 0.0
        assert share == pytest.approx(expected, abs=1e-3), (i, share)
    # And each weight still reads whole, from the slices.
    assert sum(w.nbytes for w in model.get_weights()) == weights


@pytest.mark.parametrize("devices, degree", [(2, 2), (4, 2), (4, 4)])
def test_split_layers_hold_their_part_on_each_device(devices, degree):
    strategy = mirrored(devices)

    def build():
        return tensor_parallel(mlp(), degree=degree)

    held, model = held_during_fit(strategy, build)
    dense = tfdist.parallel.dense_model(model)
    whole = weight_bytes(dense)
    # The first two Dense layers form the split block; the last stays whole.
    kept = sum(w.nbytes for w in dense.layers[-1].get_weights())
    share = 3.0 * (kept + (whole - kept) / degree)
    for device, size in held.items():
        assert size == pytest.approx(share, rel=TOLERANCE), (device, size / whole)


@pytest.mark.parametrize("cuts", [["pipe_2"], ["pipe_1", "pipe_2"]], ids=["2 stages", "3 stages"])
def test_a_pipeline_built_in_its_scope_holds_each_stage_on_its_device(cuts):
    """Under pipeline.scope(strategy), no process keeps the whole model: the host (CPU:0
    here), where it is built, holds nothing after fit; each replica's device (CPU:1...)
    holds 3x its stage (Adam):
    not the mirrored whole model beside it. It trains the weights the same pipeline trains
    built under strategy.scope() (which test_pipeline.py holds to Keras's fit)."""
    from tfdist.parallel import Pipeline

    def build():
        keras.utils.set_random_seed(1)
        layers = [keras.layers.Dense(256, activation="tanh", name=f"pipe_{i}") for i in range(3)]
        model = keras.Sequential([keras.Input((64,)), *layers, keras.layers.Dense(10)])
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
        return model

    stages = len(cuts) + 1
    batch = 8 * stages  # the global batch splits over the replicas, then in 2 micro-batches
    x, y = (a[: 4 * batch] for a in data())
    strategy = tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(1, stages + 1)]
    )
    pipeline = Pipeline(cut_before=cuts, micro_batches=2)
    with strategy.scope():
        mirrored_model = build()
    tfdist.fit(mirrored_model, x, y, batch_size=batch, verbose=0, pipeline=pipeline)
    record = tfdist.DeviceBytes()
    with pipeline.scope(strategy):
        model = build()
    tfdist.fit(model, x, y, batch_size=batch, verbose=0, callbacks=[record], pipeline=pipeline)
    for want, got in zip(mirrored_model.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-7)
    weights = weight_bytes(model)
    held = record.added
    assert held.get("CPU:0", 0) == 0  # the weights moved into the stages; no slot on the host
    layer_bytes = [sum(w.nbytes for w in layer.get_weights()) for layer in model.layers]
    starts = [0, *[[layer.name for layer in model.layers].index(c) for c in cuts], 4]
    for stage in range(stages):
        share = sum(layer_bytes[starts[stage] : starts[stage + 1]])
        got = held[f"CPU:{stage + 1}"]
        assert got == pytest.approx(3.0 * share, rel=TOLERANCE), (stage, got / weights)


def test_gemma_cut_in_two_stages_holds_each_stage_and_the_tied_embedding_on_both():
    """keras-hub's Gemma causal LM in Pipeline.scope over 2 devices, cut before its second
    decoder block: each device holds 3x its stage (Adam), and the embedding tied to the
    logits counts on both (each stage that uses it holds a copy and its slots); the host,
    where it is built, keeps none of it."""
    from tfdist.parallel import Pipeline, split
    from tools import keras_hub_models

    strategy = tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:1", "/cpu:2"])
    record = tfdist.DeviceBytes()  # counts what is made from here on
    with tfdist.host_scope(strategy):
        model = keras_hub_models.gemma_causal_lm()
    cut = [f"{model.backbone.name}/decoder_block_1"]
    pipeline = Pipeline(cut_before=cut, micro_batches=2)
    tfdist.fit(model, keras_hub_models.token_data(), verbose=0, callbacks=[record],
               pipeline=pipeline)  # fmt: skip
    weights = weight_bytes(model)
    trainable = model.trainable_variables
    assert record.added.get("CPU:0", 0) / weights < 0.01  # its seeds, nothing whole
    embedding = model.backbone.token_embedding.embeddings
    for stage in split(model, cut):
        held = [trainable[i] for i in stage.trainable]
        assert any(v is embedding for v in held), stage.index
        share = sum(int(np.prod(v.shape)) * 4 for v in held)
        got = record.added[f"CPU:{stage.index + 1}"]
        assert got == pytest.approx(3.0 * share, rel=TOLERANCE), (stage.index, got / weights)


class _Raises(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise RuntimeError("a callback's own error")


def test_counts_see_variables_made_before_and_during_fit_and_leave_the_collector_as_found():
    """DeviceBytes freezes the objects alive when fit begins out of the collector and counts
    only what fit made, plus the variables alive then: the peak is the model and Adam's
    slots, as a full count says; a fit that raises thaws the collector when the callback
    goes, and a clean one when it ends. A collector frozen before (a forking server's
    imports, this harness's survivors) stays frozen, and its variables are counted."""
    gc.collect()
    frozen_before = gc.get_freeze_count() > 0  # the harness may freeze its own
    record = tfdist.DeviceBytes()
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32)])
    model.compile(keras.optimizers.Adam(), "mse")  # slots made by fit's first step
    x = np.ones((64, 16), "float32")
    tfdist.fit(model, x, np.ones((64, 32), "float32"), batch_size=16, verbose=0,
               callbacks=[record])  # fmt: skip
    assert (gc.get_freeze_count() > 0) == frozen_before
    weights = (16 * 32 + 32) * 4
    assert record.added == {"CPU:0": pytest.approx(3 * weights, abs=64)}  # + Adam's counters
    assert record.peak == variable_bytes()  # a full count after fit: the same variables
    failing = tfdist.DeviceBytes()
    with pytest.raises(RuntimeError, match="a callback's own error"):
        tfdist.fit(model, x, np.ones((64, 32), "float32"), batch_size=16, verbose=0,
                   callbacks=[failing, _Raises()])  # fmt: skip
    assert gc.get_freeze_count() > 0  # fit raised past on_train_end
    del failing
    gc.collect()
    assert (gc.get_freeze_count() > 0) == frozen_before
    # Frozen before the callback is made: the model's variables are still counted.
    gc.freeze()
    try:
        everything = variable_bytes()
        assert everything["CPU:0"] >= 3 * weights
        again = tfdist.DeviceBytes()
        tfdist.fit(model, x, np.ones((64, 32), "float32"), batch_size=16, verbose=0,
                   callbacks=[again])  # fmt: skip
        assert gc.get_freeze_count() > 0
        assert again.peak == variable_bytes() == everything
    finally:
        if not frozen_before:
            gc.unfreeze()


def test_dropped_copies_are_collected_only_where_a_cycle_still_holds_one():
    """host.Dropped: copies freed by reference counting cost no collection; one held in a
    young reference cycle is freed by a collection of the young generations, one in an old
    cycle by a full one; a handle a cycle captured keeps its copy watched; a copy that takes
    no weak reference is collected to be sure."""
    import tensorflow as tf

    from tfdist.parallel.host import Dropped

    made = []  # the generation of each collection made

    def count(phase, info):
        if phase == "stop":
            made.append(info["generation"])

    class Cyclic:
        def __init__(self, value):
            self.value = value
            self.me = self

    enabled = gc.isenabled()
    gc.disable()  # only the collections Dropped makes are counted
    gc.callbacks.append(count)
    try:
        plain, dropped = tf.Variable(tf.zeros([4])), Dropped()
        dropped.add(plain)
        del plain
        dropped.free()
        assert made == []  # freed when dropped: nothing to collect
        cyclic, dropped = Cyclic(tf.Variable(tf.zeros([4]))), Dropped()
        dropped.add(cyclic)
        watched = dropped._copies[0]
        del cyclic
        assert watched() is not None  # alive in its cycle
        dropped.free()
        assert made == [1] and watched() is None  # young: no full collection
        old = Cyclic(tf.Variable(tf.zeros([4])))
        gc.collect()  # it survives into the oldest generation
        made.clear()
        dropped = Dropped()
        dropped.add(old)
        watched = dropped._copies[0]
        del old
        dropped.free()
        assert made == [1, 2] and watched() is None
        # The variable object goes, but a cycle still holds its handle (as a traced function
        # holds what it captured): the handle is watched too.
        variable = tf.Variable(tf.zeros([4]))
        holder, dropped = Cyclic(variable.handle), Dropped()
        dropped.add(variable)
        watched = list(dropped._copies)  # the variable and its handle
        del variable, holder
        assert [copy() is None for copy in watched] == [True, False]
        made.clear()
        dropped.free()
        assert made == [1] and all(copy() is None for copy in watched)
        made.clear()
        dropped = Dropped()
        dropped.add(1.5)  # a float takes no weak reference
        dropped.free()
        assert made == [1, 2]
    finally:
        gc.callbacks.remove(count)
        if enabled:
            gc.enable()

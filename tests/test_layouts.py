"""Layouts that compose: a tensor-parallel layout with its parts sharded (ZeRO) over their
data groups, against Keras's own fit on one device, with the bytes each device holds.

Over a mirrored strategy on 4 logical CPUs: 2-way tensor x 2-way data. A 5-Dense MLP split
by a layout map written as for Keras on JAX, and a keras.io transformer classifier (an embedding
table, attention, an MLP block), trained with Adam by tfdist.fit, called twice as users do.
"""

from __future__ import annotations

import gc

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import FitError
from tfdist.parallel import tensor_parallel
from tfdist.parallel.tensor.layout_map import plan_of

TOLERANCE = 1e-5
FEATURES, CLASSES = 16, 4


def mlp() -> keras.Model:
    """Five Dense layers: two widen-then-narrow blocks and a head, each with a bias."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((FEATURES,))
    x = inputs
    for block in range(2):
        x = keras.layers.Dense(64, activation="relu", name=f"up{block}")(x)
        x = keras.layers.Dense(FEATURES, name=f"down{block}")(x)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(x))
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data() -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, FEATURES)).astype("float32")
    y = (np.abs(x[:, :CLASSES]).argmax(axis=1)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(32)


def mesh():
    devices = [f"cpu:{i}" for i in range(4)]
    return keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)


def mlp_layout():
    """The MLP's map as a user writes one for Keras: Megatron's split, each widening layer
    by its outputs (a column), each narrowing one by its inputs (a row); the head whole."""
    layout = keras.distribution.LayoutMap(mesh())
    layout["up.*/kernel"] = (None, "model")
    layout["down.*/kernel"] = ("model", None)
    return layout


def mirrored():
    return tfdist.build_strategy("mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(4)])


@pytest.fixture(scope="module")
def mlp_reference():
    """Keras's own fit of the MLP on one device, 2 epochs."""
    model = mlp()
    history = model.fit(data(), epochs=2, verbose=0, shuffle=False)
    return model, history.history["loss"]


@pytest.mark.xdist_group("layouts_mlp")  # mlp_reference's fit runs once
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_zero_x_tensor_trains_as_keras_on_one_device_holding_its_share(
    stage, mlp_reference, tmp_path
):
    """2-way tensor x 2-way data, each part's optimizer state (zero1, zero2) or the part
    itself too (zero3) sharded over the replicas that hold it: 2 for a split weight's part,
    all 4 for a weight held whole. fit twice, an epoch each. Each device (CPU:1-3; CPU:0 is
    also the host) holds a quarter of every weight as its slice, with Adam's two slots for
    it; under zero1 and zero2 its parts whole too (what its step reads). model.save writes
    the whole weights and Adam's whole slots, put together from the slices."""
    reference, losses = mlp_reference
    strategy = mirrored()
    gc.collect()
    record = tfdist.DeviceBytes()
    with tfdist.host_scope(strategy):
        model = mlp()
    tensor_parallel(model, layout_map=mlp_layout())
    plan = plan_of(model)
    got = [
        tfdist.fit(model, data(), verbose=0, shard_optimizer=stage, callbacks=[record])
        for _ in range(2)
    ]
    assert [h.history["loss"][0] for h in got] == pytest.approx(losses, abs=1e-5)
    weights = zip(reference.weights, reference.get_weights(), model.get_weights(), strict=True)
    for v, want, have in weights:
        assert np.max(np.abs(want - have)) <= TOLERANCE, v.path

    split, whole = plan.split_bytes(model)
    assert split / (split + whole) > 0.9  # the blocks' kernels: most of the model
    sliced = 3 * (split + whole) / 4  # its slice of each weight and the slice's 2 slots
    share = sliced if stage == "zero3" else sliced + split / 2 + whole
    for device in (1, 2, 3):
        held = record.added[f"CPU:{device}"]
        assert held == pytest.approx(share, rel=0.03), (device, held / share)

    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    for want, got in zip(reference.get_weights(), loaded.get_weights(), strict=True):
        assert np.max(np.abs(want - got)) <= TOLERANCE
    slots = zip(reference.optimizer.variables, loaded.optimizer.variables, strict=True)
    for want, got in slots:
        assert want.path.split("/", 1)[1] == got.path.split("/", 1)[1]  # "adam_3/..."
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-7)

    # Another sharding would start Adam's state afresh: refused, as zero's own modes are.
    other = None if stage == "zero3" else "zero3"
    with pytest.raises(FitError, match=r"held by its tensor-parallel update .* Fit it again"):
        tfdist.fit(model, data(), verbose=0, shard_optimizer=other)

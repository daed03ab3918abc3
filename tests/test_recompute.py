"""Activation recomputation under every layout: tfdist.parallel.recompute_activations (each
layer owning weights, or blocks the user names) and Keras's own RematScope, which on the
TensorFlow backend fails in Keras's fit and which tfdist runs its own way. Each trains as
Keras's fit trains the same model without recomputation on one device, fit called twice.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest

import tfdist
from tfdist.parallel import Pipeline, UnitError, recompute_activations

TOLERANCE = 1e-5


class ResidualBlock(keras.layers.Layer):
    """A keras.io-style subclassed block: two Dense layers, a residual add and a norm."""

    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(2 * width, activation="relu")
        self.outer = keras.layers.Dense(width)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(x + self.outer(self.inner(x)))


def build(remat: str | None = None, layer_names=()) -> keras.Model:
    keras.utils.set_random_seed(0)
    scope = (
        keras.RematScope(mode=remat, layer_names=layer_names) if remat else contextlib.nullcontext()
    )
    with scope:
        inputs = keras.Input((12,))
        x = keras.layers.Dense(16, activation="relu", name="stem")(inputs)
        x = ResidualBlock(16, name="block_0")(x)
        x = ResidualBlock(16, name="block_1")(x)
        outputs = keras.layers.Dense(4, name="head")(x)
        model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(True))
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 12)).astype("float32"), rng.integers(0, 4, 64)


@pytest.fixture(scope="module")
def reference():
    """Keras's fit on one device, no recomputation, called twice."""
    x, y = data()
    model = build()
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    history += model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history["loss"]
    return model.get_weights(), history


def mirrored():
    return tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:1", "/cpu:2"])


LAYOUTS = {
    "plain": {},
    "zero1": {"shard_optimizer": "zero1"},
    "zero3": {"shard_optimizer": "zero3"},
}


def trained(layout: str, make) -> tuple[keras.Model, list[float]]:
    strategy = mirrored()
    scope = tfdist.host_scope(strategy) if layout == "zero3" else strategy.scope()
    with scope:
        model = make()
    x, y = data()
    kwargs = dict(batch_size=16, shuffle=False, verbose=0, **LAYOUTS[layout])
    history = tfdist.fit(model, x, y, epochs=2, **kwargs).history["loss"]
    history += tfdist.fit(model, x, y, epochs=1, **kwargs).history["loss"]
    return model, history


def assert_as_reference(model, history, reference) -> None:
    weights, losses = reference
    assert history == pytest.approx(losses, abs=TOLERANCE)
    for want, got in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=TOLERANCE)


def recomputed(model) -> set[str]:
    """The recomputed layers, a block's own layers named 'block_0.inner' and so on."""
    names = {}
    for block in ("block_0", "block_1"):
        for part in ("inner", "outer", "norm"):
            names[id(getattr(model.get_layer(block), part))] = f"{block}.{part}"
    return {
        names.get(id(layer), layer.name) for layer in tfdist.parallel.zero.units.recomputed(model)
    }


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("units", [None, ["block_0", "block_1"]], ids=["layers", "blocks"])
def test_recomputed_units_train_as_keras_without_them(layout, units, reference):
    def make():
        model = build()
        chosen = recompute_activations(model, units=units)
        assert [u.name for u in chosen][: len(units or [])] == (units or [])
        return model

    model, history = trained(layout, make)
    assert_as_reference(model, history, reference)
    if units:  # the blocks whole, and the layers outside them on their own
        assert recomputed(model) == {"block_0", "block_1", "stem", "head"}
    else:  # each layer owning weights
        assert "block_0.inner" in recomputed(model) and "block_0" not in recomputed(model)


@pytest.mark.parametrize("layout", ["plain", "zero3"])
@pytest.mark.parametrize(
    "mode, names", [("full", ()), ("list_of_layers", ("block_1",))], ids=["full", "named"]
)
def test_keras_remat_scope_trains_in_tfdist_fit_as_keras_without_it(layout, mode, names, reference):
    """Keras's own fit of such a model fails on the TensorFlow backend (its remat is a
    custom gradient with keyword arguments, refused in a graph); tfdist runs the layers
    RematScope marked as its own recomputed units."""
    model, history = trained(layout, lambda: build(mode, names))
    assert_as_reference(model, history, reference)
    if mode == "full":  # the innermost layers marked, each once
        assert {"block_0.inner", "block_1.norm", "stem", "head"} <= recomputed(model)
        assert "block_0" not in recomputed(model)
    else:
        assert "block_1" in recomputed(model)


def test_what_cannot_be_recomputed_is_one_line():
    with pytest.raises(UnitError, match="no layer named 'block_9'"):
        recompute_activations(build(), units=["block_9"])
    with pytest.raises(UnitError, match="holds the unit"):
        model = build()
        recompute_activations(
            model, units=[model.get_layer("block_0"), model.get_layer("block_0").inner]
        )
    keras.utils.set_random_seed(0)
    dropped = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dropout(0.5, name="drop")]
    )
    with pytest.raises(UnitError, match="keeps state its call changes"):
        recompute_activations(dropped, units=["drop"])
    strategy = mirrored()
    with strategy.scope():
        partial = build("activations")
    x, y = data()
    with pytest.raises(UnitError, match=r"RematScope\(mode='activations'\)"):
        tfdist.fit(partial, x, y, batch_size=16, verbose=0)
    # A pipeline's stages call their layers on weight values: not built for it yet.
    with tfdist.host_scope(strategy):
        staged = build()
    recompute_activations(staged)
    pipeline = Pipeline(cut_before=["block_1"], micro_batches=2)
    with pytest.raises(tfdist.FitError, match="A Pipeline does not recompute activations yet"):
        tfdist.fit(staged, x, y, batch_size=16, verbose=0, pipeline=pipeline)

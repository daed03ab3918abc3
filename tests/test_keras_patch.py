"""`tfdist.patch_keras()`: an existing script's model.fit / evaluate / predict train through
tfdist where Keras's own cannot, and Keras's own runs everywhere else.

In this process: central_storage (where Keras's own fit trains the weights but reports wrong
losses) and a model split by tensor parallelism. The multi-worker and parameter-server
tutorials' scripts, with the one line added, run under the launcher in
tests/test_fit_multiworker.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfdist
from tests import fit_models, zero_cases
from tfdist.errors import FitError
from tfdist.parallel import tensor_parallel
from tfdist.strategies import keras_guard

TOLERANCE = 1e-6


@pytest.fixture
def patched():
    tfdist.patch_keras()
    yield
    tfdist.patch_keras(False)


def central_storage():
    return tfdist.build_strategy("central_storage", cluster=None)


def mirrored():
    return tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:0", "/cpu:1"])


def test_without_the_line_keras_s_fit_under_central_storage_is_one_line_naming_the_fix():
    with central_storage().scope():
        model, data = fit_models.CASES["cnn"]()
    for call in (lambda: model.fit(data, verbose=0), lambda: model.evaluate(data, verbose=0)):
        with pytest.raises(FitError) as raised:
            call()
        message = str(raised.value)
        assert "central_storage" in message and "tfdist.patch_keras()" in message
        assert "\n" not in message
    # Keras's own predict is right there: it runs.
    assert model.predict(data, verbose=0).shape == (fit_models.EXAMPLES, 10)


def test_with_the_line_fit_evaluate_and_predict_are_tfdist_s(patched):
    """Positional arguments as Keras takes them; the same weights, history, evaluation and
    predictions as tfdist's own calls on a model made the same way."""
    strategy = central_storage()
    with strategy.scope():
        model, data = fit_models.CASES["two_heads"]()
        twin, _ = fit_models.CASES["two_heads"]()
    history = model.fit(data, None, None, 2, 0)  # x, y, batch_size, epochs, verbose
    want = tfdist.fit(twin, data, epochs=2, verbose=0)
    assert zero_cases.max_diff(model.get_weights(), twin.get_weights()) <= TOLERANCE
    assert history.history == pytest.approx(want.history)
    got = model.evaluate(data, verbose=0, return_dict=True)
    assert got == pytest.approx(tfdist.evaluate(twin, data, verbose=0, return_dict=True))
    inputs = data.map(lambda x, *_: x)
    for a, b in zip(
        keras.tree.flatten(model.predict(inputs, verbose=0)),
        keras.tree.flatten(tfdist.predict(twin, inputs, verbose=0)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)


def test_with_the_line_keras_s_own_fit_runs_where_it_can(patched):
    """Under mirrored Keras's own fit trains: nothing is routed (Keras's fit returns its own
    History with the progress it keeps; tfdist's is equal but another object), unless the
    call names one of tfdist's modes."""
    strategy = mirrored()
    with strategy.scope():
        model, data = fit_models.CASES["regularised"]()
    assert keras_guard.why_not_keras(model) is None
    history = model.fit(data, epochs=1, verbose=0)
    assert history is model.history  # Keras's fit keeps its History on the model
    with strategy.scope():
        sharded, _ = fit_models.CASES["regularised"]()
        plain, _ = fit_models.CASES["regularised"]()
    model_history = sharded.fit(data, epochs=2, verbose=0, shard_optimizer="zero2")
    tfdist.fit(plain, data, epochs=2, verbose=0)
    assert len(model_history.history["loss"]) == 2
    assert zero_cases.max_diff(sharded.get_weights(), plain.get_weights()) <= 1e-5


def test_a_split_model_s_keras_fit_names_the_fix_and_trains_through_the_line():
    keras.utils.set_random_seed(0)
    whole = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)]
    )
    strategy = mirrored()
    with strategy.scope():
        model = tensor_parallel(whole, degree=2)
        model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = x[:, :4] * 2
    with pytest.raises(FitError, match=r"split by tfdist.*tfdist\.patch_keras\(\)"):
        model.fit(x, y, batch_size=16, verbose=0)
    tfdist.patch_keras()
    try:
        losses = model.fit(x, y, batch_size=16, epochs=3, verbose=0).history["loss"]
    finally:
        tfdist.patch_keras(False)
    assert losses[-1] < losses[0]


def test_a_mode_on_evaluate_is_refused_in_one_line(patched):
    with central_storage().scope():
        model, data = fit_models.CASES["cnn"]()
    with pytest.raises(FitError, match="model.evaluate takes none of tfdist's modes"):
        model.evaluate(data, shard_optimizer="zero2")

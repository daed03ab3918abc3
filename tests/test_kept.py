"""The traced step kept on the model across calls (tfdist/training/kept.py), as Keras keeps
`model.train_function`: a second fit, an evaluate and a predict trace nothing new; a
recompile, batches of another shape and another shard_optimizer each trace again.

Traces are counted by a layer that counts its calls inside a traced function (Python runs
only while tracing), over 2 replicas of a mirrored strategy (each replica's trace calls it).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist

pytestmark = pytest.mark.slow


class Counting(keras.layers.Layer):
    """Counts the traces that call it (not Keras's symbolic builds, not eager calls)."""

    traces = 0

    def call(self, x):
        if tf.inside_function() and not isinstance(x, keras.KerasTensor):
            Counting.traces += 1
        return x


def model(strategy) -> keras.Model:
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((None, 4))  # sequences of any length
        hidden = Counting()(keras.layers.Dense(8, activation="relu")(inputs))
        pooled = keras.layers.GlobalAveragePooling1D()(hidden)
        model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
        model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def data(length: int = 3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, length, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


@pytest.fixture()
def strategy():
    return tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:0", "/cpu:1"])


def traces_of(call) -> int:
    before = Counting.traces
    call()
    return Counting.traces - before


def test_a_second_fit_an_evaluate_and_a_predict_trace_nothing_new(strategy):
    m = model(strategy)
    first = traces_of(lambda: tfdist.fit(m, data(), validation_data=data(), epochs=2, verbose=0))
    assert first > 0
    assert traces_of(lambda: tfdist.predict(m, data(), verbose=0)) > 0  # its first trace
    # Each of these once more: no new trace (the numbers go on from where they were).
    assert traces_of(lambda: tfdist.fit(m, data(), validation_data=data(), verbose=0)) == 0
    assert traces_of(lambda: tfdist.evaluate(m, data(), verbose=0)) == 0
    assert traces_of(lambda: tfdist.predict(m, data(), verbose=0)) == 0
    assert int(m.optimizer.iterations.numpy()) == 3 * 4  # 3 epochs of 4 steps


def split_model(strategy) -> keras.Model:
    """The model of `model`, its layers named for a pipeline's cut."""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((None, 4))
        hidden = Counting()(keras.layers.Dense(8, activation="relu", name="d1")(inputs))
        pooled = keras.layers.GlobalAveragePooling1D(name="pool")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(1, name="d2")(pooled))
        model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


@pytest.mark.parametrize("layout", ["central_storage", "pipeline"])
def test_other_layouts_second_fit_and_evaluate_trace_nothing_new(layout, strategy):
    """central_storage's runner and a pipeline's are kept too: a pipeline given an equal
    Pipeline again (a new object) goes on with its stages and traced programs; another cut
    traces again."""
    keywords = {}
    if layout == "central_storage":
        strategy = tfdist.build_strategy("central_storage", cluster=None)
    m = split_model(strategy)

    def fit(cut="pool"):
        if layout == "pipeline":
            keywords["pipeline"] = tfdist.parallel.Pipeline(cut_before=[cut], micro_batches=2)
        return traces_of(lambda: tfdist.fit(m, data(), verbose=0, **keywords))

    assert fit() > 0
    assert fit() == 0
    assert traces_of(lambda: tfdist.evaluate(m, data(), verbose=0)) > 0  # its first trace
    assert traces_of(lambda: tfdist.evaluate(m, data(), verbose=0)) == 0
    assert fit() == 0  # evaluate took the fit's runner
    if layout == "pipeline":
        assert fit(cut="d2") > 0
    assert int(m.optimizer.iterations.numpy()) == (4 if layout == "pipeline" else 3) * 4


def test_a_recompile_another_batch_shape_and_another_mode_each_trace_again(strategy, caplog):
    m = model(strategy)
    tfdist.fit(m, data(), verbose=0)
    with caplog.at_level("DEBUG", logger="tfdist"):
        assert traces_of(lambda: tfdist.fit(m, data(), verbose=0, shard_optimizer="zero2")) > 0
    assert "hooks changed since the last call" in caplog.text
    assert traces_of(lambda: tfdist.fit(m, data(), verbose=0, shard_optimizer="zero2")) == 0
    longer = data(length=5)  # batches of another shape
    assert traces_of(lambda: tfdist.fit(m, longer, verbose=0, shard_optimizer="zero2")) > 0
    with strategy.scope():
        m.compile(keras.optimizers.Adam(0.01), "mse")
    caplog.clear()
    with caplog.at_level("DEBUG", logger="tfdist"):
        assert traces_of(lambda: tfdist.fit(m, data(), verbose=0)) > 0
    assert "optimizer, compiled loss" in caplog.text
    assert traces_of(lambda: tfdist.fit(m, data(), verbose=0)) == 0


def test_verbose_0_is_quiet_as_keras_is_and_2_keeps_tfdists_lines(strategy, caplog, capsys):
    """A loop of short fits at verbose=0 prints nothing, as Keras's does: tfdist's lines of a
    call (the global batch, the step-time breakdown, why 'auto' runs a step a call) go to
    debug. verbose=2 (one line an epoch, Keras's choice for a log file) keeps them at info."""
    m = model(strategy)
    calls = ("Global batch 8 = 2 replica(s)", "Epoch 1: step ", "'auto': one step a call")

    read = []

    def fit(verbose: int) -> None:
        # A LambdaCallback's hooks are its instance's, not its class's: it hooks every batch.
        batches = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: read.append(sorted(logs))
        )
        tfdist.fit(m, data(), verbose=verbose, steps_per_execution="auto", callbacks=[batches])

    with caplog.at_level("INFO", logger="tfdist"):
        fit(verbose=0)
    assert not [r for r in caplog.records if r.name.startswith("tfdist")], caplog.text
    assert capsys.readouterr().out == ""
    with caplog.at_level("DEBUG", logger="tfdist"):
        fit(verbose=0)
    assert all(line in caplog.text for line in calls), caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="tfdist"):
        fit(verbose=2)
    assert all(line in caplog.text for line in calls), caplog.text
    assert len([line for line in capsys.readouterr().out.splitlines() if "loss" in line]) == 1
    assert read == [["loss"]] * 4 * 3  # every batch's logs, quiet or not

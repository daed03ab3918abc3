"""tfdist.fit / tfdist.evaluate: the same weights and logs as Keras's own model.fit on one device.

Each case of tests/fit_models.py is trained by Keras's `model.fit` without a strategy (the
reference) and by `tfdist.fit` under mirrored (2 and 4 logical CPUs) and central_storage, with
the same global batches in the same order. Multi-worker and parameter-server runs, with real
processes, are in tests/test_fit_multiworker.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests import fit_models
from tfdist.errors import FitError

WEIGHTS_TOLERANCE = 1e-5
LOGS_TOLERANCE = 1e-4
STRATEGIES = {
    "mirrored_x2": lambda: tfdist.build_strategy(
        "mirrored", cluster=None, devices=["/cpu:0", "/cpu:1"]
    ),
    "mirrored_x4": lambda: tfdist.build_strategy(
        "mirrored", cluster=None, devices=["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
    ),
    "central_storage": lambda: tfdist.build_strategy("central_storage", cluster=None),
}


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def assert_logs_close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=LOGS_TOLERANCE, err_msg=name)


@pytest.fixture(scope="module")
def references():
    """Keras's own fit and evaluate on one device, per case."""
    return fit_models.keras_references()


@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
@pytest.mark.parametrize("case", sorted(fit_models.CASES))
def test_fit_matches_keras_on_one_device(references, case, strategy_name):
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        model, data = fit_models.CASES[case]()
    history = tfdist.fit(model, data, epochs=fit_models.EPOCHS, verbose=0)
    weights, keras_history, keras_evaluation = references[case]
    assert max_diff(model.get_weights(), weights) <= WEIGHTS_TOLERANCE
    assert_logs_close(history.history, keras_history)
    assert_logs_close(tfdist.evaluate(model, data, verbose=0, return_dict=True), keras_evaluation)


def test_arrays_dataset_fn_and_validation(references):
    """numpy arrays with batch_size, and a dataset_fn of per-replica batches, train alike."""
    strategy = STRATEGIES["mirrored_x2"]()
    _, data = fit_models.regularised()
    x, y = (np.concatenate(part) for part in zip(*data.as_numpy_iterator(), strict=True))
    with strategy.scope():
        from_arrays, _ = fit_models.regularised()
        from_fn, _ = fit_models.regularised()
    history = tfdist.fit(
        from_arrays, x, y, batch_size=fit_models.GLOBAL_BATCH, epochs=fit_models.EPOCHS,
        shuffle=False, verbose=0, validation_data=(x[:64], y[:64]),
    )  # fmt: skip
    assert max_diff(from_arrays.get_weights(), references["regularised"][0]) <= WEIGHTS_TOLERANCE
    assert sorted(history.history) == ["loss", "mae", "val_loss", "val_mae"]
    assert history.history["val_loss"][-1] == pytest.approx(
        tfdist.evaluate(from_arrays, x[:64], y[:64], verbose=0)[0], abs=1e-6
    )

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        per_replica = context.get_per_replica_batch_size(fit_models.GLOBAL_BATCH)
        # Replica r of a global batch takes its r-th slice: the order one device sees.
        shard = tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica)
        return shard

    tfdist.fit(from_fn, dataset_fn, epochs=1, verbose=0, steps_per_epoch=4)
    assert int(from_fn.optimizer.iterations.numpy()) == 4


def test_steps_per_execution_and_early_stopping(references):
    strategy = STRATEGIES["mirrored_x2"]()
    with strategy.scope():
        model, data = fit_models.cnn()
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=3,  # 8 batches: calls of 3, 3 and 2 steps
        )
    tfdist.fit(model, data, epochs=fit_models.EPOCHS, verbose=0)
    assert max_diff(model.get_weights(), references["cnn"][0]) <= WEIGHTS_TOLERANCE

    stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=100.0, patience=0)
    history = tfdist.fit(model, data, epochs=5, verbose=0, callbacks=[stop])
    assert len(history.history["loss"]) == 2  # epoch 2 did not improve by 100: stop


def test_backup_and_restore_resumes_mid_epoch_exactly(references, tmp_path):
    """A run stopped after 5 of 8 steps resumes at step 6 and ends on the reference weights."""
    backup = str(tmp_path / "backup")
    strategy = STRATEGIES["mirrored_x2"]()

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (1, 4):  # epoch 2, after its 5th step
                raise KeyboardInterrupt

    with strategy.scope():
        model, data = fit_models.cnn()
    callbacks = [keras.callbacks.BackupAndRestore(backup, save_freq=1)]
    with pytest.raises(KeyboardInterrupt):
        tfdist.fit(model, data, epochs=2, verbose=0, steps_per_epoch=8,
                   callbacks=[*callbacks, Crash()])  # fmt: skip
    with strategy.scope():
        fresh, data = fit_models.cnn()
    seen = []
    logger = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: seen.append(b))
    tfdist.fit(fresh, data, epochs=2, verbose=0, steps_per_epoch=8, callbacks=[*callbacks, logger])
    assert seen[0] == 5  # epoch 2's 6th step (0-based 5) is the first one run again
    assert max_diff(fresh.get_weights(), references["cnn"][0]) <= WEIGHTS_TOLERANCE


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, d: tfdist.fit(keras.Sequential([keras.layers.Dense(1)]), d), r"is not compiled: call model\.compile"),
        (lambda m, d: tfdist.fit(m, d, epoch=3), r"unknown keyword `epoch` \(did you mean `epochs`\?\)"),
        (lambda m, d: tfdist.fit(m, d, class_weght={0: 1.0}), r"unknown keyword `class_weght` \(did you mean `class_weight`\?\)"),
        (lambda m, d: tfdist.fit(m, d.unbatch().batch(33)), r"holds 33 examples, which does not split evenly over the 2 replicas"),
        (lambda m, d: tfdist.fit(m, d.map(lambda x, y: x)), r"yields inputs without labels, but the model was compiled with a loss"),
        (lambda m, d: tfdist.fit(m, d, y=np.zeros(3)), r"y apply to arrays only"),
        (lambda m, d: tfdist.fit(m, np.zeros((10, 5)), np.zeros(10), batch_size=3), r"batch_size=3 \(the global batch\) does not split evenly over the 2"),
    ],
    ids=["uncompiled", "unknown-keyword", "class-weight-typo", "uneven-batch", "no-labels", "y-with-dataset", "odd-batch-size"],
)  # fmt: skip
def test_mistakes_get_one_clear_message(call, message):
    strategy = STRATEGIES["mirrored_x2"]()
    with strategy.scope():
        model, data = fit_models.regularised()
    with pytest.raises(FitError, match=message):
        call(model, data)


def test_a_model_built_outside_the_scope_is_refused():
    model, data = fit_models.regularised()  # no scope: the default strategy's variables
    with pytest.raises(
        FitError, match=r"created outside any strategy's scope.*strategy\.scope\(\)"
    ):
        tfdist.fit(model, data, strategy=STRATEGIES["mirrored_x2"]())


def test_deciding_callbacks_act_as_under_keras(references):
    """LearningRateScheduler, ReduceLROnPlateau and TerminateOnNaN under mirrored x2 do what
    they do under Keras's own fit on one device."""

    def run(fit, model, data):
        seen = []
        callbacks = [
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.02 / (epoch + 1)),
            keras.callbacks.ReduceLROnPlateau(
                monitor="loss", factor=0.5, patience=0, min_delta=10.0
            ),
            keras.callbacks.LambdaCallback(
                on_epoch_end=lambda epoch, logs: seen.append(
                    float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
                )
            ),
        ]
        history = fit(model, data, callbacks)
        return model.get_weights(), history.history, seen

    model, data = fit_models.cnn()
    keras_run = run(lambda m, d, c: m.fit(d, epochs=3, verbose=0, callbacks=c), model, data)
    with STRATEGIES["mirrored_x2"]().scope():
        model, data = fit_models.cnn()
    tfdist_run = run(
        lambda m, d, c: tfdist.fit(m, d, epochs=3, verbose=0, callbacks=c), model, data
    )
    assert max_diff(tfdist_run[0], keras_run[0]) <= WEIGHTS_TOLERANCE
    assert_logs_close(tfdist_run[1], keras_run[1])
    np.testing.assert_allclose(tfdist_run[2], keras_run[2], rtol=1e-6)
    # epoch 1: the schedule's 0.02; epoch 2: its 0.01, halved on the plateau
    assert tfdist_run[2][:2] == pytest.approx([0.02, 0.005])

    with STRATEGIES["mirrored_x2"]().scope():
        model, data = fit_models.regularised()
        model.compile(optimizer=keras.optimizers.SGD(1e6), loss="mse")  # diverges at once
    history = tfdist.fit(
        model, data, epochs=3, verbose=0, callbacks=[keras.callbacks.TerminateOnNaN()]
    )
    assert len(history.history.get("loss", [])) <= 1 and model.stop_training


def test_mixed_float16_with_loss_scaling_matches_keras_fit_under_the_same_strategy():
    """Loss scaling (mixed_float16 wraps the optimizer) as Keras's own fit does it under
    mirrored x2, where Keras's fit works: the same computation."""
    previous = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        weights = []
        for trainer in (
            lambda m, d: m.fit(d, epochs=2, verbose=0),
            lambda m, d: tfdist.fit(m, d, epochs=2, verbose=0),
        ):
            with STRATEGIES["mirrored_x2"]().scope():
                model, data = fit_models.cnn()
            assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
            trainer(model, data)
            weights.append(model.get_weights())
    finally:
        keras.mixed_precision.set_dtype_policy(previous)
    assert max_diff(weights[0], weights[1]) <= 1e-3  # float16 compute: same ops, same order


def test_arrays_shuffle_alike_on_every_worker_and_anew_each_epoch():
    """Workers split the same global batch, so their shuffles must agree (a fixed seed)."""
    from tfdist.training.fit_data import make_fit_data

    x = np.arange(24, dtype="float32")

    def two_epochs():  # what one worker's pipeline yields, as a fresh process would build it
        data = make_fit_data(
            x, x, batch_size=4, shuffle=True, strategy=tf.distribute.get_strategy()
        )
        return [[batch[0].numpy().tolist() for batch in data.dataset] for _ in range(2)]

    worker_0, worker_1 = two_epochs(), two_epochs()
    assert worker_0 == worker_1
    assert worker_0[0] != worker_0[1]  # a new order each epoch
    assert sorted(v for batch in worker_0[1] for v in batch) == x.tolist()  # each example once


def test_batch_norm_copies_agree_after_fit_under_mirrored():
    """Keras's own fit leaves each replica its own moving statistics; tfdist.fit averages
    them at each epoch end, so the one model saved is the one every replica holds."""

    def copies_spread(model, strategy) -> float:
        layer = next(x for x in model.layers if isinstance(x, keras.layers.BatchNormalization))
        copies = [
            np.asarray(c) for c in strategy.experimental_local_results(layer.moving_mean.value)
        ]
        return float(np.max(np.abs(copies[0] - copies[1])))

    spreads = {}
    for name in ("keras", "tfdist"):
        strategy = STRATEGIES["mirrored_x2"]()
        with strategy.scope():
            model, data = fit_models.batch_norm()
        if name == "keras":
            model.fit(data, epochs=fit_models.EPOCHS, verbose=0)
        else:
            tfdist.fit(model, data, epochs=fit_models.EPOCHS, verbose=0)
        spreads[name] = copies_spread(model, strategy)
    assert spreads["keras"] > 1e-4  # the drift this averaging removes
    assert spreads["tfdist"] == 0.0


@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_class_weight_and_validation_split_as_keras_defines_them(strategy_name):
    """Keras's rules: the last 25% of the arrays (before shuffling) validate, and each
    example weighs its class's weight (classes not listed weigh 1)."""

    def run(strategy, fit):
        with strategy.scope():
            model, data = fit_models.cnn()
        x = np.concatenate([b[0].numpy() for b in data])
        y = np.concatenate([b[1].numpy() for b in data])
        history = fit(
            model, x, y, batch_size=32, epochs=2, verbose=0, shuffle=False,
            validation_split=0.25, class_weight={0: 0.5, 2: 3.0},
        )  # fmt: skip
        return model.get_weights(), history.history

    keras_weights, keras_history = run(tf.distribute.get_strategy(), keras.Model.fit)
    weights, history = run(STRATEGIES[strategy_name](), tfdist.fit)
    assert max_diff(weights, keras_weights) <= WEIGHTS_TOLERANCE
    assert "val_loss" in history
    assert_logs_close(history, keras_history)


def test_class_weight_mistakes_are_one_line():
    model, data = fit_models.two_heads()
    with pytest.raises(FitError, match="class_weight weighs examples by their label, so it needs"):
        tfdist.fit(model, data, class_weight={0: 2.0}, verbose=0)
    model, data = fit_models.cnn()
    with pytest.raises(FitError, match="class_weight's keys are class ids"):
        tfdist.fit(model, data, class_weight={"cat": 2.0}, verbose=0)
    with pytest.raises(FitError, match="a dataset or dataset function cannot be split"):
        tfdist.fit(model, data, validation_split=0.2, verbose=0)


@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_predict_gives_keras_s_predictions_in_order(strategy_name):
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        model, data = fit_models.two_heads()
    tfdist.fit(model, data, epochs=1, verbose=0)
    plain, _ = fit_models.two_heads()
    plain.set_weights(model.get_weights())
    want = plain.predict(data, verbose=0)
    got = tfdist.predict(model, data, verbose=0)
    assert set(got) == {"kind", "size"}
    for name in want:
        assert got[name].shape == want[name].shape
        np.testing.assert_allclose(got[name], want[name], atol=1e-6)
    x = np.concatenate([b[0]["image"].numpy() for b in data])
    with pytest.raises(FitError, match="batch_size must be a positive whole number"):
        tfdist.predict(model, {"image": x, "meta": x[:, :3]}, batch_size=0)


def test_learning_rate_warmup_ramps_as_under_keras():
    """The callback runs alike under Keras's fit on one device and tfdist.fit under mirrored:
    the rate rises to 0.01 * 64 / 32 over 1.5 epochs (12 steps), then stays."""

    def run(strategy, fit):
        with strategy.scope():
            model, data = fit_models.cnn()
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss=model.loss)
        rates = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda b, logs: rates.append(
                float(model.optimizer.learning_rate.numpy())
            )
        )
        warmup = tfdist.LearningRateWarmup(
            warmup_epochs=1.5, global_batch_size=64, base_batch_size=32
        )
        fit(model, data, epochs=2, verbose=0, callbacks=[warmup, record])
        return model.get_weights(), rates

    keras_weights, keras_rates = run(tf.distribute.get_strategy(), keras.Model.fit)
    weights, rates = run(STRATEGIES["mirrored_x2"](), tfdist.fit)
    assert rates == pytest.approx([0.02 * (s + 1) / 12 for s in range(12)] + [0.02] * 4)
    assert rates == pytest.approx(keras_rates)
    assert max_diff(weights, keras_weights) <= WEIGHTS_TOLERANCE

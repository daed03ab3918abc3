"""The binary's duties as public callbacks in a user's own `tfdist.fit` script:
StepCheckpoint resumes at the saved step and data position, RunRecord keeps every session's
record — checked against Keras's own fit of the same model, data and order."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist

STEPS, EPOCHS = 4, 3  # 16 examples per step over 64: every epoch is one pass


def user_model(seed: int = 5):
    """A keras.io-style subclassed model (its own call, a Dropout-free MLP), compiled."""

    class Regressor(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.hidden(x))

    keras.utils.set_random_seed(seed)
    model = Regressor()
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    return model


def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def mirrored():
    return tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:0", "/cpu:1"])


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def test_a_re_run_resumes_at_the_saved_step_and_keeps_the_record(tmp_path):
    reference = user_model()
    reference.fit(data(), epochs=EPOCHS, verbose=0, shuffle=False)

    def session(epochs: int, seed: int = 5):
        strategy = mirrored()
        with strategy.scope():
            model = user_model(seed)
        record = tfdist.RunRecord(str(tmp_path), global_batch_size=16)
        checkpoints = tfdist.StepCheckpoint(str(tmp_path), every_n_steps=3, max_to_keep=10)
        tfdist.fit(model, data(), epochs=epochs, verbose=0, callbacks=[checkpoints, record])
        return model, record.result, checkpoints

    _, first, checkpoints = session(epochs=2)
    assert (first.steps, first.resumed_from_step) == (8, 0)
    assert checkpoints.checkpoint_status() == (8, str(tmp_path / "checkpoints"))
    saved = sorted(int(p.stem.split("-")[1]) for p in (tmp_path / "checkpoints").glob("*.index"))
    assert saved == [3, 4, 6, 8]  # every 3 steps and every epoch end, once each

    model, result, checkpoints = session(epochs=EPOCHS, seed=99)  # the checkpoint decides
    assert checkpoints.restored_step == 8
    assert (result.steps, result.resumed_from_step, result.resume_points) == (12, 8, (8,))
    assert [h["epoch"] for h in result.history] == [1, 2, 3]
    assert result.steps_trained == 12 and len(result.sessions) == 2
    assert max_diff(model.get_weights(), reference.get_weights()) <= 1e-5
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["history"][-1]["train_loss"] == result.train_loss
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]
    assert (tmp_path / "export" / "model.keras").exists()

    # A third run with nothing left to train changes nothing that was recorded.
    _, again, _ = session(epochs=EPOCHS, seed=99)
    assert again is None  # nothing trained: the record is left as it was
    assert len((tmp_path / "history.jsonl").read_text().splitlines()) == 3


def test_step_checkpoint_outside_tfdist_fit_says_what_to_use(tmp_path):
    model = user_model()
    with pytest.raises(TypeError, match="needs tfdist.fit's loop.*BackupAndRestore"):
        model.fit(data(), epochs=1, verbose=0, callbacks=[tfdist.StepCheckpoint(str(tmp_path))])


def test_a_run_killed_after_its_last_checkpoint_counts_every_step_it_trained(tmp_path):
    """Killed after the final checkpoint but before the last epoch's line: the session that
    resumes there trains nothing and writes no line, and the summary still counts the
    steps the killed one trained (tests/test_peers.py's random kill found it)."""
    from tfdist.app import TrainConfig, Trainer

    config = TrainConfig(
        model="mlp", global_batch_size=32, epochs=2, steps_per_epoch=3, eval_every=0,
        shuffle_buffer=0, data_dir=str(tmp_path / "data"), model_dir=str(tmp_path / "run"),
    )  # fmt: skip
    one = tfdist.build_strategy("one_device", cluster=None)
    Trainer(config, strategy=one).fit()
    history = tmp_path / "run" / "history.jsonl"
    lines = history.read_text().splitlines()
    history.write_text(lines[0] + "\n")  # the kill: epoch 2 saved at step 6, its line lost
    result = Trainer(config, strategy=one).fit()
    assert (result.steps, result.resumed_from_step) == (6, 6)
    assert result.steps_trained == 6

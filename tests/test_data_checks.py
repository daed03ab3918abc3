"""Data mistakes met before training: one line each, naming what the model takes and what came.

The same models train when the data is right, including the shapes Keras itself adapts
(a missing last axis of 1), so a check never refuses what Keras's fit would train.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import run_module
from tfdist.data import DataError, PipelineOptions, tfrecord_dataset, write_tfrecords
from tfdist.errors import FitError


def dense(width: int = 32, loss="sparse_categorical_crossentropy") -> keras.Model:
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(4)])
    model.compile("sgd", loss)
    return model


def two_inputs() -> keras.Model:
    image, tag = keras.Input((6,), name="image"), keras.Input((2,), name="tag")
    model = keras.Model({"image": image, "tag": tag}, keras.layers.Dense(1)(image + tag[:, :1]))
    model.compile("sgd", "mse")
    return model


X = np.zeros((64, 32), "float32")
IDS = np.zeros((64,), "int64")
ONE_HOT = np.eye(4, dtype="float32")[IDS]


@pytest.mark.parametrize(
    "model, data, message",
    [
        (dense, lambda: (np.zeros((64, 31), "float32"), IDS),
         r"^The model's input takes shape \(None, 32\) \(the batch first\); `x` yields \(16, 31\)\. "
         r"Received: inputs of shape \(16, 31\)"),
        (dense, lambda: tf.data.Dataset.from_tensor_slices((X, IDS)),
         r"takes batches of shape \(None, 32\), but `x` yields single examples of shape "
         r"\(32,\): batch the dataset"),
        (dense, lambda: (X, ONE_HOT),
         r"The loss sparse_categorical_crossentropy takes class ids, shape \(None,\), but `x` "
         r"yields one-hot labels of shape \(16, 4\)"),
        (lambda: dense(loss=keras.losses.CategoricalCrossentropy()), lambda: (X, IDS),
         r"The loss CategoricalCrossentropy takes one-hot labels of shape \(None, 4\), but "
         r"`x` yields class ids of shape \(16,\)"),
        (two_inputs, lambda: ({"image": np.zeros((64, 6), "float32")}, np.zeros((64, 1))),
         r"The model's inputs are named \['image', 'tag'\]; `x` yields a dict with keys "
         r"\['image'\], without \['tag'\]"),
        (two_inputs,
         lambda: ({"image": np.zeros((64, 6)), "tag": np.zeros((64, 2)), "id": np.zeros(64)},
                  np.zeros((64, 1))),
         r"with \['id'\] the model does not take"),
        (lambda: dense(4), lambda: (np.array([["a"] * 4] * 64), IDS),
         r"takes float32 values; `x` yields strings"),
    ],
    ids=["width", "unbatched", "one_hot_for_sparse", "ids_for_categorical", "missing_key",
         "extra_key", "strings"],
)  # fmt: skip
def test_a_data_mistake_is_one_line_naming_both_sides(model, data, message):
    built, given = model(), data()
    arguments = given if isinstance(given, tuple) else (given,)
    batch = {} if isinstance(given, tf.data.Dataset) else {"batch_size": 16}
    with pytest.raises(FitError, match=message) as raised:
        tfdist.fit(built, *arguments, verbose=0, **batch)
    assert "\n" not in str(raised.value)


def test_the_shapes_keras_adapts_still_train():
    """(b, 8, 8) for Input((8, 8, 1)); ids of shape (b, 1) for a sparse loss; a dict in
    the model's own names."""
    images = keras.Sequential(
        [keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(3)]
    )
    images.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tfdist.fit(images, np.zeros((32, 8, 8), "float32"), np.zeros((32, 1)), batch_size=8, verbose=0)
    model = two_inputs()
    features = {"image": np.zeros((32, 6), "float32"), "tag": np.zeros((32, 2), "float32")}
    tfdist.fit(model, features, np.zeros((32, 1)), batch_size=8, verbose=0)


def test_a_corrupt_record_met_in_fit_is_tfdist_s_one_line(tmp_path):
    """A truncated TFRecord shard of the user's tfdist pipeline, met by the first batch or
    mid-training alike: tfdist's DataError (one line; exit 2 through tfdist's error hook, so
    launchers do not restart it), not TensorFlow's InvalidArgumentError."""
    write_tfrecords({"id": np.arange(40, dtype=np.int64)}, str(tmp_path), name="data", num_shards=2)
    shard = tmp_path / "data-00001-of-00002.tfrecord"
    shard.write_bytes(shard.read_bytes()[:-25])  # cut into the last record
    options = PipelineOptions(repeat=False, shuffle_buffer=0, drop_remainder=False)
    data = tfrecord_dataset(str(tmp_path), batch_size=4, options=options).map(
        lambda example: (tf.cast(example["id"], tf.float32)[:, None], example["id"] % 2)
    )
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(DataError) as raised:
        tfdist.fit(model, data, verbose=0)
    assert str(raised.value).startswith(f'"{shard}" holds 19 readable record(s)')
    assert "\n" not in str(raised.value) and "\\'" not in str(raised.value)


WRONG_WIDTH = """
import numpy as np, keras, tfdist
strategy = tfdist.build_strategy("multi_worker_mirrored")
with strategy.scope():
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(4)])
    model.compile("sgd", "sparse_categorical_crossentropy")
x = np.zeros((256, 31), np.float32)  # one feature short of the model's input
tfdist.fit(model, x, np.zeros(256, np.int32), batch_size=64)
"""


@pytest.mark.multiprocess
def test_a_data_mistake_in_a_two_worker_job_is_one_line_each_and_never_restarted(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(WRONG_WIDTH)
    result = run_module(
        "tools.launch", "--workers", "2", "--max_restarts", "2", "--", "python", str(script),
        timeout=240,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 2, out[-3000:]
    for task in ("worker:0", "worker:1"):
        mine = [line for line in out.splitlines() if line.startswith(f"[{task}] ")]
        assert mine[-1] == (
            f"[{task}] error: The model's input takes shape (None, 32) (the batch first); `x` "
            "yields (64, 31). Received: inputs of shape (64, 31)"
        ), mine[-3:]
    assert "Traceback" not in out and out.count("[launch] starting") == 1
    assert "[launch] not restarting: " in out

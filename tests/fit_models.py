"""The user models of tfdist.fit's equivalence tests, and their data in a fixed order.

Shared by the in-process tests (tests/test_fit.py) and the worker processes they launch
(tests/workers/fit_worker.py), so both train exactly the same thing. Each case returns a
compiled model (call it inside a strategy's scope) and a dataset batched with the GLOBAL
batch, never shuffled.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 32
EXAMPLES = 256  # 8 whole batches: each splits evenly over 1, 2 and 4 replicas
EPOCHS = 2


def _rng():
    return np.random.default_rng(7)


def cnn():
    """(a) a Sequential CNN, SparseCategoricalCrossentropy(from_logits=True), accuracy."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    rng = _rng()
    x = rng.normal(size=(EXAMPLES, 8, 8, 1)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("int64") + 2 * (x[:, 0, 0, 0] > 0)
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def two_heads():
    """(b) two inputs, two outputs: dict losses, loss_weights, per-output metrics, weights."""
    keras.utils.set_random_seed(2)
    image = keras.Input((6,), name="image")
    meta = keras.Input((3,), name="meta")
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([image, meta]))
    kind = keras.layers.Dense(3, activation="softmax", name="kind")(hidden)
    size = keras.layers.Dense(1, name="size")(hidden)
    model = keras.Model({"image": image, "meta": meta}, {"kind": kind, "size": size})
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss={"kind": "sparse_categorical_crossentropy", "size": keras.losses.Huber()},
        loss_weights={"kind": 1.0, "size": 0.5},
        metrics={"kind": ["accuracy"], "size": [keras.metrics.MeanAbsoluteError()]},
        weighted_metrics={"kind": ["accuracy"]},
    )
    rng = _rng()
    x = {
        "image": rng.normal(size=(EXAMPLES, 6)).astype("float32"),
        "meta": rng.normal(size=(EXAMPLES, 3)).astype("float32"),
    }
    y = {
        "kind": rng.integers(0, 3, EXAMPLES),
        "size": (x["image"].sum(axis=1, keepdims=True) * 0.3).astype("float32"),
    }
    weights = {
        "kind": rng.uniform(0.2, 2.0, EXAMPLES).astype("float32"),
        "size": rng.uniform(0.2, 2.0, EXAMPLES).astype("float32"),
    }
    return model, tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(GLOBAL_BATCH)


def regularised():
    """(c) an L2 kernel regulariser and SGD with momentum, on a regression."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(
                16, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01)
            ),
            keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(0.01)),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", metrics=["mae"])
    rng = _rng()
    x = rng.normal(size=(EXAMPLES, 5)).astype("float32")
    y = (x @ np.arange(1, 6, dtype="float32")[:, None]) * 0.1
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def text():
    """(d) an Embedding text model: sparse (IndexedSlices) gradients."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [
            keras.Input((12,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.02),
        loss="binary_crossentropy",
        metrics=["accuracy", keras.metrics.AUC(name="auc")],
    )
    rng = _rng()
    x = rng.integers(0, 50, size=(EXAMPLES, 12)).astype("int32")
    y = ((x < 25).mean(axis=1) > 0.5).astype("float32")
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def batch_norm():
    """A Dense + BatchNormalization model (synchronized=False, Keras's default): each replica
    keeps its own moving statistics. Not in CASES: one device has one copy, so Keras's fit on
    one device is no reference for them."""
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(momentum=0.8),
            keras.layers.ReLU(),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = _rng()
    x = rng.normal(size=(EXAMPLES, 10)).astype("float32") * np.linspace(0.5, 3, 10)
    y = x[:, :3].sum(axis=1, keepdims=True).astype("float32")
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


CASES = {"cnn": cnn, "two_heads": two_heads, "regularised": regularised, "text": text}


def keras_references() -> dict[str, tuple[list[np.ndarray], dict, dict]]:
    """Per case, Keras's own fit on one device: (final weights, history, evaluation)."""
    out = {}
    for name, case in CASES.items():
        model, data = case()
        history = model.fit(data, epochs=EPOCHS, verbose=0, shuffle=False)
        evaluation = model.evaluate(data, verbose=0, return_dict=True)
        out[name] = (model.get_weights(), history.history, evaluation)
    return out

"""Models, optimizers and data the sharded-update tests train, in one process or in many.

Every case trains 10 steps of a global batch of 48 (which splits over 2, 3 and 4 replicas)
from the same initial weights and data order, so a sharded run and an unsharded one can be
compared weight for weight.
"""

from __future__ import annotations

import keras
import numpy as np

GLOBAL_BATCH = 48
STEPS = 10

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw_clipnorm": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05, clipnorm=0.5),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
}


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 3))).astype("float32")
    return x, y


def mlp(optimizer: str) -> keras.Model:
    """A small MLP (uneven variable sizes, so slices cut through variables)."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(13, activation="relu"),
            keras.layers.Dense(9, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )
    model.compile(OPTIMIZERS[optimizer](), "mse", metrics=["mae"])
    return model


def mixed_float16(initial_scale: float = 2.0**15) -> keras.Model:
    """The MLP computing in float16 with float32 weights, Adam under dynamic loss scaling."""
    keras.utils.set_random_seed(7)
    policy = keras.mixed_precision.DTypePolicy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(13, activation="relu", dtype=policy),
            keras.layers.Dense(9, activation="tanh", dtype=policy),
            keras.layers.Dense(3, dtype="float32"),
        ]
    )
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=initial_scale, dynamic_growth_steps=3
    )
    model.compile(optimizer, "mse")
    return model


def two_outputs() -> keras.Model:
    """A user's functional model with two named outputs and a loss for each."""
    keras.utils.set_random_seed(11)
    inputs = keras.Input((6,), name="features")
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    score = keras.layers.Dense(1, name="score")(hidden)
    label = keras.layers.Dense(3, name="label")(hidden)
    model = keras.Model(inputs, {"score": score, "label": label})
    model.compile(
        keras.optimizers.Adam(0.01),
        loss={
            "score": "mse",
            "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        },
        loss_weights={"score": 1.0, "label": 0.5},
        metrics={"label": ["accuracy"]},
    )
    return model


def two_output_targets(x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    return {"score": y[:, :1], "label": np.argmax(y, axis=1).astype("int32")}


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b, strict=True))

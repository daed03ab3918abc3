"""Models and data shared by the pipeline tests and their worker script (tests/workers/).

Four Dense blocks (cut before d2, d3, d4: four stages), a penalty on one of them, Adam:
the reference is Keras's own fit of the same model on one device, same data, same order.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 16
STEPS = 5
CUTS = {2: ["d3"], 4: ["d2", "d3", "d4"]}


def mlp() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", name="d1"),
            keras.layers.Dense(16, activation="tanh", name="d2", kernel_regularizer="l2"),
            keras.layers.Dense(16, activation="tanh", name="d3"),
            keras.layers.Dense(3, name="d4"),
        ]
    )
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data() -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 8)).astype("float32")
    y = rng.integers(0, 3, GLOBAL_BATCH * STEPS)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def reference(fits: int = 1) -> tuple[list[np.ndarray], dict]:
    """Keras's own fit on one device, called `fits` times: (weights after fits x STEPS
    steps, the last fit's history)."""
    model = mlp()
    for _ in range(fits):
        history = model.fit(data(), epochs=1, verbose=0, shuffle=False)
    return model.get_weights(), history.history

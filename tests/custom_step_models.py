"""Models with their own train_step / test_step, in the shapes keras.io teaches.

Shared by tests/test_fit_custom_steps.py (in-process strategies, against Keras's own fit
under the same strategy) and tests/workers/fit_worker.py (multi_worker_mirrored and
parameter_server processes). Each case returns a compiled model (call it inside a
strategy's scope) and a dataset batched with the GLOBAL batch, in a fixed order.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 32
EXAMPLES = 256  # 8 whole batches: each splits evenly over 1, 2 and 4 replicas
EPOCHS = 2


class KerasIoModel(keras.Model):
    """keras.io "Customizing what happens in fit()": compute_loss, the compiled metrics
    updated by hand, and `{m.name: m.result() for m in self.metrics}` returned, whose
    `compile_metrics` entry is a nested dict."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class OwnKeysModel(keras.Model):
    """keras.io's lower-level shape: compiled with an optimizer only, its own Mean tracker
    listed in `metrics`, and logs of its own: the tracker and a step counter. Its loss is
    the replica's own mean, not scaled by the replicas, so under a strategy the replicas'
    gradients add up (as under Keras's fit)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mae_tracker = keras.metrics.Mean(name="mae_loss")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = tf.reduce_mean(tf.abs(y_pred - y))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables, strict=True))
        self.mae_tracker.update_state(loss)
        return {
            "mae_loss": self.mae_tracker.result(),
            "custom_step": tf.cast(self.optimizer.iterations, "float32"),
        }

    def test_step(self, data):
        x, y = data
        self.mae_tracker.update_state(tf.reduce_mean(tf.abs(self(x, training=False) - y)))
        return {"mae_loss": self.mae_tracker.result()}

    @property
    def metrics(self):
        return [self.mae_tracker]


def _data(seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES, 16)).astype("float32")
    y = (x[:, :4].sum(axis=1, keepdims=True) * 0.5 + 0.1).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def _layers():
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return inputs, keras.layers.Dense(1)(hidden)


def keras_io():
    keras.utils.set_random_seed(5)
    model = KerasIoModel(*_layers())
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model, _data(5)


def own_keys():
    keras.utils.set_random_seed(6)
    model = OwnKeysModel(*_layers())
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5))
    return model, _data(6)


CASES = {"keras_io": keras_io, "own_keys": own_keys}


class GAN(keras.Model):
    """keras.io's "DCGAN" shape: a discriminator and a generator, each with an optimizer of
    its own that train_step applies (compile takes them; the base optimizer is unused)."""

    LATENT = 4

    def __init__(self, discriminator, generator, **kwargs):
        super().__init__(**kwargs)
        self.discriminator, self.generator = discriminator, generator
        self.seed_generator = keras.random.SeedGenerator(11)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn
        # Built here: under a mirrored strategy an optimizer first built inside the traced
        # step fails, in Keras's own fit too ("You must feed a value for placeholder tensor
        # 'cond/Placeholder'").
        self.d_optimizer.build(self.discriminator.trainable_variables)
        self.g_optimizer.build(self.generator.trainable_variables)
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def call(self, x):
        # Under a strategy Keras (its fit too) builds a model by calling it on a batch.
        return self.discriminator(x)

    def train_step(self, real):
        size = tf.shape(real)[0]
        latent = keras.random.normal((size, self.LATENT), seed=self.seed_generator)
        both = tf.concat([self.generator(latent), real], axis=0)
        labels = tf.concat([tf.ones((size, 1)), tf.zeros((size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(both))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights, strict=True)
        )
        latent = keras.random.normal((size, self.LATENT), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            fooled = self.discriminator(self.generator(latent))
            g_loss = self.loss_fn(tf.zeros((size, 1)), fooled)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights, strict=True))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def gan():
    keras.utils.set_random_seed(7)
    discriminator = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)],
        name="discriminator",
    )
    generator = keras.Sequential(
        [keras.Input((GAN.LATENT,)), keras.layers.Dense(16)], name="generator"
    )
    model = GAN(discriminator, generator)
    model.compile(
        d_optimizer=keras.optimizers.Adam(1e-3),
        g_optimizer=keras.optimizers.Adam(1e-3),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    real = np.random.default_rng(7).normal(size=(EXAMPLES, 16)).astype("float32")
    return model, tf.data.Dataset.from_tensor_slices(real).batch(GLOBAL_BATCH)


class BatchLogs(keras.callbacks.Callback):
    """Keeps every training batch's logs (reading them is what crashed on nested dicts)."""

    def __init__(self):
        super().__init__()
        self.batches: list[dict] = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs or {}))

"""Models in the shapes keras.io's examples write them, for tests that hold tfdist's splits
against Keras: the Transformer text classifier ("Text classification with Transformer"),
whose blocks are Layer subclasses, and its data.

The dropout rate is an argument: random masks differ between one batch and its micro-batches
(or its replicas), so the equality tests train with `dropout=0.0`.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

VOCAB, LENGTH, WIDTH, HEADS, HIDDEN, CLASSES = 40, 8, 16, 2, 32, 2
EXAMPLES, GLOBAL_BATCH = 64, 16


class TransformerBlock(keras.layers.Layer):
    """Self-attention and a feed-forward network, each with a residual and a layer norm."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)]
        )
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs, training=None):
        attended = self.dropout1(self.att(inputs, inputs), training=training)
        first = self.layernorm1(inputs + attended)
        fed = self.dropout2(self.ffn(first), training=training)
        return self.layernorm2(first + fed)


class TokenAndPositionEmbedding(keras.layers.Layer):
    """A token's embedding plus its position's."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = self.pos_emb(keras.ops.arange(0, keras.ops.shape(x)[-1], 1))
        return self.token_emb(x) + positions


def transformer_classifier(*, dropout: float = 0.1, seed: int = 5) -> keras.Model:
    """keras.io's classifier: embeddings, a transformer block, pooling, two Dense layers."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(LENGTH,), dtype="int32")
    x = TokenAndPositionEmbedding(LENGTH, VOCAB, WIDTH)(inputs)
    x = TransformerBlock(WIDTH, HEADS, HIDDEN, rate=dropout)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dropout(dropout)(x)
    x = keras.layers.Dense(20, activation="relu")(x)
    x = keras.layers.Dropout(dropout)(x)
    outputs = keras.layers.Dense(CLASSES, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(
        keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    return model


def padded_classifier(*, seed: int = 5) -> keras.Model:
    """The same block behind an Embedding(mask_zero=True): id 0 pads, and the mask reaches
    the attention and the pooling."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True, name="embed")(inputs)
    x = TransformerBlock(WIDTH, HEADS, HIDDEN, rate=0.0, name="block")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    x = keras.layers.Dense(20, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", name="head")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(
        keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    return model


def reviews(*, padded: bool = False) -> tf.data.Dataset:
    """EXAMPLES token sequences (the last ones zero-padded where `padded`), labelled by
    whether token 1 occurs, in global batches."""
    rng = np.random.default_rng(0)
    x = rng.integers(1, VOCAB, (EXAMPLES, LENGTH)).astype("int32")
    if padded:
        lengths = rng.integers(3, LENGTH + 1, EXAMPLES)
        x[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    y = (x == 1).any(axis=1).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

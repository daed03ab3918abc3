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


# --- keras.io's English-to-Spanish translation (a sequence-to-sequence Transformer) ------------

S2S_VOCAB, S2S_LENGTH, S2S_WIDTH, S2S_HIDDEN, S2S_HEADS = 30, 8, 16, 24, 2
S2S_EXAMPLES, S2S_BATCH = 48, 12


class PositionalEmbedding(keras.layers.Layer):
    """Token plus position embeddings; id 0 pads, and the mask says so."""

    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = keras.layers.Embedding(vocab_size, embed_dim)
        self.position_embeddings = keras.layers.Embedding(sequence_length, embed_dim)

    def call(self, inputs):
        positions = keras.ops.arange(0, keras.ops.shape(inputs)[-1], 1)
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return keras.ops.not_equal(inputs, 0)


class TransformerEncoder(keras.layers.Layer):
    """Self-attention over the padded source, then a feed-forward projection."""

    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential(
            [keras.layers.Dense(dense_dim, activation="relu"), keras.layers.Dense(embed_dim)]
        )
        self.layernorm_1 = keras.layers.LayerNormalization()
        self.layernorm_2 = keras.layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        padding = None if mask is None else keras.ops.cast(mask[:, None, :], "int32")
        attended = self.attention(query=inputs, value=inputs, key=inputs, attention_mask=padding)
        projected_input = self.layernorm_1(inputs + attended)
        return self.layernorm_2(projected_input + self.dense_proj(projected_input))


class TransformerDecoder(keras.layers.Layer):
    """Causal self-attention over the target, cross-attention to the encoder's output, then
    a feed-forward projection; the target's and the source's padding masks are honoured."""

    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention_1 = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.attention_2 = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential(
            [keras.layers.Dense(latent_dim, activation="relu"), keras.layers.Dense(embed_dim)]
        )
        self.layernorm_1 = keras.layers.LayerNormalization()
        self.layernorm_2 = keras.layers.LayerNormalization()
        self.layernorm_3 = keras.layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        inputs, encoder_outputs = inputs
        length = keras.ops.shape(inputs)[1]
        causal = keras.ops.cast(
            keras.ops.arange(length)[:, None] >= keras.ops.arange(length)[None, :], "int32"
        )[None]
        target_mask, source_mask = (None, None) if mask is None else mask
        attended = self.attention_1(
            query=inputs, value=inputs, key=inputs, attention_mask=causal, query_mask=target_mask
        )
        out_1 = self.layernorm_1(inputs + attended)
        crossed = self.attention_2(
            query=out_1, value=encoder_outputs, key=encoder_outputs,
            query_mask=target_mask, key_mask=source_mask,
        )  # fmt: skip
        out_2 = self.layernorm_2(out_1 + crossed)
        return self.layernorm_3(out_2 + self.dense_proj(out_2))


def seq2seq(*, optimizer="rmsprop", seed: int = 3) -> keras.Model:
    """keras.io's translation Transformer at small sizes (dropout left out: the equality
    tests cannot share random masks), its two inputs by name, compiled as keras.io does."""
    keras.utils.set_random_seed(seed)
    source = keras.Input(shape=(None,), dtype="int32", name="encoder_inputs")
    x = PositionalEmbedding(S2S_LENGTH, S2S_VOCAB, S2S_WIDTH, name="source_embedding")(source)
    encoded = TransformerEncoder(S2S_WIDTH, S2S_HIDDEN, S2S_HEADS, name="encoder")(x)
    target = keras.Input(shape=(None,), dtype="int32", name="decoder_inputs")
    x = PositionalEmbedding(S2S_LENGTH, S2S_VOCAB, S2S_WIDTH, name="target_embedding")(target)
    x = TransformerDecoder(S2S_WIDTH, S2S_HIDDEN, S2S_HEADS, name="decoder")([x, encoded])
    outputs = keras.layers.Dense(S2S_VOCAB, activation="softmax", name="next_token")(x)
    model = keras.Model({"encoder_inputs": source, "decoder_inputs": target}, outputs)
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def sentence_pairs() -> tf.data.Dataset:
    """Padded (source, target-in) -> target-out pairs of random lengths, in global batches:
    replicas and micro-batches hold different counts of real tokens."""
    rng = np.random.default_rng(1)
    source = np.zeros((S2S_EXAMPLES, S2S_LENGTH), "int32")
    target = np.zeros((S2S_EXAMPLES, S2S_LENGTH + 1), "int32")
    for i in range(S2S_EXAMPLES):
        n, m = rng.integers(2, S2S_LENGTH + 1), rng.integers(2, S2S_LENGTH + 2)
        source[i, :n] = rng.integers(1, S2S_VOCAB, n)
        target[i, :m] = rng.integers(1, S2S_VOCAB, m)
    inputs = {"encoder_inputs": source, "decoder_inputs": target[:, :-1]}
    return tf.data.Dataset.from_tensor_slices((inputs, target[:, 1:])).batch(S2S_BATCH)


# --- keras.io's image classification with a Vision Transformer ---------------------------------

VIT_IMAGE, VIT_PATCH, VIT_WIDTH, VIT_HEADS, VIT_CLASSES = 8, 4, 8, 2, 3
VIT_EXAMPLES, VIT_BATCH = 32, 8


class Patches(keras.layers.Layer):
    """An image cut into flattened square patches."""

    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size

    def call(self, images):
        size = self.patch_size
        patches = keras.ops.image.extract_patches(images, size)
        count = (images.shape[1] // size) * (images.shape[2] // size)
        return keras.ops.reshape(patches, (-1, count, size * size * images.shape[-1]))


class PatchEncoder(keras.layers.Layer):
    """A patch's projection plus its position's embedding (a table looked up with the same
    ids for every image: one device's tape sums each row over the batch)."""

    def __init__(self, num_patches, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_patches = num_patches
        self.projection = keras.layers.Dense(projection_dim)
        self.position_embedding = keras.layers.Embedding(num_patches, projection_dim)

    def call(self, patch):
        positions = keras.ops.expand_dims(keras.ops.arange(0, self.num_patches, 1), axis=0)
        return self.projection(patch) + self.position_embedding(positions)


class IndexedPatchEncoder(keras.layers.Layer):
    """The patch encoder as users also write it: its position table a weight of its own,
    indexed (`self.position[None]`) rather than looked up."""

    def __init__(self, num_patches, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.projection = keras.layers.Dense(projection_dim)
        self.position = self.add_weight(
            shape=(num_patches, projection_dim), initializer="uniform", name="position"
        )

    def call(self, patch):
        return self.projection(patch) + self.position[None]


def vit(*, optimizer: str = "adamw", seed: int = 4, indexed_positions: bool = False) -> keras.Model:
    """keras.io's ViT at small sizes: patches, a position Embedding, two transformer blocks
    (pre-norm attention and MLP with residuals), a flattened representation and an MLP head,
    AdamW (or rmsprop) as keras.io compiles it, without dropout (see above)."""
    keras.utils.set_random_seed(seed)
    patches_count = (VIT_IMAGE // VIT_PATCH) ** 2
    inputs = keras.Input((VIT_IMAGE, VIT_IMAGE, 1))
    encoder = IndexedPatchEncoder if indexed_positions else PatchEncoder
    encoded = encoder(patches_count, VIT_WIDTH, name="patch_encoder")(
        Patches(VIT_PATCH, name="patches")(inputs)
    )
    for i in range(2):
        x1 = keras.layers.LayerNormalization(epsilon=1e-6, name=f"ln{i}a")(encoded)
        attended = keras.layers.MultiHeadAttention(VIT_HEADS, VIT_WIDTH, name=f"attention{i}")(
            x1, x1
        )
        x2 = keras.layers.Add(name=f"residual{i}a")([attended, encoded])
        x3 = keras.layers.LayerNormalization(epsilon=1e-6, name=f"ln{i}b")(x2)
        x3 = keras.layers.Dense(2 * VIT_WIDTH, activation="gelu", name=f"mlp{i}a")(x3)
        x3 = keras.layers.Dense(VIT_WIDTH, activation="gelu", name=f"mlp{i}b")(x3)
        encoded = keras.layers.Add(name=f"residual{i}b")([x3, x2])
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="ln_final")(encoded)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(16, activation="gelu", name="head_hidden")(x)
    outputs = keras.layers.Dense(VIT_CLASSES, name="logits")(x)
    model = keras.Model(inputs, outputs)
    chosen = (
        keras.optimizers.AdamW(learning_rate=0.003, weight_decay=1e-4)
        if optimizer == "adamw"
        else keras.optimizers.RMSprop(0.003)
    )
    model.compile(
        chosen,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def images() -> tf.data.Dataset:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(VIT_EXAMPLES, VIT_IMAGE, VIT_IMAGE, 1)).astype("float32")
    y = (x[:, :4].mean(axis=(1, 2, 3)) > 0).astype("int32") + (x[:, 4:].mean(axis=(1, 2, 3)) > 0)
    return tf.data.Dataset.from_tensor_slices((x, y.astype("int32"))).batch(VIT_BATCH)


# The models the one-device checks train, with their data: name -> (make, data).
ONE_DEVICE_MATH = {
    "seq2seq_rmsprop": (seq2seq, sentence_pairs),
    "vit_adamw": (vit, images),
}

# A ViT's attention key biases shift every logit of a query alike, which the softmax cancels:
# their true gradient is zero, and Adam or RMSprop divide float32 rounding (1e-9) by its own
# root mean square, so they move by up to the learning rate per step on any device, in an
# order of summation of its own. They are held to this bound instead of the tolerance.
KEY_BIAS_BOUND = 2e-4


def max_diff(reference: keras.Model, weights) -> float:
    """The largest |difference| between `reference`'s weights and `weights` (a list, or a
    model), the key biases of attention layers excepted (KEY_BIAS_BOUND holds them)."""
    got = weights.get_weights() if isinstance(weights, keras.Model) else weights
    worst = 0.0
    for variable, want, have in zip(reference.weights, reference.get_weights(), got, strict=True):
        diff = float(np.max(np.abs(want - have)))
        if variable.path.endswith("key/bias"):
            assert diff <= KEY_BIAS_BOUND, (variable.path, diff)
            continue
        worst = max(worst, diff)
    return worst

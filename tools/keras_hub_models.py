"""A keras-hub causal LM as users bring one: a small GemmaCausalLM of random weights (no
download), its padding mask turned into sample weights, in a fixed order.

Shared by tests/test_zero3.py (local replicas) and tests/workers/zero_worker.py (worker
processes), so both train exactly what Keras's own fit trains on one device.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

VOCAB, LENGTH, EXAMPLES, GLOBAL_BATCH = 64, 8, 32, 8


def gemma_causal_lm() -> keras.Model:
    """2 decoder blocks, 2 query heads sharing 1 key/value head, tied embeddings; compiled
    as keras-hub's examples compile it (logits, per-token sample weights)."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8,
    )  # fmt: skip
    return _compiled(keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None))


def llama_causal_lm() -> keras.Model:
    """2 decoder layers, 4 query heads sharing 1 key/value head, logits from a table of their
    own (untied); compiled as gemma_causal_lm is. Shared with tests/test_tensor.py."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32,
    )  # fmt: skip
    return _compiled(keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None))


def mistral_causal_lm() -> keras.Model:
    """2 decoder layers, 2 query heads sharing 1 key/value head, a sliding window shorter
    than the sequence, logits from a table of their own (untied, ReversibleEmbedding's
    `reverse_embeddings`); compiled as gemma_causal_lm is."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.MistralBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, sliding_window=4,
    )  # fmt: skip
    return _compiled(keras_hub.models.MistralCausalLM(backbone=backbone, preprocessor=None))


def phi3_causal_lm() -> keras.Model:
    """2 decoder layers, 2 query heads sharing 1 key/value head, untied logits; compiled as
    gemma_causal_lm is."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Phi3Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32,
    )  # fmt: skip
    return _compiled(keras_hub.models.Phi3CausalLM(backbone=backbone, preprocessor=None))


def qwen_causal_lm() -> keras.Model:
    """2 decoder layers, 4 query heads sharing 2 key/value heads, biased query, key and
    value projections, tied embeddings; compiled as gemma_causal_lm is."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.QwenBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32,
    )  # fmt: skip
    return _compiled(keras_hub.models.QwenCausalLM(backbone=backbone, preprocessor=None))


def _compiled(model: keras.Model) -> keras.Model:
    """As keras-hub's examples compile a causal LM: logits, per-token sample weights."""
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    return model


def token_data() -> tf.data.Dataset:
    """(features, next tokens, weights): padded sequences whose padding weighs nothing."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, (EXAMPLES, LENGTH + 1)).astype("int32")
    mask = np.arange(LENGTH + 1)[None, :] < rng.integers(4, LENGTH + 2, EXAMPLES)[:, None]
    tokens = np.where(mask, tokens, 0)
    features = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    weights = mask[:, 1:].astype("float32")
    return tf.data.Dataset.from_tensor_slices((features, tokens[:, 1:], weights)).batch(
        GLOBAL_BATCH
    )

"""Models for the planner guide (docs/guides/planner.md): `tfdist-plan --model
docs.examples.planner_models:NAME`, run from the repository's root.

Each is built from its sizes, with random weights: the planner traces the model, it never
trains it, so nothing is downloaded.
"""

import keras


def tiny_mlp() -> keras.Model:
    """9,610 parameters: far too small to gain from a second device."""
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])  # fmt: skip
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def gpt2() -> keras.Model:
    """keras-hub's GPT-2 of 124 M parameters (the sizes of its smallest preset)."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50257, num_layers=12, num_heads=12, hidden_dim=768,
        intermediate_dim=3072, max_sequence_length=1024,
    )  # fmt: skip
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

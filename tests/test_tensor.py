"""Tensor-parallel layers (tfdist.parallel.tensor) against their dense Keras equivalents.

Over 2 and 4 replicas of a mirrored strategy on 4 logical CPUs (2-way tensor x 2-way data,
and 4-way tensor): forward outputs and gradients inside the strategy's step, and a small
transformer classifier, converted by `tensor_parallel`, trained through tfdist.fit against
the unsplit model trained by Keras's own fit on one device; and keras-hub's Gemma split by
its own layout map (`tensor_parallel(layout_map=...)`), against Keras's fit, with the bytes
each device holds during fit.
"""

from __future__ import annotations

import gc
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import FitError
from tfdist.parallel import (
    ColumnParallelDense,
    ParallelEmbedding,
    RowParallelDense,
    TensorParallelError,
    dense_model,
    split_layers,
    tensor_parallel,
)
from tfdist.parallel.tensor import dense_weights
from tfdist.parallel.tensor.derive import derive_layout_map, derive_split
from tfdist.parallel.tensor.layout_map import plan_of
from tools import keras_io_models

TOLERANCE = 1e-5
VOCAB, LENGTH, WIDTH, CLASSES = 32, 6, 16, 3


def mirrored(devices: int = 4):
    return tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(devices)]
    )


def transformer(*, mask_zero: bool = False, causal: bool = False) -> keras.Model:
    """A keras.io-style transformer classifier: embedding, self-attention, an MLP block;
    id 0 pads with `mask_zero` (the mask reaches the attention), and `causal` attends only
    to earlier positions."""
    keras.utils.set_random_seed(3)
    ids = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=mask_zero, name="embed")(ids)
    attended = keras.layers.MultiHeadAttention(4, 8, name="attention")(x, x, use_causal_mask=causal)
    x = keras.layers.LayerNormalization(name="ln1")(keras.layers.Add()([x, attended]))
    h = keras.layers.Dense(32, activation="relu", name="ff1")(x)
    h = keras.layers.Dense(WIDTH, name="ff2")(h)
    x = keras.layers.LayerNormalization(name="ln2")(keras.layers.Add()([x, h]))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, keras.layers.Dense(CLASSES, name="head")(x))


def compiled(model: keras.Model) -> keras.Model:
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def token_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (64, LENGTH)).astype("int32")
    return x, x[:, 0] % CLASSES


def in_step(strategy, model, inputs, weights):
    """Each replica's outputs (its own examples, end to end) and each weight's gradient of
    sum(outputs * weights), summed over the replicas (a split weight's parts: over the
    replicas holding the same part)."""
    dataset = tf.data.Dataset.from_tensor_slices((inputs, weights)).batch(len(weights))
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    @tf.function
    def run(batch):
        def replica(x, w):
            with tf.GradientTape() as tape:
                y = model(x)
                loss = tf.reduce_sum(y * w)
            grads = tape.gradient(loss, model.trainable_variables)
            return y, [tf.zeros([0]) if g is None else tf.convert_to_tensor(g) for g in grads]

        return strategy.run(replica, args=batch)

    outputs, grads = run(batch)
    local = strategy.experimental_local_results
    outputs = np.concatenate([t.numpy() for t in local(outputs)])
    replicas = strategy.num_replicas_in_sync
    per_variable = {}
    for variable, grad in zip(model.trainable_variables, grads, strict=True):
        parts = [t.numpy() for t in local(grad)]
        per_variable[variable.path] = sum(p for p in parts if p.size) if replicas else None
    return outputs, per_variable


def whole_gradients(layer, per_variable) -> list[np.ndarray]:
    """A split layer's gradients whole (parts of the first group, each summed over its copies)."""
    out = []
    for name, parts in layer._parts.items():
        degree = layer.tensor_parallel
        sums = []
        for part in range(degree):
            copies = parts[part::degree]
            sums.append(sum(per_variable[v.path] for v in copies))
        out.append((name, np.concatenate(sums, layer._axes[name])))
    return out


@pytest.mark.parametrize("degree", [2, 4])
def test_a_column_row_block_computes_the_dense_mlp_and_its_gradients(degree):
    strategy = mirrored()
    with strategy.scope():
        inputs = keras.Input((5,))
        column = ColumnParallelDense(8, activation="relu", tensor_parallel=degree)
        row = RowParallelDense(3, tensor_parallel=degree)
        model = keras.Model(inputs, row(column(inputs)))
    first, second = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)
    dense = keras.Sequential([keras.Input((5,)), first, second])
    first.set_weights(dense_weights(column))
    second.set_weights(dense_weights(row))
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(12, 5)).astype("float32"), rng.normal(size=(12, 3)).astype("float32")
    outputs, grads = in_step(strategy, model, x, w)
    np.testing.assert_allclose(outputs, dense(x), atol=TOLERANCE)
    np.testing.assert_allclose(model(x), dense(x), atol=TOLERANCE)  # outside a step: whole
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(dense(x) * w)
    kernel, bias, row_kernel, row_bias = tape.gradient(loss, dense.trainable_variables)
    got = dict(whole_gradients(column, grads))
    np.testing.assert_allclose(got["kernel"], kernel, atol=TOLERANCE)
    np.testing.assert_allclose(got["bias"], bias, atol=TOLERANCE)
    np.testing.assert_allclose(
        dict(whole_gradients(row, grads))["kernel"], row_kernel, atol=TOLERANCE
    )
    np.testing.assert_allclose(grads[row.bias.path], row_bias, atol=TOLERANCE)


@pytest.mark.parametrize("layer", ["column_gathered", "row_from_whole"])
def test_a_split_dense_layer_on_its_own_computes_the_dense_layer(layer):
    """A column layer that gathers its columns, and a row layer that takes each replica's
    own examples whole, over 2-way tensor x 2-way data."""
    strategy = mirrored()
    with strategy.scope():
        inputs = keras.Input((6,))
        split = (
            ColumnParallelDense(4, activation="tanh", gather_output=True, tensor_parallel=2)
            if layer == "column_gathered"
            else RowParallelDense(4, activation="tanh", input_is_parallel=False, tensor_parallel=2)
        )
        model = keras.Model(inputs, split(inputs))
    dense_layer = keras.layers.Dense(4, activation="tanh")
    dense = keras.Sequential([keras.Input((6,)), dense_layer])
    dense_layer.set_weights(dense_weights(split))
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(12, 6)).astype("float32"), rng.normal(size=(12, 4)).astype("float32")
    outputs, grads = in_step(strategy, model, x, w)
    np.testing.assert_allclose(outputs, dense(x), atol=TOLERANCE)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(dense(x) * w)
    kernel = tape.gradient(loss, dense.trainable_variables)[0]
    np.testing.assert_allclose(
        dict(whole_gradients(split, grads))["kernel"], kernel, atol=TOLERANCE
    )


@pytest.mark.parametrize("degree", [2, 4])
def test_a_parallel_embedding_looks_up_and_differentiates_as_keras_s(degree):
    strategy = mirrored()
    with strategy.scope():
        ids = keras.Input((5,), dtype="int32")
        embedding = ParallelEmbedding(8, 3, tensor_parallel=degree)
        model = keras.Model(ids, embedding(ids))
    dense_layer = keras.layers.Embedding(8, 3)
    dense = keras.Sequential([keras.Input((5,), dtype="int32"), dense_layer])
    dense_layer.set_weights(dense_weights(embedding))
    rng = np.random.default_rng(1)
    x = rng.integers(0, 8, (12, 5)).astype("int32")
    w = rng.normal(size=(12, 5, 3)).astype("float32")
    outputs, grads = in_step(strategy, model, x, w)
    np.testing.assert_allclose(outputs, dense(x), atol=TOLERANCE)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(dense(x) * w)
    (want,) = tape.gradient(loss, dense.trainable_variables)
    ((_, got),) = whole_gradients(embedding, grads)
    np.testing.assert_allclose(got, tf.convert_to_tensor(want), atol=TOLERANCE)


@pytest.mark.parametrize("degree", [2, 4])
def test_parallel_attention_computes_keras_s_attention_and_its_gradients(degree):
    keras.utils.set_random_seed(7)
    query, value = keras.Input((4, 8)), keras.Input((5, 6))
    mask = keras.Input((4, 5), dtype="bool")
    attention = keras.layers.MultiHeadAttention(4, 3, value_dim=2, name="attention")
    dense = keras.Model([query, value, mask], attention(query, value, attention_mask=mask))
    strategy = mirrored()
    with strategy.scope():
        model = tensor_parallel(dense, degree=degree)
    (split,) = split_layers(model)
    assert split.tensor_parallel == degree
    rng = np.random.default_rng(2)
    q = rng.normal(size=(8, 4, 8)).astype("float32")
    v = rng.normal(size=(8, 5, 6)).astype("float32")
    m = rng.random((8, 4, 5)) > 0.3
    w = rng.normal(size=(8, 4, 8)).astype("float32")
    outputs, grads = in_step(strategy, model, (q, v, m), w)
    np.testing.assert_allclose(outputs, dense([q, v, m]), atol=TOLERANCE)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(dense([q, v, m]) * w)
    want = tape.gradient(loss, dense.trainable_variables)
    got = dict(whole_gradients(split, grads))
    names = [
        "query_kernel",
        "query_bias",
        "key_kernel",
        "key_bias",
        "value_kernel",
        "value_bias",
        "output_kernel",
    ]
    for name, expected in zip(names, want, strict=False):
        np.testing.assert_allclose(got[name], expected, atol=TOLERANCE, err_msg=name)
    np.testing.assert_allclose(grads[split.output_bias.path], want[-1], atol=TOLERANCE)


@pytest.mark.parametrize("masks", ["mask_zero", "causal", "mask_zero+causal"])
def test_split_attention_honours_keras_s_masks(masks):
    """An Embedding(mask_zero=True) before the attention (its mask reaches the query and the
    value), and use_causal_mask: the converted model computes the dense one's outputs and
    gradients over 2-way tensor x 2-way data (it ignored the implicit masks: 0.25 apart)."""
    dense = transformer(mask_zero="mask_zero" in masks, causal="causal" in masks)
    with mirrored().scope():
        model = tensor_parallel(dense, degree=2)
    rng = np.random.default_rng(4)
    x = rng.integers(1, VOCAB, (8, LENGTH)).astype("int32")
    x[:, 4:] *= rng.random((8, LENGTH - 4)) > 0.5  # padding (id 0) late in some rows
    w = rng.normal(size=(8, CLASSES)).astype("float32")
    np.testing.assert_allclose(model(x), dense(x), atol=TOLERANCE)  # outside a step
    outputs, grads = in_step(mirrored(), model, x, w)
    np.testing.assert_allclose(outputs, dense(x), atol=TOLERANCE)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(dense(x) * w)
    want = dict(
        zip(
            [v.path for v in dense.trainable_variables],
            tape.gradient(loss, dense.trainable_variables),
            strict=True,
        )
    )
    (attention,) = [layer for layer in split_layers(model) if "attention" in layer.name]
    got = dict(whole_gradients(attention, grads))
    np.testing.assert_allclose(got["query_kernel"], want["attention/query/kernel"], atol=TOLERANCE)


@pytest.mark.parametrize("case", ["keras_io", "padded"])
def test_keras_io_s_classifier_splits_inside_its_subclassed_blocks_and_trains_as_keras(case):
    """keras.io's Transformer classifier as keras.io writes it (TokenAndPositionEmbedding
    and TransformerBlock are Layer subclasses; it crashed: "No such layer"), and the block
    behind an Embedding(mask_zero=True): converted with degree=2, the Embeddings, the
    attention and the Dense->Dense pairs inside the blocks are split, and 2 epochs through
    tfdist.fit train as Keras's fit of the dense model.

    The reference is one device. keras.io's model has a position embedding, whose sparse
    gradient's rows Keras's Adam squares apart: one device holds one row per position,
    summed over the batch, where Keras's own fit over 4 replicas keeps one per replica (0.003
    from one device in loss after an epoch); the parts' rows are added as one device's."""
    build = {
        "keras_io": lambda: keras_io_models.transformer_classifier(dropout=0.0),
        "padded": keras_io_models.padded_classifier,
    }[case]
    data = keras_io_models.reviews(padded=case == "padded")
    reference = build()
    want = reference.fit(data, epochs=2, verbose=0, shuffle=False).history
    dense = build()
    with mirrored().scope():
        model = tensor_parallel(dense, degree=2)
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    kinds = sorted(type(layer).__name__ for layer in split_layers(model))
    # keras.io's: the token and position embeddings, the block's attention and its feed-
    # forward pair; the padded one: its embedding, the block's, and the Dense->Dense head.
    pairs = 1 if case == "keras_io" else 2
    expected = ["ParallelEmbedding"] * (3 - pairs) + ["ParallelMultiHeadAttention"]
    expected += ["ColumnParallelDense", "RowParallelDense"] * pairs
    assert kinds == sorted(expected), kinds
    got = tfdist.fit(model, data, epochs=2, verbose=0).history
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    back = dense_model(model)
    for a, b in zip(reference.get_weights(), back.get_weights(), strict=True):
        assert np.max(np.abs(a - b)) <= TOLERANCE


def test_fit_called_twice_keeps_the_parts_optimizer_state():
    """Each replica's optimizer copy for its parts goes on from one fit call to the next, as
    Keras's optimizer does (it was rebuilt: 0.024 away after two one-epoch fits)."""
    x, y = token_data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    reference = compiled(transformer())
    for _ in range(2):
        reference.fit(data, verbose=0)
    with mirrored().scope():
        model = compiled(tensor_parallel(transformer(), degree=2))
    for _ in range(2):
        tfdist.fit(model, data, verbose=0)
    split = {layer.name: layer for layer in split_layers(model)}
    for layer in reference.layers:
        if layer.weights:
            mine = dense_weights(split[layer.name]) if layer.name in split else None
            mine = mine if mine is not None else model.get_layer(layer.name).get_weights()
            for a, b in zip(layer.get_weights(), mine, strict=True):
                assert np.max(np.abs(a - b)) <= TOLERANCE, layer.name


@pytest.mark.parametrize("degree", [2, 4])
def test_a_converted_transformer_trains_through_fit_as_keras_trains_it_unsplit(degree):
    """2-way tensor x 2-way data, and 4-way tensor, on 4 replicas: the same loss curve and
    the same weights after 12 Adam steps as Keras's fit on one device."""
    x, y = token_data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    reference = compiled(transformer())
    want = reference.fit(data, epochs=3, verbose=0).history
    with mirrored().scope():
        model = compiled(tensor_parallel(transformer(), degree=degree))
    kinds = {type(layer).__name__ for layer in split_layers(model)}
    assert kinds == {
        "ParallelEmbedding",
        "ParallelMultiHeadAttention",
        "ColumnParallelDense",
        "RowParallelDense",
    }
    got = tfdist.fit(model, data, epochs=3, verbose=0).history
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)
    split = {layer.name: layer for layer in split_layers(model)}
    for layer in reference.layers:
        if not layer.weights:
            continue
        mine = split[layer.name] if layer.name in split else model.get_layer(layer.name)
        mine = dense_weights(mine) if layer.name in split else mine.get_weights()
        for a, b in zip(layer.get_weights(), mine, strict=True):
            assert np.max(np.abs(a - b)) <= TOLERANCE, layer.name


def penalised() -> keras.Model:
    """Embedding(L1) -> Dense(L2 kernel, L1 bias) -> Dense(L1L2 kernel) -> head: the penalties
    every split layer carries, each on a split weight."""
    keras.utils.set_random_seed(4)
    ids = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, WIDTH, embeddings_regularizer=keras.regularizers.L1(1e-3),
                               name="embed")(ids)  # fmt: skip
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(32, activation="tanh", name="up", kernel_regularizer="l2",
                           bias_regularizer=keras.regularizers.L1(1e-2))(x)  # fmt: skip
    x = keras.layers.Dense(
        WIDTH, name="down", kernel_regularizer=keras.regularizers.L1L2(1e-3, 1e-2)
    )(x)
    return keras.Model(ids, keras.layers.Dense(CLASSES, name="head")(x))


@pytest.mark.parametrize("degree", [2, 4])
def test_split_weights_keep_their_penalties_as_keras_adds_them_unsplit(degree):
    """The penalties of split weights count once in the loss and its gradient, over 2-way
    tensor x 2-way data and 4-way tensor: the same loss and weights as Keras unsplit (the
    split layers dropped them: 0.16 apart on one kernel)."""
    x, y = token_data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    reference = compiled(penalised())
    want = reference.fit(data, epochs=2, verbose=0).history
    with mirrored().scope():
        model = compiled(tensor_parallel(penalised(), degree=degree))
    assert {layer.name for layer in split_layers(model)} == {"embed", "up", "down"}
    got = tfdist.fit(model, data, epochs=2, verbose=0).history
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    dense = dense_model(model)
    assert isinstance(dense.get_layer("down").kernel_regularizer, keras.regularizers.L1L2)
    for a, b in zip(reference.get_weights(), dense.get_weights(), strict=True):
        assert np.max(np.abs(a - b)) <= TOLERANCE


@pytest.mark.parametrize(
    "layer, what",
    [
        (keras.layers.Dense(8, kernel_constraint="non_neg"), "kernel_constraint"),
        (keras.layers.Dense(8, activity_regularizer="l2"), "activity_regularizer"),
        (
            keras.layers.Dense(8, kernel_regularizer=keras.regularizers.OrthogonalRegularizer()),
            "kernel_regularizer",
        ),
    ],
)
def test_a_layer_whose_split_would_change_its_math_is_refused(layer, what):
    inputs = keras.Input((6,))
    dense = keras.Model(inputs, keras.layers.Dense(3)(layer(inputs)))
    with mirrored().scope(), pytest.raises(TensorParallelError, match=f"Cannot split .*{what}"):
        tensor_parallel(dense, degree=2)


def test_a_trained_split_model_saves_loads_and_converts_back_to_keras_layers(tmp_path):
    """Saved and loaded under its strategy (compile=False: the parts' optimizer state is
    tfdist's, resumed by StepCheckpoint) it computes the same; outside one, loading says
    what to do; dense_model gives plain Keras layers that load without tfdist."""
    x, y = token_data()
    strategy = mirrored()
    with strategy.scope():
        model = compiled(tensor_parallel(transformer(), degree=2))
    tfdist.fit(model, x[:32], y[:32], batch_size=16, verbose=0)
    want = model.predict(x[:8], verbose=0)
    model.save(tmp_path / "split.keras")
    with strategy.scope():
        loaded = keras.models.load_model(tmp_path / "split.keras", compile=False)
    np.testing.assert_allclose(loaded.predict(x[:8], verbose=0), want, atol=TOLERANCE)
    with pytest.raises(TensorParallelError, match=r"inside `with strategy.scope\(\):`"):
        keras.models.load_model(tmp_path / "split.keras", compile=False)
    dense = dense_model(model)
    assert not split_layers(dense)
    dense.save(tmp_path / "dense.keras")
    plain = keras.models.load_model(tmp_path / "dense.keras")
    np.testing.assert_allclose(plain.predict(x[:8], verbose=0), want, atol=TOLERANCE)


def test_each_device_holds_its_part_of_a_split_weight():
    with mirrored().scope():
        layer = ColumnParallelDense(8, tensor_parallel=2)
        layer.build((None, 6))
    parts = layer._parts["kernel"]
    assert [tuple(v.shape) for v in parts] == [(6, 4)] * 4
    assert [v.value.device.split(":")[-1] for v in parts] == ["0", "1", "2", "3"]
    np.testing.assert_array_equal(parts[0].numpy(), parts[2].numpy())  # data-parallel copies


# --- what cannot be split: one clear error each --------------------------------------------------


def test_heads_that_do_not_divide_over_the_replicas_are_refused():
    query = keras.Input((4, 8))
    dense = keras.Model(query, keras.layers.MultiHeadAttention(3, 4)(query, query))
    with (
        mirrored().scope(),
        pytest.raises(TensorParallelError, match="3 heads do not divide over tensor_parallel=2"),
    ):
        tensor_parallel(dense, degree=2)


def test_units_that_do_not_divide_are_refused():
    with (
        mirrored().scope(),
        pytest.raises(TensorParallelError, match="does not divide into tensor_parallel=4"),
    ):
        ColumnParallelDense(6, tensor_parallel=4).build((None, 5))


def test_a_degree_that_does_not_divide_the_replicas_is_refused():
    with (
        mirrored().scope(),
        pytest.raises(
            TensorParallelError, match="4 replicas do not form groups of tensor_parallel=3"
        ),
    ):
        ColumnParallelDense(6, tensor_parallel=3).build((None, 5))


def test_a_subclassed_model_is_split_as_its_shapes_say_once_built():
    """No layer graph to rewrite: the split is derived from its layers (derive.py), which
    reads their shapes, so an unbuilt one is refused in one line; dense_model needs a graph."""

    class Net(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(TensorParallelError, match="has none yet. Build it first"):
        tensor_parallel(Net(), degree=2)
    with pytest.raises(TensorParallelError, match="needs degree="):
        tensor_parallel(transformer())
    with pytest.raises(TensorParallelError, match="is subclassed"):
        dense_model(Net())


@pytest.mark.parametrize(
    "optimizer, keywords, message",
    [
        (lambda: keras.optimizers.Adam(clipnorm=1.0), {}, "clipnorm"),
        # Split layers hold their parts their own way; a layout's parts shard (test_layouts).
        (lambda: "adam", {"shard_optimizer": "zero2"}, r"layout_map=derive_layout_map\(model"),
    ],
)
def test_options_split_layers_cannot_honour_are_refused(optimizer, keywords, message):
    x, y = token_data()
    with mirrored().scope():
        model = tensor_parallel(transformer(), degree=2)
        model.compile(optimizer(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(FitError, match=message):
        tfdist.fit(model, x, y, batch_size=16, verbose=0, **keywords)


# --- keras-hub's own split: tensor_parallel(layout_map=Backbone.get_layout_map(mesh)) --------


def gemma_layout(devices: int, degree: int):
    """GemmaBackbone's layout map over a (data, model) mesh of the replicas' devices."""
    import keras_hub

    names = [f"cpu:{i}" for i in range(devices)]
    mesh = keras.distribution.DeviceMesh((devices // degree, degree), ["batch", "model"], names)
    return keras_hub.models.GemmaBackbone.get_layout_map(mesh)


@pytest.fixture(scope="module")
def gemma_reference():
    """Keras's own fit of keras-hub's Gemma causal LM on one device, 2 epochs."""
    from tools import keras_hub_models

    model = keras_hub_models.gemma_causal_lm()
    history = model.fit(keras_hub_models.token_data(), epochs=2, verbose=0, shuffle=False)
    return model, history.history


@pytest.mark.xdist_group("tensor_gemma")  # gemma_reference's fit runs once
@pytest.mark.parametrize("devices", [2, 4])
def test_gemma_split_by_its_own_layout_map_trains_as_keras_fit_on_one_device(
    devices, gemma_reference
):
    """keras-hub's Gemma causal LM (random weights, its padding mask as sample weights), split
    by GemmaBackbone.get_layout_map over a model axis of 2: 1 group of 2 replicas (on CPU:1
    and CPU:2, the host CPU:0 apart), or 2 groups (2-way tensor x 2-way data). Its embedding
    (the tied logits too), query, output and MLP kernels are split; its single key/value
    head is held by both replicas of a group; norms whole. On 4 devices fit is called
    twice, an epoch each, as users do. During fit each replica's device holds 3x its share
    (Adam: its parts and what it holds whole, with their slots), and the host the model."""
    from tfdist.parallel.tensor.layout_map import plan_of
    from tools import keras_hub_models

    reference, history = gemma_reference
    replicas = range(1, 3) if devices == 2 else range(4)
    strategy = tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in replicas]
    )
    gc.collect()  # nothing of an earlier test freed during the count
    record = tfdist.DeviceBytes()  # counts what is made from here on
    with tfdist.host_scope(strategy):
        model = keras_hub_models.gemma_causal_lm()
    assert tensor_parallel(model, layout_map=gemma_layout(devices, 2)) is model
    plan = plan_of(model)
    placements = zip(model.trainable_variables, plan.placements, strict=True)
    held = {v.path: p.parts for v, p in placements}
    assert held["token_embedding/embeddings"] == 2
    assert held["decoder_block_0/attention/query/kernel"] == 2
    assert held["decoder_block_0/attention/key/kernel"] == 1  # 1 head: both replicas hold it
    assert held["decoder_block_0/ffw_linear/kernel"] == 2
    assert held["decoder_block_0/pre_ffw_norm/scale"] == 1
    data = keras_hub_models.token_data()
    if devices == 4:
        losses = [
            tfdist.fit(model, data, verbose=0, callbacks=[record]).history["loss"][0]
            for _ in range(2)
        ]
    else:
        losses = tfdist.fit(model, data, epochs=2, verbose=0, callbacks=[record]).history["loss"]
    assert losses == pytest.approx(history["loss"], abs=1e-5)
    weights = zip(reference.weights, reference.get_weights(), model.get_weights(), strict=True)
    for v, want, got in weights:
        assert np.max(np.abs(want - got)) <= TOLERANCE, v.path
    # The model is the user's Keras model again outside the step: whole weights, plain calls.
    tokens = next(iter(data))[0]
    np.testing.assert_allclose(model(tokens), reference(tokens), atol=1e-4)
    # Memory: the parts, not the whole, on each device.
    split, whole = plan.split_bytes(model)  # the single key/value head: whole on each
    assert split / (split + whole) > 0.8  # what the map splits is most of the model
    share = whole + split / 2
    for device in replicas:
        if device:  # CPU:0 over 4 replicas is also the host
            got = record.added[f"CPU:{device}"]
            assert got == pytest.approx(3.0 * share, rel=0.05), (device, got / share)
    if devices == 2:
        assert record.added["CPU:0"] == pytest.approx(split + whole, rel=0.05)


@pytest.mark.parametrize("name, backbone", [("llama", "LlamaBackbone"), ("qwen", "QwenBackbone")])
def test_keras_hub_s_own_layout_maps_as_shipped_train_as_keras(name, backbone, caplog):
    """keras-hub's Llama and Qwen maps split the attention's query, key and value kernels
    by the model's width, for GSPMD; tfdist splits those kernels along their heads (the same
    math, logged) and the causal LMs train as Keras's fit on one device. Qwen's projections
    carry biases, split with their heads."""
    import keras_hub

    from tools import keras_hub_models

    make = getattr(keras_hub_models, f"{name}_causal_lm")
    names = ["cpu:0", "cpu:1"]
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], names)
    layout = getattr(keras_hub.models, backbone).get_layout_map(mesh)
    with tfdist.host_scope(mirrored(2)):
        model = make()
    with caplog.at_level(logging.INFO, logger="tfdist"):
        tensor_parallel(model, layout_map=layout)
    assert "self_attention/query/kernel" in caplog.text and "along their heads" in caplog.text
    reference = make()
    want = reference.fit(keras_hub_models.token_data(), epochs=2, verbose=0, shuffle=False)
    got = tfdist.fit(model, keras_hub_models.token_data(), epochs=2, verbose=0)
    assert got.history["loss"] == pytest.approx(want.history["loss"], abs=1e-5)
    for want_w, got_w in zip(reference.get_weights(), model.get_weights(), strict=True):
        assert np.max(np.abs(want_w - got_w)) <= TOLERANCE
    # Its copy on plain Keras layers holds the model's weights, each once.
    dense = dense_model(model)
    assert [w.path for w in dense.weights] == [w.path for w in reference.weights]
    for want_w, got_w in zip(reference.get_weights(), dense.get_weights(), strict=True):
        assert np.max(np.abs(want_w - got_w)) <= TOLERANCE


class Gated(keras.layers.Layer):
    """A value weighed by a softmax over a gate's outputs, as a mixture of experts' router
    weighs its experts: the gate has no row layer beside it to add its parts."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = keras.layers.Dense(4, name="gate")
        self.value = keras.layers.Dense(4, name="value")

    def call(self, x):
        return self.value(x) * keras.ops.softmax(self.gate(x))


def gated_regression() -> keras.Model:
    keras.utils.set_random_seed(2)
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(1, name="head")(Gated(name="gated")(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.02), "mse")
    return model


def test_a_map_that_splits_a_lone_layer_by_its_outputs_gathers_them_and_trains_as_keras():
    """A map that splits the gate by its outputs (as keras-hub's QwenMoe map splits its
    router by experts): the softmax after it needs every column, so they are gathered."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], ["cpu:0", "cpu:1"])
    layout = keras.distribution.LayoutMap(mesh)
    layout[".*gate/kernel"] = (None, "model")
    with mirrored(2).scope():
        model = gated_regression()
    tensor_parallel(model, layout_map=layout)
    assert [kind for layer, kind in plan_of(model).layers] == ["gathered"]
    reference = gated_regression()
    want = reference.fit(data, epochs=2, verbose=0, shuffle=False).history
    got = tfdist.fit(model, data, epochs=2, verbose=0).history
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    for want_w, got_w in zip(reference.get_weights(), model.get_weights(), strict=True):
        assert np.max(np.abs(want_w - got_w)) <= TOLERANCE


def test_a_lone_layer_whose_split_outputs_are_not_its_last_dimension_is_refused():
    inputs = keras.Input((6,))
    spread = keras.layers.EinsumDense("bd,dhk->bhk", (4, 2), name="spread")(inputs)
    model = keras.Model(inputs, keras.layers.Flatten()(spread))
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], ["cpu:0", "cpu:1"])
    layout = keras.distribution.LayoutMap(mesh)
    layout["spread/kernel"] = (None, "model", None)
    with pytest.raises(TensorParallelError, match="spread is split by its outputs with no row"):
        tensor_parallel(model, layout_map=layout)


def test_a_layout_map_keras_hub_writes_is_checked_before_training():
    """One line each: a mesh without the model axis, both degree= and layout_map=, a weight
    of a layer that cannot split, and heads that do not divide over the model axis."""
    from tools import keras_hub_models

    model = keras_hub_models.gemma_causal_lm()
    mesh = keras.distribution.DeviceMesh((2,), ["batch"], ["cpu:0", "cpu:1"])
    with pytest.raises(TensorParallelError, match="has no 'model' axis"):
        tensor_parallel(model, layout_map=keras.distribution.LayoutMap(mesh))
    with pytest.raises(TensorParallelError, match="Pass degree= or layout_map=, not both"):
        tensor_parallel(model, degree=2, layout_map=gemma_layout(2, 2))
    norms = gemma_layout(2, 2)
    norms[".*pre_ffw_norm/scale"] = ("model",)
    with pytest.raises(TensorParallelError, match="belongs to a RMSNormalization"):
        tensor_parallel(model, layout_map=norms)
    with pytest.raises(
        TensorParallelError, match=r"attention_output/kernel has 2 along .* 4 parts"
    ):
        tensor_parallel(model, layout_map=gemma_layout(4, 4))


# --- a split derived from the layers' shapes: tensor_parallel(model, degree=T), no map ----------


@pytest.mark.parametrize("name", ["mistral", "phi3"])
def test_a_model_that_ships_no_layout_map_splits_as_its_shapes_say_and_trains_as_keras(
    name, caplog
):
    """keras-hub ships no layout map for Mistral or Phi3. tensor_parallel(degree=2) derives
    one: attention by heads (2 query heads sharing 1 key/value head, held whole by both
    replicas; Mistral counts them in private attributes and attends through a sliding
    window), each gated MLP by columns then rows, the vocabulary of keras-hub's
    ReversibleEmbedding (its untied reverse table by columns); norms whole. Logged layer by
    layer. fit called twice against Keras's fit on one device; dense_model gives back a
    plain Keras model that predicts as the reference does."""
    pytest.importorskip("keras_hub")
    from tools import keras_hub_models

    make = getattr(keras_hub_models, f"{name}_causal_lm")
    with tfdist.host_scope(mirrored(2)):
        model = make()
    with caplog.at_level(logging.INFO, logger="tfdist"):
        assert tensor_parallel(model, degree=2) is model
    attention = "self_attention" if name == "mistral" else "attention"
    for line in [
        "is derived from its layers' shapes",
        f"split transformer_layer_0/{attention}: by heads",
        "split transformer_layer_1: MLP feedforward_intermediate_dense, feedforward_gate_dense"
        " -> feedforward_output_dense (width 32 by columns, then rows)",
        "split token_embedding: by vocabulary (64 and its reverse table)",
    ]:
        assert line in caplog.text
    placements = zip(model.trainable_variables, plan_of(model).placements, strict=True)
    held = {v.path: (p.axis, p.parts) for v, p in placements}
    block = f"transformer_layer_0/{attention}"
    assert held[f"{block}/query/kernel"] == (1, 2)
    assert held[f"{block}/key/kernel"] == (1, 1)  # 1 key/value head: both replicas hold it
    assert held[f"{block}/attention_output/kernel"] == (0, 2)
    assert held["transformer_layer_0/feedforward_gate_dense/kernel"] == (1, 2)
    assert held["transformer_layer_0/feedforward_output_dense/kernel"] == (0, 2)
    assert held["token_embedding/reverse_embeddings"] == (1, 2)
    assert held["sequence_output_layernorm/scale"] == (None, 1)
    data = keras_hub_models.token_data()
    losses = [tfdist.fit(model, data, verbose=0).history["loss"][0] for _ in range(2)]
    reference = make()
    want = reference.fit(data, epochs=2, verbose=0, shuffle=False).history["loss"]
    assert losses == pytest.approx(want, abs=1e-5)
    for v, want_w, got_w in zip(
        reference.weights, reference.get_weights(), model.get_weights(), strict=True
    ):
        assert np.max(np.abs(want_w - got_w)) <= TOLERANCE, v.path
    plain = dense_model(model)
    assert plan_of(plain) is None and plain is not model
    tokens = next(iter(data))[0]
    np.testing.assert_allclose(plain.predict(tokens, verbose=0), reference(tokens), atol=1e-4)


class WideBlock(keras.layers.Layer):
    """A block whose MLP narrows through an activation (its parts would pass through it
    before they are added) beside one of another width that can split."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(8, activation="relu", name="up")
        self.down = keras.layers.Dense(4, activation="tanh", name="down")
        self.widen = keras.layers.Dense(12, activation="gelu", name="widen")
        self.narrow = keras.layers.Dense(4, name="narrow")

    def call(self, x):
        return self.down(self.up(x)) + self.narrow(self.widen(x))


def test_a_map_is_checked_against_the_model_before_training_naming_a_dimension_that_works():
    """Llama's map fits Mistral (the same layer names; its width split moves to the heads),
    splitting as the derived map does but for the untied logits' table, which it holds whole;
    a map that splits one projection of an attention, or an Embedding's features, is refused
    in one line that names the weight, its shape, the dimension asked and one that works;
    derive_layout_map is the derived split as a map to edit. A layer that cannot split
    stays whole, and the report says why."""
    keras_hub = pytest.importorskip("keras_hub")
    from tools import keras_hub_models

    model = keras_hub_models.mistral_causal_lm()
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], ["cpu:0", "cpu:1"])
    tensor_parallel(model, layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh))
    from_llama = [(p.axis, p.parts) for p in plan_of(model).placements]
    tensor_parallel(model, layout_map=derive_layout_map(model, mesh))
    derived = [(p.axis, p.parts) for p in plan_of(model).placements]
    # The same split, and the derived one splits the untied logits' table too
    paths = [v.path for v in model.trainable_variables]
    differ = [p for p, a, b in zip(paths, from_llama, derived, strict=True) if a != b]
    assert differ == ["token_embedding/reverse_embeddings"]
    attention_only = keras.distribution.LayoutMap(mesh)
    attention_only[".*attention_output.kernel"] = (None, None, "model")
    with pytest.raises(
        TensorParallelError,
        match=r"self_attention/query/kernel: the map splits self_attention's heads .* "
        r"dimension 1 would work .* Received: shape \(16, 2, 8\), not in the map",
    ):
        tensor_parallel(model, layout_map=attention_only)
    features = keras.distribution.LayoutMap(mesh)
    features["token_embedding/embeddings"] = (None, "model")
    with pytest.raises(
        TensorParallelError,
        match=r"dimension 0 would work .*/embeddings of shape \(64, 16\) split along dimension 1",
    ):
        tensor_parallel(model, layout_map=features)

    inputs = keras.Input((4,))
    block = keras.Model(inputs, WideBlock(name="block")(inputs))
    derived = derive_split(block, 2)
    assert derived.axes == {"block/widen/kernel": 1, "block/narrow/kernel": 0}
    assert derived.whole == [
        "block: up -> down: down applies an activation before its parts would be added"
    ]

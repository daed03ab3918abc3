"""Converting a model: `tensor_parallel` splits a Sequential or functional model's Dense->Dense
blocks, Embeddings and MultiHeadAttention layers (weights included); `dense_model` turns a
trained split model back into plain Keras layers (for one device, or for users without
tfdist)."""

from __future__ import annotations

import keras
import numpy as np

from tfdist import compat
from tfdist.parallel.tensor.layers import (
    ColumnParallelDense,
    ParallelEmbedding,
    ParallelMultiHeadAttention,
    RowParallelDense,
    _Split,
    _SplitDense,
)
from tfdist.parallel.tensor.mappings import TensorParallelError


def tensor_parallel(model: keras.Model, *, degree: int | None = None) -> keras.Model:
    """A copy of `model` with its Dense->Dense blocks, Embeddings and MultiHeadAttention
    layers split over `degree` replicas (call it inside the strategy's scope).

    A Dense layer whose output feeds only another Dense becomes a ColumnParallelDense and
    that one a RowParallelDense (an MLP block: one exchange forward); an Embedding a
    ParallelEmbedding; a MultiHeadAttention a ParallelMultiHeadAttention. The copy starts
    from the model's weights (it computes the same function) and is not compiled.

    Raises:
      TensorParallelError: a size does not divide by `degree` (units, vocabulary, heads),
        or the model is subclassed (no layer graph to rewrite).
    """
    graph = compat.layer_graph(model)
    if graph is None:
        raise TensorParallelError(
            f"tensor_parallel rewrites a Sequential or functional model's layer graph; "
            f"{model.name!r} is subclassed. Build it with the split layers directly "
            "(tfdist.parallel.ColumnParallelDense, ...). Received: " + type(model).__name__
        )
    column, row = _mlp_pairs(model, graph)
    made: dict[str, _Split] = {}

    def clone(layer):
        config = layer.get_config()
        if layer.name in column or layer.name in row:
            kind = ColumnParallelDense if layer.name in column else RowParallelDense
            new = kind(
                config["units"], activation=config["activation"], use_bias=config["use_bias"],
                tensor_parallel=degree, name=layer.name,
            )  # fmt: skip
        elif isinstance(layer, keras.layers.Embedding) and not config.get("mask_zero"):
            new = ParallelEmbedding(
                config["input_dim"], config["output_dim"], tensor_parallel=degree, name=layer.name
            )
        elif isinstance(layer, keras.layers.MultiHeadAttention) and config["attention_axes"] in (
            None, (1,), [1],
        ):  # fmt: skip
            new = ParallelMultiHeadAttention(
                config["num_heads"], config["key_dim"], value_dim=config["value_dim"],
                dropout=config["dropout"], use_bias=config["use_bias"],
                output_shape=config["output_shape"], seed=config.get("seed"),
                tensor_parallel=degree, name=layer.name,
            )  # fmt: skip
        else:
            return layer.__class__.from_config(config)
        made[layer.name] = new
        return new

    copy = keras.models.clone_model(model, clone_function=clone)
    for layer in model.layers:
        if layer.name not in made:
            if not isinstance(layer, keras.layers.InputLayer) and layer.weights:
                copy.get_layer(layer.name).set_weights(layer.get_weights())
            continue
        _load_dense(made[layer.name], layer)
    return copy


def dense_model(model: keras.Model) -> keras.Model:
    """A copy of `model` with plain Keras layers for its split ones (Dense, Embedding,
    MultiHeadAttention), the whole weights in them: for one device, or to save a model that
    loads without tfdist. Call it outside any strategy's scope.

    Raises:
      TensorParallelError: the model is subclassed (no layer graph to rewrite).
    """
    if compat.layer_graph(model) is None:
        raise TensorParallelError(
            f"dense_model rewrites a Sequential or functional model's layer graph; "
            f"{model.name!r} is subclassed. Received: {type(model).__name__}"
        )

    def clone(layer):
        if isinstance(layer, _SplitDense):
            return keras.layers.Dense(
                layer.units, activation=layer.activation, use_bias=layer.use_bias,
                name=layer.name,
            )  # fmt: skip
        if isinstance(layer, ParallelEmbedding):
            return keras.layers.Embedding(layer.input_dim, layer.output_dim, name=layer.name)
        if isinstance(layer, ParallelMultiHeadAttention):
            return keras.layers.MultiHeadAttention(
                layer.num_heads, layer.key_dim, value_dim=layer.value_dim,
                dropout=layer.dropout, use_bias=layer.use_bias,
                output_shape=layer.output_size, name=layer.name,
            )  # fmt: skip
        return layer.__class__.from_config(layer.get_config())

    copy = keras.models.clone_model(model, clone_function=clone)
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer) or not layer.weights:
            continue
        weights = dense_weights(layer) if isinstance(layer, _Split) else layer.get_weights()
        copy.get_layer(layer.name).set_weights(weights)
    return copy


def _mlp_pairs(model, graph) -> tuple[set[str], set[str]]:
    """Names of the Dense layers that start (column) and end (row) a Dense->Dense block."""
    dense = {layer.name: layer for layer in model.layers if type(layer) is keras.layers.Dense}
    consumers: dict[str, list[str]] = {}
    feeds: dict[str, str] = {}
    for layer in model.layers:
        for inputs in compat.layer_inputs_in(graph, layer):
            for tensor in inputs:
                producer = compat.producer(tensor)
                if producer is not None:
                    consumers.setdefault(producer.name, []).append(layer.name)
                    if len(inputs) == 1:
                        feeds[layer.name] = producer.name
    column, row = set(), set()
    for name in dense:
        source = feeds.get(name)
        if source in dense and consumers.get(source) == [name] and source not in row | column:
            if name in column:
                continue
            column.add(source)
            row.add(name)
    return column, row


def _load_dense(new: _Split, old) -> None:
    """Sets a split layer's parts from the dense layer it replaces."""
    if isinstance(new, (ColumnParallelDense, RowParallelDense)):
        new.set_whole("kernel", old.kernel.numpy())
        if new.use_bias:
            if isinstance(new, ColumnParallelDense):
                new.set_whole("bias", old.bias.numpy())
            else:
                new.bias.assign(old.bias.numpy())
    elif isinstance(new, ParallelEmbedding):
        new.set_whole("embeddings", old.embeddings.numpy())
    else:
        for name in ("query", "key", "value"):
            dense = getattr(old, f"{name}_dense")
            new.set_whole(f"{name}_kernel", dense.kernel.numpy())
            if new.use_bias:
                new.set_whole(f"{name}_bias", dense.bias.numpy())
        new.set_whole("output_kernel", old.output_dense.kernel.numpy())
        if new.use_bias:
            new.output_bias.assign(old.output_dense.bias.numpy())


def dense_weights(layer: _Split) -> list[np.ndarray]:
    """The split layer's weights whole, in its dense equivalent's get_weights() order."""
    if isinstance(layer, ColumnParallelDense):
        return [layer.whole("kernel"), *([layer.whole("bias")] if layer.use_bias else [])]
    if isinstance(layer, RowParallelDense):
        return [layer.whole("kernel"), *([np.asarray(layer.bias.value)] if layer.use_bias else [])]
    if isinstance(layer, ParallelEmbedding):
        return [layer.whole("embeddings")]
    out = []
    for name in ("query", "key", "value"):
        out.append(layer.whole(f"{name}_kernel"))
        if layer.use_bias:
            out.append(layer.whole(f"{name}_bias"))
    out.append(layer.whole("output_kernel"))
    if layer.use_bias:
        out.append(np.asarray(layer.output_bias.value))
    return out


__all__ = ["dense_model", "dense_weights", "tensor_parallel"]

"""Converting a model: `tensor_parallel` splits a Sequential or functional model's Dense->Dense
blocks, Embeddings and MultiHeadAttention layers (weights included); `dense_model` turns a
trained split model back into plain Keras layers (for one device, or for users without
tfdist)."""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np

from tfdist import compat
from tfdist.parallel.tensor.derive import head_counts
from tfdist.parallel.tensor.layers import (
    SEPARABLE_REGULARIZERS,
    ColumnParallelDense,
    ParallelEmbedding,
    ParallelMultiHeadAttention,
    RowParallelDense,
    _Split,
    _SplitDense,
)
from tfdist.parallel.tensor.layout_map import (
    SPLIT_BY_TFDIST,
    apply_derived_split,
    apply_layout_map,
    plan_of,
)
from tfdist.parallel.tensor.mappings import TensorParallelError
from tfdist.strategies import keras_guard

# The layers tensor_parallel's rewrite knows, by exact class (a subclass may call them in
# ways their split twins do not take: keras-hub's ReversibleEmbedding with reverse=True).
_REWRITTEN = (keras.layers.Dense, keras.layers.Embedding, keras.layers.MultiHeadAttention)


def tensor_parallel(
    model: keras.Model, *, degree: int | None = None, layout_map=None, model_axis: str = "model"
) -> keras.Model:
    """`model` split over `degree` replicas (call it inside the strategy's scope), three ways:

    - A Sequential or functional model of Keras's own layers: a copy with its Dense->Dense
      blocks, Embeddings and MultiHeadAttention layers rewritten as split layers. A Dense
      layer whose output feeds only another Dense becomes a ColumnParallelDense and that one
      a RowParallelDense (an MLP block: one exchange forward); an Embedding a
      ParallelEmbedding; a MultiHeadAttention a ParallelMultiHeadAttention. Inside a block
      written as a Layer subclass (keras.io's TransformerBlock), the layers it holds as
      attributes are split alike. The copy starts from the model's weights (it computes the
      same function) and is not compiled.
    - Any other built model (subclassed, or holding layers of other classes: keras-hub's
      ReversibleEmbedding, EinsumDense projections, attention that counts its heads in
      attributes): `model` itself, marked to train with the split its layers' shapes give
      (tfdist.parallel.tensor.derive: attention by heads, widen-then-narrow MLPs, vocabularies),
      logged layer by layer; a layer that cannot split stays whole.
    - Given a Keras `layout_map` (keras-hub's `Backbone.get_layout_map(mesh)`, or
      `derive_layout_map(model, mesh)` edited): `model` itself, marked to train with every
      weight the map splits over the mesh's `model_axis` held in parts
      (tfdist.parallel.tensor.layout_map), checked against the model first.

    The last two train under tfdist.fit with each replica's parts on its device and the whole
    model in host memory (build it in tfdist.host_scope to keep it off the devices).

    Raises:
      TensorParallelError: a size does not divide by `degree` (units, vocabulary, heads),
        a layout map asks what the model cannot do, or the model is not built (a split
        derived or mapped reads its weights' shapes).
    """
    if layout_map is not None:
        if degree is not None:
            raise TensorParallelError(
                "Pass degree= or layout_map=, not both: a layout map's mesh gives the degree "
                f"(its {model_axis!r} axis). Received: degree={degree} and a layout map"
            )
        return apply_layout_map(model, layout_map, model_axis)
    if degree is None:
        raise TensorParallelError(
            "tensor_parallel needs degree= (replicas per tensor-parallel group) or "
            "layout_map=. Received: neither"
        )
    beyond = _beyond_rewrite(model)
    if beyond is not None:
        return apply_derived_split(model, degree, why=beyond)
    graph = compat.layer_graph(model)
    column, row = _mlp_pairs(model, graph)

    def split(layer, *, top: bool):
        if isinstance(layer, keras.Sequential) and layer.built and not top:
            return tensor_parallel(layer, degree=degree), None  # loads its own weights
        made = _split(
            layer, degree, column=top and layer.name in column, row=top and layer.name in row
        )
        return (made, lambda: _load_dense(made, layer)) if made is not None else None

    split_model = _rewritten(model, split)
    keras_guard.mark_split(split_model, SPLIT_BY_TFDIST)
    return split_model


def _beyond_rewrite(model: keras.Model) -> str | None:
    """Why the layer rewrite cannot split `model` (None: it can): subclassed, or a layer
    with weights to split of a class it does not know."""
    if compat.layer_graph(model) is None:
        return f"{model.name!r} is subclassed (no layer graph to rewrite)"
    inside_attention = {
        id(inner)
        for layer in compat.all_layers(model)
        if type(layer) is keras.layers.MultiHeadAttention
        for inner in compat.all_layers(layer)
    }
    for layer in compat.all_layers(model):
        known = type(layer) in _REWRITTEN or id(layer) in inside_attention
        splittable = isinstance(layer, (*_REWRITTEN, keras.layers.EinsumDense)) or head_counts(
            layer
        )
        if splittable and not known and not isinstance(layer, keras.Model):
            return f"{model.name!r} holds {layer.name!r}, a {type(layer).__name__}"
    return None


def dense_model(model: keras.Model) -> keras.Model:
    """A copy of `model` with plain Keras layers for its split ones (Dense, Embedding,
    MultiHeadAttention), inside the blocks it holds too, the whole weights in them: for one
    device, or to save a model that loads without tfdist. Call it outside any strategy's
    scope. A model split by a layout (derived or a map) keeps Keras's layers: its copy is
    rebuilt from its config, unmarked, with the whole weights tfdist.fit wrote back.

    Raises:
      TensorParallelError: the model is subclassed (no layer graph to rewrite).
    """
    if plan_of(model) is not None:  # split by a layout: its layers are Keras's own
        copy = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model))
        if not copy.built:
            raise TensorParallelError(
                f"dense_model rebuilds {model.name!r} from its config, and the copy is not "
                "built (a subclassed model builds when called). Its weights are whole "
                f"outside tfdist.fit: save or use the model itself. Received: {type(model).__name__}"
            )
        copy.set_weights(model.get_weights())
        return copy
    _graph_of(model, "dense_model", "")

    def dense(layer, *, top: bool):
        if (
            isinstance(layer, keras.Sequential)
            and not top
            and any(isinstance(inner, _Split) for inner in compat.all_layers(layer))
        ):
            return dense_model(layer), None
        made = _dense_twin(layer)
        if made is None:
            return None
        return made, lambda: made.set_weights(dense_weights(layer))

    return _rewritten(model, dense)


def _graph_of(model, function: str, fix: str):
    graph = compat.layer_graph(model)
    if graph is None:
        raise TensorParallelError(
            f"{function} rewrites a Sequential or functional model's layer graph; "
            f"{model.name!r} is subclassed. {fix} Received: {type(model).__name__}"
        )
    return graph


# (the layer that stands for a layer, and how to load its weights once built) or None.
Replace = Callable[..., "tuple[keras.layers.Layer, Callable[[], None] | None] | None"]


def _rewritten(model: keras.Model, replace: Replace) -> keras.Model:
    """A copy of `model` whose layers `replace` gives stand-ins for, at the top of its graph
    and inside the blocks it holds; everything else copied, weights included."""
    # Weight loads, run once the copy is built (a split layer makes its parts when built).
    loads: list[Callable[[], None]] = []

    def clone(layer):
        if not isinstance(layer, keras.layers.Layer):
            return layer  # an operation in the graph (keras.ops.not_equal, ...): no state
        found = replace(layer, top=True)
        if found is None:
            return _copy(layer, replace, loads)
        made, load = found
        if load is not None:
            loads.append(load)
        return made

    copy = compat.clone_uncompiled(model, clone)
    for load in loads:
        load()
    return copy


def _copy(layer, replace: Replace, loads: list[Callable[[], None]]):
    """A copy of a layer `replace` keeps (from its config, its name kept where its class
    takes one). In a block of the user's (a Layer subclass that holds layers as
    attributes) the layers it holds are replaced as the model's are, recursively; the
    weights of everything kept are copied once the copy is built."""
    config = layer.get_config()
    try:
        copy = layer.__class__.from_config({**config, "name": layer.name})
    except TypeError:  # its __init__ takes no name: Keras names the copy
        copy = layer.__class__.from_config(config)
    if not _is_block(layer):
        loads.append(lambda: copy.set_weights(layer.get_weights()) if layer.weights else None)
        return copy
    for attribute, inner in compat.held_layers(layer):
        found = replace(inner, top=False)
        if found is not None:
            replacement, load = found
            if load is not None:
                loads.append(load)
        elif _is_block(inner):
            replacement = _copy(inner, replace, loads)
        else:
            held = getattr(copy, attribute)
            loads.append(
                lambda held=held, inner=inner: (
                    held.set_weights(inner.get_weights()) if inner.weights else None
                )
            )
            continue
        compat.replace_held_layer(copy, attribute, replacement)
    own = compat.own_variables(layer)
    if own:
        loads.append(
            lambda: [
                c.assign(o.value) for c, o in zip(compat.own_variables(copy), own, strict=True)
            ]
        )
    return copy


def _is_block(layer) -> bool:
    """A Layer subclass of the user's that holds layers (not one of Keras's own layers)."""
    return (
        not type(layer).__module__.startswith("keras.")
        and not isinstance(layer, keras.Model)
        and bool(compat.held_layers(layer))
    )


def _split(layer, degree, *, column: bool = False, row: bool = False) -> _Split | None:
    """The split layer that stands for `layer` (unbuilt), or None if it is not split."""
    config = layer.get_config()
    if column or row:
        _check_splittable(layer, ("kernel_regularizer", "bias_regularizer"))
        return (ColumnParallelDense if column else RowParallelDense)(
            config["units"], activation=config["activation"], use_bias=config["use_bias"],
            kernel_regularizer=layer.kernel_regularizer, bias_regularizer=layer.bias_regularizer,
            tensor_parallel=degree, name=layer.name,
        )  # fmt: skip
    if isinstance(layer, keras.layers.Embedding):
        _check_splittable(layer, ("embeddings_regularizer",))
        return ParallelEmbedding(
            config["input_dim"], config["output_dim"], mask_zero=config.get("mask_zero", False),
            embeddings_regularizer=layer.embeddings_regularizer,
            tensor_parallel=degree, name=layer.name,
        )  # fmt: skip
    if isinstance(layer, keras.layers.MultiHeadAttention) and config["attention_axes"] in (
        None, (1,), [1],
    ):  # fmt: skip
        _check_splittable(layer, ())
        return ParallelMultiHeadAttention(
            config["num_heads"], config["key_dim"], value_dim=config["value_dim"],
            dropout=config["dropout"], use_bias=config["use_bias"],
            output_shape=config["output_shape"], seed=config.get("seed"),
            tensor_parallel=degree, name=layer.name,
        )  # fmt: skip
    return None


def _check_splittable(layer, regularizers: tuple[str, ...]) -> None:
    """Refuses a layer whose split would silently change its math: a constraint or an
    activity regularizer (they read whole weights or outputs a part does not hold), or a
    weight penalty that is not a sum over elements (only such a penalty splits into
    parts). `regularizers` are the layer's attributes the split layer carries."""
    config = layer.get_config()
    problems = []
    for key, value in config.items():
        if value is None:
            continue
        if key.endswith("_constraint") or key == "activity_regularizer":
            problems.append(key)
        elif key.endswith("_regularizer"):
            held = getattr(layer, key, None)
            if key not in regularizers or not isinstance(held, SEPARABLE_REGULARIZERS):
                problems.append(key)
    if problems:
        received = ", ".join(f"{k}={config[k]!r}" for k in problems)
        raise TensorParallelError(
            f"Cannot split {type(layer).__name__} {layer.name!r} without changing what it "
            f"computes: {', '.join(problems)} reads its whole weight or output, which no "
            "part holds (a Dense or Embedding may keep an L1, L2 or L1L2 weight penalty). "
            f"Drop it from the layer, or leave the layer unsplit. Received: {received}"
        )


def _dense_twin(layer):
    """The plain Keras layer a split one stands for (unbuilt), or None."""
    if isinstance(layer, _SplitDense):
        return keras.layers.Dense(
            layer.units, activation=layer.activation, use_bias=layer.use_bias,
            kernel_regularizer=layer.kernel_regularizer, bias_regularizer=layer.bias_regularizer,
            name=layer.name,
        )  # fmt: skip
    if isinstance(layer, ParallelEmbedding):
        return keras.layers.Embedding(
            layer.input_dim, layer.output_dim, mask_zero=layer.mask_zero,
            embeddings_regularizer=layer.embeddings_regularizer, name=layer.name,
        )  # fmt: skip
    if isinstance(layer, ParallelMultiHeadAttention):
        return keras.layers.MultiHeadAttention(
            layer.num_heads, layer.key_dim, value_dim=layer.value_dim, dropout=layer.dropout,
            use_bias=layer.use_bias, output_shape=layer.output_size, name=layer.name,
        )  # fmt: skip
    return None


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

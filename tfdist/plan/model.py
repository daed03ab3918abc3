"""What a model costs: its parameters, and per example the FLOPs and activation bytes of each
of its layers, counted from the layers' operations in a traced forward pass.

    cost = ModelCost.of(model)              # a built Keras model
    cost.params, cost.forward_flops          # per example
    cost.units                               # per layer (nested models expanded once)

The forward pass is traced, never run, on one example: each matrix product (MatMul,
BatchMatMul, Einsum) and convolution counts 2 FLOPs per multiply-add, read from its static
shapes; element-wise work is left out (a few percent in the models users train). A
training step costs 3 forward passes (the backward pass takes two). The activations a
layer keeps for its backward pass are counted as the bytes of its products' and
non-linearities' outputs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist.plan.cluster import PlanError

_PRODUCTS = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D",
             "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput"}  # fmt: skip
# Outputs kept for the backward pass besides the products' (non-linearities, softmax, norms).
_KEPT = {"Relu", "Relu6", "Gelu", "Tanh", "Sigmoid", "Softmax", "Erf", "Elu", "Selu",
         "Softplus", "Mul", "FusedBatchNormV3", "Rsqrt", "LogSoftmax"}  # fmt: skip


@dataclasses.dataclass
class Unit:
    """A layer as a pipeline could cut it: its weights, FLOPs and activations per example."""

    name: str
    params: int = 0
    param_bytes: int = 0
    forward_flops: float = 0.0
    activation_bytes: float = 0.0
    output_bytes: float = 0.0  # what a cut after it sends forward, per example


@dataclasses.dataclass
class ModelCost:
    """A model's cost (see the module). `units` are in the order data reaches them."""

    name: str
    units: list[Unit]
    trainable_params: int
    trainable_bytes: int
    slots_per_param: int = 0
    # Under tensor parallelism (tfdist.parallel.tensor_parallel): the bytes of the weights
    # it splits (Dense pairs, attention, embeddings), the exchanges a forward pass makes
    # (one per Column -> Row block: an attention layer, a Dense pair, an embedding), and
    # the activation one exchanges per example (block_activation_bytes).
    split_bytes: int = 0
    tensor_blocks: int = 0

    @property
    def block_activation_bytes(self) -> float:
        return _block_width(self.units)

    @property
    def params(self) -> int:
        return self.trainable_params

    @property
    def forward_flops(self) -> float:
        return sum(u.forward_flops for u in self.units)

    @property
    def activation_bytes(self) -> float:
        return sum(u.activation_bytes for u in self.units)

    @classmethod
    def of(cls, model: keras.Model, example: Sequence | None = None) -> ModelCost:
        """Counts `model` (built). `example`: input shapes without the batch, where the
        model's own inputs leave a dimension unknown (a sequence length)."""
        units = _unit_layers(model)
        shapes = _input_shapes(model, example)
        specs = [tf.TensorSpec((1, *s), d) for s, d in shapes]

        @tf.function(autograph=False)
        def forward(*inputs):
            structure = getattr(model, "_inputs_struct", None)  # a functional model's
            if structure is not None:
                x = tf.nest.pack_sequence_as(structure, list(inputs))
            else:
                x = list(inputs) if len(inputs) > 1 else inputs[0]
            return model(x, training=False)

        graph = forward.get_concrete_function(*specs).graph
        by_name = {u.name: Unit(u.name) for u in units}
        other = Unit("(other)")
        for op in graph.get_operations():
            unit = by_name.get(_owner(op.name, by_name), other)
            if op.outputs and _nbytes(op.outputs[0]):
                # The unit's last float result in the graph's order: what it hands on.
                unit.output_bytes = _nbytes(op.outputs[0])
            if op.type in _PRODUCTS:
                unit.forward_flops += _flops(op)
            if op.type in _PRODUCTS or op.type in _KEPT:
                unit.activation_bytes += sum(_nbytes(t) for t in op.outputs)
        for layer in units:
            unit = by_name[layer.name]
            unit.params = sum(int(np.prod(w.shape)) for w in layer.trainable_weights)
            unit.param_bytes = sum(
                int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in layer.trainable_weights
            )
        ordered = [by_name[u.name] for u in units]
        if other.forward_flops or other.activation_bytes:
            ordered.append(other)
        trainable = model.trainable_weights
        split_bytes, blocks = _tensor_split(units)
        return cls(
            split_bytes=split_bytes,
            tensor_blocks=blocks,
            name=model.name,
            units=ordered,
            trainable_params=sum(int(np.prod(w.shape)) for w in trainable),
            trainable_bytes=sum(
                int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in trainable
            ),
            slots_per_param=slots_per_param(getattr(model, "optimizer", None)),
        )

    @classmethod
    def decoder(
        cls,
        name: str,
        *,
        layers: int,
        hidden: int,
        ffn: int,
        heads: int,
        kv_heads: int,
        vocab: int,
        sequence: int,
        slots_per_param: int = 2,
    ) -> ModelCost:
        """A Llama-style decoder counted from its shapes, for a model too big to build here
        (Llama 3 70B and 405B): a token embedding, `layers` blocks of grouped-query attention
        and a gated MLP (SwiGLU: gate, up and down projections), a final norm and an untied
        head. Per example of `sequence` tokens, in float32 as `of` counts:

          a block's FLOPs      2 S (2 H^2 + 2 H K + 3 H F) for its projections and 4 S^2 H
                               for attention's scores and weighted sum (the full square,
                               as `of` counts an unmasked product)
          what a block keeps   its products' and non-linearities' outputs, attention fused
                               (no S x S scores kept: flash attention): S (6 H + 2 K + 4 F)
          what a cut sends     S H

        with H the width, F the MLP's, K the keys' and values' width (kv_heads x H / heads).
        Tensor parallelism splits every matrix (Megatron: the embedding and head by the
        vocabulary); each block makes two split exchanges (attention, MLP), the embedding
        and the head one each.
        """
        s, h, f, k = sequence, hidden, ffn, kv_heads * hidden // heads
        width = 4 * s * h  # float32 bytes of one activation of the model's width
        block_params = 2 * h * h + 2 * h * k + 3 * h * f
        embedding = Unit(
            "token_embedding", params=vocab * h, param_bytes=4 * vocab * h,
            activation_bytes=width, output_bytes=width,
        )  # fmt: skip
        block = block_params + 2 * h  # and its two norms' scales
        blocks = [
            Unit(
                f"transformer_layer_{i}",
                params=block,
                param_bytes=4 * block,
                forward_flops=2.0 * s * block_params + 4.0 * s * s * h,
                activation_bytes=4.0 * s * (6 * h + 2 * k + 4 * f),
                output_bytes=width,
            )  # fmt: skip
            for i in range(layers)
        ]
        head = Unit(
            "head", params=vocab * h + h, param_bytes=4 * (vocab * h + h),
            forward_flops=2.0 * s * h * vocab, activation_bytes=4.0 * s * (vocab + h),
            output_bytes=4.0 * s * vocab,
        )  # fmt: skip
        units = [embedding, *blocks, head]
        params = sum(u.params for u in units)
        return cls(
            name=name, units=units, trainable_params=params, trainable_bytes=4 * params,
            slots_per_param=slots_per_param,
            split_bytes=4 * (layers * block_params + 2 * vocab * h),
            tensor_blocks=2 * layers + 2,
        )  # fmt: skip


def slots_per_param(optimizer) -> int:
    """How many copies of each weight `optimizer` keeps (Adam 2, SGD with momentum 1, ...),
    counted by building a copy of it on one small variable."""
    if optimizer is None:
        return 0
    copy = optimizer.__class__.from_config(optimizer.get_config())
    probe = keras.Variable(np.zeros((4, 4), "float32"))
    copy.build([probe])
    sized = [v for v in copy.variables if tuple(v.shape) == (4, 4)]
    return len(sized)


def _tensor_split(units) -> tuple[int, int]:
    """(bytes of the weights tensor parallelism splits, its exchanges per forward pass):
    each attention layer and embedding is one block, Dense layers outside attention pair
    up (Column -> Row)."""
    split, blocks, dense = 0, 0, []
    for unit in units:
        for layer in _leaves(unit):
            weights = sum(
                int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in layer.trainable_weights
            )
            if _is_attention(layer) or isinstance(layer, keras.layers.Embedding):
                split, blocks = split + weights, blocks + 1
            elif isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
                dense.append(weights)
    # Dense layers pair up in order (Column -> Row); an odd last one stays whole.
    paired = len(dense) // 2 * 2
    return split + sum(dense[:paired]), blocks + paired // 2


def _leaves(layer):
    """`layer` and its sublayers, an attention layer kept whole."""
    if _is_attention(layer):
        return [layer]
    children = [c for c in layer._flatten_layers(include_self=False, recursive=False)]
    if not children:
        return [layer]
    return [leaf for c in children for leaf in _leaves(c)]


def _is_attention(layer) -> bool:
    return isinstance(layer, keras.layers.MultiHeadAttention) or (
        hasattr(layer, "num_query_heads") or hasattr(layer, "_num_query_heads")
    )


def _unit_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The model's layers, a nested functional model (a keras-hub backbone) expanded into
    its own, each once (a causal LM lists its backbone's embedding again): the places a
    pipeline can cut."""
    layers: dict[int, keras.layers.Layer] = {}
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        if isinstance(layer, keras.Model) and hasattr(layer, "_operations"):
            for inner in _unit_layers(layer):
                layers.setdefault(id(inner), inner)
        else:
            layers.setdefault(id(layer), layer)
    return list(layers.values())


def _owner(op_name: str, names) -> str | None:
    """The deepest unit whose name is a component of the op's name scope."""
    found = None
    for part in op_name.split("/")[:-1]:
        if part in names:
            found = part
        else:
            stripped = re.sub(r"_\d+$", "", part)  # a scope re-entered: "dense_1_1"
            if stripped in names and found is None:
                found = stripped
    return found


def _input_shapes(model: keras.Model, example) -> list[tuple[tuple[int, ...], tf.DType]]:
    inputs = model.inputs
    if not inputs:
        raise PlanError(
            f"The planner counts a built model; {model.name!r} has no inputs yet. Build it "
            "(call it on a batch, or give it an Input). Received: an unbuilt model"
        )
    given = list(example) if example is not None else [None] * len(inputs)
    if len(given) != len(inputs):
        raise PlanError(
            f"example gives {len(given)} input shape(s) for a model of {len(inputs)} input(s). "
            f"Received: {example!r}"
        )
    shapes = []
    for tensor, shape in zip(inputs, given, strict=True):
        shape = tuple(shape) if shape is not None else tuple(tensor.shape[1:])
        if any(d is None for d in shape):
            raise PlanError(
                f"Input {tensor.name!r} has an unknown dimension {tuple(tensor.shape)}: give "
                "the example's shape (a sequence length), e.g. --example 1024. Received: "
                f"{shape}"
            )
        shapes.append((shape, tf.as_dtype(tensor.dtype)))
    return shapes


def _flops(op) -> float:
    """2 x the multiply-adds of one product, from its static shapes."""
    out = op.outputs[0].shape
    if op.type in ("Conv2D", "Conv3D", "DepthwiseConv2dNative"):
        kernel = op.inputs[1].shape.as_list()
        window = (
            math.prod(kernel[:-1]) if op.type != "DepthwiseConv2dNative" else math.prod(kernel[:-2])
        )
        return 2.0 * out.num_elements() * window
    if op.type == "Einsum":
        equation = op.get_attr("equation").decode()
        operands, _ = equation.split("->")
        sizes = {}
        for letters, tensor in zip(operands.split(","), op.inputs, strict=True):
            for letter, size in zip(letters, tensor.shape.as_list(), strict=False):
                sizes[letter] = size or 1
        return 2.0 * math.prod(sizes.values())
    a = op.inputs[0].shape.as_list()
    transpose = op.get_attr("transpose_a") if op.type == "MatMul" else op.get_attr("adj_x")
    inner = a[-2] if transpose else a[-1]
    return 2.0 * out.num_elements() * (inner or 1)


def _nbytes(tensor) -> float:
    if not tensor.dtype.is_floating or not tensor.shape.is_fully_defined():
        return 0.0
    return float(tensor.shape.num_elements() * tensor.dtype.size)


def _block_width(units: list[Unit]) -> float:
    """The activation a split block exchanges, per example: the output size that carries
    most of the model's FLOPs (a transformer's width, not its logits')."""
    by_size: dict[float, float] = {}
    for unit in units:
        if unit.forward_flops:
            by_size[unit.output_bytes] = by_size.get(unit.output_bytes, 0.0) + unit.forward_flops
    return max(by_size, key=by_size.get) if by_size else 0.0

"""Tensor parallelism: Keras layers whose weights are split across the replicas (Megatron-LM).

    with strategy.scope():                      # mirrored over 4 devices: 2-way tensor x 2-way data
        inputs = keras.Input((64,))
        h = tfdist.parallel.ColumnParallelDense(256, activation="gelu", tensor_parallel=2)(inputs)
        x = tfdist.parallel.RowParallelDense(64, tensor_parallel=2)(h)
        ...
        model.compile(...)
    tfdist.fit(model, data)

    # or convert a model's Dense->Dense blocks, Embeddings and attention layers:
    with strategy.scope():
        model = tfdist.parallel.tensor_parallel(dense_model, degree=2)

    # or, for a model of other layers (keras-hub's Mistral), split it as its shapes say:
    with tfdist.host_scope(strategy):
        model = keras_hub.models.MistralCausalLM(...)
    tfdist.parallel.tensor_parallel(model, degree=2)

The replicas form groups of T consecutive replicas (T = tensor_parallel); the replicas of a
group share their examples, and each holds 1/T of every split weight, as a variable of its
own on its own device (a device holds 1/T of the layer's parameters). Replica i holds part
i % T; groups train data parallel to each other.

The pairing is Megatron's: a ColumnParallelDense splits its kernel by output columns, so
each replica computes its columns and needs no exchange; a RowParallelDense after it splits
its kernel by input rows, so each replica computes a partial sum of the output, and one
exchange adds them. tfdist keeps each replica's batch its own outside the split layers:
a column layer first gathers its group's examples (all-gather over the batch), and a row
layer adds the partial sums and hands each replica back its own examples (reduce-scatter),
as sequence parallelism does. So a Column->Row block costs one all-gather forward and one
reduce-scatter forward, and the same two backward (their gradients). Embeddings split the
vocabulary (each replica looks up the ids in its range; the row layer's reduce-scatter adds
the parts); attention splits the heads (Q, K, V by columns, the output projection by rows).

Outside a replica context (model.predict on one device, a plain call) the layers compute
the whole result from the first group's parts, so a trained model can be used and saved as
any Keras model; `tfdist.parallel.dense_model` converts a trained model back to plain Keras
layers (for one device, or to save for users without tfdist). A saved split model loads
under the same strategy with `load_model(path, compile=False)` (its parts' optimizer state
is tfdist's, kept by tfdist.StepCheckpoint; Keras's compile-on-load would build the
optimizer over every part).

Training: each replica's gradient of its part counts its group's examples, so a part's
gradient is summed over the replicas holding the same part (the data-parallel groups) and
applied by an optimizer of that replica's own (the user's optimizer's class and config),
in tfdist.fit's update chain (TensorParallelUpdate, added by tfdist.fit when the model has
split layers); the other weights are all-reduced as usual. Under Keras's own fit the split
weights would not be updated correctly: train with tfdist.fit.

keras-hub's models say how they split: `tensor_parallel(model, layout_map=
Backbone.get_layout_map(mesh))` trains a model built in tfdist.host_scope with every weight
the map splits over the mesh's `model` axis held in parts, no layer rewritten (layout_map.py).

Across worker processes: not built yet (each process would hold only its parts, and a
checkpoint would need them gathered); local devices of one mirrored strategy only.

The package, one concern a module:

  mappings.py   the exchanges within a group, as conjugate pairs (gather-from /
                reduce-scatter-to over the examples, gather-from / scatter-to over the parts)
  layers.py     the split layers
  update.py     TensorParallelUpdate, the hook that updates their parts
  convert.py    tensor_parallel (a model's layers split) and dense_model (and back)
  layout_map.py tensor_parallel(layout_map=...): a Keras LayoutMap's split, and its hook
  derive.py     the split a model's layers' shapes give, for a model with no layout map
"""

from tfdist.parallel.tensor.convert import dense_model, dense_weights, tensor_parallel
from tfdist.parallel.tensor.derive import derive_layout_map
from tfdist.parallel.tensor.layers import (
    SPLIT_LAYERS,
    ColumnParallelDense,
    ParallelEmbedding,
    ParallelMultiHeadAttention,
    RowParallelDense,
    split_layers,
)
from tfdist.parallel.tensor.mappings import TensorParallelError
from tfdist.parallel.tensor.update import TensorParallelUpdate, update_for

__all__ = [
    "SPLIT_LAYERS",
    "ColumnParallelDense",
    "ParallelEmbedding",
    "ParallelMultiHeadAttention",
    "RowParallelDense",
    "TensorParallelError",
    "TensorParallelUpdate",
    "dense_model",
    "dense_weights",
    "derive_layout_map",
    "split_layers",
    "tensor_parallel",
    "update_for",
]

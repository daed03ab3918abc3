"""The tensor-parallel layers: each holds 1/T of its weights on each of T replicas.

ColumnParallelDense and RowParallelDense (Megatron's pair: the column layer needs no
exchange, the row layer after it adds the partial sums once), ParallelEmbedding (the
vocabulary split) and ParallelMultiHeadAttention (the heads split). Their exchanges are the
conjugate pairs of mappings.py. Outside a replica context (a plain call, model.predict on
one device) each computes the whole function from the first group's parts.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.parallel import optimizer_copies
from tfdist.parallel.tensor.mappings import (
    TensorParallelError,
    gather_from_group,
    gather_from_parts,
    reduce_scatter_to_group,
    replica_in_step,
    scatter_to_parts,
    step_sizes,
)
from tfdist.strategies import replica_placement


class _Split(keras.layers.Layer):
    """What every tensor-parallel layer shares: its degree, its parts (one plain variable per
    local replica, on the replica's device) and the whole weight they make up."""

    def __init__(self, *, tensor_parallel: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if tensor_parallel is not None and (
            not isinstance(tensor_parallel, int) or tensor_parallel < 1
        ):
            raise TensorParallelError(
                f"tensor_parallel must be a whole number >= 1. Received: {tensor_parallel!r}"
            )
        self.tensor_parallel = tensor_parallel
        self._parts: dict[str, list[keras.Variable]] = {}
        self._axes: dict[str, int] = {}

    def _placement(self) -> tuple[list[str], int]:
        """(the devices of the strategy's replicas, the degree T), checked."""
        if not tf.distribute.has_strategy():
            raise TensorParallelError(
                f"{type(self).__name__} {self.name!r} splits its weights over a strategy's "
                "replicas: create (or load) it inside `with strategy.scope():` of a mirrored "
                "strategy whose replicas the degree divides. For one device, convert a "
                "trained model with tfdist.parallel.dense_model(model). "
                f"Received: no strategy (tensor_parallel={self.tensor_parallel})"
            )
        layout = replica_placement(tf.distribute.get_strategy())
        if layout.processes > 1:
            raise TensorParallelError(
                f"{type(self).__name__} splits weights over the local devices of one "
                "mirrored strategy; across worker processes it is not built yet. Use "
                "tfdist.build_strategy('mirrored', devices=[...]) on one host. Received: "
                f"{layout.processes} worker processes"
            )
        devices = list(layout.devices)
        degree = self.tensor_parallel or len(devices)
        if len(devices) % degree:
            raise TensorParallelError(
                f"{self.name}: {len(devices)} replicas do not form groups of "
                f"tensor_parallel={degree}. Use a degree that divides the replicas. "
                f"Received: tensor_parallel={degree} over {len(devices)} replicas"
            )
        self.tensor_parallel = degree
        return devices, degree

    def _split_weight(self, name: str, whole: np.ndarray, axis: int, regularizer=None) -> None:
        """Creates the parts of weight `name` from its whole value, split along `axis`, each
        penalised by its share of `regularizer` (an elementwise one: L1, L2, L1L2)."""
        devices, degree = self._placement()
        if whole.shape[axis] % degree:
            raise TensorParallelError(
                f"{self.name}: the {name} has {whole.shape[axis]} along the split axis, which "
                f"does not divide into tensor_parallel={degree} equal parts. Choose sizes "
                f"divisible by {degree}. Received: {name} of shape {whole.shape}"
            )
        pieces = np.split(whole, degree, axis=axis)

        def make():
            made = []
            for index, device in enumerate(devices):
                with tf.device(device):
                    made.append(
                        keras.Variable(
                            pieces[index % degree],
                            dtype=self.variable_dtype,
                            name=f"{self.name}_{name}_part{index % degree}_replica{index}",
                        )  # fmt: skip
                    )
            return made

        self._parts[name] = optimizer_copies.outside_strategy(make)
        self._axes[name] = axis
        if regularizer is not None:
            for replica, variable in enumerate(self._parts[name]):
                variable.regularizer = _PartPenalty(self, regularizer, replica)
        setattr(self, f"_{name}_parts", self._parts[name])  # tracked: in the model's weights

    def part(self, name: str):
        """This replica's part of `name` inside a step; the whole weight outside one."""
        where = replica_in_step()
        parts = self._parts[name]
        if where is None:
            return tf.concat([v.value for v in parts[: self.tensor_parallel]], self._axes[name])
        replica, replicas = where
        if replicas != len(parts):
            raise TensorParallelError(
                f"{self.name} was built over {len(parts)} replicas but runs in a step over "
                f"{replicas}. Build and train the model under the same strategy. "
                f"Received: {replicas} replicas"
            )
        return parts[replica].value

    def whole(self, name: str) -> np.ndarray:
        """The whole weight, from the first group's parts."""
        parts = self._parts[name][: self.tensor_parallel]
        return np.concatenate([np.asarray(v.value) for v in parts], self._axes[name])

    def set_whole(self, name: str, value) -> None:
        """Sets weight `name` from its whole value (every replica's part)."""
        pieces = np.split(np.asarray(value), self.tensor_parallel, axis=self._axes[name])
        for index, variable in enumerate(self._parts[name]):
            variable.assign(pieces[index % self.tensor_parallel])

    @property
    def in_step(self) -> bool:
        return replica_in_step() is not None

    def get_config(self):
        return {**super().get_config(), "tensor_parallel": self.tensor_parallel}


SEPARABLE_REGULARIZERS = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)


class _PartPenalty:
    """A part's share of its whole weight's penalty, as Keras's loss collects it from every
    weight of the model (each replica's step sees every replica's parts).

    In a replica's step only the parts it holds count, each T times: a part's gradient is
    summed over the D replicas holding it, each loss scaled by 1/(T x D), so the penalty's
    gradient is the whole penalty's, and the logged loss (the replicas' mean) holds the
    whole penalty once. Outside a step the first group's parts make up the whole weight.
    """

    def __init__(self, layer: _Split, regularizer, replica: int):
        self.layer, self.regularizer, self.replica = layer, regularizer, replica

    def __call__(self, value):
        where = replica_in_step()
        degree = self.layer.tensor_parallel
        held = self.replica < degree if where is None else where[0] == self.replica
        if not held:  # not read: another replica's part
            return tf.zeros((), self.layer.variable_dtype)
        penalty = self.regularizer(value)
        return penalty if where is None else degree * penalty


def _initial(initializer, shape, dtype) -> np.ndarray:
    # Eagerly, also when Keras first builds the layer while tracing a block's call.
    with tf.init_scope():
        return np.asarray(keras.initializers.get(initializer)(shape, dtype=dtype))


class _SplitDense(_Split):
    """What the two split Dense layers share: keras.layers.Dense's arguments. (The output
    shape is the whole layer's: a step's split outputs are a step's own business.)"""

    def __init__(
        self, units: int, *, activation=None, use_bias: bool = True,
        kernel_initializer="glorot_uniform", bias_initializer="zeros",
        kernel_regularizer=None, bias_regularizer=None,
        tensor_parallel: int | None = None, **kwargs,
    ):  # fmt: skip
        super().__init__(tensor_parallel=tensor_parallel, **kwargs)
        self.units, self.use_bias = units, use_bias
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.supports_masking = True  # a Keras mask passes through, as through Dense
        self.activation = keras.activations.get(activation)
        self.kernel_initializer, self.bias_initializer = kernel_initializer, bias_initializer

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        return {
            **super().get_config(), "units": self.units, "use_bias": self.use_bias,
            "activation": keras.activations.serialize(self.activation),
            "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
        }  # fmt: skip


@keras.saving.register_keras_serializable(package="tfdist")
class ColumnParallelDense(_SplitDense):
    """A Dense layer whose kernel (and bias) is split by output columns over T replicas.

    Each replica computes its units/T columns for its group's examples (gathered first), so
    the output of each replica is [group examples, units/T]: feed it to a RowParallelDense,
    which adds the parts up. With `gather_output=True` the columns are gathered instead and
    each replica gets its own examples' whole output (a column layer on its own).

    Args:
      units: output units (divisible by T).
      gather_output: gather the columns (True) or leave them split for a RowParallelDense.
      **kwargs: `tensor_parallel`, T, the replicas each weight is split over (default: all
        of them); `activation`, `use_bias`, `kernel_initializer` and `bias_initializer` as
        keras.layers.Dense takes them.
    """

    def __init__(self, units: int, *, gather_output: bool = False, **kwargs):
        super().__init__(units, **kwargs)
        self.gather_output = gather_output

    def build(self, input_shape):
        shape = (input_shape[-1], self.units)
        kernel = _initial(self.kernel_initializer, shape, "float32")
        self._split_weight("kernel", kernel, 1, self.kernel_regularizer)
        if self.use_bias:
            bias = _initial(self.bias_initializer, (self.units,), "float32")
            self._split_weight("bias", bias, 0, self.bias_regularizer)

    def call(self, inputs):
        if not self.in_step:
            return self.activation(self._dense(inputs))
        gathered, sizes = gather_from_group(inputs, self.tensor_parallel)
        columns = self.activation(self._dense(gathered))
        if not self.gather_output:
            return columns
        return gather_from_parts(columns, sizes, self.tensor_parallel)

    def _dense(self, x):
        y = _matmul(x, self.part("kernel"))
        return y + self.part("bias") if self.use_bias else y

    def get_config(self):
        return {**super().get_config(), "gather_output": self.gather_output}


@keras.saving.register_keras_serializable(package="tfdist")
class RowParallelDense(_SplitDense):
    """A Dense layer whose kernel is split by input rows over T replicas (the bias is whole).

    It takes a ColumnParallelDense's split output ([group examples, in/T] per replica),
    computes a partial sum of the output, and one exchange adds the parts and gives each
    replica its own examples. With `input_is_parallel=False` it takes each replica's own
    examples whole, and gathers and splits them first.
    """

    def __init__(self, units: int, *, input_is_parallel: bool = True, **kwargs):
        super().__init__(units, **kwargs)
        self.input_is_parallel = input_is_parallel

    def build(self, input_shape):
        shape = (input_shape[-1], self.units)
        kernel = _initial(self.kernel_initializer, shape, "float32")
        self._split_weight("kernel", kernel, 0, self.kernel_regularizer)
        if self.use_bias:
            self.bias = self.add_weight(
                shape=(self.units,), initializer=self.bias_initializer, name="bias",
                regularizer=self.bias_regularizer,
            )  # fmt: skip

    def call(self, inputs):
        kernel = self.part("kernel")
        if not self.in_step:
            y = _matmul(inputs, kernel)
        else:
            degree = self.tensor_parallel
            if self.input_is_parallel:
                sizes, x = step_sizes(self.name), inputs
            else:  # this part's rows of the kernel take its slice of the features
                x, sizes = gather_from_group(inputs, degree)
                x = scatter_to_parts(x, degree, kernel.shape[0])
            y = reduce_scatter_to_group(_matmul(x, kernel), sizes, degree)
        if self.use_bias:
            y = y + self.bias
        return self.activation(y)

    def get_config(self):
        return {**super().get_config(), "input_is_parallel": self.input_is_parallel}


def _matmul(x, kernel):
    return tf.matmul(x, kernel) if x.shape.rank == 2 else tf.tensordot(x, kernel, 1)


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelEmbedding(_Split):
    """An Embedding whose vocabulary is split over T replicas (Megatron's VocabParallel).

    Each replica looks up the ids of its group's examples that fall in its 1/T of the
    vocabulary (zeros for the others); one exchange adds the parts and gives each replica
    its own examples' whole vectors. With `mask_zero=True` id 0 is padding, masked as
    keras.layers.Embedding masks it (the mask reaches the layers after it).
    """

    def __init__(
        self, input_dim: int, output_dim: int, *, embeddings_initializer="uniform",
        embeddings_regularizer=None, mask_zero: bool = False,
        tensor_parallel: int | None = None, **kwargs,
    ):  # fmt: skip
        super().__init__(tensor_parallel=tensor_parallel, **kwargs)
        self.input_dim, self.output_dim = input_dim, output_dim
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.embeddings_initializer = embeddings_initializer
        self.mask_zero = mask_zero
        self.supports_masking = mask_zero

    def build(self, input_shape):
        shape = (self.input_dim, self.output_dim)
        table = _initial(self.embeddings_initializer, shape, "float32")
        self._split_weight("embeddings", table, 0, self.embeddings_regularizer)

    def call(self, inputs):
        ids = tf.cast(inputs, "int32")
        table = self.part("embeddings")
        if not self.in_step:
            return tf.gather(table, ids)
        replica, _ = replica_in_step()
        ids, sizes = gather_from_group(ids, self.tensor_parallel)
        rows = self.input_dim // self.tensor_parallel
        local = ids - (replica % self.tensor_parallel) * rows
        inside = (local >= 0) & (local < rows)
        found = tf.gather(table, tf.where(inside, local, 0))
        partial = found * tf.cast(inside, found.dtype)[..., None]
        return reduce_scatter_to_group(partial, sizes, self.tensor_parallel)

    def compute_mask(self, inputs, mask=None):
        return keras.ops.not_equal(inputs, 0) if self.mask_zero else None

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.output_dim)

    def get_config(self):
        return {
            **super().get_config(), "input_dim": self.input_dim, "output_dim": self.output_dim,
            "mask_zero": self.mask_zero,
            "embeddings_regularizer": keras.regularizers.serialize(self.embeddings_regularizer),
        }  # fmt: skip


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelMultiHeadAttention(_Split):
    """keras.layers.MultiHeadAttention (inputs [batch, length, features]) with its heads
    split over T replicas: the query, key and value projections by heads (columns), the
    output projection by heads (rows, its bias whole), one exchange after it.

    Takes `query`, `value`, optional `key` and `attention_mask` ([batch, Tq, Tk]) as the
    Keras layer does, and honours the same masks: the Keras masks of `query`, `value` and
    `key` (an `Embedding(mask_zero=True)` before it), and `use_causal_mask`. It computes the
    same function (attention dropout included), and its output carries the query's mask.
    """

    def __init__(
        self, num_heads: int, key_dim: int, *, value_dim: int | None = None,
        dropout: float = 0.0, use_bias: bool = True, output_shape: int | None = None,
        kernel_initializer="glorot_uniform", bias_initializer="zeros", seed=None,
        tensor_parallel: int | None = None, **kwargs,
    ):  # fmt: skip
        super().__init__(tensor_parallel=tensor_parallel, **kwargs)
        self.num_heads, self.key_dim = num_heads, key_dim
        self.value_dim = value_dim or key_dim
        self.dropout, self.use_bias, self.output_size = dropout, use_bias, output_shape
        self.kernel_initializer, self.bias_initializer = kernel_initializer, bias_initializer
        self._softmax = keras.layers.Softmax(axis=-1)
        self._dropout_layer = keras.layers.Dropout(dropout, seed=seed)
        self.supports_masking = True  # takes the inputs' Keras masks; passes the query's on

    def build(self, query_shape, value_shape=None, key_shape=None):
        value_shape = value_shape or query_shape
        key_shape = key_shape or value_shape
        _, degree = self._placement()
        if self.num_heads % degree:
            raise TensorParallelError(
                f"{self.name}: {self.num_heads} heads do not divide over "
                f"tensor_parallel={degree} replicas. Use a number of heads divisible by "
                f"{degree}, or another degree. Received: num_heads={self.num_heads}"
            )
        heads, out = self.num_heads, self.output_size or query_shape[-1]
        for name, features, size in (
            ("query", query_shape[-1], self.key_dim),
            ("key", key_shape[-1], self.key_dim),
            ("value", value_shape[-1], self.value_dim),
        ):
            kernel = _initial(self.kernel_initializer, (features, heads, size), "float32")
            self._split_weight(f"{name}_kernel", kernel, 1)
            if self.use_bias:
                bias = _initial(self.bias_initializer, (heads, size), "float32")
                self._split_weight(f"{name}_bias", bias, 0)
        kernel = _initial(self.kernel_initializer, (heads, self.value_dim, out), "float32")
        self._split_weight("output_kernel", kernel, 0)
        if self.use_bias:
            self.output_bias = self.add_weight(
                shape=(out,), initializer=self.bias_initializer, name="output_bias"
            )

    def _project(self, name: str, x):
        y = tf.einsum("abc,cde->abde", x, self.part(f"{name}_kernel"))
        return y + self.part(f"{name}_bias") if self.use_bias else y

    def call(
        self, query, value=None, key=None, query_mask=None, value_mask=None, key_mask=None,
        attention_mask=None, training=None, use_causal_mask=False,
    ):  # fmt: skip
        value = query if value is None else value
        key = value if key is None else key
        # Keras's rule (MultiHeadAttention._compute_attention_mask): the query's mask by
        # rows, the value's and the key's by columns, and the attention mask, all ANDed.
        query_mask = compat.keras_mask(query) if query_mask is None else query_mask
        own_query_mask = query_mask
        for tensor in (query, value, key):  # used up here, as Keras's layer uses them up
            compat.set_keras_mask(tensor, None)
        attention_mask = _joined_masks(
            attention_mask,
            None if query_mask is None else tf.cast(query_mask, "bool")[:, :, None],
            None if value_mask is None else tf.cast(value_mask, "bool")[:, None, :],
            None if key_mask is None or key is value else tf.cast(key_mask, "bool")[:, None, :],
        )
        sizes = None
        if self.in_step:
            degree = self.tensor_parallel
            same_value, same_key = value is query, key is value
            query, sizes = gather_from_group(query, degree)
            value = query if same_value else gather_from_group(value, degree)[0]
            key = value if same_key else gather_from_group(key, degree)[0]
            if attention_mask is not None:
                attention_mask = gather_from_group(attention_mask, degree)[0]
        if use_causal_mask:
            length_q, length_v = tf.shape(query)[1], tf.shape(value)[1]
            causal = tf.linalg.band_part(tf.ones([1, length_q, length_v], "bool"), -1, 0)
            attention_mask = _joined_masks(attention_mask, causal)
        q = self._project("query", query) * (1.0 / math.sqrt(self.key_dim))
        k, v = self._project("key", key), self._project("value", value)
        scores = tf.einsum("aecd,abcd->acbe", k, q)  # [batch, heads, Tq, Tk]
        mask = None if attention_mask is None else tf.cast(attention_mask, "bool")[:, None]
        if self.dropout > 0:
            scores = self._softmax(scores, mask=mask)
            scores = self._dropout_layer(scores, training=training)
        else:
            scores = _attention_weights(scores, mask)
        context = tf.einsum("acbe,aecd->abcd", scores, v)  # [batch, Tq, heads, value_dim]
        partial = tf.einsum("abcd,cde->abe", context, self.part("output_kernel"))
        if sizes is not None:
            partial = reduce_scatter_to_group(partial, sizes, self.tensor_parallel)
        output = partial + self.output_bias if self.use_bias else partial
        if own_query_mask is not None:
            compat.set_keras_mask(output, own_query_mask)
        return output

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        return (*query_shape[:-1], self.output_size or query_shape[-1])

    def get_config(self):
        return {
            **super().get_config(), "num_heads": self.num_heads, "key_dim": self.key_dim,
            "value_dim": self.value_dim, "dropout": self.dropout, "use_bias": self.use_bias,
            "output_shape": self.output_size,
        }  # fmt: skip


def _attention_weights(scores, mask):
    """Softmax over the keys as Keras's MultiHeadAttention takes it without dropout (through
    ops.dot_product_attention): masked scores set to -0.7 x the dtype's largest, so a query
    row with every key masked (a padding position) attends to all keys alike. (With dropout
    Keras's Softmax layer gives such a row zeros; `call` uses that layer then.)"""
    if mask is not None:
        largest = 65500.0 if scores.dtype == tf.float16 else 3.38953e38
        scores = tf.where(mask, scores, tf.constant(-0.7 * largest, scores.dtype))
    return tf.nn.softmax(scores, axis=-1)


def _joined_masks(*masks):
    """The positions every given boolean mask allows (None where none is given)."""
    given = [tf.cast(m, "bool") for m in masks if m is not None]
    if not given:
        return None
    joined = given[0]
    for mask in given[1:]:
        joined = joined & mask
    return joined


SPLIT_LAYERS = (
    ColumnParallelDense,
    RowParallelDense,
    ParallelEmbedding,
    ParallelMultiHeadAttention,
)


def split_layers(model: keras.Model) -> list[_Split]:
    """The model's tensor-parallel layers (nested ones included)."""
    return [layer for layer in compat.all_layers(model) if isinstance(layer, _Split)]


__all__ = [
    "SPLIT_LAYERS",
    "ColumnParallelDense",
    "ParallelEmbedding",
    "ParallelMultiHeadAttention",
    "RowParallelDense",
    "split_layers",
]

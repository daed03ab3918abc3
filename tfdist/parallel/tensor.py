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

Across worker processes: not built yet (each process would hold only its parts, and a
checkpoint would need them gathered); local devices of one mirrored strategy only.
"""

from __future__ import annotations

import math
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.parallel import updates
from tfdist.training.fit_data import FitError
from tfdist.training.runner import StepHook


class TensorParallelError(FitError):
    """A layer cannot be split as asked (the message says why and how to fix it)."""


# --- where a layer's parts live, and the exchanges between them -------------------------------


def _replica() -> tuple[int, int] | None:
    """(this replica's id, replicas) inside a strategy's step with several replicas; else None."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    if replica is None:
        raise TensorParallelError(
            "Tensor-parallel layers need each replica's id when the step is traced (one "
            "program per replica, as mirrored strategies trace). Received: a dynamic id"
        )
    return int(replica), context.num_replicas_in_sync


def _group_rows(x, sizes, group: int, degree: int):
    """The rows of the members of `group` in `x`, every replica's rows end to end."""
    starts = tf.concat([[0], tf.cumsum(sizes)], 0)
    return x[starts[group * degree] : starts[(group + 1) * degree]]


# Every replica's batch size in the step being traced: gathered by the first split layer
# that gathers its group's examples, and reused by the others (a row layer needs it to hand
# the rows back: its input holds the group's rows, not its own count). Keyed by the graph
# being built (a loop's body is a graph of its own) and the replica (mirrored strategies
# trace their replicas in threads at once).
_SIZES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sizes(context, x, replica: int):
    graph = tf.compat.v1.get_default_graph()
    known = _SIZES.setdefault(graph, {})
    if replica not in known:
        known[replica] = context.all_gather(tf.shape(x)[:1], axis=0)
    return known[replica]


def gather_group(x, degree: int):
    """Every example of this replica's group (its members' batches end to end) and every
    replica's batch size. The gradient flows back to each member's own rows."""
    replica, _ = _replica()
    context = tf.distribute.get_replica_context()
    sizes = _sizes(context, x, replica)
    boolean = x.dtype == tf.bool  # collectives take numbers: a mask travels as int32
    everyone = context.all_gather(tf.cast(x, "int32") if boolean else x, axis=0)
    rows = _group_rows(everyone, sizes, replica // degree, degree)
    return (tf.cast(rows, tf.bool) if boolean else rows), sizes


def step_sizes(layer_name: str) -> tf.Tensor:
    """Every replica's batch size in this step (recorded by the split layer before)."""
    replica, _ = _replica()
    sizes = _SIZES.get(tf.compat.v1.get_default_graph(), {}).get(replica)
    if sizes is None:
        raise TensorParallelError(
            f"{layer_name} takes the split output of a ColumnParallelDense (or a parallel "
            "embedding or attention layer) but none ran before it in this step. Put a "
            "column-parallel layer before it, or pass input_is_parallel=False. "
            "Received: a row-parallel layer first"
        )
    return sizes


def reduce_scatter_group(partial, sizes, degree: int):
    """This replica's rows of the sum of its group's `partial`s (each [group examples, ...])."""
    replica, _ = _replica()
    context = tf.distribute.get_replica_context()
    group, rank = divmod(replica, degree)
    # Every replica's partial, end to end: each is as long as its group's examples.
    everyone = context.all_gather(partial, axis=0)
    length = tf.reduce_sum(sizes[group * degree : (group + 1) * degree])
    start = degree * tf.reduce_sum(sizes[: group * degree])
    mine = tf.add_n(
        [
            everyone[start + member * length : start + (member + 1) * length]
            for member in range(degree)
        ]
    )
    offset = tf.reduce_sum(sizes[group * degree : group * degree + rank])
    return mine[offset : offset + sizes[replica]]


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
        strategy = tf.distribute.get_strategy()
        if compat.sync_worker_count(strategy) > 1:
            raise TensorParallelError(
                f"{type(self).__name__} splits weights over the local devices of one "
                "mirrored strategy; across worker processes it is not built yet. Use "
                "tfdist.build_strategy('mirrored', devices=[...]) on one host. Received: "
                f"{compat.sync_worker_count(strategy)} worker processes"
            )
        devices = list(strategy.extended.worker_devices)
        degree = self.tensor_parallel or len(devices)
        if len(devices) % degree:
            raise TensorParallelError(
                f"{self.name}: {len(devices)} replicas do not form groups of "
                f"tensor_parallel={degree}. Use a degree that divides the replicas. "
                f"Received: tensor_parallel={degree} over {len(devices)} replicas"
            )
        self.tensor_parallel = degree
        return devices, degree

    def _split_weight(self, name: str, whole: np.ndarray, axis: int) -> None:
        """Creates the parts of weight `name` from its whole value, split along `axis`."""
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

        self._parts[name] = updates.outside_strategy(make)
        self._axes[name] = axis
        setattr(self, f"_{name}_parts", self._parts[name])  # tracked: in the model's weights

    def part(self, name: str):
        """This replica's part of `name` inside a step; the whole weight outside one."""
        where = _replica()
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
        return _replica() is not None

    def get_config(self):
        return {**super().get_config(), "tensor_parallel": self.tensor_parallel}


def _initial(initializer, shape, dtype) -> np.ndarray:
    return np.asarray(keras.initializers.get(initializer)(shape, dtype=dtype))


class _SplitDense(_Split):
    """What the two split Dense layers share: keras.layers.Dense's arguments. (The output
    shape is the whole layer's: a step's split outputs are a step's own business.)"""

    def __init__(
        self, units: int, *, activation=None, use_bias: bool = True,
        kernel_initializer="glorot_uniform", bias_initializer="zeros",
        tensor_parallel: int | None = None, **kwargs,
    ):  # fmt: skip
        super().__init__(tensor_parallel=tensor_parallel, **kwargs)
        self.units, self.use_bias = units, use_bias
        self.activation = keras.activations.get(activation)
        self.kernel_initializer, self.bias_initializer = kernel_initializer, bias_initializer

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        return {
            **super().get_config(), "units": self.units, "use_bias": self.use_bias,
            "activation": keras.activations.serialize(self.activation),
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
      activation, use_bias, kernel_initializer, bias_initializer: as keras.layers.Dense.
      gather_output: gather the columns (True) or leave them split for a RowParallelDense.
      tensor_parallel: T, the replicas each weight is split over (default: all of them).
    """

    def __init__(self, units: int, *, gather_output: bool = False, **kwargs):
        super().__init__(units, **kwargs)
        self.gather_output = gather_output

    def build(self, input_shape):
        shape = (input_shape[-1], self.units)
        self._split_weight("kernel", _initial(self.kernel_initializer, shape, "float32"), 1)
        if self.use_bias:
            self._split_weight("bias", _initial(self.bias_initializer, (self.units,), "float32"), 0)

    def call(self, inputs):
        if not self.in_step:
            return self.activation(self._dense(inputs))
        gathered, sizes = gather_group(inputs, self.tensor_parallel)
        columns = self.activation(self._dense(gathered))
        if not self.gather_output:
            return columns
        replica, _ = _replica()
        context = tf.distribute.get_replica_context()
        everyone = context.all_gather(columns[None], axis=0)  # [replicas, rows, units/T]
        group = replica // self.tensor_parallel
        members = everyone[group * self.tensor_parallel : (group + 1) * self.tensor_parallel]
        whole = tf.concat(tf.unstack(members, num=self.tensor_parallel), axis=-1)
        rank = replica % self.tensor_parallel
        offset = tf.reduce_sum(
            sizes[group * self.tensor_parallel : group * self.tensor_parallel + rank]
        )
        return whole[offset : offset + sizes[replica]]

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
        self._split_weight("kernel", _initial(self.kernel_initializer, shape, "float32"), 0)
        if self.use_bias:
            self.bias = self.add_weight(
                shape=(self.units,), initializer=self.bias_initializer, name="bias"
            )

    def call(self, inputs):
        kernel = self.part("kernel")
        if not self.in_step:
            y = _matmul(inputs, kernel)
        else:
            replica, _ = _replica()
            degree = self.tensor_parallel
            if self.input_is_parallel:
                sizes, x = step_sizes(self.name), inputs
            else:
                x, sizes = gather_group(inputs, degree)
                width = kernel.shape[0]  # this part's rows: its slice of the features
                x = x[..., (replica % degree) * width : (replica % degree + 1) * width]
                x = tf.ensure_shape(x, [*x.shape[:-1], width])
            y = reduce_scatter_group(_matmul(x, kernel), sizes, degree)
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
    its own examples' whole vectors.
    """

    def __init__(
        self, input_dim: int, output_dim: int, *, embeddings_initializer="uniform",
        tensor_parallel: int | None = None, **kwargs,
    ):  # fmt: skip
        super().__init__(tensor_parallel=tensor_parallel, **kwargs)
        self.input_dim, self.output_dim = input_dim, output_dim
        self.embeddings_initializer = embeddings_initializer

    def build(self, input_shape):
        shape = (self.input_dim, self.output_dim)
        self._split_weight("embeddings", _initial(self.embeddings_initializer, shape, "float32"), 0)

    def call(self, inputs):
        ids = tf.cast(inputs, "int32")
        table = self.part("embeddings")
        if not self.in_step:
            return tf.gather(table, ids)
        replica, _ = _replica()
        ids, sizes = gather_group(ids, self.tensor_parallel)
        rows = self.input_dim // self.tensor_parallel
        local = ids - (replica % self.tensor_parallel) * rows
        inside = (local >= 0) & (local < rows)
        found = tf.gather(table, tf.where(inside, local, 0))
        partial = found * tf.cast(inside, found.dtype)[..., None]
        return reduce_scatter_group(partial, sizes, self.tensor_parallel)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.output_dim)

    def get_config(self):
        return {**super().get_config(), "input_dim": self.input_dim, "output_dim": self.output_dim}


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelMultiHeadAttention(_Split):
    """keras.layers.MultiHeadAttention (inputs [batch, length, features]) with its heads
    split over T replicas: the query, key and value projections by heads (columns), the
    output projection by heads (rows, its bias whole), one exchange after it.

    Takes `query`, `value`, optional `key` and `attention_mask` ([batch, Tq, Tk]) as the
    Keras layer does, and computes the same function (attention dropout included).
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

    def call(self, query, value=None, key=None, attention_mask=None, training=None):
        value = query if value is None else value
        key = value if key is None else key
        sizes = None
        if self.in_step:
            degree = self.tensor_parallel
            same_value, same_key = value is query, key is value
            query, sizes = gather_group(query, degree)
            value = query if same_value else gather_group(value, degree)[0]
            key = value if same_key else gather_group(key, degree)[0]
            if attention_mask is not None:
                attention_mask = gather_group(attention_mask, degree)[0]
        q = self._project("query", query) * (1.0 / math.sqrt(self.key_dim))
        k, v = self._project("key", key), self._project("value", value)
        scores = tf.einsum("aecd,abcd->acbe", k, q)  # [batch, heads, Tq, Tk]
        mask = None if attention_mask is None else tf.cast(attention_mask, "bool")[:, None]
        scores = self._softmax(scores, mask=mask)
        scores = self._dropout_layer(scores, training=training)
        context = tf.einsum("acbe,aecd->abcd", scores, v)  # [batch, Tq, heads, value_dim]
        partial = tf.einsum("abcd,cde->abe", context, self.part("output_kernel"))
        if sizes is not None:
            partial = reduce_scatter_group(partial, sizes, self.tensor_parallel)
        return partial + self.output_bias if self.use_bias else partial

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        return (*query_shape[:-1], self.output_size or query_shape[-1])

    def get_config(self):
        return {
            **super().get_config(), "num_heads": self.num_heads, "key_dim": self.key_dim,
            "value_dim": self.value_dim, "dropout": self.dropout, "use_bias": self.use_bias,
            "output_shape": self.output_size,
        }  # fmt: skip


SPLIT_LAYERS = (
    ColumnParallelDense,
    RowParallelDense,
    ParallelEmbedding,
    ParallelMultiHeadAttention,
)


def split_layers(model: keras.Model) -> list[_Split]:
    """The model's tensor-parallel layers (nested ones included)."""
    return [layer for layer in compat.all_layers(model) if isinstance(layer, _Split)]


# --- training: each part's gradient summed over its data-parallel copies ----------------------


class TensorParallelUpdate(StepHook):
    """Updates the split weights' parts in tfdist.fit's chain; the rest go on as usual.

    In each replica's step, the gradient of its parts (which count its group's examples) is
    summed over the replicas that hold the same parts, one per group, and applied by the
    replica's own copy of the user's optimizer (same class and config, its slots built for
    its parts only, on its device, counting the user's optimizer's steps and taking its
    learning rate). tfdist.fit adds it when the model has split layers.
    """

    synchronous_only = True

    def build(self, model: keras.Model, strategy: tf.distribute.Strategy) -> None:
        optimizer = model.optimizer
        who = "Tensor-parallel layers' parts"
        updates.check_copyable(optimizer, who=who, error=TensorParallelError)
        if optimizer.clipnorm is not None:
            raise TensorParallelError(
                f"{who} are updated one replica at a time, so the norm of a whole weight "
                "(clipnorm) is not known where a part is updated. Use clipvalue, or no "
                f"clipping. Received: clipnorm={optimizer.clipnorm}"
            )
        layers = split_layers(model)
        replicas = strategy.num_replicas_in_sync
        self.degree = {layer.tensor_parallel for layer in layers}
        if len(self.degree) != 1:
            raise TensorParallelError(
                "Every split layer of a model must use the same tensor_parallel degree. "
                f"Received: degrees {sorted(self.degree)}"
            )
        (self.degree,) = self.degree
        # Replica -> its parts, in the model's order (the same order on every replica).
        self.parts: list[list[keras.Variable]] = [[] for _ in range(replicas)]
        for layer in layers:
            for parts in layer._parts.values():
                for replica, variable in enumerate(parts):
                    self.parts[replica].append(variable)
        self.owned = {id(v) for parts in self.parts for v in parts}
        rest = [v for v in model.trainable_variables if id(v) not in self.owned]

        def make():
            copies = []
            for parts in self.parts:
                with tf.device(parts[0].value.device if parts else None):
                    copies.append(updates.optimizer_copy(optimizer, parts))
            return copies

        self.optimizers = updates.outside_strategy(make)
        self.user = optimizer
        optimizer.build(rest)  # the user's optimizer keeps the replicated weights' state

    def apply(self, grads_and_vars, apply_next):
        context = tf.distribute.get_replica_context()
        replica = int(tf.get_static_value(context.replica_id_in_sync_group))
        given = {id(v): g for g, v in grads_and_vars}
        parts = self.parts[replica]
        copies = list(range(replica % self.degree, len(self.parts), self.degree))
        grads = [given.get(id(v)) for v in parts]
        grads = [
            tf.zeros_like(v.value) if g is None else g for g, v in zip(grads, parts, strict=True)
        ]
        summed = _summed_over(context, grads, [tuple(v.shape) for v in parts], copies)
        copy, user = self.optimizers[replica], self.user
        with tf.device(parts[0].value.device):
            # The user's optimizer counts the step after this hook (Adam's bias correction
            # reads iterations + 1); the copy reads the same count.
            copy.iterations.assign(tf.cast(user.iterations, copy.iterations.dtype))
            updates.update_step(
                copy, summed, parts, learning_rate=user.learning_rate,
                weight_decay=user.weight_decay or 0.0,
            )  # fmt: skip
        rest = [(g, v) for g, v in grads_and_vars if id(v) not in self.owned]
        return apply_next(rest)

    def checkpoint_state(self) -> dict:
        return {f"tensor_parallel_optimizer_{r}": copy for r, copy in enumerate(self.optimizers)}


def _summed_over(context, grads: list, shapes: list, copies: list[int]) -> list:
    """Each of `grads` summed over the replicas `copies` (each replica passes its own).

    The dense ones travel packed in one gather. A sparse gradient (an embedding's lookups)
    stays sparse: its rows are gathered, not added, as Keras's own optimizers take them
    (Adam squares each looked-up row's gradient apart, so a densified sum would train
    differently from Keras on one device).
    """
    if len(copies) == 1:
        return list(grads)
    out = list(grads)
    dense = [i for i, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
    if dense:
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(grads[i]), [-1]) for i in dense], 0)
        everyone = context.all_gather(flat[None], axis=0)  # [replicas, elements]
        total = tf.add_n([everyone[r] for r in copies])
        sizes = [int(np.prod(shapes[i])) for i in dense]
        for i, piece in zip(dense, tf.split(total, sizes), strict=True):
            out[i] = tf.reshape(piece, shapes[i])
    for i, grad in enumerate(grads):
        if isinstance(grad, tf.IndexedSlices):
            counts = context.all_gather(tf.shape(grad.indices)[:1], axis=0)
            values = context.all_gather(grad.values, axis=0)
            indices = context.all_gather(grad.indices, axis=0)
            starts = tf.concat([[0], tf.cumsum(counts)], 0)
            out[i] = tf.IndexedSlices(
                tf.concat([values[starts[r] : starts[r + 1]] for r in copies], 0),
                tf.concat([indices[starts[r] : starts[r + 1]] for r in copies], 0),
                grad.dense_shape,
            )
    return out


# --- converting a model ------------------------------------------------------------------------


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

"""Every private TensorFlow / Keras entry point tfdist relies on, each behind a name of its own.

Checked on TensorFlow 2.21 and Keras 3.15. TensorFlow and Keras may rename or remove any of
these in a minor release; when one breaks, this is the only module to change (and
tests/test_compat.py names the entry). Each entry's "Why:" line says why no public API does.
Grouped by topic; add new entries to the section they belong to (or a new section), never
elsewhere in tfdist.

Sections:
  strategies         building and inspecting tf.distribute strategy objects
  cross-device ops   the CrossDeviceOps protocol tfdist's ring all-reduce implements
  coordination       TensorFlow's coordination service (multi-worker start-up and heartbeats)
  keras training     what Keras's trainer and optimizer keep privately, which tfdist.fit's
                     runners and loop read or drive as Keras's own fit does
  ps shards          checkpointing and looking up variables split across ps tasks
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

# `tensorflow.python` is TensorFlow's private tree: these imports stay in this module.
from tensorflow.python.distribute import distribute_utils, mirrored_run
from tensorflow.python.distribute import values as values_lib

# --- strategies -------------------------------------------------------------------------------


class MirroredStrategy(tf.distribute.MirroredStrategy):
    """tf.distribute.MirroredStrategy whose collective keys start at `collective_key_base`.

    TensorFlow numbers the collective groups of every MirroredStrategy from 1, so a second one
    over another number of devices in the same process aborts with "joining a group with size
    4, but that group has size 2". MirroredExtended's constructor reads the base from the
    strategy object; set on this instance before that runs, it gives this strategy its own
    key range and leaves tf.distribute.MirroredStrategy's class attribute alone. The class
    keeps TensorFlow's name, so messages that name a strategy's type read the same.

    Why: the private `_collective_key_base` is the only way to choose the keys.
    """

    def __init__(self, devices=None, cross_device_ops=None, *, collective_key_base: int = 0):
        self._collective_key_base = collective_key_base
        super().__init__(devices, cross_device_ops=cross_device_ops)


def mirrored_strategy(
    devices: Sequence[str],
    *,
    cross_device_ops: tf.distribute.CrossDeviceOps | None,
    collective_key_base: int,
) -> tf.distribute.MirroredStrategy:
    """A MirroredStrategy over `devices` whose collective group keys start after the base."""
    return MirroredStrategy(
        list(devices), cross_device_ops=cross_device_ops, collective_key_base=collective_key_base
    )


def replace_cross_device_ops(
    strategy: tf.distribute.Strategy,
    build: Callable[[tf.distribute.CrossDeviceOps], tf.distribute.CrossDeviceOps],
) -> None:
    """Replaces the strategy's CrossDeviceOps (what batch_reduce uses) with `build(current)`.

    Why: MultiWorkerMirroredStrategy takes no cross_device_ops argument; its private
    `extended._cross_device_ops` is the only way to route gradients through tfdist's ring.
    """
    extended = strategy.extended
    extended._cross_device_ops = build(extended._cross_device_ops)


def intercept_variable_creation(
    strategy: tf.distribute.Strategy, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Routes this strategy object's variable creation through `wrap(original_creator)`.

    The wrapped creator is called as creator(next_creator, **kwargs), like TensorFlow's; only
    this instance's method is replaced.

    Why: a public tf.variable_creator_scope would have to be entered around every use of the
    scope; the private `extended._create_variable` sees every variable, ps and shards chosen.
    """
    extended = strategy.extended
    extended._create_variable = wrap(extended._create_variable)


def sync_worker_count(strategy: tf.distribute.Strategy) -> int:
    """Processes that run a synchronous strategy's steps together (1 unless multi-worker).

    Why: MultiWorkerMirroredStrategy's extended object keeps the count in `_num_workers`.
    """
    return worker_count(strategy)


def worker_count(strategy: tf.distribute.Strategy) -> int:
    """The worker processes a strategy trains on: those stepping together under
    multi_worker_mirrored, those a parameter-server coordinator schedules steps on (1 for a
    strategy of one process).

    Why: both strategies' extended objects keep the count in `_num_workers`.
    """
    return int(getattr(strategy.extended, "_num_workers", 1) or 1)


def strategy_cluster_resolver(strategy: tf.distribute.Strategy):
    """The cluster resolver a strategy was built with, or None.

    Why: ParameterServerStrategy's public `cluster_resolver` is None; it keeps its resolver
    in the private `_cluster_resolver`.
    """
    return strategy.cluster_resolver or getattr(strategy, "_cluster_resolver", None)


# --- cross-device ops -------------------------------------------------------------------------


class CrossDeviceOps(tf.distribute.CrossDeviceOps):
    """tf.distribute.CrossDeviceOps with its two private hooks under public names.

    Subclasses override `gather_implementation` and `num_between_graph_workers` (above 1, or
    TensorFlow skips reducing a value held on one device) instead of TensorFlow's names.

    Why: the hooks exist only as the private `_gather_implementation` and
    `_num_between_graph_workers`.
    """

    @property
    def num_between_graph_workers(self) -> int:
        return 1

    def gather_implementation(self, per_replica_value, destinations, axis, options):
        raise NotImplementedError(f"{type(self).__name__} does not gather")

    @property
    def _num_between_graph_workers(self) -> int:
        return self.num_between_graph_workers

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        return self.gather_implementation(per_replica_value, destinations, axis, options)


def gather(
    cross_device_ops: tf.distribute.CrossDeviceOps,
    per_replica_value,
    destinations,
    axis: int,
    options=None,
):
    """`cross_device_ops` gathers `per_replica_value` along `axis` onto `destinations`.

    Why: CrossDeviceOps has no public gather; strategies call its private `_gather`.
    """
    return cross_device_ops._gather(per_replica_value, destinations, axis, options)


def mirrored_value(per_device: Sequence[tf.Tensor]) -> tf.distribute.DistributedValues:
    """One Mirrored value from a tensor per device, as TensorFlow's CrossDeviceOps return.

    Why: no public API wraps per-device tensors; TensorFlow's own CrossDeviceOps use the
    private `distribute_utils.regroup` and `values.Mirrored`.
    """
    return distribute_utils.regroup(tuple(per_device), wrap_class=values_lib.Mirrored)


def replica_threads_here() -> bool:
    """Whether the caller is one of a MirroredStrategy's replica threads in this process
    (whose `merge_call` hands the strategy every replica's value as tensors of one graph).

    Why: the replica threads are private to mirrored_run.
    """
    return isinstance(threading.current_thread(), mirrored_run._MirroredReplicaThread)


# --- coordination service ---------------------------------------------------------------------


def coordination_service_configured() -> bool:
    """Whether TensorFlow's coordination service has been configured in this process.

    Why: only the private eager context (`tensorflow.python.eager.context`) knows.
    """
    from tensorflow.python.eager import context

    return context.context().coordination_service is not None


def announce(key: str, value: str) -> None:
    """Sets `key` in the coordination service's key-value store, for every task to read.

    Why: the store is reached only through the private eager context.
    """
    from tensorflow.python.eager import context

    context.context().set_config_key_value(key, value)


def await_key(key: str, timeout_ms: int) -> str:
    """`key`'s value in the coordination service's store, once some task has set it; raises
    tf.errors.DeadlineExceededError after `timeout_ms`. A wait that gives up aborts nothing
    (a collective's timeout aborts every collective of the process).

    Why: the store is reached only through the private eager context.
    """
    from tensorflow.python.eager import context

    return context.context().get_config_key_value(key, timeout_in_ms=timeout_ms)


def forget_key(key: str) -> None:
    """Deletes `key` from the coordination service's store.

    Why: the store is reached only through the private eager context.
    """
    from tensorflow.python.eager import context

    context.context().delete_config_key_value(key)


def configure_coordination_service(
    *,
    leader: str,
    jobs: Mapping[str, int],
    register_timeout_ms: int,
    heartbeat_timeout_ms: int,
    register_with_barrier: bool,
) -> None:
    """Configures TensorFlow's coordination service before any strategy starts it.

    Args:
      leader: the task hosting the service, e.g. "/job:chief/replica:0/task:0".
      jobs: the number of tasks of each coordinated job.
      register_timeout_ms: how long every task waits for the others to register (0: forever).
      heartbeat_timeout_ms: silence after which a task is declared dead (0: TensorFlow's).
      register_with_barrier: the leader, too, waits at most register_timeout_ms.

    Why: MultiWorkerMirroredStrategy takes no timeouts; the private eager context, its
    CoordinatedJob proto and the barrier field (no argument sets it) are the only way.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=leader,
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=count)
            for job, count in jobs.items()
        ],
        cluster_register_timeout_in_ms=register_timeout_ms,
        heartbeat_timeout_in_ms=heartbeat_timeout_ms,
    )
    ctx.coordination_service.cluster_register_with_barrier = register_with_barrier


# --- keras training -----------------------------------------------------------------------------


def symbolic_build(model: keras.Model, sample_batch, *, build_optimizer: bool = True) -> None:
    """Builds the model, its compiled metrics and losses and (unless `build_optimizer` is
    False) the optimizer's slots from one batch's shapes, as Keras's fit does before its
    first step.

    Why: Keras 3.15 has no public call that builds the compiled metrics and losses without
    running a step (`Trainer._symbolic_build`); it builds an unbuilt optimizer too, so the
    optimizer passes for built while it runs.
    """
    optimizer = model.optimizer
    if build_optimizer or optimizer is None or optimizer.built:
        model._symbolic_build(data_batch=sample_batch)
        return
    optimizer.built = True
    try:
        model._symbolic_build(data_batch=sample_batch)
    finally:
        optimizer.built = False


def strategy_of(model: keras.Model):
    """The strategy Keras recorded when the model was created (None: no strategy's scope).

    Why: Keras records it in `Layer._distribute_strategy`; no public accessor.
    """
    return model._distribute_strategy


def compiled_loss(model: keras.Model):
    """The loss `compile` was given, in Keras's wrapper (None: compiled without one).

    Why: `Trainer._compile_loss`; the public `model.loss` is the user's object, unset for
    some forms of `compile`.
    """
    return model._compile_loss


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether the model's `call` takes `training`.

    Why: Keras inspects the signature once and keeps `_call_has_training_arg`.
    """
    return bool(model._call_has_training_arg)


def compute_loss(model: keras.Model, **kwargs):
    """The compiled loss of a batch, as Keras's train_step computes it.

    Why: `Trainer._compute_loss` adds regularisation losses and honours a model's
    `compute_loss` override; the public `compute_loss` skips the latter's checks.
    """
    return model._compute_loss(**kwargs)


def loss_tracker(model: keras.Model):
    """The Mean metric that Keras's train_step feeds the loss into (the logged "loss").

    Why: `Trainer._loss_tracker` has no public name.
    """
    return model._loss_tracker


def unscale_loss(loss):
    """A replica's loss without the 1/replicas factor Keras's losses apply under a strategy.

    Why: `keras.src.losses.loss.unscale_loss_for_distribution` is not exported.
    """
    from keras.src.losses.loss import unscale_loss_for_distribution

    return unscale_loss_for_distribution(loss)


def metrics_in_order(model: keras.Model, logs: dict) -> list | float:
    """Logs as `evaluate` returns them without return_dict: `metrics_names` order.

    Why: `Trainer._flatten_metrics_in_order` holds Keras's ordering rule.
    """
    return model._flatten_metrics_in_order(logs)


def should_evaluate(model: keras.Model, epoch: int, validation_freq) -> bool:
    """Keras's rule for whether fit validates after `epoch` (an int period or a list).

    Why: `Trainer._should_eval`.
    """
    return bool(model._should_eval(epoch, validation_freq))


def take_restored_epoch(model: keras.Model) -> int | None:
    """The epoch a BackupAndRestore callback restored, consumed (a later fit starts afresh).

    Why: BackupAndRestore hands it to Keras's fit through `model._initial_epoch`.
    """
    restored = model._initial_epoch
    model._initial_epoch = None
    return restored


def backup_now(callback: keras.callbacks.BackupAndRestore, *, epoch: int) -> None:
    """Makes a BackupAndRestore callback write its backup now, as taken during `epoch`.

    Its metadata records the epoch; the optimizer's iteration count tells how far into it
    the backup was taken. Why: the callback saves only at epoch ends or every `save_freq`
    batches (`_save_model`, `_current_epoch`); a preemption saves between.
    """
    callback._current_epoch = epoch
    callback._save_model()


def optimizer_variables_list(optimizer) -> list:
    """The variables an optimizer was built over, in its order.

    Why: Keras keeps them in `_trainable_variables`; `optimizer.variables` holds its slots.
    """
    return list(optimizer._trainable_variables)


def momentum_slot(optimizer, variable):
    """SGD's momentum slot for `variable`.

    Why: Keras 3.15 keeps the slots in `momentums`, by the index `_get_variable_index`
    gives (no public lookup).
    """
    return optimizer.momentums[optimizer._get_variable_index(variable)]


def clip_gradients(optimizer, grads: list) -> list:
    """`grads` clipped as `optimizer` clips them in its update (clipnorm per gradient,
    global_clipnorm over all, clipvalue per element; None gradients kept).

    Why: Keras 3.15 clips inside `apply` (`BaseOptimizer._clip_gradients`), with no public
    call; a StepHook that applies gradients itself clips first.
    """
    return optimizer._clip_gradients(grads)


def updates_only_through_update_step(optimizer) -> bool:
    """Whether `optimizer`'s update is its `update_step` per variable, as Keras's base
    optimizer runs it: its class does not replace `apply` or the steps around update_step.

    Why: Keras 3.15 optimizers may keep state outside `update_step` in private overrides
    (Nadam's `_u_product` in `_backend_update_step`); a caller of update_step would miss it.
    """
    base = keras.optimizers.Optimizer
    kind = type(optimizer)
    return all(
        getattr(kind, name) is getattr(base, name)
        for name in ("apply", "_backend_apply_gradients", "_backend_update_step")
    )


def uses_weight_decay(optimizer, variable) -> bool:
    """Whether `optimizer` decays `variable` (not excluded by exclude_from_weight_decay).

    Why: Keras 3.15 decides it in the private `BaseOptimizer._use_weight_decay`.
    """
    return bool(optimizer._use_weight_decay(variable))


def learning_rate_schedule(optimizer):
    """The optimizer's learning rate as given (a schedule, or a variable).

    Why: `learning_rate` evaluates a schedule at the current step; `_learning_rate` is the
    schedule object itself.
    """
    return getattr(optimizer, "_learning_rate", None)


def direct_assign(variable: keras.Variable, value) -> None:
    """Writes a Keras variable below its stateless-scope check.

    Why: inside a StatelessScope Keras records assignments instead of making them;
    `_direct_assign` is its own write, which MetricState uses for every variable it does
    not hold.
    """
    variable._direct_assign(value)


def replace_loss_reduction(reduce: Callable) -> Callable:
    """Makes `reduce` the function every Keras loss reduces its values with, returning the
    one it replaces (call it again with that to undo).

    Why: a loss divides a replica's weighted sum by the replica's own count (its unmasked
    elements, or its weights' sum) inside `Loss.__call__`, which reads the module's
    `reduce_weighted_values` at each call; Keras has no option for a count over the global
    batch (tfdist.training.loss_normalisation).
    """
    from keras.src.losses import loss as keras_loss

    original = keras_loss.reduce_weighted_values
    keras_loss.reduce_weighted_values = reduce
    return original


def standardize_loss_reduction(reduction) -> str:
    """A loss reduction's name as Keras spells it ("auto" -> "sum_over_batch_size").

    Why: the spelling rules live in `keras.src.losses.loss`; a replacement of the
    reduction must read the names as Keras does.
    """
    from keras.src.losses import loss as keras_loss

    return keras_loss.standardize_reduction(reduction)


def scale_loss_for_distribution(value):
    """A replica's loss scaled as Keras scales it before the replicas' gradients are summed.

    Why: Keras's own helper (`keras.src.losses.loss`), not exported.
    """
    from keras.src.losses import loss as keras_loss

    return keras_loss.scale_loss_for_distribution(value)


def same_rank(a, b):
    """(a, b) squeezed or expanded to the same rank, as Keras aligns losses and weights.

    Why: Keras's own rule (`keras.src.losses.loss.squeeze_or_expand_to_same_rank`), not
    exported; a count over weights must align them as the loss does.
    """
    from keras.src.losses import loss as keras_loss

    return keras_loss.squeeze_or_expand_to_same_rank(a, b)


def keras_train_step():
    """Keras's own TensorFlow `train_step` (a model whose class replaces it has its own)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer.train_step


def keras_test_step():
    """Keras's own TensorFlow `test_step`.

    Why (both): the trainer class is in `keras.src`; comparing a model's method with it is
    how Keras-shaped code tells an override.
    """
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer.test_step


def optimizer_strategy(optimizer):
    """The strategy an optimizer was created under (None: none recorded).

    Why: Keras's TensorFlow optimizer keeps it in `_distribution_strategy`.
    """
    return getattr(optimizer, "_distribution_strategy", None)


def all_layers(model: keras.Model) -> list:
    """Every layer inside `model`, nested ones included, the model itself not.

    Why: Keras's `_flatten_layers`; `model.layers` lists only the top level.
    """
    return list(model._flatten_layers(include_self=False))


def sublayers(layer) -> list:
    """The layers `layer` holds directly (tracked by Keras, private attributes included).

    Why: Keras's `_flatten_layers(recursive=False)`.
    """
    return list(layer._flatten_layers(include_self=False, recursive=False))


def layer_graph(model: keras.Model):
    """The functional graph of a Sequential or functional model (None: a subclassed one).

    Why: a built Sequential keeps its graph in `_functional`; a functional model's graph
    nodes are Keras's `_nodes_by_depth`.
    """
    graph = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    return graph if getattr(graph, "_nodes_by_depth", None) is not None else None


def layer_inputs_in(graph, layer) -> list[list]:
    """The symbolic tensors `layer` takes at each of its calls in a `layer_graph`.

    Why: a layer's calls are its `_inbound_nodes` (a layer shared by several models has
    calls outside this one).
    """
    nodes = {id(node) for depth in graph._nodes_by_depth.values() for node in depth}
    return [list(node.input_tensors) for node in layer._inbound_nodes if id(node) in nodes]


def graph_nodes(graph) -> list:
    """Every call of a layer (or op) in a `layer_graph`, the model's inputs left out: Keras's
    nodes, each with `operation`, `input_tensors`, `output_tensors` and `parent_nodes`.

    Why: the same `_nodes_by_depth` as `layer_inputs_in`.
    """
    return [
        node
        for depth in sorted(graph._nodes_by_depth, reverse=True)
        for node in graph._nodes_by_depth[depth]
        if not isinstance(node.operation, keras.layers.InputLayer)
    ]


def tensors_taken(graph) -> set[int]:
    """The ids of every symbolic tensor some layer of a `layer_graph` takes.

    Why: the same `_nodes_by_depth` as `layer_inputs_in`, every node's inputs.
    """
    return {
        id(t) for depth in graph._nodes_by_depth.values() for node in depth
        for t in node.input_tensors
    }  # fmt: skip


def producer(tensor):
    """The layer that made a symbolic tensor (None: a model input).

    Why: Keras records it in the KerasTensor's `_keras_history`.
    """
    history = getattr(tensor, "_keras_history", None)
    operation = history.operation if history is not None else None
    return None if isinstance(operation, keras.layers.InputLayer) else operation


def clone_uncompiled(model: keras.Model, clone_function) -> keras.Model:
    """keras.models.clone_model(model, clone_function=...), the copy left uncompiled.

    Why: Keras 3 compiles the clone of a compiled functional model from its compile config
    and builds that optimizer over the clone's weights, where the caller (tensor_parallel)
    has replaced layers whose parts an optimizer made under the strategy cannot take yet.
    """
    compiled = model.compiled
    model.compiled = False
    try:
        return keras.models.clone_model(model, clone_function=clone_function)
    finally:
        model.compiled = compiled


def host_variable(strategy, device: str, **kwargs):
    """A plain variable on `device`, made inside `strategy`'s scope without the strategy's
    variable creator (which would mirror it on every replica's device).

    Why: tf.Variable goes through the creator stack the scope set up; a ResourceVariable
    made directly does not. Keras asks a variable for its `_distribute_strategy` to check
    it belongs to the scope's strategy.
    """
    from tensorflow.python.ops.resource_variable_ops import ResourceVariable

    kwargs.pop("colocate_with", None)
    with tf.device(device):
        variable = ResourceVariable(**kwargs)
    variable._distribute_strategy = strategy
    return variable


def build_optimizer_plainly(optimizer, variables, device: str, run_outside) -> None:
    """Builds `optimizer`'s state for plain `variables` on `device`, with no strategy.

    Why: Keras's TensorFlow optimizer makes each slot inside its strategy's
    `colocate_vars_with(variable)`, which a mirrored strategy allows only for its own
    distributed variables; the optimizer keeps the strategy it was made under in
    `_distribution_strategy`. `run_outside` runs a function where no scope is entered.
    """
    made_under = optimizer._distribution_strategy

    def build():
        optimizer._distribution_strategy = tf.distribute.get_strategy()  # where no scope is
        with tf.device(device):
            optimizer.build(variables)

    try:
        run_outside(build)
    finally:
        optimizer._distribution_strategy = made_under


def run_graph(model: keras.Model, inputs, call_fn):
    """Runs a functional model's graph on `inputs`, each layer called through
    `call_fn(layer, *args, **kwargs)`; returns its outputs.

    Why: Keras's `Functional._run_through_graph` (what clone_model uses); no public name.
    """
    return model._run_through_graph(inputs, call_fn=call_fn)


def inputs_like(model: keras.Model, inputs: list):
    """`inputs` (one per model input, in order) in the structure of the model's inputs (a
    dict, a list or one tensor).

    Why: a functional model keeps that structure in `_inputs_struct`.
    """
    return keras.tree.pack_sequence_as(model._inputs_struct, inputs)


def held_layers(layer) -> list[tuple[str, keras.layers.Layer]]:
    """The layers `layer` holds in public attributes (a Layer subclass's sublayers), by
    attribute name, in the order they were set.

    Why: Keras tracks a layer's sublayers in `_layers`, without the attribute names a copy
    needs to put a replacement in the same place.
    """
    return [
        (name, value)
        for name, value in vars(layer).items()
        if not name.startswith("_") and isinstance(value, keras.layers.Layer)
    ]


def replace_held_layer(layer, attribute: str, replacement) -> None:
    """Sets `layer.<attribute>` to `replacement`, and stops tracking the layer it held (an
    unbuilt layer left tracked would stay in `layer.layers`).

    Why: Keras's Layer.__setattr__ tracks the new sublayer at the end of `_layers` and keeps
    the old one there; the weights (get_weights) follow `_layers`' order.
    """
    old = getattr(layer, attribute)
    at = next((i for i, sub in enumerate(layer._layers) if sub is old), None)
    setattr(layer, attribute, replacement)
    kept = [sub for sub in layer._layers if sub is not old and sub is not replacement]
    if at is not None:  # in the old one's place, so the weights keep their order
        kept.insert(at, replacement)
    layer._layers[:] = kept


def own_variables(layer) -> list:
    """The variables a layer created itself (add_weight in its build), not its sublayers'.

    Why: `layer.weights` gathers the sublayers' too; Keras keeps a layer's own in
    `_trainable_variables` and `_non_trainable_variables`.
    """
    return [*layer._trainable_variables, *layer._non_trainable_variables]


def keras_mask(tensor):
    """The Keras mask a tensor carries (from Embedding(mask_zero=True), Masking, ...), on a
    symbolic tensor too; None if none.

    Why: Keras keeps it in `_keras_mask`, read and written through keras.src.backend's
    get_keras_mask / set_keras_mask (no public name).
    """
    from keras.src import backend as keras_backend

    return keras_backend.get_keras_mask(tensor)


def set_keras_mask(tensor, mask) -> None:
    """Makes `tensor` carry the Keras mask `mask` (see keras_mask)."""
    from keras.src import backend as keras_backend

    keras_backend.set_keras_mask(tensor, mask)


# --- checkpointing of variables split across ps tasks (training/ps_shards.py) --------------------

# Why: a ShardedVariable's slots and whole values are saved as one tensor each by objects of
# tfdist's own that TensorFlow's checkpointing must accept as its own kind. tf.train.Checkpoint
# saves any Trackable through `_serialize_to_tensors` / `_restore_from_tensors` and finds its
# children through `_trackable_children`: the protocol tf.Variable itself implements, without
# a public base class.
Trackable = tf.__internal__.tracking.Trackable


@contextlib.contextmanager
def keras_take_replaced(take: Callable) -> Iterator[None]:
    """Within the block, Keras's TensorFlow `ops.take` (which Embedding calls) is `take`.

    Why: Keras reads an Embedding's whole table into the step and gathers there; a table
    split across ps tasks must be gathered shard by shard on the tasks that hold it
    (tf.nn.embedding_lookup), and Keras has no hook for that. Only a step's tracing runs
    inside: the graph keeps the lookups.
    """
    from keras.src.backend.tensorflow import numpy as keras_tf_numpy

    original = keras_tf_numpy.take
    keras_tf_numpy.take = take
    try:
        yield
    finally:
        keras_tf_numpy.take = original


def keras_take():
    """Keras's own TensorFlow `ops.take`, for a replacement to fall back on."""
    from keras.src.backend.tensorflow import numpy as keras_tf_numpy

    return keras_tf_numpy.take


def replace_storage(variable: keras.Variable, storage) -> None:
    """Makes `storage` (a tf.Variable, or an object that reads like one) what the Keras
    variable reads and writes, in place of the tf.Variable it made.

    Why: Keras's TensorFlow variable keeps its tf.Variable in `_value` and reads every value,
    handle and checkpoint tensor through it; no public setter exists. ZeRO-3 gives a
    layer's weight a storage of its own (the host copy, or the gathered slices while a
    step is traced) without rebuilding the layer.
    """
    variable._value = storage


def replace_call(layer: keras.layers.Layer, call: Callable) -> None:
    """Makes `call` what the layer's `__call__` runs, in place of its class's `call`, until
    restore_call.

    Why: Keras's Layer.__call__ runs `self.call(...)`, read from the instance; tensor
    parallelism from a layout map puts exchanges around a layer's own computation while a
    step is traced, without rebuilding the layer (keras-hub's layers build their sublayers
    in code no copy could reach).
    """
    vars(layer)["call"] = call  # past Keras's attribute tracking: a function, not state


def restore_call(layer: keras.layers.Layer) -> None:
    """Undoes replace_call."""
    vars(layer).pop("call", None)


def keras_saves_weights_through_disk(model_qualifies: Callable[[keras.Model], bool]) -> None:
    """Makes Keras's `model.save` of a `.keras` file write the weights to a temporary file
    beside it, then copy that file into the archive, for the models `model_qualifies`
    (installed once; other models save as Keras chooses).

    Why: Keras 3.15's saving_lib writes the weights into an in-memory buffer first whenever
    `is_memory_sufficient(model)` says there is room, so every process of a model held in
    parts (each writes the whole file: its reads are collectives) held the whole model in
    memory at its save (3.0-3.8 W of resident memory, tools/peak_bench.py). Its other
    branch, meant for models too large for memory, streams them: each weight as it is read.
    """
    try:
        from keras.src.saving import saving_lib
    except ImportError:  # another Keras: its saves go as it chooses (an optimisation only)
        return
    if not hasattr(saving_lib, "is_memory_sufficient"):
        return
    original = getattr(
        saving_lib.is_memory_sufficient, "__wrapped__", saving_lib.is_memory_sufficient
    )

    def is_memory_sufficient(model):
        return False if model_qualifies(model) else original(model)

    is_memory_sufficient.__wrapped__ = original
    saving_lib.is_memory_sufficient = is_memory_sufficient


def storage_of(variable: keras.Variable):
    """The tf.Variable (or stand-in) a Keras variable reads: see replace_storage."""
    return variable._value


def autocast_dtype():
    """The dtype Keras casts float variables to where they are read now (None: no casting).

    Why: Keras's Layer.__call__ enters an `AutocastScope` (mixed precision) around `call`,
    kept in Keras's global state; a call run again later (a unit's backward pass) must run
    under the same one.
    """
    scope = keras.src.backend.get_autocast_scope()
    return None if scope is None else scope.dtype


def autocasting(dtype):
    """A context in which Keras casts float variables to `dtype` where they are read, as
    under the layer call that gave `autocast_dtype` (a no-op for None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return keras.src.backend.AutocastScope(dtype)


def forget_traced_functions(model: keras.Model) -> None:
    """Makes Keras trace the model's train, test and predict functions again at their next
    use (after its variables' storage changed: a traced function reads the storage it saw).

    Why: Keras's TensorFlow trainer keeps each traced function in `train_function`,
    `test_function` and `predict_function`, and makes a new one only where it is None.
    """
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)


def stateless_scope(values: Sequence[tuple[keras.Variable, tf.Tensor]]) -> keras.StatelessScope:
    """A `keras.StatelessScope` (collecting losses) in which each variable reads as its
    value in `values`, which may be a part of the variable: smaller along one dimension.

    Why: StatelessScope checks each value's shape against its variable's when it is made,
    and `stateless_call` makes one; a tensor-parallel stage of a pipeline calls its layers
    on its parts of their weights (the split layers run in their exchanges, which expect
    the parts). The scope reads its mapping by the variable's id, as it is made.
    """
    scope = keras.StatelessScope(collect_losses=True)
    for variable, value in values:
        scope.state_mapping[id(variable)] = tf.convert_to_tensor(value, variable.dtype)
    return scope

"""What the modes that update weights themselves share (pipeline stages, tensor-parallel
parts, ZeRO's slices): a copy of the user's optimizer for the weights a replica keeps, built
outside the strategy; the checks that such a copy can stand for the user's optimizer; and
one update step through the copy's `update_step`, as Keras's `apply` takes it. And for the
modes whose weights read as a replica's own variable while a step is traced (ZeRO-3's
slices, a layout map's parts): that variable's stand-in storage, and the span of the trace.

A copy is the user's optimizer's class and config, its slots built for the weights it is
given (plain variables on one device). Its step goes through `update_step` directly, not
`apply`, whose tf.distribute calls expect the strategy's variables.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError, TfdistError
from tfdist.strategies import ReplicaPlacement
from tfdist.training import shards, sparse_rows

# Optimizers whose update of each weight reads only that weight's gradient and slots (and
# scalar hyperparameters): any contiguous range of the packed weights can be updated alone.
ELEMENTWISE = (
    keras.optimizers.SGD,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.Adamax,
    keras.optimizers.RMSprop,
    keras.optimizers.Adagrad,
    keras.optimizers.Adadelta,
    keras.optimizers.Ftrl,
    keras.optimizers.Lion,
)


def outside_strategy(build: Callable):
    """Runs `build` in a thread of its own, where no strategy's scope is entered (scopes are
    per thread), so the variables it creates are plain ones on the devices it names."""
    result: list = []
    errors: list[BaseException] = []

    def run():
        try:
            result.append(build())
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="tfdist-build")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def optimizer_copy(optimizer, variables) -> keras.optimizers.Optimizer:
    """A copy of `optimizer` (same class and config) built on `variables` (call it where
    the copy's slots should live: under `tf.device`, outside the strategy)."""
    copy = type(optimizer).from_config(optimizer.get_config())
    copy.build(variables)
    return copy


def check_copyable(optimizer, *, who: str, error: type[FitError] = FitError) -> None:
    """Refuses an optimizer that copies updating parts of the weights cannot stand for.

    Args:
      optimizer: the model's.
      who: what updates the parts, for the messages ("A pipeline's stages").
      error: the FitError subclass to raise.
    """
    if optimizer is None:
        raise error(f"{who} update the model's weights with its optimizer; compile it with one.")
    name = type(optimizer).__name__
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise error(
            f"{who} update their weights apart, so a LossScaleOptimizer's one check over "
            "every gradient (mixed_float16) is not made for them. Train in float32 or "
            "mixed_bfloat16. Received: LossScaleOptimizer"
        )
    if optimizer.global_clipnorm is not None:
        raise error(
            f"{who} update their weights apart, so a norm over all the gradients "
            "(global_clipnorm) is known to none of them. Use clipvalue (or clipnorm where "
            f"whole weights are kept). Received: global_clipnorm={optimizer.global_clipnorm}"
        )
    if not compat.updates_only_through_update_step(optimizer) or optimizer.use_ema:
        raise error(
            f"{who} apply {name}'s update_step to their weights, but this optimizer keeps "
            "state outside it (Nadam's momentum schedule, moving averages with use_ema, an "
            f"optimizer of optimizers). Use Adam, AdamW, SGD, RMSprop, ... Received: {name}"
        )
    if optimizer.gradient_accumulation_steps:
        raise error(
            f"{who} take each step's gradients whole; drop the optimizer's "
            "gradient_accumulation_steps (a pipeline's micro-batches, or tfdist.fit's "
            "accumulate_steps, accumulate instead). "
            f"Received: gradient_accumulation_steps={optimizer.gradient_accumulation_steps}"
        )


def learning_rate_at(optimizer, iterations):
    """The learning rate the user's `optimizer` gives the step `iterations` counts: its
    schedule's value there (the schedule it holds now: a callback may replace it), or its
    rate as it is now (a callback may assign it). A copy's own rate is never read: it was
    the user's when the copy was made."""
    rate = compat.learning_rate_schedule(optimizer)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return rate(iterations)
    if isinstance(rate, keras.Variable):
        return rate.value
    return rate() if callable(rate) else rate


def update_step(optimizer, grads, variables, *, learning_rate, weight_decay) -> None:
    """One update of `variables` by a copy, as `apply` makes it: clipping (per gradient),
    decoupled weight decay first, then `update_step`. The caller sets the copy's step count
    (Adam's bias correction reads iterations + 1) and advances it."""
    grads = compat.clip_gradients(optimizer, grads)
    for grad, variable in zip(grads, variables, strict=True):
        lr = tf.cast(learning_rate, variable.dtype)
        if weight_decay and compat.uses_weight_decay(optimizer, variable):
            variable.assign(variable - variable * tf.cast(weight_decay, variable.dtype) * lr)
        optimizer.update_step(grad, variable, lr)


def decoupled_decays(optimizer, variables) -> list[bool]:
    """For each of `variables`, whether the optimizer decays it (weight_decay, and the
    variable not excluded): a copy built for other variables (slices, parts) cannot tell by
    their names."""
    return [
        bool(optimizer.weight_decay) and compat.uses_weight_decay(optimizer, v) for v in variables
    ]


OFFLOADS = ("optimizer",)


def checked_offload(offload, *, who: str, error: type[FitError]) -> str | None:
    """`offload` if a sharded mode can take it (None or 'optimizer'); raises `error`."""
    if offload not in (None, *OFFLOADS):
        raise error(
            f"{who} takes offload=None or 'optimizer' (the optimizer's state in host "
            f"memory). Received: offload={offload!r}"
        )
    return offload


def apply_with_copy(user, copy, grads, variables, decays, device) -> None:
    """One update of a replica's own `variables` by its `copy` of the `user`'s optimizer, as
    Keras's apply makes it (decoupled decay first, where `decays`), the copy counting the
    user's steps; then the user's optimizer counts the step (it ends the chain)."""
    done = []
    with tf.device(device):
        copy.iterations.assign(tf.cast(user.iterations, copy.iterations.dtype))
        weight_decay = user.weight_decay or 0.0
        for grad, variable, decay in zip(grads, variables, decays, strict=True):
            lr = tf.cast(user.learning_rate, variable.dtype)
            if decay:
                variable.assign(variable - variable * tf.cast(weight_decay, variable.dtype) * lr)
            copy.update_step(grad, variable, lr)
            done.append(tf.identity(variable.value))
    with tf.control_dependencies(done):
        user.iterations.assign_add(1)


class TraceSpan:
    """`enter` when the first replica's step begins to be traced, `leave` after the last
    (a mirrored strategy traces its replicas in threads at once): while a mode's weights
    read through stand-ins.

        with span():
            return train_step(batch)
    """

    def __init__(self, enter: Callable[[], None], leave: Callable[[], None]):
        self._enter, self._leave = enter, leave
        self._lock = threading.Lock()
        self._tracing = 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if not self._tracing:
                self._enter()
            self._tracing += 1
        try:
            yield
        finally:
            with self._lock:
                self._tracing -= 1
                if not self._tracing:
                    self._leave()


class StandIn(abc.ABC):
    """A Keras weight's storage while a step is traced (compat.replace_storage): its value
    is what `read` gives on this replica, and its handle is `own()`, this replica's own
    variable, so the tape's gradient for the weight is that variable's."""

    def __init__(self, whole, own: Callable[[], keras.Variable]):
        self.own = own
        self.dtype, self.shape, self.name = whole.dtype, whole.shape, whole.name
        self._shared_name = whole._shared_name

    @abc.abstractmethod
    def read(self) -> tf.Tensor:
        """The weight's value on this replica."""

    @property
    def handle(self):
        return self.own().handle

    @property
    def device(self):
        return self.own().value.device

    def __tf_tensor__(self, dtype=None, name=None):
        value = self.read()
        if dtype is not None and tf.as_dtype(dtype) != value.dtype:
            value = tf.cast(value, dtype)
        return value

    def read_value(self):
        return self.__tf_tensor__()

    # What Keras's Variable hands to its storage (`self.value.<op>`): a stand-in answers as
    # the tensor it stands for, so `self.pos[None]` or `-self.scale` reads the weight.
    def __getitem__(self, index):
        return self.read()[index]

    def __neg__(self):
        return -self.read()

    def __abs__(self):
        return abs(self.read())

    def __invert__(self):
        return ~self.read()

    def read_after_update(self) -> tf.Tensor:
        """A tensor that exists once this replica's variable has its new value (a step's
        clock reads it; reading the weight itself could gather it again)."""
        return tf.identity(self.own().value)


# How long a whole read across worker processes (outside a step: a save, get_weights, a
# checkpoint) waits for every process to make it; then ReadTogetherError, not a hang.
WHOLE_READ_TIMEOUT_SECONDS = 300.0


class ReadTogetherError(TfdistError, RuntimeError):
    """A whole read of a weight that worker processes hold in parts, made by fewer than all
    of them."""


def read_options() -> tf.distribute.experimental.CommunicationOptions:
    """The options of a whole read's collective: it gives up after
    WHOLE_READ_TIMEOUT_SECONDS."""
    return tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=WHOLE_READ_TIMEOUT_SECONDS
    )


@contextlib.contextmanager
def read_together(who: str, strategy: tf.distribute.Strategy):
    """Where a whole read across worker processes runs: every process first meets the others
    in the coordination service's store, and one that waits alone gives up there, before any
    collective starts (a collective that times out aborts the process's collectives, and
    TensorFlow's abort has crashed the process); then one ReadTogetherError says what to do.
    The collective's own timeout stays, for a read that meets but never completes."""
    try:
        if tf.executing_eagerly() and compat.coordination_service_configured():
            _meet(strategy)
        yield
    except (tf.errors.DeadlineExceededError, tf.errors.CancelledError,
            tf.errors.UnavailableError) as error:  # fmt: skip
        raise ReadTogetherError(
            f"Under {who} each worker process holds only part of the model, so reading a "
            "weight whole (model.save, get_weights, predict, evaluate, a checkpoint) is a "
            "collective every process must make at the same point; the other processes did "
            f"not join within {WHOLE_READ_TIMEOUT_SECONDS:.0f} s. Make the call on every "
            "worker (as tfdist.fit runs callbacks on every worker), not only on the chief. "
            f"Received: {type(error).__name__}"
        ) from None


_READS = {"made": 0}  # this process's whole reads across processes, counted in order


def _meet(strategy: tf.distribute.Strategy) -> None:
    """Waits until every worker process has come to this process's next whole read (each
    sets a key for its n-th read and waits for the others' n-th), at most
    WHOLE_READ_TIMEOUT_SECONDS. Once all have come to read n, none waits on read n-1's keys
    any more: this process's is deleted (the store stays small over a long run)."""
    resolver = strategy.cluster_resolver
    jobs = resolver.cluster_spec().as_dict()
    n = _READS["made"]
    _READS["made"] += 1

    def key(n, job, index):
        return f"tfdist/whole_read/{n}/{job}/{index}"

    me = (resolver.task_type, resolver.task_id)
    compat.announce(key(n, *me), "here")
    deadline = time.monotonic() + WHOLE_READ_TIMEOUT_SECONDS
    for job in ("chief", "worker"):
        for index in range(len(jobs.get(job, ()))):
            if (job, index) != me:
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                compat.await_key(key(n, job, index), left_ms)
    if n:
        compat.forget_key(key(n - 1, *me))


_STREAMING = []  # installed once: see _stream_saves_of_parts


def _stream_saves_of_parts() -> None:
    """Keras's model.save of a model held in parts writes its weights through a file on
    disk, one weight at a time as each is read whole, not into memory first."""
    if not _STREAMING:
        compat.keras_saves_weights_through_disk(held_in_parts)
        _STREAMING.append(True)


def held_in_parts(model: keras.Model) -> bool:
    """Whether some weight of `model` is held in parts (a WholeStandIn's storage)."""
    return any(isinstance(compat.storage_of(v), WholeStandIn) for v in model.weights)


class WholeStandIn(StandIn):
    """A stand-in that holds no whole copy of its weight and is read whole on demand (ZeRO-3's
    slices, a pipeline's stages): `read` gives the whole value where it is read, `assign`
    writes a whole value into what holds it. Checkpoints, `numpy`, `get_weights` and a
    SavedModel export see the whole weight, one variable at a time."""

    # Across worker processes a read is a collective every process makes (the evaluation
    # step runs its replicas' reads outside any cond).
    read_by_collectives = True

    def __init__(self, whole, own: Callable[[], keras.Variable]):
        super().__init__(whole, own)
        _stream_saves_of_parts()

    @abc.abstractmethod
    def assign(self, value, use_locking=None, name=None, read_value=True):
        """Writes a whole value into what holds the weight."""

    def numpy(self):
        return self.read().numpy()

    def __array__(self, dtype=None, copy=None):
        del copy  # always a new array
        return np.asarray(self.numpy(), dtype=dtype)

    def _serialize_to_tensors(self):
        if shards.saving():  # a sharded checkpoint: its shards hold this weight
            return {}
        return {"VARIABLE_VALUE": self.read()}

    def _restore_from_tensors(self, restored_tensors):
        self.assign(restored_tensors["VARIABLE_VALUE"])

    def _export_to_saved_model_graph(self, object_map, tensor_map, options, **kwargs):
        # A SavedModel holds a whole variable: one made for the export, from what holds it.
        self._exported = tf.Variable(self.read(), name=self.name.split(":")[0])
        resources = self._exported._export_to_saved_model_graph(
            object_map, tensor_map, options, **kwargs
        )
        object_map[self] = object_map[self._exported]
        return resources

    def _write_object_proto(self, proto, options):
        return tf.Variable(self.read())._write_object_proto(proto, options)

    def _copy_trackable_to_cpu(self, object_map):
        object_map[self] = tf.Variable(self.read())


def one_replica_per_process(
    layout: ReplicaPlacement, *, who: str, error: type[FitError] = FitError
) -> ReplicaPlacement:
    """`layout` (a runner's), if a mode that exchanges its own buffers can run on it: not one
    compiled program (TPU cores), and across processes one device each. Raises `error`,
    naming `who`, otherwise."""
    if layout.single_program:
        raise error(
            f"{who} is not built for TPUs (their replicas are one XLA program). "
            "Drop the option on TPU. Received: a TPU strategy"
        )
    devices, workers = len(layout.devices), layout.processes
    if workers > 1 and devices > 1:
        raise error(
            f"{who} across worker processes runs one replica per process; this job has "
            f"{devices} devices in each of {workers} processes. Start one process per "
            "device (tfdist-launch --workers N), or use mirrored in one process. "
            f"Received: {workers} workers x {devices} devices"
        )
    return layout


def added(a, b):
    """Two gradients of one weight (two micro-batches', two pipelines'), added as one
    device's tape holds them for both together (tfdist.training.sparse_rows). Between worker
    processes the ring sums them dense (see the pipeline's `_update`)."""
    return sparse_rows.added(a, b)


def dense_part(g) -> tf.Tensor:
    """A tensor that exists once `g` does (something to wait for)."""
    return g.values if isinstance(g, tf.IndexedSlices) else g


def metric_state(model, variables, state, y, y_pred, sample_weight, loss, size) -> list:
    """The metric state (`state`, the values of `variables`) after one micro-batch's loss
    (counted `size` times) and compiled metrics: what a stage-by-stage step hands on."""
    with keras.StatelessScope(state_mapping=list(zip(variables, state, strict=True))) as scope:
        compat.loss_tracker(model).update_state(loss, sample_weight=size)
        model.compute_metrics(None, y, y_pred, sample_weight=sample_weight)
    return [scope.get_current_value(v) for v in variables]


def added_to_loss(model, variables, state, amount) -> list:
    """`state` with `amount` added to the logged loss's total (a stage's penalty)."""
    total = compat.loss_tracker(model).total
    return [
        s + tf.cast(amount, s.dtype) if v is total else s
        for s, v in zip(state, variables, strict=True)
    ]


# --- flat slices of a weight (ZeRO's shards of a layout's parts and of a pipeline's stages) ---


def slice_size(shape, count: int) -> int:
    """The length of each of `count` flat slices of a weight of `shape` (the last padded
    with zeros): ceil(elements / count)."""
    return -(-int(np.prod(shape, dtype=np.int64)) // count)


def flat_slice(value, count: int, k: int, shape=None) -> tf.Tensor:
    """Slice `k` of `count` of `value` (of `shape`, by default its own), flattened and
    padded with zeros; a gradient of rows (IndexedSlices) is made dense first."""
    shape = tf.TensorShape(value.shape if shape is None else shape)
    elements = int(np.prod(shape.as_list(), dtype=np.int64))
    flat = tf.reshape(tf.convert_to_tensor(value), [elements])
    size = slice_size(shape, count)
    flat = tf.pad(flat, [[0, size * count - elements]])
    return flat[k * size : (k + 1) * size]


def joined(pieces, shape) -> tf.Tensor:
    """A value of `shape` from its flat slices, in order (the padding dropped)."""
    flat = tf.concat([tf.convert_to_tensor(p) for p in pieces], 0)
    return tf.reshape(flat[: int(np.prod(shape, dtype=np.int64))], shape)

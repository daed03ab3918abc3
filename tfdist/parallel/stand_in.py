"""A weight's stand-in storage, for the modes whose weights read as a replica's own
variable while a step is traced (ZeRO-3's slices, a layout map's parts, a pipeline's
stages, host_scope's slices): `StandIn`, and `WholeStandIn` for those read whole on demand
(a save, get_weights, a checkpoint), with the meeting every worker process makes before
such a read and the span of a trace during which the stand-ins are in place.
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
from tfdist.errors import TfdistError
from tfdist.training import shards


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

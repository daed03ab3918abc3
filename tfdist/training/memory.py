"""Bytes of the variables on each device: what a memory-saving layout must divide.

A layout that exists to save memory (ZeRO, pipeline stages, tensor-parallel layers) is
judged by what each device holds while it trains: the weights, the optimizer's slots and
whatever copies the layout keeps. `variable_bytes()` adds up the sizes of every live
`tf.Variable` in this process by the device it is placed on (a mirrored variable counts
once on each device it has a copy on); `DeviceBytes` records the most each device held at
any batch end of a `fit`.

    record = tfdist.DeviceBytes()
    tfdist.fit(model, data, callbacks=[record])
    record.peak          # {"CPU:0": 3145728, "CPU:1": 3145728}
    record.added         # the same, less what the devices held before fit began

A count walks Python's live objects; during fit only those made since fit began (the
others are frozen out of the garbage collector meanwhile), so counting at every batch end
stays cheap in a process that holds much else; `DeviceBytes(every=N)` counts at every
N-th. It counts variables, not tensors: activations and the gradients a step makes live in
TensorFlow's allocator and are not seen here (tools/memory_bench.py reports peak RSS next
to these counts). Variables of other models alive in the process count too: compare against
`before` (taken when the callback is made), or read `added`.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable

import keras
import tensorflow as tf


def device_name(device: str) -> str:
    """ "CPU:1" for "/job:localhost/replica:0/task:0/device:CPU:1"; the job and task are
    kept for another process's device ("/job:worker/task:1/CPU:0")."""
    spec = tf.DeviceSpec.from_string(device or "")
    local = f"{spec.device_type or 'CPU'}:{spec.device_index or 0}"
    if spec.job in (None, "localhost"):
        return local
    return f"/job:{spec.job}/task:{spec.task or 0}/{local}"


def live_variables() -> Iterable[tf.Variable]:
    """Every tf.Variable alive in this process that holds its own memory: the copies of a
    distributed variable, not the variable that stands for them. Objects frozen out of the
    collector (gc.freeze: a forking server's imports, say) are walked too, and stay frozen;
    the collection made first to drop dead ones collects only the others (a frozen variable
    that died in a reference cycle since it was frozen still counts), so that a process
    that froze what it holds is not walked whole by the collector at each count."""
    gc.collect()
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()  # gc.get_objects() lists no frozen object
    try:
        return _variables_among(gc.get_objects())
    finally:
        if frozen:
            gc.freeze()


def _variables_among_unfrozen() -> list[tf.Variable]:
    gc.collect()
    return _variables_among(gc.get_objects())


def _variables_among(objects) -> list[tf.Variable]:
    seen: set[int] = set()
    found = []
    for obj in objects:
        if not isinstance(obj, tf.Variable) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, tf.distribute.DistributedValues):
            continue  # its copies are variables of their own, found here too
        found.append(obj)
    return found


def nbytes(variable) -> int | None:
    """A variable's (tf.Variable's or Keras's) bytes from its shape and dtype (no copy of its value); None if its
    shape is not fully known."""
    size = tf.TensorShape(variable.shape).num_elements()
    return None if size is None else size * tf.as_dtype(variable.dtype).size


def variable_bytes() -> dict[str, int]:
    """{device: bytes of the variables placed on it}, over every live variable."""
    return _bytes_by_device(live_variables())


def _bytes_by_device(variables: Iterable[tf.Variable]) -> dict[str, int]:
    totals: dict[str, int] = {}
    seen: set[int] = set()
    for variable in variables:
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        try:
            device = device_name(variable.device)
        except (ValueError, AttributeError):  # an uninitialised or deleted variable
            continue
        size = nbytes(variable)
        if size is not None:
            totals[device] = totals.get(device, 0) + size
    return totals


class DeviceBytes(keras.callbacks.Callback):
    """Records the most bytes of variables each device held at any batch end of fit.

    Each count is cheap however big the process: when fit begins, one full walk finds the
    variables alive then (kept by weak reference) and freezes the objects alive then out of
    Python's garbage collector (gc.freeze, undone when fit ends), so each batch end's
    count walks only what fit made since, plus those variables that are still alive.

    Attributes:
      before: {device: bytes} when the callback was made (build the model after it to see
        the model's own bytes in `added`).
      peak: {device: the most bytes seen at a batch end}.
      added: {device: peak - before}, for the devices that gained bytes.
    """

    def __init__(self, every: int = 1):
        super().__init__()
        self.every = every
        self.before = variable_bytes()
        self.peak: dict[str, int] = {}
        self._batches = 0
        self._known: list[weakref.ref] = []  # the variables alive when fit began
        self._froze = False
        self._refreeze = False

    def on_train_begin(self, logs=None):
        self._thaw()  # a fit that raised never reached on_train_end
        if not gc.isenabled():
            return  # someone else manages the collector: count the slow way
        self._known = [weakref.ref(v) for v in live_variables()]
        # A collector frozen before (by a forking server, say) is frozen again when fit ends.
        refreeze = gc.get_freeze_count() > 0
        gc.freeze()
        self._froze = True
        # A fit that raises skips on_train_end (as Keras's does): the collector is thawed
        # when this callback goes, at the latest.
        self._thaw_at_exit = weakref.finalize(self, _thaw, refreeze)
        self._refreeze = refreeze

    def on_train_end(self, logs=None):
        self._thaw()
        self._known = []

    def _thaw(self) -> None:
        if self._froze:
            self._thaw_at_exit.detach()
            _thaw(self._refreeze)
            self._froze = False

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if (self._batches - 1) % self.every:
            return
        if self._froze:
            known = [v for v in (ref() for ref in self._known) if v is not None]
            counted = _bytes_by_device([*known, *_variables_among_unfrozen()])
        else:
            counted = variable_bytes()
        for device, size in counted.items():
            self.peak[device] = max(self.peak.get(device, 0), size)

    @property
    def added(self) -> dict[str, int]:
        grown = {d: size - self.before.get(d, 0) for d, size in sorted(self.peak.items())}
        return {d: size for d, size in grown.items() if size > 0}


def _thaw(refreeze: bool) -> None:
    """Undoes on_train_begin's freeze. Where the collector was frozen before (a forking
    server's imports), it stays frozen: what was alive when fit began stays so, and what fit
    left behind is collected (none of it was frozen) and the rest left to the collector."""
    if refreeze:
        gc.collect()
    else:
        gc.unfreeze()


__all__ = ["DeviceBytes", "device_name", "live_variables", "nbytes", "variable_bytes"]

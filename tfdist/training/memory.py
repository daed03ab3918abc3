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

Each count walks Python's live objects (tens of milliseconds in a process with TensorFlow
loaded): `DeviceBytes(every=N)` counts at every N-th batch. It counts variables, not tensors: activations and the gradients a step makes live in
TensorFlow's allocator and are not seen here (tools/memory_bench.py reports peak RSS next
to these counts). Variables of other models alive in the process count too: compare against
`before` (taken when the callback is made), or read `added`.
"""

from __future__ import annotations

import gc
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
    distributed variable, not the variable that stands for them."""
    gc.collect()
    seen: set[int] = set()
    for obj in gc.get_objects():
        if not isinstance(obj, tf.Variable) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, tf.distribute.DistributedValues):
            continue  # its copies are variables of their own, found here too
        yield obj


def nbytes(variable) -> int | None:
    """A variable's (tf.Variable's or Keras's) bytes from its shape and dtype (no copy of its value); None if its
    shape is not fully known."""
    size = tf.TensorShape(variable.shape).num_elements()
    return None if size is None else size * tf.as_dtype(variable.dtype).size


def variable_bytes() -> dict[str, int]:
    """{device: bytes of the variables placed on it}, over every live variable."""
    totals: dict[str, int] = {}
    for variable in live_variables():
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

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if (self._batches - 1) % self.every:
            return
        for device, size in variable_bytes().items():
            self.peak[device] = max(self.peak.get(device, 0), size)

    @property
    def added(self) -> dict[str, int]:
        grown = {d: size - self.before.get(d, 0) for d, size in sorted(self.peak.items())}
        return {d: size for d, size in grown.items() if size > 0}


__all__ = ["DeviceBytes", "device_name", "live_variables", "nbytes", "variable_bytes"]

"""A sharded optimizer's state in `model.save`, laid out as Keras's own optimizer saves it.

Under zero1, zero2 and zero3 the user's optimizer is built on no variables (it keeps the step
count and the learning rate); the slots live in slices on the replicas. Keras's save writes
an optimizer's `variables` by position, so a `.keras` file of a sharded model held two
elements: loaded by Keras, its Adam restarted from zero moments at step 0, silently.

`keep_in_saves` gives the user's optimizer a `save_own_variables` that writes what the same
optimizer built on the model's weights would write: its own variables, then each weight's
slots whole (gathered from the slices: a collective, so every worker process saves, as
every worker must save under multi_worker_mirrored anyway). The order is read off a copy of
the optimizer built on one-element stand-ins of the weights, so any optimizer whose slots
the hooks shard keeps Keras's layout, with no list of optimizers here. Loading such a file
(tfdist or not) builds the optimizer on the model's weights and reads them in that order.

The slots are gathered one bucket of weights at a time (`BucketReader`), as the weights of
a sharded model are gathered for a save one at a time, so TensorFlow's allocator holds no
more than a bucket's slots beyond the step's peak; Keras's writer keeps what it was given in
host memory, as it does for any save. Writing without that is a sharded checkpoint's job
(tfdist.StepCheckpoint).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import keras
import numpy as np

from tfdist.parallel import optimizer_copies

_STAND_IN = "tfdist_saved_v"
_SLOT = re.compile(_STAND_IN + r"(\d+)_(\w+)$")


class BucketReader:
    """Whole slots, one weight at a time, gathered a bucket of weights at a time.

    Args:
      buckets: the weights' positions, in the groups one gather makes whole.
      gather: gather(slot, bucket index) -> {position: the whole slot value}, a collective
        (every process asks for the same buckets in the same order).
      names: the slots each weight has (momentum, velocity, ...).
    """

    def __init__(self, buckets, gather: Callable[[str, int], dict], names):
        self.buckets = [tuple(b) for b in buckets]
        self.gather, self.names = gather, list(names)
        self._at: int | None = None
        self._held: dict[str, dict[int, np.ndarray]] = {}

    def __call__(self, i: int, name: str) -> np.ndarray:
        b = next(k for k, bucket in enumerate(self.buckets) if i in bucket)
        if b != self._at:
            self._held = {}  # let go of the last bucket before gathering the next
            for slot in self.names:
                self._held[slot] = {j: np.asarray(t) for j, t in self.gather(slot, b).items()}
            self._at = b
        if name not in self._held:
            raise ValueError(
                f"The sharded optimizer state has no slot {name!r} to save (the copy of the "
                f"optimizer built on the weights has it). Received: slots {self.names}"
            )
        return self._held[name][i]


def keep_in_saves(
    optimizer: keras.optimizers.Optimizer,
    model: keras.Model,
    reader: Callable[[], Callable[[int, str], np.ndarray]],
) -> None:
    """Makes Keras's save of `optimizer` write the sharded state whole.

    Args:
      optimizer: the model's optimizer (the outer one of a LossScaleOptimizer).
      model: the model whose trainable weights the slots belong to.
      reader: returns read(position in model.trainable_variables, slot) -> the whole value
        (a BucketReader: collectives across worker processes).
    """

    def save_own_variables(store) -> None:
        for k, value in enumerate(saved_values(optimizer, model, reader())):
            store[str(k)] = value

    # An attribute of this optimizer object only: a recompiled model's new optimizer, or the
    # same optimizer's class elsewhere, saves as Keras does.
    optimizer.save_own_variables = save_own_variables


def saved_values(optimizer, model: keras.Model, read: Callable[[int, str], np.ndarray]):
    """The values Keras's save of `optimizer`, built on the model's trainable weights, would
    write, in its order (a generator): the optimizer's own variables, and each weight's
    slots, read one at a time."""
    trainable = list(model.trainable_variables)

    def layout():
        stand_ins = [
            keras.Variable(np.zeros([1], v.dtype), dtype=v.dtype, name=f"{_STAND_IN}{i}")
            for i, v in enumerate(trainable)
        ]
        return optimizer_copies.optimizer_copy(optimizer, stand_ins).variables

    own = {_own_name(v): v for v in optimizer.variables}
    for variable in optimizer_copies.outside_strategy(layout):
        found = _SLOT.search(variable.path)
        if found:
            yield read(int(found.group(1)), found.group(2))
        else:
            yield np.asarray(own[_own_name(variable)].numpy())


def _own_name(variable) -> str:
    """A variable's path without its optimizer's name (a copy is named apart)."""
    return variable.path.split("/", 1)[-1]

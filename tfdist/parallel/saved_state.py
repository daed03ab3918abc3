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

The slots are whole in memory while they are written, as Keras's own save holds them;
writing them without holding them whole is a sharded checkpoint's job (tfdist.StepCheckpoint).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import keras
import numpy as np

from tfdist.parallel import updates

_STAND_IN = "tfdist_saved_v"
_SLOT = re.compile(_STAND_IN + r"(\d+)_(\w+)$")


def keep_in_saves(
    optimizer: keras.optimizers.Optimizer,
    model: keras.Model,
    whole_slots: Callable[[], dict],
) -> None:
    """Makes Keras's save of `optimizer` write the sharded state whole.

    Args:
      optimizer: the model's optimizer (the outer one of a LossScaleOptimizer).
      model: the model whose trainable weights the slots belong to.
      whole_slots: returns {"v<index in model.trainable_variables>_<slot>": whole value}
        (a collective across worker processes).
    """

    def save_own_variables(store) -> None:
        for k, value in enumerate(saved_values(optimizer, model, whole_slots())):
            store[str(k)] = value

    # An attribute of this optimizer object only: a recompiled model's new optimizer, or the
    # same optimizer's class elsewhere, saves as Keras does.
    optimizer.save_own_variables = save_own_variables


def saved_values(optimizer, model: keras.Model, slots: dict) -> list[np.ndarray]:
    """The values Keras's save of `optimizer`, built on the model's trainable weights, would
    write, in its order: the optimizer's own variables, and each weight's slots."""
    trainable = list(model.trainable_variables)

    def layout():
        stand_ins = [
            keras.Variable(np.zeros([1], v.dtype), dtype=v.dtype, name=f"{_STAND_IN}{i}")
            for i, v in enumerate(trainable)
        ]
        return updates.optimizer_copy(optimizer, stand_ins).variables

    own = {_own_name(v): v for v in optimizer.variables}
    values = []
    for variable in updates.outside_strategy(layout):
        found = _SLOT.search(variable.path)
        if found:
            key = f"v{found.group(1)}_{found.group(2)}"
            if key not in slots:
                raise ValueError(
                    f"The sharded optimizer state has no slot {key!r} to save (the copy of "
                    f"{type(optimizer).__name__} built on the weights has it). Received: "
                    f"slots {sorted(slots)[:6]}"
                )
            values.append(np.asarray(slots[key]))
        else:
            values.append(np.asarray(own[_own_name(variable)].numpy()))
    return values


def _own_name(variable) -> str:
    """A variable's path without its optimizer's name (a copy is named apart)."""
    return variable.path.split("/", 1)[-1]

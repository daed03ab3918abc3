"""`tfdist.predict`: a model's predictions, in order, under any strategy it was made in.

Keras's own `model.predict` splits the data over the strategy's replicas and gathers the
outputs back (under multi_worker_mirrored every worker gets every row, measured in
tests/test_fit_multiworker.py); under parameter_server Keras 3 cannot run it at all.
Predictions in a training script are usually wanted whole, on the process that writes them,
and under every strategy alike, so `tfdist.predict` runs the model's
own `predict_step` on this process's default device, reading the trained weights where
they live (a replica's copy, or the parameter servers), over all of the data, in order.
Every task that calls it gets every prediction; call it on the chief only, or split the
data yourself, when that is too much work for one device.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.task import is_chief
from tfdist.training import fit_callbacks
from tfdist.training.fit_data import DEFAULT_BATCH_SIZE
from tfdist.training.steps import traced


def predict(
    model: keras.Model,
    x: Any,
    *,
    batch_size: int | None = None,
    verbose: int | str = "auto",
    steps: int | None = None,
    callbacks: list[keras.callbacks.Callback] | None = None,
) -> Any:
    """The model's outputs for `x`, as `model.predict` returns them (NumPy arrays).

    Args:
      model: a Keras model (compiled or not), made under any strategy's scope or none.
      x: arrays (or a dict/list of them) with `batch_size`; a tf.data.Dataset of batches,
        whose elements are x or (x, y[, sample_weight]); or a dataset function, called with
        a default tf.distribute.InputContext.
      batch_size: for arrays, the examples per step (default 32).
      verbose: "auto", 0 or 1 (a progress bar, drawn by the chief only), as for
        `model.predict`.
      steps: stop after this many batches (default: all of the data).
      callbacks: Keras callbacks; their predict hooks are called as `model.predict` calls
        them.

    Returns:
      The outputs of every batch, concatenated along the first axis, in the structure the
      model returns (an array, or a dict or list of arrays).

    Raises:
      FitError: the model or the data cannot be used (the message says why).
    """
    if not isinstance(model, keras.Model):
        raise FitError(
            f"tfdist.predict runs a keras.Model. Received: model of type {type(model).__name__}"
        )
    dataset = _batches(x, batch_size)
    if steps is not None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise FitError(f"steps must be a whole number >= 1. Received: steps={steps!r}")
        dataset = dataset.take(steps)
    known = int(dataset.cardinality())
    callback_list = fit_callbacks.callback_list(
        callbacks, add_progbar=verbose != 0 and is_chief(), verbose=verbose, epochs=1,
        steps=known if known >= 0 else None, model=model,
    )  # fmt: skip
    step = _predict_function(model)
    outputs = []
    callback_list.on_predict_begin()
    for index, batch in enumerate(dataset):
        callback_list.on_predict_batch_begin(index)
        output = step(batch)
        outputs.append(tf.nest.map_structure(np.asarray, output))
        callback_list.on_predict_batch_end(index, {"outputs": output})
    callback_list.on_predict_end()
    if not outputs:
        raise FitError("tfdist.predict got no batch: the data is empty.")
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outputs)


def _batches(x, batch_size) -> tf.data.Dataset:
    if isinstance(x, tf.data.Dataset):
        dataset = x
    elif callable(x) and not isinstance(x, (np.ndarray, tf.Tensor, dict, list, tuple)):
        dataset = x(tf.distribute.InputContext())
    else:
        if x is None:
            raise FitError("No data: pass `x` as arrays, a tf.data.Dataset or a dataset_fn.")
        size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise FitError(f"batch_size must be a positive whole number. Received: {size!r}")
        return tf.data.Dataset.from_tensor_slices(x).batch(size)
    if batch_size is not None:
        raise FitError(
            "`x` is a dataset, which carries its own batching; batch_size applies to arrays "
            f"only. Received: batch_size={batch_size!r}"
        )
    # Elements may carry labels and weights: predict_step takes the inputs, as in Keras.
    return dataset


# The model's attribute that holds (its compile, the traced predict step): kept across calls
# until the model is compiled again, as Keras keeps model.predict_function. In its __dict__
# (Keras does not track it; the function's hold on the model is a cycle the collector frees).
_ATTRIBUTE = "_tfdist_predict_step"


def _predict_function(model: keras.Model):
    compiled = (id(getattr(model, "optimizer", None)), id(compat.compiled_loss(model)))
    kept = vars(model).get(_ATTRIBUTE)
    if kept is None or kept[0] != compiled:
        kept = (compiled, traced(lambda batch: model.predict_step(batch)))
        vars(model)[_ATTRIBUTE] = kept
    return kept[1]

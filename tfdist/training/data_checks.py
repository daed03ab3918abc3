"""The first batch held against the model before training: one line for each data mistake.

Keras finds these mistakes only inside the traced step, on every worker, as a traceback of
several screens and exit code 1, which launchers restart. Here each is a FitError (exit 2, not
restarted) that names the expected and the received value:

- a batch whose inputs do not fit the model's Input shapes (a width of 31 for Input((32,)));
- a dataset not batched (examples where the model takes batches);
- string inputs for a numeric Input;
- a dict of inputs missing one of the model's named inputs, or holding one it does not take;
- labels that do not fit the loss: one-hot labels for a sparse loss, class ids for a
  categorical one.

Only what the model declares is checked: a subclassed model without Input shapes, or a
loss of its own, is left to its own code.
"""

from __future__ import annotations

import re
from typing import Any

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.training.fit_data import unpack


def check_batch(model: keras.Model, batch: Any, what: str) -> None:
    """Raises FitError if `batch` (the data's first) cannot feed `model` (see the module)."""
    x, y, _ = unpack(batch)
    inputs = _declared_inputs(model)
    if inputs is not None and x is not None:
        _check_inputs(inputs, x, what)
    if y is not None:
        _check_labels(model, y, what)


def _declared_inputs(model: keras.Model) -> Any:
    """The model's Input tensors in its input structure, or None (a subclassed model)."""
    try:
        inputs = model.inputs  # a Sequential that was never called has these, not `input`
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    try:
        return model.input  # a Functional model's structure: one, a list or a dict
    except (AttributeError, ValueError):
        return inputs[0] if len(inputs) == 1 else list(inputs)


def _check_inputs(inputs: Any, x: Any, what: str) -> None:
    if isinstance(inputs, dict) and isinstance(x, dict):
        missing, extra = sorted(set(inputs) - set(x)), sorted(set(x) - set(inputs))
        if missing or extra:
            raise FitError(
                f"The model's inputs are named {sorted(inputs)}; `{what}` yields a dict with "
                f"keys {sorted(x)}"
                + (f", without {missing}" if missing else "")
                + (f", with {extra} the model does not take" if extra else "")
                + ". Name the features as the model's keras.Input(name=...) layers. "
                f"Received: keys {sorted(x)}"
            )
        pairs = [(f"Input {name!r}", inputs[name], x[name]) for name in sorted(inputs)]
    else:
        flat_inputs, flat_x = tf.nest.flatten(inputs), tf.nest.flatten(x)
        if len(flat_inputs) != len(flat_x):
            raise FitError(
                f"The model takes {len(flat_inputs)} input(s); `{what}` yields {len(flat_x)}. "
                f"Received: inputs of shapes {[_shape(v) for v in flat_x]}"
            )
        several = len(flat_inputs) > 1
        pairs = [
            (_name(i, k if several else None), i, v)
            for k, (i, v) in enumerate(zip(flat_inputs, flat_x, strict=True))
        ]
    for name, declared, given in pairs:
        _check_one_input(name, declared, given, what)


def _check_one_input(name: str, declared, given, what: str) -> None:
    want = tuple(declared.shape)
    got = tuple(getattr(given, "shape", ()))
    if isinstance(given, tf.SparseTensor | tf.RaggedTensor):
        return  # ragged and sparse inputs carry shapes of their own
    # Keras adds or drops a last axis of 1 where the ranks differ by one: (b, 8, 8) feeds
    # Input((8, 8, 1)), and (b, 8, 1) feeds Input((8,)).
    if len(got) == len(want) - 1 and want[-1] == 1 and _fits(got[1:], want[1:-1]):
        return
    if len(got) == len(want) + 1 and got[-1] == 1 and _fits(got[1:-1], want[1:]):
        return
    if len(got) == len(want) - 1 and _fits(got, want[1:]):
        raise FitError(
            f"{name} takes batches of shape {_text(want)}, but `{what}` yields single "
            f"examples of shape {_text(got)}: batch the dataset (dataset.batch(global_batch)) "
            f"or pass arrays with batch_size. Received: elements of shape {_text(got)}"
        )
    if len(got) != len(want) or not _fits(got[1:], want[1:]):
        raise FitError(
            f"{name} takes shape {_text(want)} (the batch first); `{what}` yields "
            f"{_text(got)}. Received: inputs of shape {_text(got)}"
        )
    dtype = getattr(given, "dtype", None)
    if dtype == tf.string and declared.dtype != "string":
        raise FitError(
            f"{name} takes {declared.dtype} values; `{what}` yields strings (map them "
            "to numbers first, e.g. with keras.layers.StringLookup). Received: dtype string"
        )


def _check_labels(model: keras.Model, y: Any, what: str) -> None:
    kind, loss_name = _loss_kind(model)
    outputs = getattr(model, "outputs", None)
    if kind is None or not outputs or len(outputs) != 1 or isinstance(y, dict | list | tuple):
        return
    output = tuple(outputs[0].shape)
    labels = tuple(getattr(y, "shape", ()))
    classes = output[-1] if output else None
    if not classes or classes < 2:
        return
    if kind == "sparse" and len(labels) == len(output) and labels[-1] == classes:
        raise FitError(
            f"The loss {loss_name} takes class ids, shape {_text(output[:-1])}, but "
            f"`{what}` yields one-hot labels of shape {_text(labels)}: use "
            "CategoricalCrossentropy, or pass the ids (np.argmax(y, axis=-1)). Received: "
            f"labels of shape {_text(labels)}"
        )
    if kind == "categorical" and (
        len(labels) == len(output) - 1 or (len(labels) == len(output) and labels[-1] == 1)
    ):
        raise FitError(
            f"The loss {loss_name} takes one-hot labels of shape {_text(output)}, but "
            f"`{what}` yields class ids of shape {_text(labels)}: use "
            "SparseCategoricalCrossentropy, or one-hot the labels "
            f"(keras.utils.to_categorical(y, {classes})). Received: labels of shape "
            f"{_text(labels)}"
        )


_SPARSE = {"sparse_categorical_crossentropy", "SparseCategoricalCrossentropy"}
_CATEGORICAL = {"categorical_crossentropy", "CategoricalCrossentropy"}


def _loss_kind(model: keras.Model) -> tuple[str | None, str]:
    """('sparse' | 'categorical' | None, the loss's name) of a single-output model's loss as
    compile was given it (an object, a function or its name)."""
    if compat.compiled_loss(model) is None:
        return None, ""
    loss = getattr(model, "loss", None)
    if isinstance(loss, list | tuple) and len(loss) == 1:
        loss = loss[0]
    name = loss if isinstance(loss, str) else type(loss).__name__
    if callable(loss) and not isinstance(loss, keras.losses.Loss):
        name = getattr(loss, "__name__", name)
    if name in _SPARSE:
        return "sparse", name
    if name in _CATEGORICAL:
        return "categorical", name
    return None, name


def _fits(got: tuple, want: tuple) -> bool:
    if len(got) != len(want):
        return False
    return all(w is None or g is None or g == w for g, w in zip(got, want, strict=True))


def _shape(value) -> str:
    return _text(tuple(getattr(value, "shape", ())))


def _text(shape: tuple) -> str:
    return (
        "("
        + ", ".join("None" if d is None else str(d) for d in shape)
        + (",)" if len(shape) == 1 else ")")
    )


def _name(tensor, index: int | None) -> str:
    """How a message names the model's input: "Input 'image'" when the user named it,
    else "The model's input" (its position among several)."""
    name = getattr(tensor, "name", None) or ""
    if name and not re.fullmatch(r"(keras_tensor|input_layer|input)(_\d+)?", name):
        return f"Input {name!r}"
    return "The model's input" + ("" if index is None else f" {index}")

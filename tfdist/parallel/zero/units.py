"""Units: the layers whose weights a sharding mode gathers just before the layer runs, and
gathers again for its backward pass instead of keeping them from the forward pass.

PyTorch FSDP frees a unit's gathered parameters after its forward (`reshard_after_forward`)
and gathers them again for its backward. In a TensorFlow graph a tensor lives until the
last op that reads it has run, and the backward of a layer's matmul reads the weight the
forward read: so a gathered weight would live from its layer's forward to its backward,
and every layer's at once at the turn of the step. Here, while a step is traced, each
unit's call becomes a custom gradient:

  - forward: the layer's own call, not recorded on the tape, with its reads of its weights
    waiting for the unit's inputs (`awaited`);
  - backward: once the gradients of its outputs have arrived, the call again under a tape
    of its own (its reads gathering the weights again), and that tape's gradients of the
    inputs and weights.

So a unit's gathered weights live while it runs, and its activations are recomputed in its
backward pass (as `keras.RematScope` does for a layer; the re-gather and the recompute are
one pass). The cost is one more forward pass of each unit.

A unit is a layer that owns trainable weights itself, holds no sublayer that does, and keeps
no state its call changes (no non-trainable variable anywhere in it: BatchNorm's statistics,
a dropout's seed generator), so that running it twice computes the same thing; recurrent
cells are not units (a loop calls them once per time step). A weight read outside every
unit (a layer that owns weights and holds weighted sublayers, a BatchNorm, a train_step of
the user's own) is gathered where it is read and kept until its gradient is taken.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError

_waiting = threading.local()  # a mirrored strategy traces its replicas in threads


# The units a user named for a model (recompute(model, units=...)), kept beside the model,
# not tracked by Keras.
_NAMED = "_tfdist_units"
# Marks a call already made a recomputed one, so that no layer is wrapped twice.
_RECOMPUTED = "_tfdist_recomputed"
# Keras's RematScope modes tfdist runs (whole layers recomputed); the others are refused.
_REMAT_MODES = ("full", "list_of_layers")


class UnitError(FitError):
    """Units named that the model does not have, or a Keras RematScope mode tfdist does
    not run."""


def layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The model's units, in the order Keras tracks its layers: the blocks the user named
    (`recompute(model, units=[...])`), then each layer owning weights outside them."""
    named = list(vars(model).get(_NAMED, ()))
    inside = {id(sub) for block in named for sub in block._flatten_layers(include_self=True)}
    out = list(named)
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if id(layer) in inside:
            continue
        if not layer._trainable_variables or layer.non_trainable_variables:
            continue
        if any(sub.trainable_variables for sub in compat.sublayers(layer)):
            continue
        if hasattr(layer, "state_size") or isinstance(layer, keras.layers.RNN):
            continue  # an RNN's cell: a loop calls it once per time step
        out.append(layer)
    return out


def awaited() -> list[tf.Tensor]:
    """What a read of a weight inside the unit being traced waits for (empty outside
    units): the unit's inputs in its forward pass, its outputs' gradients in its backward."""
    return list(getattr(_waiting, "tensors", ()))


@contextlib.contextmanager
def _awaiting(tensors: Sequence) -> Iterator[None]:
    before = getattr(_waiting, "tensors", ())
    _waiting.tensors = [t for t in tensors if isinstance(t, tf.Tensor)]
    try:
        yield
    finally:
        _waiting.tensors = before


def recompute(units: Sequence[keras.layers.Layer]) -> None:
    """Makes each unit's call a recomputed one (see the module docstring); a layer already
    made one stays as it is."""
    for layer in units:
        if not getattr(layer.call, _RECOMPUTED, False):
            compat.replace_call(layer, _recomputed(layer.call))


def recomputed(model: keras.Model) -> list[keras.layers.Layer]:
    """The model's layers whose call is a recomputed one."""
    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if getattr(layer.call, _RECOMPUTED, False)
    ]


def recompute_activations(
    model: keras.Model, units: Sequence[str | keras.layers.Layer] | None = None
) -> list[keras.layers.Layer]:
    """Recomputes the activations of `model`'s units in the backward pass instead of
    keeping them from the forward pass, under every tfdist layout (activation
    checkpointing, as `keras.RematScope` and torch's `checkpoint` do): a step's peak keeps
    each unit's inputs, not what its layers compute inside, at the cost of one more forward
    pass of each unit. Under zero3 the units are also what is gathered at once, and their
    re-gather and recompute are one pass.

    Args:
      model: a built Keras model.
      units: None (each layer that owns weights, zero3's units), or the layers, or their
        names or paths, to recompute whole: the blocks of a transformer, say (keras-hub's
        `transformer_layer_0` ...). Layers owning weights outside them stay units of their
        own under zero3.

    Returns:
      The units, in the order of `units` (then Keras's).

    Raises:
      UnitError: a name the model has no layer of, or a layer holding another named one.
    """
    if units is not None:
        found = {}
        for layer in model._flatten_layers(include_self=False, recursive=True):
            found.setdefault(layer.name, layer)
            found.setdefault(getattr(layer, "path", None) or layer.name, layer)
        named = []
        for unit in units:
            layer = unit if isinstance(unit, keras.layers.Layer) else found.get(unit)
            if layer is None:
                raise UnitError(
                    f"The model has no layer named {unit!r} to recompute. Name its layers "
                    f"(or their paths) as model.summary() lists them, e.g. "
                    f"{sorted(found)[:3]}. Received: units={list(units)!r}"
                )
            if layer.non_trainable_variables:
                raise UnitError(
                    f"The unit {layer.name!r} keeps state its call changes "
                    f"({layer.non_trainable_variables[0].path}: a dropout's seed, "
                    "BatchNormalization's statistics), so running it again in the backward "
                    "pass would not compute what the forward pass did. Name blocks without "
                    f"such layers, or their weighted layers. Received: units={list(units)!r}"
                )
            named.append(layer)
        for block in named:
            held = [o for o in named if o is not block and o in block._flatten_layers()]
            if held:
                raise UnitError(
                    f"The unit {block.name!r} holds the unit {held[0].name!r}: name blocks "
                    f"that do not hold each other. Received: units={list(units)!r}"
                )
        vars(model)[_NAMED] = tuple(named)
    chosen = layers(model)
    recompute(chosen)
    return chosen


def honour_remat_scope(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers Keras's RematScope marked in `model`, recomputed tfdist's way, as units.

    Why: Keras builds a marked layer's call into `keras.remat`, which on the TensorFlow
    backend is a custom gradient taking keyword arguments, refused outside eager execution
    ("The custom_gradient decorator currently supports keywords arguments only when eager
    execution is enabled"): Keras's own fit of such a model fails. tfdist clears the mark
    and recomputes the same layers (the innermost of 'full', the named of
    'list_of_layers').

    Raises:
      UnitError: a RematScope mode that recomputes part of a layer ('activations',
        'larger_than'), which tfdist does not run.
    """
    marked = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        mode = getattr(layer, "_remat_mode", None)
        if mode is None or getattr(layer.call, _RECOMPUTED, False):
            continue
        if mode.mode not in _REMAT_MODES:
            raise UnitError(
                f"keras.RematScope(mode={mode.mode!r}) recomputes part of a layer, which "
                "tfdist does not run. Use RematScope(mode='full') or "
                "mode='list_of_layers', or tfdist.parallel.recompute_activations(model). "
                f"Received: layer {layer.name!r} under mode={mode.mode!r}"
            )
        # A layer whose call changes state (a dropout's seed, BatchNorm's statistics) would
        # not compute the same thing twice: it keeps its activations, as zero3's units do.
        chosen = mode.mode == "full" or layer.name in (mode.layer_names or ())
        if chosen and not layer.non_trainable_variables:
            marked.append(layer)
        layer._remat_mode = None
    # Of 'full', the innermost: a marked layer holding none (each recomputed once).
    ids = {id(layer) for layer in marked}
    chosen = [
        layer
        for layer in marked
        if not any(id(sub) in ids for sub in layer._flatten_layers(include_self=False))
    ]
    if chosen:
        vars(model)[_NAMED] = tuple(chosen) + tuple(vars(model).get(_NAMED, ()))
        recompute(chosen)
    return chosen


def _recomputed(call):
    @functools.wraps(call)
    def unit_call(*args, **kwargs):
        flat = tf.nest.flatten((args, kwargs))
        spots = [j for j, x in enumerate(flat) if isinstance(x, tf.Tensor)]
        if not spots:  # nothing to differentiate through (a call on no tensors)
            return call(*args, **kwargs)
        autocast = compat.autocast_dtype()

        def run(tensors):
            items = list(flat)
            for j, tensor in zip(spots, tensors, strict=True):
                items[j] = tensor
            again_args, again_kwargs = tf.nest.pack_sequence_as((args, kwargs), items)
            with compat.autocasting(autocast):
                return call(*again_args, **again_kwargs)

        @tf.custom_gradient
        def unit(*inputs):
            with _awaiting(inputs):
                outputs = run(inputs)

            def grad(*upstream, variables=None):
                arrived = [
                    g.values if isinstance(g, tf.IndexedSlices) else g
                    for g in upstream
                    if g is not None
                ]
                with tf.control_dependencies(arrived):  # not before the gradient arrives
                    again = [tf.identity(x) for x in inputs]
                differentiable = [x for x in again if x.dtype.is_floating]
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    tape.watch(differentiable)
                    tape.watch(variables or [])
                    with _awaiting(arrived):
                        redone = run(again)
                grads = tape.gradient(
                    tf.nest.flatten(redone),
                    differentiable + list(variables or []),
                    output_gradients=list(upstream),
                )  # fmt: skip
                by_input = iter(grads[: len(differentiable)])
                inputs_grads = [next(by_input) if x.dtype.is_floating else None for x in again]
                return inputs_grads, grads[len(differentiable) :]

            return outputs, grad

        return unit(*[flat[j] for j in spots])

    setattr(unit_call, _RECOMPUTED, True)
    return unit_call


__all__ = [
    "UnitError",
    "awaited",
    "honour_remat_scope",
    "layers",
    "recompute",
    "recompute_activations",
    "recomputed",
]

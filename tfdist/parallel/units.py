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

_waiting = threading.local()  # a mirrored strategy traces its replicas in threads


def layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The model's units, in the order Keras tracks its layers."""
    out = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
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
    """Makes each unit's call a recomputed one (see the module docstring)."""
    for layer in units:
        compat.replace_call(layer, _recomputed(layer.call))


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

    return unit_call


__all__ = ["awaited", "layers", "recompute"]

"""The exchanges Megatron-LM puts around a split layer, made while a step is traced: a
layer whose weights a layout map splits (tensor/layout_map.py) runs inside the gathers and
reduce-scatters its kind of split needs (column, gathered, row, vocab, heads; see
layout_map's docstring), its group's examples and sizes counted once per traced step.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import tensorflow as tf

from tfdist import compat
from tfdist.parallel.tensor.derive import (
    HEAD_COUNTS,
)
from tfdist.parallel.tensor.layout_map import LayoutPlan
from tfdist.parallel.tensor.mappings import (
    TensorParallelError,
    gather_from_group,
    gather_from_parts,
    reduce_scatter_to_group,
    replica_in_step,
    step_sizes,
)

# The attributes in which attention layers count the query heads that share a key/value
# head (Mistral's private); their head counts: derive.HEAD_COUNTS.
GROUP_COUNTS = ("num_key_value_groups", "_num_key_value_groups")


def _local_heads(count: int, degree: int) -> int:
    return count // degree if count % degree == 0 else 1


class SplitCalls:
    """The split layers of a plan run inside their exchanges while installed: each layer's
    call wrapped by its kind's (below), a row layer's input check lifted (its part takes
    its share of the features), an attention layer counting this replica's heads.

    Args:
      plan: the model's split.
      variables: the model's trainable weights, in the plan's order.
      gather: the all-gather of a group's examples (None: TensorFlow's, for a step of one
        strategy; a pipeline's stage groups pass tfdist's, whose gradient is taken in the
        replica context the backward pass runs in, not the forward's).
    """

    def __init__(self, plan: LayoutPlan, variables: list, gather=None):
        self.plan, self.variables, self.gather = plan, list(variables), gather
        self._region = threading.local()
        self._gathers: dict = {}
        self._lifted: list = []  # (layer, attribute, its value): set back by uninstall

    def install(self) -> None:
        degree = self.plan.degree
        self._lifted = []
        for layer, kind in self.plan.layers:
            compat.replace_call(layer, _CALLS[kind](self, layer, layer.call))
            if kind == "row" and layer.input_spec is not None:
                # Keras checks the input's width against the whole kernel's (Dense): this
                # replica's part takes its share of the features.
                self._lifted.append((layer, "input_spec", layer.input_spec))
                layer.input_spec = None
            if kind == "heads":
                local = {
                    attribute: _local_heads(count, degree)
                    for attribute in HEAD_COUNTS
                    if isinstance(count := getattr(layer, attribute, None), int)
                }
                for groups in GROUP_COUNTS:
                    if isinstance(getattr(layer, groups, None), int):
                        # Llama repeats each key/value head for its queries: here, this
                        # replica's ("_num_key_value_groups" beside "_num_query_heads")
                        prefix = groups[: groups.index("num")]
                        local[groups] = (
                            local[f"{prefix}num_query_heads"]
                            // local[f"{prefix}num_key_value_heads"]
                        )
                for attribute, count in local.items():
                    self._lifted.append((layer, attribute, getattr(layer, attribute)))
                    setattr(layer, attribute, count)

    def uninstall(self) -> None:
        for layer, _ in self.plan.layers:
            compat.restore_call(layer)
        for layer, attribute, value in self._lifted:
            setattr(layer, attribute, value)
        self._lifted = []
        self._gathers.clear()

    def in_region(self) -> bool:
        return getattr(self._region, "depth", 0) > 0

    @contextlib.contextmanager
    def region(self):
        self._region.depth = getattr(self._region, "depth", 0) + 1
        try:
            yield
        finally:
            self._region.depth -= 1

    def group_rows(self, x):
        """(the group's examples of `x`, every replica's batch size): gathered once per
        tensor per replica's step (the query, key and value read one gather)."""
        replica, _ = replica_in_step()
        key = (tf.compat.v1.get_default_graph(), replica, x.ref())
        if key not in self._gathers:
            self._gathers[key] = gather_from_group(x, self.plan.degree, gather=self.gather)
        return self._gathers[key]

    def is_split(self, variable) -> bool:
        """Whether the replicas hold `variable` in parts."""
        i = next(i for i, v in enumerate(self.variables) if v is variable)
        return self.plan.placements[i].parts > 1


def _column(calls: SplitCalls, layer, call):
    first = _first_argument(call)

    def column(*args, **kwargs):
        inputs, args, kwargs = first(args, kwargs)
        if replica_in_step() is None or calls.in_region():
            return call(inputs, *args, **kwargs)
        return call(calls.group_rows(inputs)[0], *args, **kwargs)

    return column


def _gathered(calls: SplitCalls, layer, call):
    first = _first_argument(call)

    def gathered(*args, **kwargs):
        inputs, args, kwargs = first(args, kwargs)
        if replica_in_step() is None or calls.in_region():
            return call(inputs, *args, **kwargs)
        x, sizes = calls.group_rows(inputs)
        return gather_from_parts(call(x, *args, **kwargs), sizes, calls.plan.degree)

    return gathered


def _row(calls: SplitCalls, layer, call):
    first = _first_argument(call)

    def row(*args, **kwargs):
        inputs, args, kwargs = first(args, kwargs)
        partial = call(inputs, *args, **kwargs)
        if replica_in_step() is None or calls.in_region():
            return partial
        return reduce_scatter_to_group(partial, step_sizes(layer.name), calls.plan.degree)

    return row


def _vocab(calls: SplitCalls, layer, call):
    first = _first_argument(call)
    degree = calls.plan.degree
    table_split = calls.is_split(layer.embeddings)
    reverse_table = getattr(layer, "reverse_embeddings", None)  # untied logits: a table apart
    logits_split = calls.is_split(layer.embeddings if reverse_table is None else reverse_table)

    def vocab(*args, **kwargs):
        inputs, args, kwargs = first(args, kwargs)
        if replica_in_step() is None:
            return call(inputs, *args, **kwargs)
        replica, _ = replica_in_step()
        if kwargs.get("reverse", args[0] if args else False):  # the logits: my columns
            if not logits_split:
                return call(inputs, *args, **kwargs)
            x, sizes = calls.group_rows(inputs)
            return gather_from_parts(call(x, *args, **kwargs), sizes, degree)
        if not table_split:
            return call(inputs, *args, **kwargs)
        ids, sizes = calls.group_rows(inputs)
        rows = layer.input_dim // degree
        local = tf.cast(ids, "int32") - (replica % degree) * rows
        inside = (local >= 0) & (local < rows)
        found = call(tf.where(inside, local, 0), *args, **kwargs)
        partial = found * tf.cast(inside, found.dtype)[..., None]
        return reduce_scatter_to_group(partial, sizes, degree)

    return vocab


def _heads(calls: SplitCalls, layer, call):
    first = _first_argument(call)

    def heads(*args, **kwargs):
        inputs, args, kwargs = first(args, kwargs)
        if replica_in_step() is None:
            return call(inputs, *args, **kwargs)
        x, sizes = calls.group_rows(inputs)

        def rows(value):  # a mask or cache beside the input: per example too
            if isinstance(value, tf.Tensor) and value.shape.rank:
                return calls.group_rows(value)[0]
            return value

        args = [rows(a) for a in args]
        kwargs = {k: rows(v) for k, v in kwargs.items()}
        with calls.region():
            partial = call(x, *args, **kwargs)
        if not isinstance(partial, tf.Tensor):
            raise TensorParallelError(
                f"{layer.name} returned {type(partial).__name__} in a training step; a split "
                "attention layer must return one tensor there (no cache)."
            )
        return reduce_scatter_to_group(partial, sizes, calls.plan.degree)

    return heads


def _first_argument(call):
    """A function that takes a call's first argument out of (args, kwargs), however it was
    passed (keras-hub's Llama passes its attention layer's input by name)."""
    name = next(iter(inspect.signature(call).parameters))

    def first(args, kwargs):
        if args:
            return args[0], args[1:], kwargs
        kwargs = dict(kwargs)
        return kwargs.pop(name), (), kwargs

    return first


_CALLS = {
    "column": _column,
    "gathered": _gathered,
    "row": _row,
    "vocab": _vocab,
    "heads": _heads,
}

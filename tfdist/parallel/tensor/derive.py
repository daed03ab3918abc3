"""A tensor split derived from a model's layers and shapes, for models that ship no layout map.

keras-hub ships layout maps for Gemma, Llama, Qwen and the QwenMoes only (per-model maps were
closed won't-fix; shape-based sharding is asked in keras-hub#2806). `derive_split` reads the
split off the layers themselves, as Megatron-LM places it by hand:

  attention  a layer that counts its heads in attributes (`num_query_heads`, Mistral's
             `_num_query_heads`, ...): each projection kernel inside it is split along its
             first dimension of a head count's size; a projection whose heads reach its
             output is a column (query, key, value), one that contracts them a row (the
             output projection). Key/value heads fewer than the degree are held whole by
             the replicas that share them (grouped-query attention; layout_map.py).
  MLP        inside a block (a layer that holds Dense or 2-D EinsumDense layers directly, not
             a functional model), the layers that widen d -> f are columns and those that
             narrow f -> d back, with no activation of their own, the rows that add their
             parts (a gated MLP's gate and intermediate projections, then its output one).
             Layers of the same shapes in one block split together or stay whole together.
  vocabulary an Embedding (keras-hub's ReversibleEmbedding too) is split by its vocabulary:
             its table along rows, an untied reverse table along columns.

Whatever does not fit stays whole on every replica, and the report says why: a count that
does not divide over the degree, a projection with no head dimension, a narrowing layer
with an activation (its parts would pass through it before they are added), widths that
match both ways (d -> d: which way the block runs cannot be read from shapes).

What shapes cannot say: that nothing between a block's column and row layers mixes the
widened features (a norm across them would). The transformer blocks of keras-hub and
keras.io have only elementwise gates and activations there; a model that does otherwise
needs a layout map of its own (tensor_parallel(layout_map=...)).
"""

from __future__ import annotations

import dataclasses
import re

import keras

from tfdist import compat
from tfdist.parallel.tensor.mappings import TensorParallelError

# The attributes in which attention layers count their heads (keras-hub's: Gemma's, Llama's
# and Phi3's public, Mistral's private).
HEAD_COUNTS = (
    "num_query_heads", "num_key_value_heads", "num_heads",
    "_num_query_heads", "_num_key_value_heads",
)  # fmt: skip
QUERY_COUNTS = ("num_query_heads", "num_heads", "_num_query_heads")


@dataclasses.dataclass
class DerivedSplit:
    """What `derive_split` found.

    Attributes:
      axes: each split weight's path -> the dimension it is split along.
      split: one line per layer split ("transformer_layer_0/self_attention: by heads (...)").
      whole: one line per layer left whole that could have split, and why.
    """

    degree: int
    axes: dict[str, int] = dataclasses.field(default_factory=dict)
    split: list[str] = dataclasses.field(default_factory=list)
    whole: list[str] = dataclasses.field(default_factory=list)

    def hint(self, path: str) -> str:
        """What the derived split does with the weight at `path`, for an error message."""
        if path in self.axes:
            return (
                f"dimension {self.axes[path]} would work (as the split derived from shapes has it)"
            )
        return "no dimension: leave it whole (the split derived from shapes does)"

    def report(self) -> str:
        lines = [f"split {line}" for line in self.split]
        lines += [f"whole {line}" for line in self.whole]
        return "; ".join(lines) if lines else "nothing splits"


def derive_split(model: keras.Model, degree: int) -> DerivedSplit:
    """The tensor split of `model` over `degree` replicas that its layers' shapes give (see
    the module docstring). The model must be built."""
    found = DerivedSplit(degree)
    regions = attention_layers(model)
    inside = {id(inner) for region in regions for inner in compat.all_layers(region)}
    for region in regions:
        _split_attention(region, found)
    for holder in [model, *compat.all_layers(model)]:
        if isinstance(holder, keras.Model) or id(holder) in inside or holder in regions:
            continue
        _split_mlp(holder, found)
    for layer in compat.all_layers(model):
        if isinstance(layer, keras.layers.Embedding) and id(layer) not in inside:
            _split_vocabulary(layer, found)
    return found


def derive_layout_map(model: keras.Model, mesh, *, model_axis: str = "model"):
    """A `keras.distribution.LayoutMap` over `mesh` that splits `model` as `derive_split`
    does over the mesh's `model_axis`: to read, edit and pass to
    `tensor_parallel(model, layout_map=...)`."""
    degree = int(mesh.shape[list(mesh.axis_names).index(model_axis)])
    layout = keras.distribution.LayoutMap(mesh)
    variables = {v.path: v for v in model.trainable_variables}
    derived = derive_split(model, degree)
    if not derived.axes:
        raise TensorParallelError(
            f"derive_layout_map found nothing in {model.name!r} to split over {degree}: it "
            "splits attention layers by their heads, MLP blocks (a widening Dense, then a "
            "narrowing one, inside a layer of their own) and vocabularies. Write a map for "
            "its layers (keys matched from the start of each weight's path, "
            f"{model.trainable_variables[0].path!r} here), or split its Dense layers with "
            f"tensor_parallel(model, degree={degree}). Received: {derived.report()}"
        )
    for path, axis in derived.axes.items():
        axes = [None] * len(variables[path].shape)
        axes[axis] = model_axis
        layout[f"^{re.escape(path)}$"] = tuple(axes)
    return layout


def head_counts(layer) -> dict[str, int]:
    return {a: n for a in HEAD_COUNTS if isinstance(n := getattr(layer, a, None), int)}


def attention_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers that count heads and hold linear layers, innermost first (a decoder block
    that counts heads and holds such an attention layer is not one)."""
    found = [
        layer
        for layer in compat.all_layers(model)
        if not isinstance(layer, keras.Model)
        and head_counts(layer)
        and any(_kernel(inner) is not None for inner in compat.all_layers(layer))
    ]
    return [
        layer
        for layer in found
        if not any(other is not layer and other in compat.all_layers(layer) for other in found)
    ]


def _kernel(layer):
    if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)) and layer.built:
        return layer.kernel
    return None


def _letters(layer) -> tuple[str, str]:
    """(the kernel's letters, the output's) of a Dense or EinsumDense."""
    if isinstance(layer, keras.layers.Dense):
        return "ab", "...b"
    kernel, output = re.split(r",|->", layer.equation.replace(" ", ""))[1:]
    return kernel, output


def _linear(layer) -> bool:
    return keras.activations.serialize(layer.activation) in ("linear", None)


def _split_attention(region, found: DerivedSplit) -> None:
    counts = head_counts(region)
    degree, name = found.degree, region.path
    fixed = [a for a in counts if isinstance(getattr(type(region), a, None), property)]
    queries = [counts[a] for a in QUERY_COUNTS if a in counts]
    why = None
    if fixed:
        why = (
            f"it counts heads in a read-only {fixed[0]} (Keras's MultiHeadAttention: "
            "tensor_parallel's layer rewrite splits it in a functional model)"
        )
    elif queries and queries[0] % degree:
        why = f"{queries[0]} query heads do not divide over {degree}"
    elif any(n % degree and degree % n for n in counts.values()):
        why = f"head counts {sorted(set(counts.values()))} do not divide over {degree}"
    elif getattr(region, "query_head_dim_normalize", True) is False:
        why = "it scales queries by the width over the head count, which a split changes"
    planned = {}
    for inner in compat.all_layers(region):
        kernel = _kernel(inner)
        if why or kernel is None:
            continue
        heads = [i for i, n in enumerate(kernel.shape) if int(n) in counts.values()]
        if not heads:
            why = f"{inner.name}'s kernel {tuple(kernel.shape)} has no dimension of a head count"
            break
        letters, output = _letters(inner)
        if letters[heads[0]] not in output and not _linear(inner):
            why = f"{inner.name} contracts the heads and then applies an activation"
            break
        planned[kernel.path] = heads[0]
    if why:
        found.whole.append(f"{name}: {why}")
        return
    found.axes.update(planned)
    shown = ", ".join(f"{a.lstrip('_')}={n}" for a, n in counts.items())
    found.split.append(f"{name}: by heads ({shown}; {len(planned)} projections)")


def _split_mlp(holder, found: DerivedSplit) -> None:
    """The widen-then-narrow layers that `holder` holds directly."""
    shaped = []  # (layer, its input width, its output width)
    for layer in compat.sublayers(holder):
        kernel = _kernel(layer)
        if kernel is None or len(kernel.shape) != 2:
            continue
        letters, output = _letters(layer)
        if letters[1] not in output or letters[0] in output:
            continue  # not one width in, one width out
        shaped.append((layer, int(kernel.shape[0]), int(kernel.shape[1])))
    # Layers of the same shapes cannot be told apart by their shapes: a width's columns and
    # rows split together, or all stay whole.
    for narrow, wide in sorted({(d, f) for _, d, f in shaped if d < f}):
        columns = [c for c, d, f in shaped if (d, f) == (narrow, wide)]
        rows = [r for r, f, d in shaped if (d, f) == (narrow, wide)]
        if not rows:
            continue
        names = f"{', '.join(c.name for c in columns)} -> {', '.join(r.name for r in rows)}"
        active = [r for r in rows if not _linear(r)]
        if active:
            found.whole.append(
                f"{holder.path}: {names}: {active[0].name} applies an activation before its "
                "parts would be added"
            )
        elif wide % found.degree:
            found.whole.append(
                f"{holder.path}: {names}: width {wide} does not divide over {found.degree}"
            )
        else:
            found.axes.update({c.kernel.path: 1 for c in columns})
            found.axes.update({r.kernel.path: 0 for r in rows})
            found.split.append(f"{holder.path}: MLP {names} (width {wide} by columns, then rows)")


def _split_vocabulary(layer, found: DerivedSplit) -> None:
    size = int(layer.embeddings.shape[0])
    if size % found.degree:
        found.whole.append(f"{layer.path}: vocabulary {size} does not divide over {found.degree}")
        return
    found.axes[layer.embeddings.path] = 0
    reverse = getattr(layer, "reverse_embeddings", None)  # keras-hub's untied logits
    if reverse is not None:
        found.axes[reverse.path] = 1
    untied = " and its reverse table" if reverse is not None else ""
    found.split.append(f"{layer.path}: by vocabulary ({size}{untied})")


__all__ = ["DerivedSplit", "derive_layout_map", "derive_split"]

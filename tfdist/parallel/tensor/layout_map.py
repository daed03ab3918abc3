"""Tensor parallelism from a Keras `LayoutMap`: the split keras-hub ships for its models.

keras-hub's backbones say how their weights split over a device mesh
(`GemmaBackbone.get_layout_map(mesh)`, Llama's, Qwen's): a `keras.distribution.LayoutMap`
from variable paths to the mesh axis each dimension is split over. Keras honours it on JAX.
Here, on TensorFlow, `tensor_parallel(model, layout_map=...)` reads the same map:

    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=[...])
    with tfdist.host_scope(strategy):               # mirrored over the 4 devices
        model = keras_hub.models.GemmaCausalLM(backbone=GemmaBackbone(...))
        model.compile(...)
    tfdist.parallel.tensor_parallel(model, layout_map=GemmaBackbone.get_layout_map(mesh))
    tfdist.fit(model, data)

The size T of the mesh's `model` axis is the tensor-parallel degree: the replicas form groups
of T consecutive replicas, and the groups train data parallel to each other (the map's
`batch` axis). Each replica holds, on its device, its part of every weight the map splits
over `model` (and that part's optimizer slots), and the other weights whole: 3/T of the
split weights' bytes under Adam. The whole model stays in host memory (tfdist.host_scope),
written back at each epoch's end and before each save, so `predict`, `evaluate` and
`model.save` see a plain Keras model.

No layer is rewritten. While tfdist.fit traces a step, each weight reads as this replica's
part (its storage is a stand-in, as zero3's is), and the layers that own split weights run
inside the exchanges Megatron-LM puts around them, by what the split does to the layer:

  column   a Dense or EinsumDense whose split dimension reaches its output (Gemma's query,
           key, value and gating kernels): its input is first gathered over the group's
           examples (once per tensor: the query, key and value share one), and its output
           is this replica's columns for those examples;
  gathered a column Dense with no row layer beside it (held by the same layer) to add its
           parts (QwenMoe's router, split by experts): its output columns are gathered, so
           each replica reads every column of its own examples;
  row      one whose split dimension is contracted (the attention's output projection, the
           MLP's last kernel): its partial sums are added over the group, and each replica
           keeps its own examples (a reduce-scatter); a bias it has is added once;
  vocab    an Embedding split by its vocabulary: each replica looks up the ids in its range,
           and the parts are added; keras-hub's ReversibleEmbedding, called in reverse for
           the logits, gives each replica its columns of them, gathered (from the tied table,
           or from its own reverse table where the map splits that);
  heads    an attention layer that counts its heads in attributes (keras-hub's
           `num_query_heads`, `num_key_value_heads`): its input and attention mask are
           gathered over the group once, it runs with this replica's heads (its head counts
           divided by T while the step is traced; key/value heads fewer than T are held
           whole by the replicas that share them, as Megatron replicates them), and its
           output is reduced as a row layer's. Its kernels are split by heads: where a map
           splits a query, key or value kernel by the model's width instead (keras-hub's
           Llama, Qwen and QwenMoe maps, written for GSPMD), it is split along its heads,
           the same math in Megatron-LM's layout (logged); a kernel with no one dimension
           of a head count's size is refused in one line.

Gradients: a part's gradient counts its group's examples, so it is summed over the replicas
that hold the same part (one per group; every replica for a weight held whole) and applied
by each replica's copy of the user's optimizer. The result equals Keras's own fit on one
device.

With shard_optimizer (ZeRO over each part's data group, FSDP x TP): each part, and each
weight held whole, is cut into flat slices, one per replica that holds it (the data group:
one replica of each tensor group), and each replica's optimizer copy keeps the slots of its
slice only. Under zero1 and zero2 a replica keeps its parts whole for its step: its slice's
update is all-gathered over the group into them. Under zero3 it keeps only its slices: a
part is all-gathered over its group where the step reads it, and the gather's gradient is
the group's sum of the slice's gradient (TensorFlow's all_gather differentiates so: an
all-reduce of which each replica keeps its slice). An embedding table stays a whole part
(its looked-up rows arrive sparse, and Keras's optimizer updates them as rows). Every
gathered part lives until the step ends: the step's peak holds the replica's tensor share
of the weights, not one unit's (zero3's units are not built here).

Local devices of one mirrored strategy (not across worker processes). With a pipeline
the stages train the parts themselves, each stage replica a group of T devices
(parallel/pipeline/tensor.py, which runs the same exchanges: SplitCalls).

Where the pieces live: this module reads a map as a split (LayoutPlan, apply_layout_map);
split_calls.py makes the exchanges around each kind of split layer; layout_parallel.py is
the hook that trains the parts (LayoutParallel).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.parallel.tensor.derive import (
    HEAD_COUNTS,
    DerivedSplit,
    attention_layers,
    derive_split,
    head_counts,
)
from tfdist.parallel.tensor.mappings import (
    TensorParallelError,
)
from tfdist.strategies import keras_guard

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Placement:
    """Where one trainable weight lives: split along `axis` into `parts` (replica r holds
    part `index(r)`), or whole on every replica (axis None, one part). A row layer's bias
    reads as 1/T of itself: the group adds T of them."""

    axis: int | None
    parts: int
    degree: int
    scale: float = 1.0

    def index(self, replica: int) -> int:
        """The part replica `replica` holds."""
        rank = replica % self.degree
        return rank * self.parts // self.degree

    def piece(self, whole, index: int):
        if self.axis is None:
            return whole
        return np.split(np.asarray(whole), self.parts, axis=self.axis)[index]

    def shape_of(self, variable) -> tuple[int, ...]:
        """The shape of one part of `variable`."""
        shape = list(variable.shape)
        if self.axis is not None:
            shape[self.axis] //= self.parts
        return tuple(shape)


@dataclasses.dataclass
class LayoutPlan:
    """What tensor_parallel(model, layout_map=...) found: the degree, each trainable
    weight's placement (in model.trainable_variables' order) and each split layer's kind."""

    degree: int
    placements: list[Placement]
    # (layer, kind): "column", "gathered", "row", "vocab" or "heads".
    layers: list[tuple[keras.layers.Layer, str]]

    def split_bytes(self, model: keras.Model) -> tuple[int, int]:
        """(bytes of the weights split over the group, bytes of those each replica holds
        whole; a part replicas share counts as split over the parts)."""
        split = whole = 0
        for variable, placement in zip(model.trainable_variables, self.placements, strict=True):
            size = int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size
            if placement.parts == 1:
                whole += size
            else:
                split += size
        return split, whole


# model -> its plan (a model's attributes would be tracked by Keras).
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# Why Keras's own model.fit cannot train a model split here (tfdist/strategies/keras_guard.py).
SPLIT_BY_TFDIST = "its weights are split by tfdist's tensor parallelism"


def plan_of(model: keras.Model) -> LayoutPlan | None:
    return _PLANS.get(model)


def apply_layout_map(model: keras.Model, layout_map, model_axis: str = "model") -> keras.Model:
    """Marks `model` to train split as `layout_map` says (see the module docstring); returns
    the model itself. Checked here: every split divides, every layer it names can split."""
    mesh = getattr(layout_map, "device_mesh", None)
    if mesh is None or not hasattr(layout_map, "__getitem__"):
        raise TensorParallelError(
            "layout_map must be a keras.distribution.LayoutMap (keras-hub's "
            "Backbone.get_layout_map(mesh) returns one). Received: "
            f"{type(layout_map).__name__}"
        )
    if model_axis not in mesh.axis_names:
        raise TensorParallelError(
            f"The layout map's mesh has no {model_axis!r} axis to split weights over. Name "
            "the tensor-parallel axis with model_axis=..., or build the mesh with it. "
            f"Received: axes {list(mesh.axis_names)}"
        )
    _check_built(model, "tensor_parallel(layout_map=...)")
    degree = int(mesh.shape[list(mesh.axis_names).index(model_axis)])
    axes: dict[int, int] = {}  # weight -> its split axis, as the map names it
    for variable in model.trainable_variables:
        try:
            layout = layout_map[variable.path]
        except ValueError as e:
            raise TensorParallelError(f"The layout map is ambiguous: {e}") from None
        named = [] if layout is None else [i for i, a in enumerate(layout.axes) if a == model_axis]
        if len(named) > 1:
            raise TensorParallelError(
                f"{variable.path} is split over {model_axis!r} along {len(named)} dimensions; "
                f"tfdist splits a weight along one. Received: {layout.axes}"
            )
        if named:
            axes[id(variable)] = named[0]
    if not axes:
        paths = [v.path for v in model.trainable_variables]
        raise TensorParallelError(
            f"The layout map splits none of {model.name!r}'s weights over {model_axis!r}: "
            "its keys are matched from the start of each weight's path (this model's are "
            f"like {paths[0]!r}), so nothing would be split. Write keys that "
            "match those paths (a leading '.*' matches any prefix), or derive one: "
            f"derive_layout_map(model, mesh). Received: paths {', '.join(paths[:4])}"
            + (", ..." if len(paths) > 4 else "")
        )
    return _apply(model, axes, degree, derive_split(model, degree))


def apply_derived_split(model: keras.Model, degree: int, *, why: str) -> keras.Model:
    """Marks `model` to train split over `degree` replicas as its layers' shapes say
    (derive.py), logging why (`why`: the layer rewrite cannot), what splits and what stays
    whole; returns the model itself."""
    _check_built(model, "tensor_parallel")
    derived = derive_split(model, degree)
    log.info(
        "tensor_parallel: %s, so its split over %d replicas is derived from its layers' "
        "shapes: %s",
        why, degree, derived.report(),
    )  # fmt: skip
    by_path = {v.path: v for v in model.trainable_variables}
    axes = {id(by_path[path]): axis for path, axis in derived.axes.items()}
    return _apply(model, axes, degree, derived)


def _check_built(model: keras.Model, function: str) -> None:
    if not model.built:
        raise TensorParallelError(
            f"{function} reads the paths and shapes of {model.name!r}'s weights, and it has "
            "none yet. Build it first (call it on a batch, or model.build(shape))."
        )


def _apply(model: keras.Model, axes: dict[int, int], degree: int, derived) -> keras.Model:
    """Plans the split `axes` (weight id -> dimension) asks, checked; `derived` (the split
    the shapes give) names a dimension that would work in each refusal."""
    owners = {
        id(v): layer for layer in compat.all_layers(model) for v in compat.own_variables(layer)
    }
    moved = _split_by_heads(model, axes, owners)
    if moved:
        log.info(
            "Inside attention tfdist splits by heads: %s split along their heads, where the "
            "layout map splits them by the model's width (the same math)",
            ", ".join(moved),
        )
    layers: dict[int, tuple[keras.layers.Layer, str]] = {}
    placements: dict[int, Placement] = {}
    by_id = {id(v): v for v in model.trainable_variables}
    for variable in model.trainable_variables:
        if id(variable) not in axes:
            continue
        layer = owners.get(id(variable))
        kind, extra = _kind(layer, variable, axes[id(variable)], derived)
        layers[id(layer)] = (layer, kind)
        for key, placement in extra.items():
            _check_divides(by_id[key], placement, degree, derived, shared=kind == "column")
        placements.update(extra)
    split = {id(layer) for layer, _ in layers.values()}
    regions = _head_regions(model, split, degree, axes, derived)
    _gather_lone_columns(model, layers, regions)
    plan = LayoutPlan(
        degree=degree,
        placements=[
            placements.get(id(v), Placement(None, 1, degree)) for v in model.trainable_variables
        ],
        layers=[*layers.values(), *((layer, "heads") for layer in regions)],
    )
    _PLANS[model] = plan
    keras_guard.mark_split(model, SPLIT_BY_TFDIST)
    return model


def _kind(layer, variable, axis: int, derived: DerivedSplit) -> tuple[str, dict[int, Placement]]:
    """(the layer's kind, the placements of its weights) for a layer whose `variable` the
    map splits along `axis`."""
    name, degree = variable.path, derived.degree
    asked = f"Received: {name} of shape {tuple(variable.shape)} split along dimension {axis}"
    if isinstance(layer, keras.layers.Embedding):
        reverse = getattr(layer, "reverse_embeddings", None)
        vocabulary_axis = 1 if reverse is not None and variable is reverse else 0
        if axis != vocabulary_axis:
            raise TensorParallelError(
                f"{name}: an Embedding splits by its vocabulary (dimension {vocabulary_axis}); "
                f"splitting its features is not built: {derived.hint(name)}. {asked}"
            )
        return "vocab", {id(variable): Placement(axis, degree, degree)}
    linear = isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))
    if not linear or variable is not layer.kernel:
        raise TensorParallelError(
            f"{name}: tensor_parallel(layout_map=...) splits the kernels of Dense and "
            "EinsumDense layers and the tables of Embeddings; this weight belongs to a "
            f"{type(layer).__name__}. Leave it out of the map: {derived.hint(name)}. {asked}"
        )
    if isinstance(layer, keras.layers.Dense):
        kernel, output = "ab", "...b"
    else:  # "btd,ndh->btnh": the input's, the kernel's and the output's letters
        kernel, output = re.split(r",|->", layer.equation.replace(" ", ""))[1:]
    letter = kernel[axis]
    placements = {id(variable): Placement(axis, degree, degree)}
    bias = getattr(layer, "bias", None)
    if letter in output:
        if bias is not None:  # split with the columns where it runs along them
            letters = [c for c in output if c in _bias_letters(layer, output)]
            if letter in letters:
                placements[id(bias)] = Placement(letters.index(letter), degree, degree)
        return "column", placements
    if keras.activations.serialize(layer.activation) not in ("linear", None):
        raise TensorParallelError(
            f"{layer.name} adds its partial sums over the group after its kernel, so its "
            "activation would be applied to a part. Split it by its outputs instead, or "
            f"move the activation to a layer of its own: {derived.hint(name)}. {asked} "
            f"(activation {keras.activations.serialize(layer.activation)})"
        )
    if bias is not None:
        placements[id(bias)] = Placement(None, 1, degree, scale=1.0 / degree)
    return "row", placements


def _gather_lone_columns(model, layers: dict, regions: list) -> None:
    """A column layer pairs with a row layer beside it (held by the same layer: an MLP's
    gate and its output projection), which adds the parts up. One with no row layer beside
    it (QwenMoe's router, which keras-hub's map splits by experts) has its output columns
    gathered instead ("gathered"), so what reads it sees every column, as GSPMD gives it."""
    inside = {id(inner) for region in regions for inner in compat.all_layers(region)}
    parents: dict[int, int] = {}
    for holder in [model, *compat.all_layers(model)]:
        for child in compat.sublayers(holder):
            parents[id(child)] = id(holder)
    rows = {parents.get(key) for key, (_, kind) in layers.items() if kind == "row"}
    for key, (layer, kind) in list(layers.items()):
        if kind != "column" or key in inside or parents.get(key) in rows:
            continue
        if not isinstance(layer, keras.layers.Dense):
            raise TensorParallelError(
                f"{layer.name} is split by its outputs with no row layer beside it to add its "
                "parts, and its split outputs are not its last dimension, which tfdist "
                "gathers. Leave it out of the map, or split the layer that reads it by its "
                f"inputs. Received: a {type(layer).__name__} split alone"
            )
        layers[key] = (layer, "gathered")


def _bias_letters(layer, output: str) -> str:
    if isinstance(layer, keras.layers.Dense):
        return output[-1]
    return layer.bias_axes or ""


def _check_divides(
    variable, placement: Placement, degree: int, derived: DerivedSplit, *, shared: bool
) -> None:
    """A split dimension divides into T parts; a column layer's (`shared`) may be smaller
    than T and divide it (key/value heads several replicas hold), never a row layer's or a
    vocabulary (their parts are added)."""
    if placement.axis is None:
        return
    size = int(variable.shape[placement.axis])
    if size % degree == 0:
        return
    if shared and degree % size == 0:
        placement.parts = size  # T / size replicas of a group hold each part
        return
    raise TensorParallelError(
        f"{variable.path} has {size} along its split dimension {placement.axis}, which does "
        f"not divide into {degree} parts (the mesh's model axis). Choose sizes divisible by "
        f"{degree} (heads, units, vocabulary), or a smaller model axis; "
        f"{derived.hint(variable.path)}. Received: shape {tuple(variable.shape)}"
    )


def _check_split_by_heads(region, split_axes: dict[int, int], derived: DerivedSplit) -> None:
    """Inside an attention layer tfdist splits the heads: each split kernel there must be
    split along a dimension of a head count's size (keras-hub's Llama map splits its query,
    key and value kernels by the model's width instead, which GSPMD can run and this cannot)."""
    counts = set(head_counts(region).values())
    for inner in compat.all_layers(region):
        kernel = getattr(inner, "kernel", None)
        if inner is region or kernel is None:
            continue
        if id(kernel) not in split_axes:
            # The layer runs with this replica's heads: each projection must hold them
            raise TensorParallelError(
                f"{kernel.path}: the map splits {region.name}'s heads (some of its "
                "projections), and leaves this projection whole; a split attention splits "
                f"every projection by its heads: {derived.hint(kernel.path)}. Received: "
                f"shape {tuple(kernel.shape)}, not in the map"
            )
        axis = split_axes[id(kernel)]
        if int(kernel.shape[axis]) not in counts:
            raise TensorParallelError(
                f"{kernel.path}: inside {region.name} tfdist splits attention by its heads, "
                f"and the map splits this kernel along dimension {axis} (of "
                f"{int(kernel.shape[axis])}), not a head count ({sorted(counts)}): "
                f"{derived.hint(kernel.path)}. Received: shape {tuple(kernel.shape)}"
            )


def _split_by_heads(model, axes: dict[int, int], owners: dict) -> list[str]:
    """Moves the split of each kernel inside an attention layer that the map splits along a
    dimension other than its heads (the model's width) to its first dimension of a head
    count's size, in place in `axes`; returns their paths. A kernel with no such dimension
    is left for `_check_split_by_heads` to refuse."""
    split = {id(owners.get(id(v))) for v in model.trainable_variables if id(v) in axes}
    moved = []
    for region in _attention_layers(model, split):
        counts = set(head_counts(region).values())
        for inner in compat.all_layers(region):
            kernel = getattr(inner, "kernel", None)
            if inner is region or kernel is None or id(kernel) not in axes:
                continue
            axis = axes[id(kernel)]
            if int(kernel.shape[axis]) in counts:
                continue
            # keras-hub orders a projection's kernel (width, heads, head size): the first
            # dimension of a head count's size is its heads, even where the head size
            # equals a head count
            heads = [i for i, n in enumerate(kernel.shape) if int(n) in counts]
            if heads:
                axes[id(kernel)] = heads[0]
                moved.append(kernel.path)
    return moved


def _attention_layers(model, split: set[int]) -> list[keras.layers.Layer]:
    """The attention layers (derive.attention_layers: innermost, a decoder block that counts
    heads is not one) that hold layers in `split` (ids)."""
    return [
        layer
        for layer in attention_layers(model)
        if any(id(inner) in split for inner in compat.all_layers(layer))
    ]


def _head_regions(
    model, split: set[int], degree: int, split_axes: dict[int, int], derived: DerivedSplit
) -> list[keras.layers.Layer]:
    """The attention layers that run on the group's examples with this replica's heads,
    checked: their kernels split by heads, and head counts that divide over `degree`."""
    inner = _attention_layers(model, split)
    for layer in inner:
        _check_split_by_heads(layer, split_axes, derived)
        if getattr(layer, "query_head_dim_normalize", True) is False:
            raise TensorParallelError(
                f"{layer.name} scales its queries by hidden_dim // num_query_heads, which "
                "its split heads would change. Use query_head_dim_normalize=True, or split "
                "it with degree=... layers. Received: query_head_dim_normalize=False"
            )
        for attribute in HEAD_COUNTS:
            count = getattr(layer, attribute, None)
            if isinstance(count, int) and count % degree and degree % count:
                raise TensorParallelError(
                    f"{layer.name} has {attribute}={count}, which does not split over "
                    f"{degree} replicas. Use a count divisible by {degree}. "
                    f"Received: {attribute}={count}"
                )
    return inner


# --- the split layers' exchanges, while a step is traced ------------------------------------


# --- training ---------------------------------------------------------------------------------


# --- the exchanges around each kind of split layer -------------------------------------------


__all__ = ["LayoutPlan", "Placement", "apply_layout_map", "plan_of"]

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import re
import threading
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.collective import replicas
from tfdist.parallel import flat_slices, host, optimizer_copies, saved_state, stand_in
from tfdist.parallel.tensor.derive import (
    HEAD_COUNTS,
    DerivedSplit,
    attention_layers,
    derive_split,
    head_counts,
)
from tfdist.parallel.tensor.mappings import (
    TensorParallelError,
    gather_from_group,
    gather_from_parts,
    reduce_scatter_to_group,
    replica_in_step,
    step_sizes,
    summed_over,
)
from tfdist.strategies import keras_guard
from tfdist.training.hooks import StepHook
from tfdist.training.job import Job

log = logging.getLogger(__name__)

# The attributes in which attention layers count the query heads that share a key/value
# head (Mistral's private); their head counts: derive.HEAD_COUNTS.
GROUP_COUNTS = ("num_key_value_groups", "_num_key_value_groups")


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


def _groups(placement: Placement, replicas: int) -> list[list[int]]:
    """For each part, the replicas that hold it (its data group), in order."""
    return [[r for r in range(replicas) if placement.index(r) == j] for j in range(placement.parts)]


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _slice_of(part: np.ndarray, count: int, k: int) -> np.ndarray:
    """Slice `k` of `count` of `part`, flattened and padded with zeros."""
    size = flat_slices.slice_size(part.shape, count)
    flat = np.zeros(size * count, part.dtype)
    flat[: part.size] = np.ravel(part)
    return flat[k * size : (k + 1) * size]


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


def _local_heads(count: int, degree: int) -> int:
    return count // degree if count % degree == 0 else 1


# --- the split layers' exchanges, while a step is traced ------------------------------------


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


# --- training ---------------------------------------------------------------------------------


class LayoutParallel(StepHook):
    """Trains a model that tensor_parallel(layout_map=...) marked: each replica's parts and
    their optimizer slots on its device, the whole model in host memory. It ends the chain
    (it applies every weight's update). See the module docstring."""

    synchronous_only = True
    takes_host_scope_models = True
    applies_update = True
    ends_chain = True
    keeps_optimizer_state = True

    def __init__(self, plan: LayoutPlan, shard: str | None = None):
        self.plan = plan
        # shard_optimizer: None, or each part's optimizer state (zero1, zero2) and under
        # zero3 the part itself sharded over the replicas that hold that part (its data group).
        self.shard = {3: "zero3", 1: "zero1", 2: "zero2"}.get(shard, shard)
        # While a replica's step is traced: each weight reads as the replica's part, the
        # split layers run inside their exchanges, attention layers count its heads.
        self._traced = stand_in.TraceSpan(self._enter, self._exit)

    @property
    def name(self) -> str:
        sharded = f" x shard_optimizer={self.shard!r}" if self.shard else ""
        return f"tensor_parallel(layout_map=...){sharded}"

    def build(self, model: keras.Model, job: Job) -> None:
        if self.already_built(model, job):
            return  # a later fit: the parts keep their optimizer state
        optimizer, who = model.optimizer, "Tensor-parallel parts"
        optimizer_copies.check_copyable(optimizer, who=who, error=TensorParallelError)
        if optimizer.clipnorm is not None or getattr(optimizer, "global_clipnorm", None):
            raise TensorParallelError(
                f"{who} are updated one replica at a time, so the norm of a whole weight "
                "(clipnorm) is not known where a part is updated. Use clipvalue, or no "
                f"clipping. Received: clipnorm={optimizer.clipnorm}"
            )
        layout = job.placement
        if layout.processes > 1 or layout.single_program:
            raise TensorParallelError(
                "LayoutParallel splits weights over the local devices of one mirrored "
                "strategy (across worker processes tfdist.fit trains a layout map's model "
                "as a pipeline of one stage, a tensor group a process); over TPU cores it "
                f"is not built. Received: {layout.processes} processes, "
                f"single program: {layout.single_program}"
            )
        degree, replicas = self.plan.degree, layout.replicas
        if replicas % degree:
            raise TensorParallelError(
                f"The layout map's model axis is {degree}, which does not divide the "
                f"strategy's {replicas} replicas into groups. Build the mesh with a model "
                f"axis that divides {replicas}. Received: model axis {degree}"
            )
        self.model, self.replicas, self.devices = model, replicas, list(layout.devices)
        host.move_to_host(model, job.strategy)
        self.variables = list(model.trainable_variables)
        if len(self.variables) != len(self.plan.placements):
            raise TensorParallelError(
                "The model's trainable weights changed after tensor_parallel(layout_map=...) "
                "read them. Call it again after changing the model."
            )
        self.hosts = [compat.storage_of(v) for v in self.variables]
        self.calls = SplitCalls(self.plan, self.variables)
        self.decays = optimizer_copies.decoupled_decays(optimizer, self.variables)
        self.optimizer = optimizer
        if not optimizer.built:
            optimizer.build([])  # iterations and the learning rate; the parts keep the slots

        self.groups = [_groups(p, replicas) for p in self.plan.placements]
        # Under shard_optimizer each weight's part is cut into flat slices, one per replica
        # of its data group, except an embedding table's: its looked-up rows arrive sparse,
        # and Keras's optimizer updates them as rows (a slice of them would be dense).
        tables = {id(layer.embeddings) for layer in compat.all_layers(model)
                  if isinstance(layer, keras.layers.Embedding)}  # fmt: skip
        self.sliced = [
            self.shard is not None and id(v) not in tables and _size(p.shape_of(v)) > 0
            for v, p in zip(self.variables, self.plan.placements, strict=True)
        ]
        if self.shard and tables:
            log.info(
                "%s: embedding tables stay whole tensor parts on their replicas (their "
                "gradients are sparse rows): %s", self.name,
                ", ".join(v.path for v in self.variables if id(v) in tables),
            )  # fmt: skip

        def make():
            parts, slices, copies = [], [], []
            for r, device in enumerate(self.devices):
                with tf.device(device):
                    mine, cut, updated = [], [], []
                    for i, (v, p) in enumerate(
                        zip(self.variables, self.plan.placements, strict=True)
                    ):
                        name = f"tp_v{i}_part{p.index(r)}"
                        whole = None
                        if not (self.sliced[i] and self.shard == "zero3"):
                            whole = keras.Variable(
                                np.zeros(p.shape_of(v), v.dtype), dtype=v.dtype, name=name,
                                autocast=False,
                            )  # fmt: skip
                        piece = None
                        if self.sliced[i]:
                            group = self.groups[i][p.index(r)]
                            piece = keras.Variable(
                                np.zeros(flat_slices.slice_size(p.shape_of(v), len(group)), v.dtype),
                                dtype=v.dtype, name=f"{name}_slice{group.index(r)}",
                                autocast=False,
                            )  # fmt: skip
                        mine.append(whole if whole is not None else piece)
                        cut.append(piece)
                        updated.append(piece if piece is not None else whole)
                    parts.append(mine)
                    slices.append(cut)
                    copies.append(optimizer_copies.optimizer_copy(optimizer, updated))
            return parts, slices, copies

        # parts[r][i]: what replica r's step reads weight i through (its part, or under
        # zero3 its slice of the part, gathered when read); slices[r][i]: its slice of the
        # part (None where not sliced), which its optimizer copy updates.
        self.parts, self.slices, self.copies = optimizer_copies.outside_strategy(make)
        self._stand_ins = [_Part(self, i) for i in range(len(self.variables))]
        saved_state.keep_in_saves(optimizer, model, self.slot_reader)

    # --- where training starts and settles ----------------------------------------------------

    def start(self) -> None:
        """Each replica takes its parts (and its slices of them) from the whole weights in
        host memory."""
        for i, placement in enumerate(self.plan.placements):
            whole = self.hosts[i].numpy()
            for r in range(self.replicas):
                part = placement.piece(whole, placement.index(r))
                if self.slices[r][i] is not None:
                    group = self.groups[i][placement.index(r)]
                    self.slices[r][i].assign(_slice_of(part, len(group), group.index(r)))
                if self.parts[r][i] is not self.slices[r][i]:
                    self.parts[r][i].assign(part)

    def settle(self) -> None:
        """The whole weights in host memory, from the first group's parts (or the slices
        that make them up)."""
        for i, placement in enumerate(self.plan.placements):
            pieces = [self.whole_part(i, j) for j in range(placement.parts)]
            whole = pieces[0] if placement.axis is None else np.concatenate(pieces, placement.axis)
            self.hosts[i].assign(whole)

    def whole_part(self, i: int, j: int, held=None) -> np.ndarray:
        """Part `j` of weight `i` (given `held`, of the variable `held(r)` replica r keeps
        for it: a slot), put together from its group's slices where it is sliced."""
        group = self.groups[i][j]
        if held is None:
            held = (lambda r: self.slices[r][i]) if self.sliced[i] else (lambda r: self.parts[r][i])
        if not self.sliced[i]:
            return held(group[0]).numpy()
        shape = self.plan.placements[i].shape_of(self.variables[i])
        flat = np.concatenate([held(r).numpy() for r in group])
        return flat[: _size(shape)].reshape(shape)

    # --- one step -----------------------------------------------------------------------------

    def step(self, batch, train_step):
        with self._traced():
            return train_step(batch)

    def _enter(self) -> None:
        for variable, storage in zip(self.variables, self._stand_ins, strict=True):
            compat.replace_storage(variable, storage)
        self.calls.install()

    def _exit(self) -> None:
        for variable, storage in zip(self.variables, self.hosts, strict=True):
            compat.replace_storage(variable, storage)
        self.calls.uninstall()

    def part(self, i: int) -> keras.Variable:
        replica, _ = replica_in_step()
        return self.parts[replica][i]

    def read_part(self, i: int) -> tf.Tensor:
        """This replica's part of weight `i`, in its step: under zero3 its data group's
        slices all-gathered. The gather's gradient sums the group's gradients and keeps this
        replica's slice of the sum (TensorFlow's all_gather differentiates so), which is
        what the tape returns for the slice."""
        own = tf.identity(self.part(i).value)  # a read, on the tape
        if not (self.sliced[i] and self.shard == "zero3"):
            return own
        return self._gathered_part(i, own)

    def _gathered_part(self, i: int, mine: tf.Tensor) -> tf.Tensor:
        """Weight `i`'s part put together from this replica's slice `mine` and those of the
        other replicas of its group, in a replica's step (an all-gather every replica makes)."""
        replica, _ = replica_in_step()
        placement = self.plan.placements[i]
        group = self.groups[i][placement.index(replica)]
        shape = placement.shape_of(self.variables[i])
        everyone = replicas.all_gather(mine[None])
        flat = tf.concat([everyone[r] for r in group], 0)[: _size(shape)]
        return tf.reshape(flat, shape)

    # --- the update -----------------------------------------------------------------------------

    def apply(self, grads_and_vars, apply_next):
        del apply_next  # the end of the chain: every weight's update is applied here
        replica, _ = replica_in_step()
        given = {id(v): g for g, v in grads_and_vars}
        grads = [given.get(id(v)) for v in self.variables]
        present = [i for i, g in enumerate(grads) if g is not None]
        # Under zero3 a sliced part's gradient is its slice's, summed over the group already
        # (read_part's gather); every other part's is summed here.
        gathered = [i for i in present if self.sliced[i] and self.shard == "zero3"]
        summed: dict[int, tf.Tensor] = {i: grads[i] for i in gathered}
        rest = [i for i in present if i not in summed]
        # One exchange per way of holding (parts per weight): the same calls on every replica.
        for count in sorted({self.plan.placements[i].parts for i in rest}):
            chosen = [i for i in rest if self.plan.placements[i].parts == count]
            placement = self.plan.placements[chosen[0]]
            copies = self.groups[chosen[0]][placement.index(replica)]
            shapes = [self.plan.placements[i].shape_of(self.variables[i]) for i in chosen]
            got = summed_over([grads[i] for i in chosen], shapes, copies)
            summed.update(zip(chosen, got, strict=True))
        for i in rest:  # zero1 / zero2: this replica's slice of the summed gradient
            if self.sliced[i]:
                group = self.groups[i][self.plan.placements[i].index(replica)]
                summed[i] = flat_slices.flat_slice(summed[i], len(group), group.index(replica))
        held = [self.slices[replica][i] if self.sliced[i] else self.parts[replica][i]
                for i in present]  # fmt: skip
        optimizer_copies.apply_with_copy(
            self.optimizer, self.copies[replica], [summed[i] for i in present], held,
            [self.decays[i] for i in present], self.devices[replica],
        )  # fmt: skip
        # zero1 / zero2: each part made whole again from its group's updated slices.
        for i in present:
            if self.sliced[i] and self.shard != "zero3":
                mine = tf.identity(self.slices[replica][i].value)
                self.parts[replica][i].assign(self._gathered_part(i, mine))
        return None

    def checkpoint_state(self) -> dict:
        return {f"tensor_layout_optimizer_{r}": copy for r, copy in enumerate(self.copies)}

    def slot_reader(self) -> saved_state.BucketReader:
        """Whole slots for model.save, a weight at a time, from the first group's parts (as
        settle() makes the weights whole), put together from their slices where sliced."""
        held = {}  # (weight, replica, slot) -> the slot variable
        for r, copy in enumerate(self.copies):
            for slot in copy.variables:
                found = _PART_SLOT.search(slot.path)
                if found:
                    held[int(found[1]), r, found[2]] = slot

        def whole(name: str, i: int) -> dict[int, np.ndarray]:
            placement = self.plan.placements[i]
            pieces = [
                self.whole_part(i, j, lambda r: held[i, r, name]) for j in range(placement.parts)
            ]
            if placement.axis is None:
                return {i: pieces[0]}
            return {i: np.concatenate(pieces, axis=placement.axis)}

        buckets = [(i,) for i in range(len(self.variables))]
        return saved_state.BucketReader(buckets, whole, sorted({key[2] for key in held}))


# A slot of a replica's part (or slice of it) in its optimizer copy: Keras names it after
# the variable (tp_v{weight}_part{part}, then _slice{k}) and the slot ("momentum").
_PART_SLOT = re.compile(r"tp_v(\d+)_part\d+(?:_slice\d+)?_(\w+)$")


class _Part(stand_in.StandIn):
    """A weight's storage while a step is traced: it reads as this replica's part (a row
    layer's bias as 1/T of it), and its handle is the part's, so the tape's gradient for
    the weight is the part's."""

    def __init__(self, hook: LayoutParallel, index: int):
        super().__init__(hook.hosts[index], lambda: hook.part(index))
        self._hook, self._index = hook, index
        self.scale = hook.plan.placements[index].scale

    def read(self) -> tf.Tensor:
        value = self._hook.read_part(self._index)
        if self.scale != 1.0:
            value = value * tf.constant(self.scale, value.dtype)
        return value


# --- the exchanges around each kind of split layer -------------------------------------------


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

__all__ = ["LayoutParallel", "LayoutPlan", "Placement", "apply_layout_map", "plan_of"]

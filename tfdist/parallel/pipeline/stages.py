"""Cutting a Keras model into pipeline stages, and chaining stage models into one model.

A stage is a sub-model of the user's model that shares its layers (and so its variables):
stage 0 takes the model's inputs, the last stage gives its outputs, and each stage after the
first takes what crosses the cut before it, plus any of the model's inputs it reads (every
stage has the batch: a padding mask used by every block needs no transfer).

What crosses a cut (a `Crossing`) is every tensor made before it and used after it: one
activation in a chain of blocks, several where branches meet after the cut (an encoder's
output and a decoder's embedded input), a skip connection's tensor (passed on by the stages
it skips, as torch's pipelining passes it). A Keras mask an activation carries (from an
Embedding(mask_zero=True), say) crosses beside it and is attached to it again on the other
side, so the layers after the cut see the mask they would see in the unsplit model.

A weight that several stages use (tied input and output embeddings, as keras-hub's causal
LMs have) is held by each of them; the pipeline sums its gradient over them, so the copies
stay equal (Megatron-LM's tied embeddings). `tied(stages)` (tied.py) names those weights.

    stages = split(model, cut_before=["block_2", "block_3", "head"])   # 4 stages
    model = chain([stage_0, stage_1, stage_2, stage_3])                # and back

Each bad split gets one error naming what is wrong (a cut at a layer the model does not
have, cuts out of order, a cut before a shared layer, stages whose shapes do not chain),
raised before anything trains.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import heapq
import logging
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError

log = logging.getLogger(__name__)


class StageError(FitError):
    """A model cannot be cut into stages as asked (the message says why and how to fix it)."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a pipeline.

    Attributes:
      index: its position, 0 for the stage that takes the model's inputs.
      model: a Keras model over the user's model's layers (their variables are shared).
        Stage 0 takes the model's inputs; a later stage takes the activations of
        `received`, then the model's inputs listed in `inputs`.
      trainable: positions of its trainable variables in `model.trainable_variables` of the
        whole model, in the stage model's order.
      non_trainable: the same for non-trainable variables (BatchNormalization statistics).
      inputs: positions in the whole model's `inputs` of those a later stage reads from
        the batch (empty for stage 0, which takes them all).
      received: what crosses the cut before it (None for stage 0). Its model takes the
        crossing's activations first, then the model's inputs in `inputs`.
      sent: what crosses the cut after it (None for the last stage).
      gives: per item of `sent`: `k >= 0` for its model's output k, `~i` for item i of
        `received`, passed on unchanged (a skip connection over the stage).
    """

    index: int
    model: keras.Model
    trainable: tuple[int, ...]
    non_trainable: tuple[int, ...]
    inputs: tuple[int, ...] = ()
    received: Crossing | None = None
    sent: Crossing | None = None
    gives: tuple[int, ...] = ()

    @property
    def first(self) -> bool:
        return self.index == 0

    def call_args(self, received: Sequence, batch: Sequence) -> tuple[Any, Any]:
        """(inputs, mask) to call this stage's model with, given what arrived over the cut
        (`received`, one tensor per item) and the model's inputs flattened (`batch`)."""
        crossing = self.received
        if crossing is None:
            raise ValueError("Stage 0 takes the model's inputs as they are")
        activations = list(received[: crossing.activations])
        given = [*activations, *(batch[k] for k in self.inputs)]
        masks = [None if j is None else received[j] for j in crossing.masks]
        masks += [None] * len(self.inputs)
        if len(given) == 1:
            return given[0], masks[0]
        return given, (masks if any(m is not None for m in masks) else None)

    def passed_on(self, outputs, received: Sequence) -> list:
        """What crosses the cut after this stage: its outputs and what it passes on."""
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return [outputs[k] if k >= 0 else received[~k] for k in self.gives]

    def watched(self, received: Sequence) -> list:
        """The items of `received` a gradient flows back through (a tape watches them)."""
        return [t for t, d in zip(received, self.received.differentiable, strict=True) if d]

    def seeds(self, outputs, upstream: Sequence) -> tuple[list, list, dict]:
        """The backward pass's (targets, their gradients, passed): `upstream` holds the
        gradient of each differentiable item of `sent`, as it came back over the cut; an
        item this stage passed on has its gradient in `passed`, by the received item."""
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        targets, seeds, passed = [], [], {}
        back = iter(upstream)
        for k, differentiable in zip(self.gives, self.sent.differentiable, strict=True):
            if not differentiable:
                continue
            g = next(back)
            if k >= 0:
                targets.append(outputs[k])
                seeds.append(g)
            else:
                passed[~k] = g if ~k not in passed else passed[~k] + g
        return targets, seeds, passed

    def sent_back(self, grads: Sequence, received: Sequence, passed: dict) -> list:
        """The gradient of each watched item of `received`: this stage's own (`grads`, in
        `watched` order, None where the item does not count) plus what came back for it
        where the stage passed it on."""
        out = []
        positions = [i for i, d in enumerate(self.received.differentiable) if d]
        for g, i in zip(grads, positions, strict=True):
            g = tf.zeros_like(received[i]) if g is None else tf.convert_to_tensor(g)
            out.append(g + passed[i] if i in passed else g)
        return out


@dataclasses.dataclass(frozen=True)
class Crossing:
    """What crosses one cut, forward: `activations` tensors, then the Keras masks some of
    them carry. Backward, the gradient of each `differentiable` item crosses back.

    Attributes:
      items: the symbolic tensors, activations first, then masks (in the unsplit model).
      activations: how many of `items` are activations.
      masks: per activation, the position in `items` of its mask (None: it has none).
      differentiable: per item, whether a gradient flows back through it (a float tensor).
    """

    items: tuple[Any, ...]
    activations: int
    masks: tuple[int | None, ...]
    differentiable: tuple[bool, ...]

    def describe(self) -> str:
        return _described(self.items[: self.activations], self.masks, self.items)


def split(model: keras.Model, cut_before: Sequence[str] | None = None) -> list[Stage]:
    """Cuts `model` into stages, a new stage starting at each layer named in `cut_before`.

    Args:
      model: a built Sequential or functional model.
      cut_before: names of the layers where stages 1, 2, ... begin, in the order the data
        reaches them; a layer of a nested model by its path, "backbone/block_1" (the nested
        models on the path then run layer by layer in the model's graph). None: the model
        is a chain of stage models (see `chain`), cut at each.

    Returns:
      len(cut_before) + 1 stages.

    Raises:
      StageError: a name is not a layer of the model, the cuts are out of order, a cut
        layer is called more than once, an output is made before the last cut, or a stage
        cannot be built from what crosses (a Keras mask made from another cut's mask).
    """
    graph = compat.layer_graph(model)
    if graph is None:
        raise StageError(
            f"A pipeline cuts a model's layer graph into stages, so it takes a built "
            f"Sequential or functional model; {model.name!r} is a subclassed model (its "
            "call() is Python code with no graph to cut). Build the stages as models and "
            "chain them: model = tfdist.parallel.chain([stage_0, stage_1, ...]). "
            f"Received: {type(model).__name__}"
        )
    owner = model
    if cut_before is not None and any("/" in name for name in cut_before):
        model, cut_before = _flattened(model, list(cut_before))
        graph = compat.layer_graph(model)
    cut_before, names = _checked_cuts(model, cut_before)
    nodes = _in_order(graph)
    position = {id(node): k for k, node in enumerate(nodes)}
    cuts = [position[id(_only_call(model.get_layer(name), nodes))] for name in cut_before]
    if cuts != sorted(cuts):
        raise StageError(
            "cut_before must name the layers in the order the data reaches them "
            f"({', '.join(n for n in names if n in cut_before)}). Received: {cut_before!r}"
        )
    stage_of = [bisect.bisect_right(cuts, k) for k in range(len(nodes))]
    crossings = _crossings(model, nodes, stage_of, cut_before)
    ran_in: dict[int, set[int]] = {}  # layer -> the stages its calls fall in
    for node, index in zip(nodes, stage_of, strict=True):
        ran_in.setdefault(id(node.operation), set()).add(index)
    stages, reads, gives = [], [], []
    for index in range(len(cuts) + 1):
        sub, read, give = _stage(model, graph, index, crossings, cut_before, ran_in)
        stages.append(sub)
        reads.append(read)
        gives.append(give)
    return _indexed(owner, stages, reads, crossings, gives)


def _checked_cuts(model: keras.Model, cut_before) -> tuple[list[str], list[str]]:
    """(the cut layers' names, the model's layers' names), each cut refused in one line
    where it names no layer or a layer twice; None: the model's stage models, cut at each."""
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    names = [layer.name for layer in layers]
    if cut_before is None:
        if len(layers) < 2 or not all(isinstance(layer, keras.Model) for layer in layers):
            raise StageError(
                f"Say where to cut {model.name!r}: pass cut_before=[names of the layers where "
                "stages 1, 2, ... begin], or chain stage models with tfdist.parallel.chain. "
                f"Its layers: {', '.join(names)}. Received: cut_before=None"
            )
        cut_before = names[1:]
    cut_before = list(cut_before)
    for name in cut_before:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise StageError(
                f"Cannot cut {model.name!r} before layer {name!r}: it has no layer of that "
                f"name{hint}. Its layers, in order: {', '.join(names)}. "
                f"Received: cut_before={cut_before!r}"
            )
    if len(set(cut_before)) != len(cut_before):
        raise StageError(f"A layer is named twice in cut_before. Received: {cut_before!r}")
    return cut_before, names


def _stage(model, graph, index: int, crossings, cut_before, ran_in) -> tuple:
    """Stage `index`'s model, the model's inputs it reads (by position), and what it gives
    the next crossing (see _indexed); refused in one line where it cannot be built."""
    model_inputs = list(model.inputs)
    before = crossings[index - 1] if index else None
    outputs, give = list(model.outputs), ()
    if index < len(crossings):  # what it makes of the next crossing; the rest it passes on
        received = {id(t): k for k, t in enumerate(before.items)} if before else {}
        outputs, give = [], []
        for item in crossings[index].items:
            if id(item) in received:
                give.append(~received[id(item)])
            else:
                give.append(len(outputs))
                outputs.append(item)
    activations = list(before.items[: before.activations]) if before else []
    name = f"{model.name}_stage_{index}"
    where = f"before {cut_before[index - 1]!r}" if index else "at the model's inputs"
    try:
        if not outputs:
            raise ValueError("it makes nothing the stages after it use")
        if index:  # the model's inputs it reads: only those its layers take
            sub = _model([*activations, *model_inputs], outputs, name)
            taken = compat.tensors_taken(compat.layer_graph(sub))
            read = tuple(k for k, t in enumerate(model_inputs) if id(t) in taken)
            sub = _model([*activations, *(model_inputs[k] for k in read)], outputs, name)
        else:  # stage 0 takes the inputs as the model does (a dict, say)
            sub = _model(compat.inputs_like(graph, model_inputs), outputs, name)
            read = ()
    except ValueError as e:
        crossing = before or crossings[index]
        raise StageError(
            f"Stage {index} of {model.name!r} (starting {where}) cannot be built from what "
            f"crosses its cuts. The cut {'before' if before else 'after'} it passes "
            f"{crossing.describe()}. Keras said: {str(e).splitlines()[0]}. Cut elsewhere: "
            "where fewer tensors, and no Keras mask made of another cut's mask, cross. "
            f"Received: cut_before={cut_before!r}"
        ) from None
    again = [
        layer.name
        for layer in sub.layers
        if not isinstance(layer, keras.layers.InputLayer)
        and index not in ran_in.get(id(layer), {index})
    ]
    if again:  # Keras would make it again from the model's inputs (a mask's source)
        raise StageError(
            f"Stage {index} of {model.name!r} (starting {where}) would run layer "
            f"{again[0]!r} of an earlier stage again: a Keras mask a layer after the cut "
            f"makes is computed from it. The cut before it passes {before.describe()}. "
            "Cut before the layer that makes the mask, or after the one that uses it up. "
            f"Received: cut_before={cut_before!r}"
        )
    return sub, read, tuple(give)


def devices_for(stages: int, chunks: int, micro_batches: int, *, holder: str) -> int:
    """The devices `stages` stages take at `chunks` stages a device, checked: the stages
    divide into the chunks, and the interleaved schedule (chunks > 1) gets micro-batches
    in groups of those devices (`holder` names whose devices they are, for the message).

    Raises:
      StageError: either does not hold.
    """
    if stages % chunks:
        raise StageError(
            f"chunks_per_device={chunks} puts {chunks} stages on each device: cut the model "
            f"into a multiple of {chunks} stages. Received: {stages} stages"
        )
    width = stages // chunks
    if chunks > 1 and micro_batches % width:
        raise StageError(
            f"The interleaved schedule takes micro-batches in groups of {holder} {width} "
            f"devices: micro_batches must be a multiple of {width}. Received: "
            f"micro_batches={micro_batches}"
        )
    return width


def _model(inputs, outputs: list, name: str) -> keras.Model:
    return keras.Model(
        inputs[0] if isinstance(inputs, list) and len(inputs) == 1 else inputs,
        outputs[0] if len(outputs) == 1 else outputs,
        name=name,
    )


def chain(stages: Sequence[keras.Model], *, name: str | None = None) -> keras.Model:
    """One functional model that runs `stages` one after another (a pipeline cuts it at each).

    Args:
      stages: built Keras models; each one's output feeds the next one's input.
      name: the chained model's name.

    Raises:
      StageError: fewer than two stages, a stage that is not built, or stages whose shapes
        do not chain (stage k gives what stage k+1 cannot take).
    """
    stages = list(stages)
    if len(stages) < 2 or not all(isinstance(s, keras.Model) for s in stages):
        raise StageError(
            "chain takes two or more Keras models, the stages in order. "
            f"Received: {[type(s).__name__ for s in stages]}"
        )
    for index, stage in enumerate(stages):
        if not stage.built or not getattr(stage, "inputs", None):
            raise StageError(
                f"Stage {index} ({stage.name!r}) has no input shape: give it a keras.Input "
                "(or build it) so the stages' shapes can be checked. "
                f"Received: an unbuilt {type(stage).__name__}"
            )
    for index in range(len(stages) - 1):
        given, taken = stages[index].outputs, stages[index + 1].inputs
        if len(given) != 1 or len(taken) != 1 or not _fits(given[0].shape, taken[0].shape):
            raise StageError(
                f"The stages' shapes do not chain: stage {index} ({stages[index].name!r}) "
                f"gives {_shapes(given)}, but stage {index + 1} ({stages[index + 1].name!r}) "
                f"takes {_shapes(taken)}. Each stage must take what the one before gives. "
                f"Received: {len(stages)} stages"
            )
    inputs = [keras.Input(batch_shape=t.shape, dtype=t.dtype) for t in stages[0].inputs]
    x = stages[0](inputs[0] if len(inputs) == 1 else inputs)
    for stage in stages[1:]:
        x = stage(x)
    return keras.Model(inputs[0] if len(inputs) == 1 else inputs, x, name=name)


def _flattened(model: keras.Model, cut_before: list[str]) -> tuple[keras.Model, list[str]]:
    """`model` with the nested models that the cut paths pass through run layer by layer
    in its own graph (the same layer objects: the same variables), and the cuts as names of
    that graph's layers. A path joins layer names with "/" as Keras's variable paths do:
    "gemma_backbone/decoder_block_1" is the layer decoder_block_1 of the nested model
    gemma_backbone."""
    inlined: set[int] = set()
    names = []
    for path in cut_before:
        holder, parts = model, path.split("/")
        for depth, part in enumerate(parts):
            found = {
                layer.name: layer
                for layer in holder.layers
                if not isinstance(layer, keras.layers.InputLayer)
            }
            layer = found.get(part)
            if layer is None:
                where = "/".join(parts[:depth]) or model.name
                close = difflib.get_close_matches(part, list(found), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise StageError(
                    f"Cannot cut {model.name!r} before {path!r}: {where!r} has no layer "
                    f"{part!r}{hint}. Its layers: {', '.join(found)}. A path names a nested "
                    "model's layer as 'outer/inner'. Received: cut_before="
                    f"{cut_before!r}"
                )
            if depth < len(parts) - 1:
                if not isinstance(layer, keras.Model) or compat.layer_graph(layer) is None:
                    raise StageError(
                        f"Cannot cut {model.name!r} before {path!r}: {part!r} is a "
                        f"{type(layer).__name__}, not a Sequential or functional model whose "
                        "layers a cut can reach. Received: cut_before="
                        f"{cut_before!r}"
                    )
                inlined.add(id(layer))
                holder = layer
        names.append(parts[-1])

    def call(operation, *args, **kwargs):
        if id(operation) in inlined:
            given = args[0] if len(args) == 1 else list(args)
            return compat.run_graph(operation, given, call)
        return operation(*args, **kwargs)

    inputs = [keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name) for t in model.inputs]
    outputs = compat.run_graph(model, inputs, call)
    structure = compat.inputs_like(model, inputs)
    try:
        flat = keras.Model(structure, outputs, name=model.name)
    except ValueError as e:
        raise StageError(
            f"Cannot run the nested models of {model.name!r} as one graph to cut it at "
            f"{cut_before!r}: {str(e).splitlines()[0]}. Cut at the top level, or build the "
            "model flat. Received: cut_before="
            f"{cut_before!r}"
        ) from None
    flat_names = [layer.name for layer in flat.layers]
    duplicated = sorted({name for name in names if flat_names.count(name) > 1})
    if duplicated:
        raise StageError(
            f"Cannot cut {model.name!r} at {duplicated[0]!r}: run as one graph, the model has "
            "two layers of that name (one nested, one not). Received: cut_before="
            f"{cut_before!r}"
        )
    return flat, names


def _in_order(graph) -> list:
    """Every layer call of `graph` (Keras's nodes, the model's inputs left out), each after
    the calls whose tensors it takes; of the calls ready, first the one whose layer the model
    lists first. So a cut before a layer puts the layers listed before it in the stages
    before, where the data allows, and a layer's second call (a tied embedding's logits)
    falls where its input is made."""
    nodes = compat.graph_nodes(graph)
    rank = {id(operation): k for k, operation in enumerate(graph.operations)}
    known = {id(node) for node in nodes}
    waiting = {id(node): 0 for node in nodes}
    after: dict[int, list] = {}
    for node in nodes:
        for parent in node.parent_nodes:
            if id(parent) in known:
                waiting[id(node)] += 1
                after.setdefault(id(parent), []).append(node)
    seq = {id(node): k for k, node in enumerate(nodes)}  # ties: in Keras's depth order
    ready = [(rank[id(n.operation)], seq[id(n)], n) for n in nodes if not waiting[id(n)]]
    heapq.heapify(ready)
    ordered = []
    while ready:
        *_, node = heapq.heappop(ready)
        ordered.append(node)
        for child in after.get(id(node), []):
            waiting[id(child)] -= 1
            if not waiting[id(child)]:
                heapq.heappush(ready, (rank[id(child.operation)], seq[id(child)], child))
    return ordered


def _only_call(layer, nodes: list):
    calls = [node for node in nodes if node.operation is layer]
    if len(calls) != 1:
        raise StageError(
            f"Cannot cut before layer {layer.name!r}: it is called {len(calls)} times in the "
            "model (a shared layer), so 'before it' is not one place. Cut before another "
            f"layer. Received: cut before {layer.name!r}"
        )
    return calls[0]


def _crossings(model, nodes: list, stage_of: list[int], cut_before) -> list[Crossing]:
    """What crosses each cut: the tensors made before it and used after it (by producer, in
    order), then the Keras masks they carry. `stage_of` gives each node's stage."""
    last = len(cut_before)
    made: dict[int, int] = {}  # tensor -> the stage making it
    last_use: dict[int, int] = {}  # tensor -> the last stage using it
    ordered = []
    for node, index in zip(nodes, stage_of, strict=True):
        for t in node.output_tensors:
            made[id(t)] = index
            ordered.append(t)
        for t in node.input_tensors:
            last_use[id(t)] = max(last_use.get(id(t), -1), index)
    for t in model.outputs:
        if made.get(id(t), last) < last:
            producer = compat.producer(t)
            raise StageError(
                f"Cannot cut {model.name!r} there: its output from {producer.name!r} is made "
                "before the last cut, and the last stage gives the model's outputs. Cut after "
                f"every output layer. Received: cut_before={cut_before!r}"
            )
    crossings = []
    for c in range(last):
        activations = [t for t in ordered if made[id(t)] <= c < last_use.get(id(t), -1)]
        items, masks = list(activations), []
        for t in activations:
            mask = compat.keras_mask(t)
            if mask is None:
                masks.append(None)
                continue
            found = next((k for k, item in enumerate(items) if item is mask), None)
            if found is None:
                items.append(mask)
                found = len(items) - 1
            masks.append(found)
        differentiable = tuple(
            k < len(activations) and tf.as_dtype(item.dtype).is_floating
            for k, item in enumerate(items)
        )
        crossings.append(Crossing(tuple(items), len(activations), tuple(masks), differentiable))
    return crossings


def _described(activations, masks, items) -> str:
    """'2 tensors: float32 (None, 8, 16) from 'encoder' with its Keras mask, ...'."""
    parts = []
    for t, mask in zip(activations, masks, strict=True):
        producer = compat.producer(t)
        part = f"{t.dtype} {tuple(t.shape)} from {getattr(producer, 'name', 'the inputs')!r}"
        if mask is not None:
            part += f" with its Keras mask ({items[mask].dtype} {tuple(items[mask].shape)})"
        parts.append(part)
    count = f"{len(parts)} tensor{'s' if len(parts) != 1 else ''}"
    return f"{count}: {', '.join(parts)}" if parts else "no tensor"


def _indexed(
    model: keras.Model,
    models: list[keras.Model],
    reads: list[tuple[int, ...]] | None = None,
    crossings: list[Crossing] | None = None,
    gives: list[tuple[int, ...]] | None = None,
) -> list[Stage]:
    trainable = {id(v): i for i, v in enumerate(model.trainable_variables)}
    non_trainable = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
    owner: dict[int, int] = {}
    stages = []
    for index, sub in enumerate(models):
        for v in sub.non_trainable_variables:  # a tied weight is fine; shared statistics not
            if id(v) in owner and owner[id(v)] != index:
                raise StageError(
                    f"Variable {v.path} (not trainable: a layer's statistics) is used by stage "
                    f"{owner[id(v)]} and stage {index}, a layer shared across a cut: each "
                    "stage would keep statistics of its own. Cut so the shared layer's uses "
                    f"fall in one stage. Received: {len(models)} stages"
                )
            owner[id(v)] = index
        for v in sub.trainable_variables:
            owner.setdefault(id(v), index)
        stages.append(
            Stage(
                index=index,
                model=sub,
                trainable=tuple(trainable[id(v)] for v in sub.trainable_variables),
                non_trainable=tuple(non_trainable[id(v)] for v in sub.non_trainable_variables),
                inputs=reads[index] if reads else (),
                received=crossings[index - 1] if crossings and index else None,
                sent=crossings[index] if crossings and index < len(crossings) else None,
                gives=gives[index] if gives else (),
            )
        )
    missed = [v.path for v in model.trainable_variables if id(v) not in owner]
    if missed:
        raise StageError(
            f"No stage uses {missed[0]} (and {len(missed) - 1} more): the cut stages do not "
            "cover the model. Received: a model whose outputs do not depend on every weight"
        )
    return stages


def _fits(given, taken) -> bool:
    if len(given) != len(taken):
        return False
    return all(a is None or b is None or a == b for a, b in zip(given, taken, strict=True))


def _shapes(tensors) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tensors)

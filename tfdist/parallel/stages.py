"""Cutting a Keras model into pipeline stages, and chaining stage models into one model.

A stage is a sub-model of the user's model that shares its layers (and so its variables):
stage 0 takes the model's inputs, the last stage gives its outputs, and each stage after the
first takes the one tensor the stage before gives, plus any of the model's inputs it reads
(every stage has the batch: a padding mask used by every block needs no transfer).

A weight that several stages use (tied input and output embeddings, as keras-hub's causal
LMs have) is held by each of them; the pipeline sums its gradient over them, so the copies
stay equal (Megatron-LM's tied embeddings). `tied(stages)` names those weights.

    stages = split(model, cut_before=["block_2", "block_3", "head"])   # 4 stages
    model = chain([stage_0, stage_1, stage_2, stage_3])                # and back

Each bad split gets one error naming what is wrong (a cut at a layer the model does not
have, cuts out of order, a cut where the data flows around it, stages whose shapes do not
chain), raised before anything trains.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence

import keras

from tfdist import compat
from tfdist.errors import FitError


class StageError(FitError):
    """A model cannot be cut into stages as asked (the message says why and how to fix it)."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a pipeline.

    Attributes:
      index: its position, 0 for the stage that takes the model's inputs.
      model: a Keras model over the user's model's layers (their variables are shared).
        Stage 0 takes the model's inputs; a later stage takes the tensor the stage before
        gives, then the model's inputs listed in `inputs`.
      trainable: positions of its trainable variables in `model.trainable_variables` of the
        whole model, in the stage model's order.
      non_trainable: the same for non-trainable variables (BatchNormalization statistics).
      inputs: positions in the whole model's `inputs` of those a later stage reads from
        the batch (empty for stage 0, which takes them all).
    """

    index: int
    model: keras.Model
    trainable: tuple[int, ...]
    non_trainable: tuple[int, ...]
    inputs: tuple[int, ...] = ()

    @property
    def first(self) -> bool:
        return self.index == 0


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
      StageError: a name is not a layer of the model, the cuts are out of order, a tensor
        made before a cut is used after it, a cut layer takes several tensors, or a Keras
        mask would cross a cut.
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
    if not cut_before:
        raise StageError("A pipeline needs at least one cut (two stages). Received: cut_before=[]")
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
    boundaries = [_boundary(model.get_layer(name), graph, model.inputs) for name in cut_before]
    order = [names.index(name) for name in cut_before]
    if order != sorted(order):
        raise StageError(
            "cut_before must name the layers in the order the data reaches them "
            f"({', '.join(n for n in names if n in cut_before)}). Received: {cut_before!r}"
        )
    model_inputs = list(model.inputs)
    ends = [model_inputs, *[[b, *model_inputs] for b in boundaries]]
    outs = [[b] for b in boundaries] + [list(model.outputs)]
    stages, reads = [], []
    for index, (inputs, outputs) in enumerate(zip(ends, outs, strict=True)):
        name = f"{model.name}_stage_{index}"
        try:  # stage 0 takes the inputs as the model does (a dict, say)
            sub = _model(compat.inputs_like(graph, inputs) if not index else inputs, outputs, name)
        except ValueError as e:
            where = f"before {cut_before[index - 1]!r}" if index else "at the model's inputs"
            raise StageError(
                f"Stage {index} of {model.name!r} (starting {where}) needs a tensor made "
                "before it begins: data flows around a cut (a skip connection; the model's "
                "own inputs are no obstacle, every stage reads them from the batch). Cut "
                "before the block that forks, or after it joins. "
                f"Keras said: {str(e).splitlines()[0]}. Received: cut_before={cut_before!r}"
            ) from None
        read = ()
        if index:  # the model's inputs this stage reads: only those its layers take
            taken = compat.tensors_taken(compat.layer_graph(sub))
            read = tuple(k for k, t in enumerate(model_inputs) if id(t) in taken)
            sub = _model([inputs[0], *(model_inputs[k] for k in read)], outputs, name)
        stages.append(sub)
        reads.append(read)
    _check_disjoint(model, graph, stages, cut_before)
    return _indexed(owner, stages, reads)


def tied(stages: Sequence[Stage]) -> dict[int, tuple[int, ...]]:
    """{position in the model's trainable_variables: the stages holding it} for each weight
    that more than one stage uses (its gradient is the sum of theirs)."""
    holders: dict[int, list[int]] = {}
    for stage in stages:
        for i in stage.trainable:
            holders.setdefault(i, []).append(stage.index)
    return {i: tuple(s) for i, s in sorted(holders.items()) if len(s) > 1}


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


def _check_disjoint(model, graph, stages: list[keras.Model], cut_before) -> None:
    """A later stage that takes the model's inputs must not run again a layer an earlier
    stage ran (what Keras builds when a tensor of an earlier stage is used after a cut: it
    recomputes it from those inputs). A layer is in as many stages as it has calls at most
    (a tied embedding: a lookup in the first stage, the logits in the last)."""
    seen: dict[int, list[int]] = {}
    for index, sub in enumerate(stages):
        for layer in sub.layers:
            if isinstance(layer, keras.layers.InputLayer):
                continue
            holders = seen.setdefault(id(layer), [])
            holders.append(index)
            if len(holders) > len(compat.layer_inputs_in(graph, layer)):
                raise StageError(
                    f"Stage {index} of {model.name!r} (starting before "
                    f"{cut_before[index - 1]!r}) needs what layer {layer.name!r} of stage "
                    f"{holders[0]} made: data flows around a cut (a skip connection). Cut "
                    "before the block that forks, or after it joins. Received: cut_before="
                    f"{cut_before!r}"
                )


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


def _boundary(layer, graph, model_inputs):
    """The one tensor the cut layer takes besides the model's inputs: what crosses from one
    stage to the next."""
    calls = compat.layer_inputs_in(graph, layer)
    given = {id(t) for t in model_inputs}
    inputs = [t for t in calls[0] if id(t) not in given] if len(calls) == 1 else None
    if inputs is None or len(inputs) != 1:
        count = (
            "is called more than once"
            if len(calls) != 1
            else f"takes {len(inputs)} tensors made by layers before it"
        )
        raise StageError(
            f"Cannot cut before layer {layer.name!r}: it {count}, and a cut passes one tensor "
            "from a stage to the next (besides the model's inputs, which every stage reads). "
            "Cut before a layer that takes one such tensor. "
            f"Received: cut before {layer.name!r}"
        )
    if compat.keras_mask(inputs[0]) is not None:
        producer = compat.producer(inputs[0])
        raise StageError(
            f"Cannot cut before layer {layer.name!r}: what it takes carries a Keras mask (from "
            "an Embedding(mask_zero=True) or Masking layer before it), and a cut passes the "
            "activations alone, so the next stage would attend to, or pool over, the padding. "
            "Cut after the layer that uses the mask up (a pooling layer, say). Received: cut "
            f"before {layer.name!r}, after {getattr(producer, 'name', 'the inputs')!r}"
        )
    return inputs[0]


def _indexed(
    model: keras.Model, models: list[keras.Model], reads: list[tuple[int, ...]] | None = None
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

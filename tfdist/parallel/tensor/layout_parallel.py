"""Training a model a layout map splits (tensor/layout_map.py): the LayoutParallel hook builds
each replica's parts of the split weights and their optimizer copies, puts a stand-in in
each weight's storage while a step is traced (each reads as this replica's part), applies
each step's update to the parts, and writes the whole weights back to the host's model at
each epoch's end and before each save.
"""

from __future__ import annotations

import logging
import re

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.collective import replicas
from tfdist.parallel import flat_slices, host, optimizer_copies, saved_state, stand_in
from tfdist.parallel.tensor.layout_map import LayoutPlan, Placement
from tfdist.parallel.tensor.mappings import (
    TensorParallelError,
    replica_in_step,
    summed_over,
)
from tfdist.parallel.tensor.split_calls import SplitCalls
from tfdist.training.hooks import StepHook
from tfdist.training.job import Job

log = logging.getLogger(__name__)


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
        optimizer = model.optimizer
        layout, replicas = self._checked_layout(optimizer, job)
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

        # parts[r][i]: what replica r's step reads weight i through (its part, or under
        # zero3 its slice of the part, gathered when read); slices[r][i]: its slice of the
        # part (None where not sliced), which its optimizer copy updates.
        self.parts, self.slices, self.copies = optimizer_copies.outside_strategy(
            lambda: self._made_parts(optimizer)
        )
        self._stand_ins = [_Part(self, i) for i in range(len(self.variables))]
        saved_state.keep_in_saves(optimizer, model, self.slot_reader)

    def _checked_layout(self, optimizer, job: Job):
        """(the job's placement, its replicas), the optimizer, the job and the map's degree
        each refused in one line where the parts cannot train under them."""
        who = "Tensor-parallel parts"
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
        return layout, replicas

    def _made_parts(self, optimizer):
        """(parts, slices, copies) of every replica, on its device (see build)."""
        parts, slices, copies = [], [], []
        for r, device in enumerate(self.devices):
            with tf.device(device):
                mine, cut, updated = [], [], []
                for i, (v, p) in enumerate(zip(self.variables, self.plan.placements, strict=True)):
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

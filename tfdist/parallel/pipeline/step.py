"""One training step of a pipeline's stage replicas in this process (see pipeline.py).

The passes run in the executor (executor.py), in a graph without tf.function's ordering of
stateful ops; then each stage's gradients are summed over the stages that hold a tied weight
and averaged over the pipelines (in the graph in one process, by a ring per stage across
processes), and each stage's optimizer copy takes one step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.parallel import optimizer_copies
from tfdist.parallel.pipeline import sums
from tfdist.parallel.pipeline.executor import Executor, StageInput, StepOptions
from tfdist.parallel.pipeline.home import StageReplica, flat_slice, joined, piece_of, slice_size
from tfdist.parallel.pipeline.links import StageLinks
from tfdist.parallel.pipeline.schedules import schedule
from tfdist.training import sparse_rows


@dataclasses.dataclass
class _Result:
    """What one stage replica's passes give its update."""

    grads: list[tf.Tensor]
    statistics: list[tf.Tensor]
    times: tf.Tensor | None  # [passes, 2]: each pass's start and end (its first member's)


class PipelineStep:
    """Builds one training step of this process's stage replicas, for micro-batches of
    `micro` examples: every pass in its schedule's order (the executor), the gradients
    averaged over the pipelines, one optimizer step per stage. The traced function takes
    the global batch and returns (the step's metric state, each replica's pass times)."""

    # runner: the PipelineRunner (pipeline/runner.py, which imports this module)
    def __init__(self, runner: Any, micro: int):
        self.runner, self.micro = runner, micro
        self.model = runner.model
        self._last_gather = None  # while a step is traced: the last ring gather made
        options = runner.options
        # (pipeline, stage) -> its replica's members (one, or a tensor group's T), and the
        # first, which stands for the replica where one device does (sends, receives).
        self.members: dict[tuple[int, int], list[StageReplica]] = {}
        for r in sorted(runner.replicas, key=lambda r: r.member):
            self.members.setdefault((r.pipeline, r.stage.index), []).append(r)
        self.local = {key: members[0] for key, members in self.members.items()}
        self.tensor = runner.tensor_stages
        # Between processes the sends and receives are collective transfers, with keys of
        # this program's own: TensorFlow's collective runtime remembers each instance key's
        # shape for the life of the process.
        transfers = runner.links.program() if runner.processes > 1 else None
        self.links = StageLinks(runner.stages, self.local, transfers=transfers, micro=micro)
        # One pass order per device of a pipeline (a pass's chunk c on device d is stage
        # c * width + d).
        plan = schedule(
            options.schedule, runner.devices_per_pipeline, options.micro_batches,
            chunks=options.chunks_per_device,
        )  # fmt: skip
        self.executor = Executor(
            self.model, runner.stages, plan, self.links, runner.metric_variables,
            StepOptions(
                micro_batches=options.micro_batches, pipelines=runner.pipelines, micro=micro,
                timed=True, processes=runner.processes,
            ),
            tensor=self.tensor,
        )  # fmt: skip
        self.names: dict[str, list[str]] = {}  # replica -> its passes, in the order run
        # ((pipeline, stage), member) -> which of its weights' gradients are sparse
        # (IndexedSlices).
        self.sparse: dict[tuple[tuple[int, int], int], list[bool]] = {}
        self.counted = False  # whether the step's gradients are of sums over its count
        self._passes = None  # the passes' program, built when the step is first traced
        self.function = tf.function(self.step)

    def passes(self, times) -> dict[tuple[int, int], list[tuple[str, float, float]]]:
        """{(pipeline, stage): [(pass, start, end), ...]} of one step, from its `times`."""
        out = {}
        for key, value in times.items():
            pipeline, stage = (int(k) for k in key.split("_"))
            out[pipeline, stage] = [
                (name, float(t[0]), float(t[1]))
                for name, t in zip(self.names[key], np.asarray(value), strict=True)
            ]
        return out

    # --- the step ---------------------------------------------------------------------------------

    def step(self, batch):
        """The traced step: the passes' program, then the exchange and the updates."""
        flat = tf.nest.flatten(batch)
        keys = sorted(self.local)
        values = []
        self._last_gather = None
        for key in keys:
            for r in self.members[key]:
                with tf.device(r.device):
                    values += [self._whole(r, j) for j in range(len(r.trainable))]
                    values += [tf.identity(v.value) for v in r.non_trainable]
        if self._passes is None:
            # Without tf.function's ordering of stateful ops in program order: its chain of
            # the passes' timestamps (stateful, no resource) would make every pass wait for
            # the one built before it, on every stage, and the stages would take turns.
            # Here only the schedule's own dependencies order them (transport.py's reason).
            specs = [tf.TensorSpec(t.shape, t.dtype) for t in [*flat, *values]]
            structure = batch
            self._passes = tf.compat.v1.wrap_function(
                lambda *args: self._all_passes(structure, len(flat), keys, args), specs
            )
        outputs = list(self._passes(*flat, *values))
        results: dict[tuple[tuple[int, int], int], _Result] = {}
        at = 0
        for key in keys:
            for r in self.members[key]:
                grads = []
                for j, sparse in enumerate(self.sparse[key, r.member]):
                    if sparse:
                        # A tensor: Keras's sparse ops (RMSprop's divide) read its dtype.
                        # The shape of what the replica reads (under zero3 it holds a slice
                        # of it).
                        shape = tf.constant(np.asarray(self._read_shape(r, j), np.int64))
                        grads.append(tf.IndexedSlices(outputs[at], outputs[at + 1], shape))
                        at += 2
                    else:
                        grads.append(outputs[at])
                        at += 1
                statistics = outputs[at : at + len(r.non_trainable)]
                at += len(r.non_trainable)
                results[key, r.member] = _Result(grads, statistics, None)
            results[key, 0].times = outputs[at]
            at += 1
        count = None
        if self.counted:  # the step's count over its micro-batches and pipelines
            count, at = outputs[at], at + 1
        state = outputs[at:]
        updates = self._update(results, count)
        with tf.control_dependencies(updates):
            state = [tf.identity(s) for s in state]
        times = {f"{p}_{s}": results[(p, s), 0].times for p, s in keys}
        return state, times

    def _read_shape(self, r: StageReplica, j: int) -> tuple[int, ...]:
        """The shape of `r`'s j-th weight as the step reads it: the weight's, or a
        tensor-parallel part's (under zero3 the replica holds a slice of it)."""
        return self.runner.held_shape(r.stage.trainable[j])

    def _whole(self, r: StageReplica, j: int) -> tf.Tensor:
        """Replica `r`'s j-th weight for this step's passes: under zero3, a sliced weight
        gathered from the slices of its stage's replicas (one per pipeline)."""
        weight = r.trainable[j]
        if self.runner.shard != "zero3" or r.slices[j] is None:
            return tf.identity(weight.value)
        return self._gathered(r, j)

    def _gathered(self, r: StageReplica, j: int) -> tf.Tensor:
        """Replica `r`'s j-th weight put together from its stage's replicas' slices of it:
        copies between this process's devices, or the stage's ring between processes."""
        runner = self.runner
        shape = runner.held_shape(r.stage.trainable[j])
        count = runner.pipelines
        if not runner.whole_stages:
            size = slice_size(shape, count)
            bounds = [(k * size, (k + 1) * size) for k in range(count)]
            ring = runner.ring_of(r)
            # One gather at a time: each holds its chunks and the part they make at once,
            # so gathers all in flight would hold every part twice (FSDP limits its
            # gathers in flight too).
            after = [] if self._last_gather is None else [self._last_gather]
            with tf.control_dependencies(after):
                mine = tf.identity(r.slices[j].value)
            whole = ring.all_gather(mine, bounds)
            self._last_gather = whole
            return joined([whole], shape)
        holder = {piece_of(q, count): q for q in range(count)}
        members = [self.members[holder[k], r.stage.index][r.member] for k in range(count)]
        pieces = [member.slices[j].value for member in members]
        return joined(pieces, shape)

    def _all_passes(self, structure, batch_length: int, keys, args) -> list[tf.Tensor]:
        """Every pass of this process's stage replicas, in the schedule's order per stage.

        Takes the batch (flattened) and each replica's weights and statistics; returns per
        replica its weight gradients (summed over the micro-batches), its statistics after
        the last forward pass, its passes' [start, end] times; then the metric state.
        """
        batch = tf.nest.pack_sequence_as(structure, list(args[:batch_length]))
        given, at = {}, batch_length
        for key in keys:
            weights, statistics = [], []
            for r in self.members[key]:
                counts = len(r.trainable), len(r.non_trainable)
                weights.append(list(args[at : at + counts[0]]))
                statistics.append(list(args[at + counts[0] : at + sum(counts)]))
                at += sum(counts)
            group = len(weights) > 1
            given[key] = StageInput(
                self.local[key].device, weights if group else weights[0],
                statistics if group else statistics[0], group,
            )  # fmt: skip
        state = [tf.zeros(v.shape, v.dtype) for v in self.runner.metric_variables]
        with self.tensor.traced() if self.tensor else contextlib.nullcontext():
            step = self.executor.run(batch, given, state)
        self.names = {f"{p}_{s}": step.stages[p, s].names for p, s in keys}
        outputs = []
        for key in keys:
            own, group = step.stages[key], given[key].group
            weights = given[key].weights if group else [given[key].weights]
            per_member = own.grads if group else [own.grads]
            member_statistics = own.statistics if group else [own.statistics]
            for r, member_grads, member_weights, member_stats in zip(
                self.members[key], per_member, weights, member_statistics, strict=True
            ):
                grads = [
                    _no_rows(w) if g is None else g
                    for g, w in zip(member_grads, member_weights, strict=True)
                ]
                # A sparse gradient (an Embedding's rows) leaves the program as its values
                # and indices; `step` makes it an IndexedSlices again.
                self.sparse[key, r.member] = [isinstance(g, tf.IndexedSlices) for g in grads]
                for g in grads:
                    outputs += [g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g]
                outputs += list(member_stats)
            outputs.append(own.times)
        self.counted = step.count is not None
        if self.counted:
            outputs.append(step.count)
        outputs += step.state
        return self.links.after_sends(outputs)

    def _update(self, results: dict, count=None) -> list[tf.Tensor]:
        """Each replica's gradients summed over the stages that hold the weight (tied
        weights) and averaged over the pipelines, then one optimizer step. With `count`
        (the step's count of unmasked elements), the summed gradients are of the loss's
        sums: divided by it instead."""
        runner, pipelines = self.runner, self.runner.pipelines
        user = self.model.optimizer
        # The user's optimizer counts the steps (callbacks read its iterations) and gives
        # each step's rate: a callback may have changed it since the last step.
        step = tf.identity(user.iterations.value)
        learning_rate = optimizer_copies.learning_rate_at(user, step)
        done = []
        for ((pipeline, index), member), result in results.items():
            r = self.members[pipeline, index][member]
            if not runner.whole_stages:
                grads = self._summed_members(results, r, index)
                grads = self._summed_between_processes(r, grads)
            else:  # every replica of the stage is on a device here
                with tf.device(r.device):
                    grads = [self._summed_here(results, r, i, index) for i in r.stage.trainable]
            if count is not None:
                grads = [_scaled(g, 1.0 / count) for g in grads]
            elif pipelines > 1:
                grads = [_scaled(g, 1.0 / pipelines) for g in grads]
            with tf.device(r.device):
                done.append(_apply(r.optimizer, grads, r.updated, step, learning_rate))
                for variable, value in zip(r.non_trainable, result.statistics, strict=True):
                    variable.assign(value)
        if runner.shard in ("zero1", "zero2"):
            with tf.control_dependencies(done):
                done += self._gathered_back()
        with tf.control_dependencies(done):
            done.append(user.iterations.assign_add(1))
        return done

    def _summed_here(self, results, r: StageReplica, i: int, index: int):
        """Weight `i`'s gradient for replica `r` (of stage `index`), in one process: summed
        over the pipelines and the stages holding it (and a tensor group's members holding
        the same part: every member, for a weight held whole). Under shard_optimizer, the
        replica's slice of that sum: zero2 and zero3 sum only their slices of each gradient
        (the reduce-scatter's sums), zero1 slices the whole sum (the all-reduce's); the
        same numbers either way."""
        runner = self.runner
        members = [0]
        if runner.placements is not None:
            placement = runner.placements[i]
            part = placement.index(r.member)
            members = [k for k in range(runner.tensor) if placement.index(k) == part]
        grads = [
            results[(q, s), k].grads[runner.stages[s].trainable.index(i)]
            for q in range(runner.pipelines)
            for s in runner.tied.get(i, (index,))
            for k in members
        ]
        if i not in runner.sliced:
            return functools.reduce(sums.added, grads)
        pieces, k = runner.pipelines, piece_of(r.pipeline, runner.pipelines)
        shape = runner.held_shape(i)
        if runner.shard == "zero1":
            return flat_slice(functools.reduce(sums.added, grads), pieces, k, shape)
        return functools.reduce(sums.added, [flat_slice(g, pieces, k, shape) for g in grads])

    def _summed_members(self, results, r: StageReplica, index: int) -> list:
        """Replica `r`'s gradients (of stage `index`), each summed over the members of its
        tensor group that hold the same part (every member, for a weight held whole: each
        member's gradient counts its own rows): what its ring then sums over the
        pipelines."""
        runner = self.runner
        own = results[(r.pipeline, index), r.member].grads
        if runner.placements is None:
            return list(own)
        out = []
        for j, i in enumerate(r.stage.trainable):
            placement = runner.placements[i]
            part = placement.index(r.member)
            members = [k for k in range(runner.tensor) if placement.index(k) == part]
            grads = [results[(r.pipeline, index), k].grads[j] for k in members]
            out.append(functools.reduce(sums.added, grads))
        return out

    def _gathered_back(self) -> list:
        """zero1 and zero2: each replica's whole weights again, from the updated slices of
        its stage's replicas (the all-gather)."""
        written = []
        for r in (member for members in self.members.values() for member in members):
            for j, variable in enumerate(r.trainable):
                if r.slices[j] is not None:
                    with tf.device(r.device):
                        written.append(variable.assign(self._gathered(r, j)))
        return written

    def _summed_between_processes(self, r: StageReplica, grads: list) -> list:
        """`grads` summed over the pipelines' replicas of this stage (a ring per stage), and
        a shared weight's over every replica of the stages that hold it (a ring per set of
        holders). Rows looked up by the batch travel as rows (one device's tape keeps each
        lookup's row apart, and Adam squares each apart); other gradients travel dense.
        Under shard_optimizer a sliced weight's gradient comes back as this replica's slice
        of the sum: zero2 and zero3 reduce-scatter it over the stage's ring (a tied weight's,
        and zero1's, is sliced from the whole sum)."""
        runner = self.runner
        out = list(grads)
        count = runner.pipelines
        piece = piece_of(r.pipeline, count)
        scatter = {
            j for j, i in enumerate(r.stage.trainable)
            if i in runner.sliced and runner.shard != "zero1" and i not in runner.tied
        }  # fmt: skip
        scattered: set[int] = set()  # came back from the ring as this replica's slice
        last = None  # the last reduce-scatter made
        # holders -> positions in `grads`, in the model's order of the weights: every member
        # of a ring passes the same weights in the same order (stages may list shared weights
        # in orders of their own)
        groups: dict[tuple[int, ...], list[int]] = {}
        for j, i in sorted(enumerate(r.stage.trainable), key=lambda pair: pair[1]):
            groups.setdefault(runner.tied.get(i, ()), []).append(j)
        for holders, positions in groups.items():
            if not holders and runner.pipelines == 1:
                continue
            ring = runner.ring_of(r, holders)
            rows = [j for j in positions if self._as_rows(r.stage.trainable[j], grads[j])]
            dense = [j for j in positions if j not in rows and j not in scatter]
            if dense:
                summed = ring.all_reduce_many([tf.convert_to_tensor(grads[j]) for j in dense])
                for j, g in zip(dense, summed, strict=True):
                    out[j] = g
            for j in rows:
                out[j] = ring.all_gather_rows(_as_slices(grads[j]))
            for j in sorted(scatter.intersection(positions) - set(rows)):
                shape = runner.held_shape(r.stage.trainable[j])
                size = slice_size(shape, count)
                flat = tf.reshape(tf.convert_to_tensor(grads[j]), [-1])
                padding = size * count - int(np.prod(shape))
                if padding:
                    flat = tf.pad(flat, [[0, padding]])
                # One at a time, as the gathers (_gathered): each holds its chunks' sums.
                after = [] if last is None else [last]
                with tf.control_dependencies(after):
                    flat = tf.identity(flat)
                out[j] = last = ring.reduce_scatter(
                    flat, [(k * size, (k + 1) * size) for k in range(count)]
                )
                scattered.add(j)
        for j, i in enumerate(r.stage.trainable):
            if i in runner.sliced and j not in scattered:
                shape = runner.held_shape(i)
                out[j] = flat_slice(out[j], count, piece, shape)
        return out

    def _as_rows(self, i: int, g) -> bool:
        """Whether weight `i`'s gradient crosses the processes as rows. The members of a
        ring must agree: for a weight several stages hold, the stages' probe decided
        (tied.shared), the same on every process; a stage's own weight is decided by its
        gradient, which every replica of the stage traces alike."""
        shared = self.runner.shared.get(i)
        if shared is not None:
            return shared.rows
        return isinstance(g, tf.IndexedSlices) and not sparse_rows.batch_independent(g.indices)


def _as_slices(g) -> tf.IndexedSlices:
    """`g` as rows: a dense gradient as every row of its weight once (the same update)."""
    if isinstance(g, tf.IndexedSlices):
        return g
    g = tf.convert_to_tensor(g)
    return tf.IndexedSlices(g, tf.range(tf.shape(g, out_type=tf.int64)[0]), tf.shape(g, tf.int64))


def _no_rows(weight) -> tf.Tensor | tf.IndexedSlices:
    """The gradient of a weight this stage holds but does not use (a tied layer's weight
    another stage reads): no rows, so that added to the other holder's sparse rows it keeps
    them apart as one device's tape does (dense zeros would sum them: Adam then squares
    each token's rows together, 0.03 from one device on keras-hub's Llama)."""
    if weight.shape.rank == 0:
        return tf.zeros_like(weight)
    return tf.IndexedSlices(
        tf.zeros([0, *weight.shape[1:]], weight.dtype),
        tf.zeros([0], tf.int64),
        tf.constant(weight.shape.as_list(), tf.int64),
    )


def _scaled(g, factor: float):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape
        )
    return g * tf.cast(factor, g.dtype)


def _apply(optimizer, grads, variables, step, learning_rate) -> tf.Tensor:
    """One step of a stage's optimizer copy: the user's `step` (Adam's bias correction reads
    it) at the user's `learning_rate`."""
    optimizer.iterations.assign(tf.cast(step, optimizer.iterations.dtype))
    optimizer_copies.update_step(
        optimizer, grads, variables, learning_rate=learning_rate,
        weight_decay=optimizer.weight_decay or 0.0,
    )  # fmt: skip
    return optimizer.iterations.assign_add(1)

"""Pipeline parallelism: a Keras model cut into stages that train their micro-batches in turn.

    with strategy.scope():                 # mirrored over 4 devices, or 4 worker processes
        model = build_model(); model.compile("adam", "sparse_categorical_crossentropy",
                                             metrics=["accuracy"])
    tfdist.fit(model, dataset, epochs=3,
               pipeline=tfdist.parallel.Pipeline(cut_before=["block_2", "block_3", "head"],
                                                 micro_batches=4, schedule="1f1b"))

The strategy's replicas form a grid of D pipelines x S stages: replica r holds stage r % S
of pipeline r // S (4 replicas and 2 stages: 2 pipelines, data parallel). Each step, pipeline
p takes its 1/D of the global batch as M micro-batches; each stage runs its forward and
backward passes in the order the schedule gives (schedules.py), activations going forward
and their gradients backward, between devices in one program or between worker processes
over TensorFlow's point-to-point collective transfers. A stage sums its weights' gradients
over the micro-batches, averages them over the D pipelines (a ring all-reduce among the
stage's replicas), and takes one optimizer step: the step the unsplit model takes on the
whole batch, up to floating point (tests/test_pipeline.py checks it after 5 steps).

Where things live. Each stage's weights, the state of its optimizer (a copy of the user's,
same class and config) and its activations live on the stage's device, in variables of
tfdist's own, and nowhere else: no process holds the whole model. When fit first starts,
each weight's value moves into the stage replicas that hold it and its whole copy (built in
`Pipeline.scope(strategy)`, in host memory, or mirrored under `strategy.scope()`) is
dropped, one weight at a time; the user's optimizer is built with no slots of its own. From
then on the storage of each Keras weight and each of the user's slots is its stage's (see
_Home): evaluation, callbacks, checkpoints, `get_weights` and `model.save` read the one
Keras model, one variable at a time (across worker processes, from the process whose
stage holds it: a collective every process makes, as every process saves), and a restore
lands in the stages. Only BatchNormalization's statistics are written back, at each epoch's
end and before each save. The loss is the compiled one (with its loss weights and sample
weights), plus each stage's regularisation losses; the metrics are the compiled ones,
updated on the last stage.

A stage after the first reads the model's inputs it uses (a padding mask every decoder
block takes) from the batch, as the first stage does. A weight used by several stages (an
embedding tied to the output logits, as keras-hub's causal LMs have) is held by each of
them, with optimizer state of its own; its gradient is summed over them (and over the
pipelines), so the copies take the same steps and stay equal (Megatron-LM's tied
embeddings).

Limits (each refused with a message): models with their own `train_step` (a pipeline runs
the layer graph, not the step), global_clipnorm (a norm over every stage), loss scaling,
StepHooks (accumulation is the micro-batches already; sharded state is per stage already).
BatchNormalization normalises each micro-batch by its own statistics, as in GPipe; M = 1
matches the unsplit model exactly.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import logging
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.collective.keys import block, group_key_base
from tfdist.collective.transport import ProcessLinks, ProcessRing, Transfers
from tfdist.errors import FitError
from tfdist.parallel import units, updates
from tfdist.parallel.host import host_device, host_scope
from tfdist.parallel.schedules import SCHEDULES, Pass, schedule, simulate
from tfdist.parallel.stages import Stage, StageError, devices_for, split, tied
from tfdist.strategies import needs_coordinator
from tfdist.training import loss_normalisation, shards
from tfdist.training.fit_data import FitData, unpack
from tfdist.training.memory import nbytes
from tfdist.training.runner import StepHook
from tfdist.training.runners.common import batch_size, logs_from_state
from tfdist.training.runners.sync import SyncRunner
from tfdist.training.steps import custom_train_step

log = logging.getLogger(__name__)

# Group keys of the stage-to-stage links (one 2-member group per neighbouring pair); the
# rings that average a stage's gradients over the pipelines (a block of 1000 keys per
# stage) and those that sum a tied weight's gradients over the stages holding it (one block
# per set of holders) take blocks of their ranges; collective/keys.py holds every range.
LINK_GROUP_KEY_BASE = group_key_base("pipeline_links")

# The stages write the model back in buckets of this many bytes of float64 sums (a larger
# variable alone): what the epoch's end adds to a process's peak. Every weight and slot at
# once made that peak 21.6x the weights (tools/peak_bench.py); 4 MiB buckets, 5.5x.
SETTLE_BUCKET_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """How `tfdist.fit(..., pipeline=...)` cuts and schedules the model.

    Args:
      cut_before: names of the layers where stages 1, 2, ... begin (stage 0 starts at the
        inputs), in the order the data reaches them; None for a model made by
        `tfdist.parallel.chain` (cut between its stage models). The strategy's replicas must
        be a multiple of the stages: the multiple is the number of data-parallel pipelines.
      micro_batches: M, the micro-batches each pipeline's share of a batch is cut into
        (it must divide that share). More shrinks the bubble, (S-1)/(M+S-1).
      schedule: 'gpipe' (every forward, then every backward: M micro-batches' activations
        held), '1f1b' (a forward and a backward in turn: at most S-s held on stage s) or
        'interleaved' (1F1B over `chunks_per_device` stages per device: the bubble falls to
        (S-1)/(vM+S-1); M a multiple of the devices per pipeline; local devices only).
      chunks_per_device: v, the stages each device holds under the interleaved schedule:
        the model is cut into S*v stages and device d of a pipeline holds stages d, d+S, ...
      timeout_seconds: how long a transfer between worker processes may wait for its peer
        (None: forever), so a lost stage ends the step with an error instead of a hang.

    Raises:
      ValueError: an option out of range.
    """

    cut_before: tuple[str, ...] | None = None
    micro_batches: int = 1
    schedule: str = "1f1b"
    timeout_seconds: float | None = None
    chunks_per_device: int = 1

    def __post_init__(self):
        m, v = self.micro_batches, self.chunks_per_device
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"micro_batches must be a whole number >= 1. Received: {m!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULES)}. Received: {self.schedule!r}"
            )
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"chunks_per_device must be a whole number >= 1. Received: {v!r}")
        if v > 1 and self.schedule != "interleaved":
            raise ValueError(
                "chunks_per_device applies to schedule='interleaved' (each device holds several "
                f"stages); {self.schedule!r} holds one stage per device. Received: "
                f"chunks_per_device={v}"
            )
        if self.cut_before is not None:
            if isinstance(self.cut_before, str):
                raise ValueError(
                    f"cut_before is a list of layer names. Received: the string {self.cut_before!r}"
                )
            object.__setattr__(self, "cut_before", tuple(self.cut_before))

    def scope(self, strategy: tf.distribute.Strategy):
        """Build and compile the model here, in place of `strategy.scope()`, and each device
        holds only its stage: the model's weights are made once, in this host's memory, not
        mirrored on every replica's device (tfdist.host_scope), and move into the stages
        when fit begins, the host's copy dropped (the optimizer's state is made in the
        stages only).

            with pipeline.scope(strategy):
                model = build_model()
                model.compile("adam", "sparse_categorical_crossentropy")
            tfdist.fit(model, dataset, pipeline=pipeline)
        """
        return host_scope(strategy)

    def runner(self, model: keras.Model, strategy: tf.distribute.Strategy):
        """The runner tfdist.fit trains `model` with (not yet built): under
        parameter_server, each worker's replica split over its devices (downpour.py)."""
        recomputed = units.recomputed(model)
        if recomputed:
            # Its stages call the layers on weight values (stateless calls), which a unit's
            # custom gradient would not differentiate: not built yet.
            raise FitError(
                f"A Pipeline does not recompute activations yet (the layer "
                f"{recomputed[0].name!r} was made a recomputed unit, by "
                "tfdist.parallel.recompute_activations or keras.RematScope): it keeps each "
                "micro-batch's activations as its schedule says. Build the model without "
                "them, or use shard_optimizer='zero3', which recomputes each unit. "
                f"Received: {len(recomputed)} recomputed layer(s)"
            )
        if needs_coordinator(strategy):  # parameter_server: a replica per worker, split
            from tfdist.parallel.downpour import SplitReplicaRunner

            return SplitReplicaRunner(model, strategy, self)
        return PipelineRunner(model, strategy, self)


@dataclasses.dataclass
class _StageReplica:
    """One replica of one stage: its place, its weights and its optimizer (on its device)."""

    stage: Stage
    pipeline: int
    device: str
    trainable: list[keras.Variable]
    non_trainable: list[keras.Variable]
    optimizer: keras.optimizers.Optimizer | None  # built once the weights have moved in


class PipelineRunner(SyncRunner):
    """Trains a model cut into pipeline stages (see the module docstring).

    Evaluation, the chief, agreement between workers and failure messages are the
    synchronous runner's: the model's weights read from the stages (see _Home).
    """

    builds_optimizer = False  # its slots are the stages' (see _Home)

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy, options: Pipeline):
        super().__init__(model, strategy)
        self.options = options
        self.stages: list[Stage] = []
        self.replicas: list[_StageReplica] = []  # this process's
        self.pipelines = 1
        self.devices_per_pipeline = 1
        self._state: list[np.ndarray] = []
        self._programs: dict[int, _StepProgram] = {}
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._loaded = False
        self.tied: dict[int, tuple[int, ...]] = {}  # weight -> the stages holding it
        # By stage (its pipelines' replicas) and by a tied weight's holders (theirs).
        self._rings: dict[int | tuple[int, ...], ProcessRing] = {}
        # Between worker processes: activations forward, their gradients back. TensorFlow's
        # collective runtime remembers each instance key's shape for the life of the
        # process, so each step program (one per micro-batch size) takes keys of its own.
        self.links = ProcessLinks(
            group_key_base=LINK_GROUP_KEY_BASE, timeout_seconds=options.timeout_seconds
        )
        self.last_passes: dict[tuple[int, int], list[tuple[str, float, float]]] = {}

    # --- building -------------------------------------------------------------------------------

    @property
    def processes(self) -> int:
        return self.placement.processes

    def build(self, sample_batch, step_hooks: Sequence[StepHook] = ()) -> None:
        model, options = self.model, self.options
        if step_hooks:
            raise FitError(
                "A pipeline takes no step hooks: its micro-batches already accumulate "
                "gradients (drop accumulate_steps), and each stage keeps only its own "
                "optimizer state (drop shard_optimizer). "
                f"Received: {', '.join(h.name for h in step_hooks)}"
            )
        if custom_train_step(model):
            raise FitError(
                f"Model {model.name!r} has its own train_step, which runs the whole model at "
                "once; a pipeline runs its layers stage by stage with the compiled loss and "
                "metrics. Move the step's logic into compile()'s loss and metrics, or train "
                "without pipeline=. Received: a model with train_step overridden"
            )
        updates.check_copyable(model.optimizer, who="A pipeline's stages")
        super().build(sample_batch)  # all but the optimizer's slots, which the stages keep
        home = _Home.of(model)
        if home is not None and home.key == self._home_key():
            # A later fit on the same layout: its stages go on with their weights and slots.
            self.stages, self.tied, self.replicas = home.stages, home.tied, home.replicas
            self._grid()
        else:
            self.stages = split(model, options.cut_before)
            self.tied = tied(self.stages)
            self._place(*self._grid())
            held = sum(nbytes(v) or 0 for r in self.replicas for v in r.trainable)
            whole = sum(nbytes(v) or 0 for v in model.trainable_variables)
            log.info(
                "The stages hold the model's weights (%.1f MB here of %.1f MB) and their "
                "optimizer's state; no process holds the whole model.",
                held / 2**20,
                whole / 2**20,
            )
        if self.tied:
            names = sorted({model.trainable_variables[i].path for i in self.tied})
            log.info(
                "Weights used by several stages (tied) are held by each of them, their "
                "gradients summed: %s",
                ", ".join(names),
            )
        self._rings = self._make_rings()
        self._state = self._zeros()

    def _home_key(self) -> tuple:
        options = self.options
        return (options.cut_before, options.chunks_per_device, self.placement)

    def _grid(self) -> tuple[list[int], dict[int, str]]:
        """Sets the pipelines and the devices each takes; returns this process's ranks
        (pipeline p's stage k is rank p * stages + k) and each rank's device."""
        stages, layout = self.stages, self.placement
        devices = list(layout.devices)
        processes = layout.processes
        replicas = layout.replicas
        if processes > 1 and len(devices) > 1:
            raise FitError(
                "A pipeline across worker processes takes one device per process (stage "
                f"replicas are processes); this job has {processes} processes with "
                f"{len(devices)} devices each. Run one process per device. "
                f"Received: {replicas} replicas"
            )
        chunks = self.options.chunks_per_device
        width = devices_for(len(stages), chunks, self.options.micro_batches, holder="a pipeline's")
        if chunks > 1 and processes > 1:
            raise FitError(
                "The interleaved schedule runs over one process's devices (each device holds "
                f"{chunks} stages); this job has {processes} worker processes. Use "
                "schedule='1f1b' across processes. Received: chunks_per_device="
                f"{chunks}"
            )
        self.devices_per_pipeline = width
        if replicas % width:
            raise StageError(
                f"{len(stages)} stages need a multiple of {width} replicas (D pipelines x "
                f"{width} devices); the strategy has {replicas}. Cut the model into a "
                "number of stages that divides the replicas, or change the devices/workers. "
                f"Received: {len(stages)} stages over {replicas} replicas"
            )
        self.pipelines = replicas // width
        if processes > 1:
            ranks = [layout.process_index]
            devices = {ranks[0]: devices[0]}
        else:
            # Pipeline p's stage k: its device is p's (k mod width)-th (interleaved: each
            # device holds the stages k, k + width, ...).
            ranks = list(range(self.pipelines * len(stages)))
            devices = {
                rank: devices[(rank // len(stages)) * width + (rank % len(stages)) % width]
                for rank in ranks
            }
        return ranks, devices

    def _place(self, ranks: list[int], devices: dict[int, str]) -> None:
        """Makes this process's stage replicas and moves the model's weights and its
        optimizer's slots into them (see _Home)."""
        stages = self.stages
        trainable = self.model.trainable_variables
        non_trainable = self.model.non_trainable_variables

        def make():
            made = []
            for rank in ranks:
                pipeline, index = divmod(rank, len(stages))
                stage, device = stages[index], devices[rank]
                with tf.device(device):
                    # Named as the model's own (its path's '/' as '_'), so the optimizer
                    # copy's slots are named as the user's optimizer's for the same weight.
                    copies = [_copy(trainable[i]) for i in stage.trainable]
                    statistics = [_copy(non_trainable[i]) for i in stage.non_trainable]
                made.append(_StageReplica(stage, pipeline, device, copies, statistics, None))
            return made

        self.replicas = updates.outside_strategy(make)
        home = _Home(self._home_key(), self, self.replicas)
        user = self.model.optimizer
        empty: list[tf.Variable] = []  # the slots made without a value, if it builds now
        if not user.built:  # its slots made empty: each is given its stage's below

            def outside(build):
                def run():
                    with _empty_variables() as made:  # in the thread that builds
                        build()
                    empty.extend(made)

                return updates.outside_strategy(run)

            compat.build_optimizer_plainly(user, trainable, host_device(self.strategy), outside)
        # The weights move into the stages first, each whole copy dropped as it goes, then
        # the stages' optimizers are built: the whole model and the slots never coexist.
        home.take_weights(self.model)

        def build_optimizers():
            for r in self.replicas:
                with tf.device(r.device):
                    r.optimizer = updates.optimizer_copy(user, r.trainable)

        updates.outside_strategy(build_optimizers)
        home.take_slots(self.model, fresh={id(v) for v in empty})

    def _make_rings(self) -> dict:
        """Between worker processes: a ring per stage over its pipelines' replicas, and one
        per set of stages holding a tied weight."""
        rings: dict[int | tuple[int, ...], ProcessRing] = {}
        if self.processes == 1:
            return rings
        for r in self.replicas:
            rings[r.stage.index] = ProcessRing(
                rank=r.pipeline,
                ranks=self.pipelines,
                timeout_seconds=self.options.timeout_seconds,
                group_key_base=block("pipeline_stage_rings", r.stage.index, size=1000),
            )
        # A tied weight's gradient is summed over every replica of the stages holding it:
        # one ring per set of holders, over the pipelines x holders processes.
        for k, holders in enumerate(sorted(set(self.tied.values()))):
            for r in self.replicas:
                if r.stage.index in holders:
                    rings[holders] = ProcessRing(
                        rank=r.pipeline * len(holders) + holders.index(r.stage.index),
                        ranks=self.pipelines * len(holders),
                        timeout_seconds=self.options.timeout_seconds,
                        group_key_base=block("pipeline_tied_rings", k, size=1000),
                    )
        return rings

    def checkpoint_shards(self) -> shards.Shards:
        return _Home.of(self.model)

    def check_callbacks(self, callbacks) -> None:
        super().check_callbacks(callbacks)
        for callback in callbacks:
            if isinstance(callback, keras.callbacks.BackupAndRestore) and isinstance(
                callback.save_freq, int
            ):
                raise FitError(
                    "Under a pipeline the stages keep the statistics (BatchNormalization's) "
                    "while an epoch trains and write them into the model at its end; "
                    "BackupAndRestore with save_freq=<steps> would back up stale ones. Use "
                    "save_freq='epoch', or tfdist.StepCheckpoint, which settles the stages "
                    f"before it saves. Received: save_freq={callback.save_freq}"
                )

    # --- data -------------------------------------------------------------------------------------

    def iterator(self, data: FitData, *, skip: int = 0):
        if data.dataset is None:
            raise FitError(
                "A pipeline feeds each stage from the global batches, so it takes a dataset "
                "batched with the global batch (or arrays with batch_size), not a dataset_fn. "
                "Received: a dataset_fn"
            )
        dataset = data.dataset.skip(skip) if skip else data.dataset
        return iter(dataset)

    def _split_batch(self, batch) -> int:
        size = int(batch_size(unpack(batch)[0]))
        parts = self.pipelines * self.options.micro_batches
        if size % parts:
            raise FitError(
                f"A batch of {size} examples does not split into {self.pipelines} pipeline(s) "
                f"x {self.options.micro_batches} micro-batches: make the global batch a "
                f"multiple of {parts} (and batch with drop_remainder=True, or give "
                "steps_per_epoch, so the last batch is full too). "
                f"Received: micro_batches={self.options.micro_batches}, batch of {size}"
            )
        return size // parts

    # --- training ---------------------------------------------------------------------------------

    def begin(self, global_step: int, *, total_steps=None, checkpoint_status=None) -> None:
        super().begin(global_step, total_steps=total_steps, checkpoint_status=checkpoint_status)
        self._loaded = False  # callbacks may have restored the model: load it into the stages

    def train(self, iterator, n: int, *, bounded: bool, logs: str | None):
        with self.explained():
            if not self._loaded:
                self._load()
            done = 0
            while done < n:
                batch = iterator.get_next_as_optional()
                if not batch.has_value():
                    break
                batch = batch.get_value()
                micro = self._split_batch(batch)
                program = self._program(micro)
                # In a thread of its own, outside any strategy's scope (scopes are per
                # thread): under one, Keras would scale the compiled loss by the replicas.
                if self._thread is None:
                    self._thread = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="tfdist-pipeline"
                    )
                state, times = self._thread.submit(program.function, batch).result()
                self._state = [a + np.asarray(b) for a, b in zip(self._state, state, strict=True)]
                self.last_passes = program.passes(times)
                done += 1
            return done, (self._read(logs) if logs and done else None)

    def _program(self, micro: int) -> _StepProgram:
        if micro not in self._programs:
            self._programs[micro] = _StepProgram(self, micro)
        return self._programs[micro]

    def _zeros(self) -> list[np.ndarray]:
        return [np.zeros(v.shape, v.dtype) for v in self.metric_variables]

    def reset(self) -> None:
        super().reset()
        self._state = self._zeros()

    def _read(self, scope: str) -> dict[str, float]:
        if scope == "local" or self.processes == 1:
            return logs_from_state(self.model, self.metric_variables, self._state)
        return self.logs()

    def logs(self) -> dict[str, float]:
        state = self._state
        if self.processes > 1:
            state = self._summed_over_workers(state)
        return logs_from_state(self.model, self.metric_variables, state)

    def _summed_over_workers(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Each array summed over every worker process (a collective: all call it)."""
        flat = np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays] or [[]])
        strategy = self.strategy
        with self.explained():
            values = strategy.experimental_distribute_values_from_function(
                lambda _: tf.constant(flat)
            )
            total = strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None).numpy()
        out, at = [], 0
        for a in arrays:
            size = int(np.prod(np.shape(a)))
            out.append(total[at : at + size].reshape(np.shape(a)).astype(np.asarray(a).dtype))
            at += size
        return out

    def step_times(self) -> dict[str, float] | None:
        return None

    # --- the whole model and the stages -----------------------------------------------------------

    def _load(self) -> None:
        """The stages take the model's statistics (BatchNormalization's): its weights and
        its optimizer's slots are the stages' own already (see _Home)."""
        non_trainable = self.model.non_trainable_variables
        for r in self.replicas:
            for copy, i in zip(r.non_trainable, r.stage.non_trainable, strict=True):
                copy.assign(non_trainable[i].value)
        self._loaded = True

    def settle(self) -> None:
        """Writes the stages' statistics into the model, on every replica (a collective
        across worker processes); the weights and slots are read from the stages where
        they are read, so nothing else is written back."""
        if self._thread is not None:  # made again if training goes on
            self._thread.shutdown()
            self._thread = None
        if not self._loaded:
            return  # nothing trained since the model was last loaded
        targets = self.model.non_trainable_variables  # the same list on every process
        held: dict[int, list] = {}  # target -> this process's copies of it
        for r in self.replicas:
            for copy, i in zip(r.non_trainable, r.stage.non_trainable, strict=True):
                held.setdefault(i, []).append(copy)
        # Each target takes the mean of every replica's copy of it (BatchNormalization's
        # statistics are averaged over the pipelines). In buckets of SETTLE_BUCKET_BYTES,
        # the same on every process: one bucket's sums exist at a time.
        for bucket in _buckets(targets, SETTLE_BUCKET_BYTES):
            sums, copies = [], np.zeros(len(bucket), np.float64)
            for j, k in enumerate(bucket):
                total = np.zeros(targets[k].shape, np.float64)
                for mine in held.get(k, []):
                    total += np.asarray(mine.value, np.float64)
                    copies[j] += 1
                sums.append(total)
            if self.processes > 1:
                *sums, copies = self._summed_over_workers([*sums, copies])
            for k, total, count in zip(bucket, sums, copies, strict=True):
                targets[k].assign((total / max(count, 1.0)).astype(targets[k].dtype))
            del sums


class _Home(shards.Shards):
    """Where a pipeline keeps a model's weights and its optimizer's slots, from the first
    fit on: in this process's stage replicas, and nowhere else.

    Each trainable weight's storage, and each of the user's optimizer's slots' (see
    compat.replace_storage), becomes a `_Staged`: reading it reads the stage replica that
    holds it (across worker processes, that replica's process sends it to every process,
    a collective all make together, as all save together); assigning it assigns every
    replica of this process that holds it. So `model.save`, `get_weights`, evaluation,
    callbacks and checkpoints see one Keras model, read one variable at a time, and a
    restore (`load_weights`, BackupAndRestore) lands in the stages. It lives as long as
    the model (its storages point here): a later fit on the same layout goes on with the
    same stage replicas, slots and all.
    """

    def __init__(self, key: tuple, runner: PipelineRunner, replicas: list[_StageReplica]):
        self.key, self.strategy, self.processes = key, runner.strategy, runner.processes
        self.stages, self.tied, self.replicas = runner.stages, runner.tied, replicas
        # By pipeline, then stage: pipeline 0's first holder of a weight is its source.
        self._ordered = sorted(replicas, key=lambda r: (r.pipeline, r.stage.index))
        self.staged: list[tuple[str, _Staged]] = []  # by checkpoint key (shards.py)
        self._placeholders: dict[tf.DType, tf.Variable] = {}
        self._sent = tf.function(self._send_part, reduce_retracing=True)

    @staticmethod
    def of(model: keras.Model) -> _Home | None:
        for variable in model.trainable_variables:
            storage = compat.storage_of(variable)
            if isinstance(storage, _Staged):
                return storage.home
        return None

    # --- which replica holds what ---------------------------------------------------------

    def holding(self, i: int) -> tuple[int, ...]:
        """The stages that hold trainable weight `i` (several for a tied weight)."""
        return self.tied.get(i) or tuple(s.index for s in self.stages if i in s.trainable)

    def source(self, i: int) -> bool:
        """Whether this process sends weight `i` (and its slots) where it is read: it holds
        pipeline 0's first stage holding it. In one process every stage is here."""
        if self.processes == 1:
            return True
        r = self.replicas[0]
        return r.pipeline == 0 and r.stage.index == min(self.holding(i))

    def copies(self, i: int, slot: str | None = None) -> list[keras.Variable]:
        """This process's replicas' copies of weight `i` (or of its slot named `slot`),
        the source's first."""
        out = []
        for r in self._ordered:
            if i not in r.stage.trainable:
                continue
            if slot is None:
                out.append(r.trainable[r.stage.trainable.index(i)])
            else:  # none where the stage's optimizer keeps no such slot
                out += [v for v in r.optimizer.variables if v.name == slot][:1]
        return out

    # --- moving in --------------------------------------------------------------------------

    def take_weights(self, model: keras.Model) -> None:
        """Each trainable weight's value moves into its stage replicas and its whole copy
        is dropped, one weight at a time."""
        for i, weight in enumerate(model.trainable_variables):
            self._take(weight, i, self.copies(i), shards.weight_key(i))
        compat.forget_traced_functions(model)  # they read the whole copies
        gc.collect()  # the whole copies sit in reference cycles: freed now

    def take_slots(self, model: keras.Model, fresh: set[int]) -> None:
        """The same for the user's optimizer's slots, matched to the stage optimizers' by
        name (a copy's slots are named after the weight, as the user's are). A slot whose
        storage is in `fresh` (ids) was made without a value: the stage's slot, built by the
        same optimizer, starts as it would."""
        user = model.optimizer
        paths = {v.path.replace("/", "_"): i for i, v in enumerate(model.trainable_variables)}
        skip = {id(user.iterations), id(getattr(user, "_learning_rate", None))}
        for slot in user.variables:
            if id(slot) in skip:
                continue
            i = _weight_of(slot.name, paths)
            copies = [] if i is None else self.copies(i, slot.name)
            if i is None or (self.copies(i) and not copies):
                raise FitError(
                    f"Cannot match the optimizer state {slot.name!r} of "
                    f"{type(user).__name__} with a weight's slot in the pipeline's stages "
                    "(its slots are not named after the weights): the stages could not "
                    f"keep it. Use a Keras optimizer. Received: {type(user).__name__}"
                )
            name = slot.name[len(model.trainable_variables[i].path) + 1 :]  # "momentum"
            self._take(slot, i, copies, shards.slot_key(i, name), fresh)
        gc.collect()

    def _take(
        self,
        variable: keras.Variable,
        i: int,
        copies: list,
        key: str,
        fresh: set[int] = frozenset(),
    ) -> None:
        old = compat.storage_of(variable)
        if not self.holding(i):
            return  # no stage reads the weight: it keeps its storage
        staged = _Staged(self, old, variable.shape, copies, self.source(i))
        # A read of a weight held in parts (another layout's stages, host_scope's slices)
        # is a collective: every process makes it.
        if id(old) not in fresh and (copies or getattr(old, "read_by_collectives", False)):
            staged.assign(tf.convert_to_tensor(old))
        compat.replace_storage(variable, staged)
        self.staged.append((key, staged))

    # --- sharded checkpoints --------------------------------------------------------------

    def entries(self) -> list[shards.Entry]:
        """This process's part of a sharded checkpoint: each weight and slot it is the
        source of, whole (each is written by one process)."""
        return [
            shards.Entry(key, tf.identity(staged.copies[0].value))
            for key, staged in self.staged
            if staged.source and staged.copies
        ]

    def wanted(self) -> list[shards.Wanted]:
        """What this process's stages read back: each weight and slot they hold."""
        return [
            shards.Wanted(key, staged.dtype, staged.assign)
            for key, staged in self.staged
            if staged.copies
        ]

    # --- reading --------------------------------------------------------------------------

    def read(self, staged: _Staged) -> tf.Tensor:
        if self.processes == 1:
            return tf.identity(staged.copies[0].value)
        context = tf.distribute.get_replica_context()
        part = self._part(staged)
        if context is not None and context.strategy is self.strategy:
            with tf.device(self.replicas[0].device):
                return context.all_reduce(tf.distribute.ReduceOp.SUM, part)
        with updates.read_together("a pipeline"):
            return self._sent(part)

    def _part(self, staged: _Staged) -> tf.Tensor:
        """What this process adds to a read across processes: the value at its source,
        zeros elsewhere (so the sum is the value, exactly)."""
        with tf.device(self.replicas[0].device):
            if staged.source:
                return tf.identity(staged.copies[0].value)
            return tf.zeros(staged.shape, staged.dtype)

    def _send_part(self, part: tf.Tensor) -> tf.Tensor:
        def replica(part):
            with tf.device(self.replicas[0].device):
                part = tf.identity(part)
                return tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, part, options=updates.read_options()
                )

        sent = self.strategy.run(replica, args=(part,))
        return self.strategy.experimental_local_results(sent)[0]

    def placeholder(self, dtype) -> tf.Variable:
        """An empty variable: the resource handle of a weight no replica here holds."""
        dtype = tf.as_dtype(dtype)
        if dtype not in self._placeholders:
            device = self.replicas[0].device

            def make():
                with tf.device(device):
                    return tf.Variable(tf.zeros([0], dtype), trainable=False)

            self._placeholders[dtype] = updates.outside_strategy(make)
        return self._placeholders[dtype]


class _Staged(updates.WholeStandIn):
    """A weight's (or a slot's) storage under a pipeline: see _Home."""

    def __init__(self, home: _Home, old, shape, copies: list[keras.Variable], source: bool):
        dtype = old.dtype  # not `old` itself: the stand-in must not keep the whole copy
        super().__init__(old, lambda: copies[0] if copies else home.placeholder(dtype))
        self.shape = tf.TensorShape(shape)
        self.home, self.copies, self.source = home, copies, source
        self.trainable = getattr(old, "trainable", True)

    def read(self) -> tf.Tensor:
        return self.home.read(self)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        del use_locking, name, read_value
        value = tf.convert_to_tensor(value, self.dtype)
        for copy in self.copies:
            copy.assign(value)


@contextlib.contextmanager
def _empty_variables():
    """While entered, each variable made is an empty placeholder (its initial value is
    made and dropped, one at a time); yields the list of those made, to be given their
    storage (compat.replace_storage). Keras's optimizers make every slot in `build`, at
    once: this keeps the user's optimizer from holding every slot whole while it is built,
    when the stages hold them."""
    made: list[tf.Variable] = []

    def creator(next_creator, **kwargs):
        value = kwargs["initial_value"]
        value = value() if callable(value) else value
        kwargs["initial_value"] = tf.zeros([0], tf.as_dtype(value.dtype).base_dtype)
        kwargs.pop("shape", None)
        made.append(next_creator(**kwargs))
        return made[-1]

    with tf.variable_creator_scope(creator):
        yield made


def _weight_of(slot: str, paths: dict[str, int]) -> int | None:
    """The weight a Keras optimizer's slot was made for: slots are named
    "<weight path, '/' as '_'>_<slot>"; the longest such path."""
    found = [p for p in paths if slot.startswith(p + "_")]
    return paths[max(found, key=len)] if found else None


def _buckets(variables: list, limit: int) -> list[list[int]]:
    """Positions of `variables` in runs of at most `limit` bytes (a larger one alone)."""
    out, size = [[]], 0
    for k, v in enumerate(variables):
        bytes_ = int(np.prod(v.shape)) * 8
        if out[-1] and size + bytes_ > limit:
            out.append([])
            size = 0
        out[-1].append(k)
        size += bytes_
    return [b for b in out if b]


@dataclasses.dataclass
class _Forward:
    """What a micro-batch's forward pass keeps for its backward pass on the same stage."""

    tape: tf.GradientTape
    inputs: Any  # what crossed the cut before the stage (the batch's share on the first)
    outputs: Any
    regularization: tf.Tensor | None  # the stage's penalty, per micro-batch
    objective: tf.Tensor | None  # the loss term to differentiate: on the last stage only


@dataclasses.dataclass
class _Passes:
    """One stage replica's state while its passes are built, in the schedule's order."""

    weights: list[tf.Tensor]
    statistics: list[tf.Tensor]  # BatchNormalization's, after the latest forward pass
    grads: list[tf.Tensor] | None = None  # the weights' gradients, summed so far
    saved: dict[int, _Forward] = dataclasses.field(default_factory=dict)  # by micro-batch
    start: tf.Tensor | None = None  # the current pass's start mark
    last_end: tf.Tensor | None = None  # the previous pass's end: one pass at a time
    times: list[tf.Tensor] = dataclasses.field(default_factory=list)  # [start, end] each
    names: list[str] = dataclasses.field(default_factory=list)  # the passes, as run


@dataclasses.dataclass
class _Result:
    """What one stage replica's passes give its update."""

    grads: list[tf.Tensor]
    statistics: list[tf.Tensor]
    times: tf.Tensor  # [passes, 2]: each pass's start and end


class _StepProgram:
    """Builds one training step of this process's stage replicas, for micro-batches of
    `micro` examples: every pass in its schedule's order, the gradients averaged over the
    pipelines, one optimizer step per stage. The traced function takes the global batch and
    returns (the step's metric state, each replica's pass times)."""

    def __init__(self, runner: PipelineRunner, micro: int):
        self.runner, self.micro = runner, micro
        self.model = runner.model
        self.options = runner.options
        self.stages = len(runner.stages)
        self.width = runner.devices_per_pipeline
        # One pass order per device of a pipeline (a pass's chunk c on device d is stage
        # c * width + d).
        self.plan = schedule(
            self.options.schedule, self.width, self.options.micro_batches,
            chunks=self.options.chunks_per_device,
        )  # fmt: skip
        self.local = {(r.pipeline, r.stage.index): r for r in runner.replicas}
        # Activations and gradients between stages on this process's devices, by
        # (pipeline, receiving stage, pass kind, micro-batch); between processes they go
        # through `transfers`.
        self.mailbox: dict[tuple[int, int, str, int], tf.Tensor] = {}
        self.transfers: Transfers = runner.links.program()
        self.names: dict[str, list[str]] = {}  # replica -> its passes, in the order run
        # (pipeline, stage) -> which of its weights' gradients are sparse (IndexedSlices).
        self.sparse: dict[tuple[int, int], list[bool]] = {}
        self._passes = None  # the passes' program, built when the step is first traced
        # The last stage's micro-batches' own counts (masked losses) and (loss sum, size),
        # as traced: empty for a loss that divides by its micro-batch's size.
        self.counts: list[tf.Tensor] = []
        self.sums: list[tuple[tf.Tensor, tf.Tensor]] = []
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

    # --- the order of passes --------------------------------------------------------------------

    def order(self) -> list[tuple[_StageReplica, Pass]]:
        """This process's passes in an order that builds each before what consumes it: by
        when the schedule starts them (a consumer starts after its producer ends)."""
        starts = simulate(self.plan).starts
        passes = []
        for r in self.local.values():
            device, chunk = r.stage.index % self.width, r.stage.index // self.width
            passes += [
                (starts[device][k], r.stage.index, r.pipeline, device, k)
                for k, p in enumerate(self.plan[device])
                if p.chunk == chunk
            ]
        return [
            (self.local[pipeline, stage], self.plan[device][k])
            for _, stage, pipeline, device, k in sorted(passes)
        ]

    # --- the step ---------------------------------------------------------------------------------

    def step(self, batch):
        """The traced step: the passes' program, then the exchange and the updates."""
        flat = tf.nest.flatten(batch)
        keys = sorted(self.local)
        values = []
        for key in keys:
            r = self.local[key]
            with tf.device(r.device):
                values += [tf.identity(v.value) for v in [*r.trainable, *r.non_trainable]]
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
        results: dict[tuple[int, int], _Result] = {}
        at = 0
        for key in keys:
            r = self.local[key]
            grads = []
            for variable, sparse in zip(r.trainable, self.sparse[key], strict=True):
                if sparse:
                    # A tensor: Keras's sparse ops (RMSprop's divide) read its dtype.
                    shape = tf.constant(np.asarray(variable.shape, np.int64))
                    grads.append(tf.IndexedSlices(outputs[at], outputs[at + 1], shape))
                    at += 2
                else:
                    grads.append(outputs[at])
                    at += 1
            statistics = outputs[at : at + len(r.non_trainable)]
            at += len(r.non_trainable)
            results[key] = _Result(grads, statistics, outputs[at])
            at += 1
        count = None
        if self.counts:  # the step's count over its micro-batches and pipelines
            count, at = outputs[at], at + 1
        state = outputs[at:]
        updates = self._update(results, count)
        with tf.control_dependencies(updates):
            state = [tf.identity(s) for s in state]
        times = {f"{p}_{s}": results[p, s].times for p, s in keys}
        return state, times

    def _all_passes(self, structure, batch_length: int, keys, args) -> list[tf.Tensor]:
        """Every pass of this process's stage replicas, in the schedule's order per stage.

        Takes the batch (flattened) and each replica's weights and statistics; returns per
        replica its weight gradients (summed over the micro-batches), its statistics after
        the last forward pass, its passes' [start, end] times; then the metric state.
        """
        runner = self.runner
        batch = tf.nest.pack_sequence_as(structure, list(args[:batch_length]))
        x, y, sample_weight = unpack(batch)
        state = [tf.zeros(v.shape, v.dtype) for v in runner.metric_variables]
        live: dict[tuple[int, int], _Passes] = {}
        self.counts, self.sums = [], []
        self.mailbox = {}
        self._traced_crossings = self._trace_crossings(x)
        at = batch_length
        for key in keys:
            r = self.local[key]
            trainable, statistics = len(r.trainable), len(r.non_trainable)
            live[key] = _Passes(
                weights=list(args[at : at + trainable]),
                statistics=list(args[at + trainable : at + trainable + statistics]),
            )
            at += trainable + statistics
        device_end: dict[str, tf.Tensor] = {}  # one pass at a time per device
        for r, p in self.order():
            own = live[r.pipeline, r.stage.index]
            own.last_end = device_end.get(r.device, own.last_end)
            with tf.device(r.device):
                if p.kind == "F":
                    done, state = self._forward(r, p.micro_batch, own, x, y, sample_weight, state)
                else:
                    done = self._backward(r, p.micro_batch, own)
                with tf.control_dependencies(tf.nest.flatten(done)):
                    end = tf.timestamp()
                own.times.append(tf.stack([own.start, end]))
                own.last_end = device_end[r.device] = end
                own.names.append(str(dataclasses.replace(p, chunk=0)))  # its stage's pass
        self.names = {f"{p}_{s}": live[p, s].names for p, s in keys}
        outputs = []
        for key in keys:
            own = live[key]
            # A sparse gradient (an Embedding's rows) leaves the program as its values and
            # indices; `step` makes it an IndexedSlices again.
            self.sparse[key] = [isinstance(g, tf.IndexedSlices) for g in own.grads or []]
            for g in own.grads or []:
                outputs += [g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g]
            outputs += [*own.statistics, tf.stack(own.times)]
        if self.counts:
            count = tf.add_n([tf.cast(c, tf.float32) for c in self.counts])
            outputs.append(count)
            # The logged loss: the step's sum over its count, as one device logs its batch's.
            size = tf.add_n([n for _, n in self.sums])
            mean = tf.add_n([total for total, _ in self.sums]) / count
            state = updates.added_to_loss(self.model, runner.metric_variables, state, mean * size)
        outputs += state
        return self.transfers.after_sends(outputs)

    def _micro(self, tensor, pipeline: int, m: int):
        if tensor is None:
            return None
        start = (pipeline * self.options.micro_batches + m) * self.micro
        return tf.nest.map_structure(lambda t: t[start : start + self.micro], tensor)

    def _forward(self, r: _StageReplica, m: int, own: _Passes, x, y, sample_weight, state):
        stage, model = r.stage, self.model
        last = stage.index == self.stages - 1
        if stage.first:
            inputs = self._begin(own, self._micro(x, r.pipeline, m))
            given, mask = inputs, None
        else:  # what crossed the cut, and the model's inputs it reads (a padding mask, say)
            inputs = self._begin(own, self._receive(r, m, "F", self._crossing(stage.index - 1)))
            batch = tf.nest.flatten(self._micro(x, r.pipeline, m))
            given, mask = stage.call_args(inputs, batch)
        objective = None
        with tf.GradientTape() as tape:
            tape.watch(own.weights)
            if not stage.first:
                tape.watch(stage.watched(inputs))
            outputs, statistics, losses = stage.model.stateless_call(
                own.weights, own.statistics, given, training=True, return_losses=True,
                **({} if mask is None else {"mask": mask}),
            )  # fmt: skip
            regularization = tf.add_n(losses) / self.options.micro_batches if losses else None
            if last:
                y_m, w_m = self._micro(y, r.pipeline, m), self._micro(sample_weight, r.pipeline, m)
                with loss_normalisation.global_batch(), loss_normalisation.recorded() as counts:
                    loss = compat.compiled_loss(model)(y_m, outputs, w_m)
                if counts:
                    # Divided by its own count (a mask's, or its weights'): the micro-batch's
                    # sum, divided by the whole step's count at the update, as one device.
                    self._check_counted(counts, regularization)
                    self.counts.append(counts[0])
                    objective = loss * tf.cast(counts[0], loss.dtype)
                else:
                    objective = loss / self.options.micro_batches
                if regularization is not None:
                    objective = objective + regularization
        own.statistics = list(statistics)
        size = tf.cast(batch_size(outputs), tf.float32)
        if last:
            logged = loss
            if counts:  # the step's mean is logged at its end (_all_passes), from the sums
                self.sums.append((objective, size))
                logged = tf.zeros_like(loss)
            state = updates.metric_state(
                self.model, self.runner.metric_variables, state, y_m, outputs, w_m, logged, size
            )
        if regularization is not None:  # the logged loss counts each stage's penalty too
            state = updates.added_to_loss(
                self.model,
                self.runner.metric_variables,
                state,
                regularization * self.options.micro_batches * size,
            )
        own.saved[m] = _Forward(tape, inputs, outputs, regularization, objective)
        if not last:
            self._send(r, m, "F", stage.passed_on(outputs, [] if stage.first else inputs))
        return outputs, state

    def _check_counted(self, counts: list, regularization) -> None:
        """Refuses what a micro-batch's count cannot normalise over the whole step: several
        losses (each its own count), a penalty beside the loss (it would be divided by the
        count too), stages across worker processes (the count is the last stage's)."""
        problem = None
        if len(counts) > 1 or len(self.model.outputs) > 1:
            problem = "a model of several outputs (each loss needs its own count)"
        elif regularization is not None:
            problem = "a penalty (a regulariser or add_loss) in the last stage's layers"
        elif self.runner.processes > 1:
            problem = "stages in several worker processes (only the last stage knows the count)"
        if problem is not None:
            raise StageError(
                "A pipeline divides a masked (or weight-reduced) loss by the whole step's "
                "count of unmasked elements, as one device does; it cannot with "
                f"{problem}. Use Keras's default reduction without a mask, shard_optimizer="
                f"'zero3' instead of the pipeline, or one process. Received: {problem}"
            )

    def _begin(self, own: _Passes, arrived):
        """Marks a pass's start, once its input has arrived and the stage's previous pass
        has ended, and returns the input as the pass must use it (after the mark)."""
        deps = [t for t in tf.nest.flatten(arrived) if isinstance(t, tf.Tensor)]
        if own.last_end is not None:
            deps.append(own.last_end)
        with tf.control_dependencies(deps):
            own.start = tf.timestamp()
        with tf.control_dependencies([own.start]):
            return tf.nest.map_structure(tf.identity, arrived)

    def _backward(self, r: _StageReplica, m: int, own: _Passes):
        stage = r.stage
        forward = own.saved.pop(m)
        watched = [] if stage.first else stage.watched(forward.inputs)
        sources = [*own.weights, *watched]
        passed = {}
        if forward.objective is not None:
            self._begin(own, [])
            with tf.control_dependencies([own.start]):
                grads = forward.tape.gradient(forward.objective, sources)
        else:
            upstream = self._receive(r, m, "B", self._crossing(stage.index, back=True))
            upstream = self._begin(own, upstream)
            targets, seeds, passed = stage.seeds(forward.outputs, upstream)
            if forward.regularization is not None:
                targets.append(forward.regularization)
                seeds.append(tf.ones_like(forward.regularization))
            grads = (
                forward.tape.gradient(targets, sources, output_gradients=seeds)
                if targets
                else [None] * len(sources)
            )
        weight_grads = [
            g if g is not None else _no_rows(w)
            for g, w in zip(grads[: len(own.weights)], own.weights, strict=True)
        ]
        if own.grads is None:
            own.grads = weight_grads
        else:
            own.grads = [updates.added(a, b) for a, b in zip(own.grads, weight_grads, strict=True)]
        if not stage.first:
            back = stage.sent_back(grads[len(own.weights) :], forward.inputs, passed)
            self._send(r, m, "B", back)
            if back:
                return back
        return updates.dense_part(own.grads[0]) if own.grads else tf.constant(0.0)

    def _update(self, results: dict[tuple[int, int], _Result], count=None) -> list[tf.Tensor]:
        """Each replica's gradients summed over the stages that hold the weight (tied
        weights) and averaged over the pipelines, then one optimizer step. With `count`
        (the step's count of unmasked elements), the summed gradients are of the loss's
        sums: divided by it instead."""
        runner, pipelines = self.runner, self.runner.pipelines
        user = self.model.optimizer
        # The user's optimizer counts the steps (callbacks read its iterations) and gives
        # each step's rate: a callback may have changed it since the last step.
        step = tf.identity(user.iterations.value)
        learning_rate = updates.learning_rate_at(user, step)
        done = []
        for (pipeline, index), result in results.items():
            r = self.local[pipeline, index]
            if runner.processes > 1:
                grads = self._summed_between_processes(r, result.grads)
            else:  # every replica of every stage is on a device here
                with tf.device(r.device):
                    grads = [
                        functools.reduce(
                            updates.added,
                            [
                                results[q, s].grads[runner.stages[s].trainable.index(i)]
                                for q in range(pipelines)
                                for s in runner.tied.get(i, (index,))
                            ],
                        )
                        for i in r.stage.trainable
                    ]
            if count is not None:
                grads = [_scaled(g, 1.0 / count) for g in grads]
            elif pipelines > 1:
                grads = [_scaled(g, 1.0 / pipelines) for g in grads]
            with tf.device(r.device):
                done.append(_apply(r.optimizer, grads, r.trainable, step, learning_rate))
                for variable, value in zip(r.non_trainable, result.statistics, strict=True):
                    variable.assign(value)
        with tf.control_dependencies(done):
            done.append(user.iterations.assign_add(1))
        return done

    def _summed_between_processes(self, r: _StageReplica, grads: list) -> list:
        """`grads` summed over the pipelines' replicas of this stage (a ring per stage), and
        a tied weight's over every replica of the stages that hold it (a ring per set of
        holders); sparse gradients travel dense."""
        runner = self.runner
        out = list(grads)
        # holders -> positions in `grads`, in the model's order of the weights: every member
        # of a ring passes the same weights in the same order (stages may list tied weights
        # in orders of their own)
        groups: dict[tuple[int, ...], list[int]] = {}
        for j, i in sorted(enumerate(r.stage.trainable), key=lambda pair: pair[1]):
            groups.setdefault(runner.tied.get(i, ()), []).append(j)
        for holders, positions in groups.items():
            if not holders and runner.pipelines == 1:
                continue
            ring = runner._rings[holders or r.stage.index]
            summed = ring.all_reduce_many([tf.convert_to_tensor(grads[j]) for j in positions])
            for j, g in zip(positions, summed, strict=True):
                out[j] = g
        return out

    # --- transfers between stages -----------------------------------------------------------------

    def _crossing(self, stage: int, *, back: bool = False) -> list[tf.TensorSpec]:
        """What crosses the cut after stage `stage` for one micro-batch, forward (its
        activations and masks) or `back` (the gradients of those that take one). A transfer
        between processes needs whole shapes: a sequence length the model leaves open is
        worked out from the batch, through the stages before."""
        items = self._traced_crossings[stage]
        if back:
            differentiable = self.runner.stages[stage].sent.differentiable
            items = [t for t, d in zip(items, differentiable, strict=True) if d]
        return [tf.TensorSpec(t.shape, t.dtype) for t in items]

    def _trace_crossings(self, x) -> list[list]:
        """What crosses each cut for one micro-batch of `x`, symbolically."""
        given = tf.nest.map_structure(
            lambda t: keras.KerasTensor((self.micro, *t.shape[1:]), t.dtype), x
        )
        flat, received, found = tf.nest.flatten(given), [], []
        for stage in self.runner.stages[:-1]:
            inputs = given if stage.first else stage.call_args(received, flat)[0]
            received = stage.passed_on(stage.model.compute_output_spec(inputs), received)
            found.append(received)
        return found

    def _link(self, pipeline: int, low_stage: int) -> int:
        """The group key of the link between stages low_stage and low_stage + 1."""
        return LINK_GROUP_KEY_BASE + pipeline * self.stages + low_stage

    def _key(self, m: int, kind: str, item: int) -> int:
        """A transfer's instance key within the program: one per micro-batch, way and item
        of the crossing."""
        width = max(len(items) for items in self._traced_crossings)
        return (2 * m + (kind == "B")) * width + item

    def _send(self, r: _StageReplica, m: int, kind: str, tensors: list) -> None:
        to = r.stage.index + (1 if kind == "F" else -1)
        if (r.pipeline, to) in self.local:
            self.mailbox[r.pipeline, to, kind, m] = tensors
            return
        group = self._link(r.pipeline, min(to, r.stage.index))
        for item, tensor in enumerate(tensors):
            self.transfers.send(tensor, group_key=group, key=self._key(m, kind, item))

    def _receive(self, r: _StageReplica, m: int, kind: str, specs: list[tf.TensorSpec]) -> list:
        key = (r.pipeline, r.stage.index, kind, m)
        if key in self.mailbox:
            return [tf.identity(t) for t in self.mailbox.pop(key)]  # copied to this device
        low = r.stage.index - 1 if kind == "F" else r.stage.index
        return [
            self.transfers.receive(
                spec.shape,
                dtype=spec.dtype,
                group_key=self._link(r.pipeline, low),
                key=self._key(m, kind, item),
            )  # fmt: skip
            for item, spec in enumerate(specs)
        ]


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
    updates.update_step(
        optimizer, grads, variables, learning_rate=learning_rate,
        weight_decay=optimizer.weight_decay or 0.0,
    )  # fmt: skip
    return optimizer.iterations.assign_add(1)


def _copy(variable) -> keras.Variable:
    """A plain variable shaped as `variable` (its value is loaded before training)."""
    return keras.Variable(
        np.zeros(variable.shape, variable.dtype),
        dtype=variable.dtype,
        trainable=variable.trainable,
        name=variable.path.replace("/", "_"),
    )

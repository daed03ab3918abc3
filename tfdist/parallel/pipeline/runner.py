"""The runner of a pipeline (see pipeline.py): it cuts the model into stages, places their
replicas on the strategy's devices (or worker processes), moves the model's weights and
its optimizer's slots into them (pipeline/home.py), and trains a batch a step, each step a
program of its own (pipeline/step.py) for each micro-batch size.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.collective.keys import block
from tfdist.collective.transport import ProcessLinks, ProcessRing
from tfdist.errors import FitError
from tfdist.parallel import optimizer_copies
from tfdist.parallel.host import host_device
from tfdist.parallel.pipeline.grid import stage_grid
from tfdist.parallel.pipeline.home import StageReplica, StageStore, empty_variables, slice_size
from tfdist.parallel.pipeline.links import LINK_GROUP_KEY_BASE
from tfdist.parallel.pipeline.stages import Stage, split
from tfdist.parallel.pipeline.step import PipelineStep
from tfdist.parallel.pipeline.tensor import TensorStages
from tfdist.parallel.pipeline.tied import SharedWeight, shared, tied
from tfdist.parallel.tensor.layout_map import plan_of
from tfdist.strategies import strategy_kind
from tfdist.strategies.replicas import ReplicaPlacement
from tfdist.training.engine import Engine, EngineState
from tfdist.training.fit_data import FitData, unpack
from tfdist.training.hooks import StepHook
from tfdist.training.job import GLOBAL_BATCHES, LockstepJob
from tfdist.training.loop import each_batch
from tfdist.training.memory import nbytes
from tfdist.training.runners.common import batch_size, logs_from_state
from tfdist.training.runners.sync import SyncRunner
from tfdist.training.steps import custom_train_step

log = logging.getLogger(__name__)

# The stages write the model back in buckets of this many bytes of float64 sums (a larger
# variable alone): what the epoch's end adds to a process's peak. Every weight and slot at
# once made that peak 21.6x the weights (tools/peak_bench.py); 4 MiB buckets, 5.5x.
SETTLE_BUCKET_BYTES = 4 * 2**20


class PipelineRunner(Engine):
    """Trains a model cut into pipeline stages (see the module docstring).

    Its job is a synchronous one fed the global batches (the chief, agreement between
    workers, failure messages). The model's build and its evaluation are a synchronous
    engine's (`whole`), with the model's weights read from the stages (see StageStore).
    Kept across calls for the same layout (training/kept.py compares the Pipeline and its
    settings by value): a later fit goes on with the stages, rings and traced programs.
    """

    def __init__(
        self,
        model: keras.Model,
        strategy: tf.distribute.Strategy,
        options: Any,  # a tfdist.parallel.Pipeline (pipeline.py makes this runner)
        shard: str | None = None,
    ):
        self.model, self.strategy, self.options = model, strategy, options
        self.job = LockstepJob(strategy, feed=GLOBAL_BATCHES, callback_checks=[_backups_per_epoch])
        # Builds the model (all but the optimizer's slots, which the stages keep) and
        # evaluates it.
        self.whole = SyncRunner(model, strategy, job=self.job, builds_optimizer=False)
        self.metric_variables: list[keras.Variable] = []
        # fit's shard_optimizer: each stage's optimizer state ('zero1'; 'zero2': its summed
        # gradients too) or its weights too ('zero3') in flat slices over its pipelines.
        self.shard = shard
        self.sliced: set[int] = set()  # the weights cut into slices (see _slice_plan)
        self.stages: list[Stage] = []
        self.replicas: list[StageReplica] = []  # this process's
        self.pipelines = 1
        self.devices_per_pipeline = 1
        self.devices = 1  # every process's devices the stage replicas take
        # A model split by a layout map: each stage replica is a group of `tensor` devices
        # (pipeline/tensor.py), each weight held as `placements` says.
        plan = plan_of(model)
        self.tensor = 1 if plan is None else plan.degree
        self.placements = None if plan is None else list(plan.placements)
        self.tensor_stages: TensorStages | None = None
        # Whether each process holds every pipeline's replicas of its stages (one process;
        # worker processes of several devices): a stage's exchanges stay in the process.
        self.whole_stages = True
        self._state: list[np.ndarray] = []
        self._programs: dict[int, PipelineStep] = {}
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._loaded = False
        self.tied: dict[int, tuple[int, ...]] = {}  # weight -> the stages holding it
        self.shared: dict[int, SharedWeight] = {}  # weight -> who holds it and who reads it
        # By stage (its pipelines' replicas) and by a tied weight's holders (theirs).
        self._rings: dict[tuple, ProcessRing] = {}  # see ring_of
        # Between worker processes: activations forward, their gradients back. TensorFlow's
        # collective runtime remembers each instance key's shape for the life of the
        # process, so each step program (one per micro-batch size) takes keys of its own.
        self.links = ProcessLinks(
            group_key_base=LINK_GROUP_KEY_BASE, timeout_seconds=options.timeout_seconds
        )
        self.last_passes: dict[tuple[int, int], list[tuple[str, float, float]]] = {}
        self._built_store: StageStore | None = None  # the stages this runner was built on

    # --- building -------------------------------------------------------------------------------

    @property
    def placement(self) -> ReplicaPlacement:
        return self.job.placement

    @property
    def processes(self) -> int:
        return self.placement.processes

    def build(self, sample_batch, step_hooks: Sequence[StepHook] = ()) -> None:
        model, options = self.model, self.options
        layout_map_across = self.placements is not None and self.processes > 1
        if step_hooks and options.cut_before == () and layout_map_across:
            raise FitError(
                "Across worker processes a model split by a layout map trains as one stage "
                "of tfdist's pipeline (a tensor group a process), which takes no step hooks: "
                "drop accumulate_steps (or raise the batch), the user's step_hooks and other "
                "update modes; shard_optimizer works. Received: "
                f"{', '.join(h.name for h in step_hooks)}"
            )
        if step_hooks:
            raise FitError(
                "A pipeline takes no step hooks: its micro-batches already accumulate "
                "gradients (drop accumulate_steps; shard_optimizer shards each stage's state "
                "over its pipelines), and of tensor parallelism it trains a model split by a "
                "layout map (tensor_parallel(model, layout_map=...)), not the split layers "
                "tensor_parallel(model, degree=...) writes (split the model by "
                "derive_layout_map(model, mesh) instead). Received: "
                f"{', '.join(h.name for h in step_hooks)}"
            )
        if self.tensor > 1:
            self._check_tensor()
        if custom_train_step(model):
            raise FitError(
                f"Model {model.name!r} has its own train_step, which runs the whole model at "
                "once; a pipeline runs its layers stage by stage with the compiled loss and "
                "metrics. Move the step's logic into compile()'s loss and metrics, or train "
                "without pipeline=. Received: a model with train_step overridden"
            )
        optimizer_copies.check_copyable(model.optimizer, who="A pipeline's stages")
        self.whole.build(sample_batch)
        self.metric_variables = self.whole.metric_variables
        store = StageStore.of(model)
        if store is not None and store is self._built_store and store.key == self._store_key():
            # A later fit with this runner (kept on the model): its stages, rings and traced
            # step programs go on.
            self._state = self._zeros()
            return
        if store is not None and store.key == self._store_key():
            # A later fit on the same layout: its stages go on with their weights and slots.
            self.stages, self.tied, self.replicas = store.stages, store.tied, store.replicas
            self.shared, self.sliced = store.shared, store.sliced
            self._grid()
        else:
            self.stages = split(model, options.cut_before)
            self.tied = tied(self.stages)
            self.shared = shared(self.stages)
            ranks, devices = self._grid()
            self.sliced = self._slice_plan()
            self._place(ranks, devices)
            held = sum(nbytes(v) or 0 for r in self.replicas for v in r.trainable)
            whole = sum(nbytes(v) or 0 for v in model.trainable_variables)
            log.info(
                "The stages hold the model's weights (%.1f MB here of %.1f MB) and their "
                "optimizer's state; no process holds the whole model.",
                held / 2**20,
                whole / 2**20,
            )
        self._log_shared()
        self._rings = self._make_rings()
        self._state = self._zeros()
        if self.tensor > 1:
            store = StageStore.of(model)
            if store.tensor_stages is None:  # the groups' strategies, for every later fit
                ranks, devices = self._grid()
                groups = {divmod(rank, len(self.stages)): devices[rank] for rank in ranks}
                store.tensor_stages = TensorStages(model, plan_of(model), groups)
            self.tensor_stages = store.tensor_stages
        self._built_store = StageStore.of(model)

    def _check_tensor(self) -> None:
        """What a pipeline of tensor-parallel stages does not do yet, refused in one line."""
        normalised = [layer.name for layer in compat.all_layers(self.model)
                      if isinstance(layer, keras.layers.BatchNormalization)]  # fmt: skip
        if normalised:
            # Each member would normalise its own rows of the micro-batch, not the
            # micro-batch's: other numbers than the unsplit stage's, silently.
            problem = f"BatchNormalization ({', '.join(normalised[:3])}) in a split stage"
            raise FitError(
                "A pipeline of tensor-parallel stages (a layout map's model with pipeline=) "
                f"does not normalise over the micro-batch yet: {problem}. Drop one of them. "
                f"Received: {problem}"
            )

    def _log_shared(self) -> None:
        """Names the weights several stages hold: tied ones (read by several), and those of a
        layer called on both sides of a cut that only one stage reads."""
        names = self.model.trainable_variables
        tied = sorted(names[i].path for i, s in self.shared.items() if s.tied)
        if tied:
            log.info(
                "Weights read by several stages (tied) are held by each of them, their "
                "gradients summed: %s",
                ", ".join(tied),
            )
        alone = sorted(
            f"{names[i].path} (read by stage {s.users[0]})"
            for i, s in self.shared.items()
            if len(s.users) == 1
        )
        if alone:
            log.info(
                "Weights of a layer called on both sides of a cut, read by one stage only "
                "(not tied), are held by each stage that calls the layer, and take the "
                "reading stage's gradient: %s",
                ", ".join(alone),
            )

    def describe_batch(self, global_batch: int) -> str:
        options, stages = self.options, len(self.stages)
        per = global_batch // self.pipelines
        devices = self.devices_per_pipeline * self.tensor
        tensor = f" ({self.tensor} a stage, its layers split)" if self.tensor > 1 else ""
        kind = strategy_kind(self.strategy)
        if stages == 1:  # no cut: each replica a tensor group, the replicas data-parallel
            split = ", its layers split" if self.tensor > 1 else ""
            shard = f", {self.shard}" if self.shard else ""
            return (
                f"Global batch {global_batch} = {self.pipelines} data x {per}, each replica "
                f"over {devices} device(s){split} (one stage{shard}; {kind})"
            )
        return (
            f"Global batch {global_batch} = {self.pipelines} pipeline(s) x {per} per pipeline, "
            f"each of {stages} stages over {devices} device(s){tensor} in "
            f"{options.micro_batches} micro-batch(es) of {per // options.micro_batches} "
            f"({options.schedule}{', ' + self.shard if self.shard else ''}; {kind})"
        )

    def _store_key(self) -> tuple:
        options = self.options
        return (
            options.cut_before, options.chunks_per_device, self.placement, self.shard,
            self.tensor,
        )  # fmt: skip

    def _slice_plan(self) -> set[int]:
        """The trainable weights (by position) whose optimizer state, and under zero3 the
        weight itself, each stage replica keeps a flat 1/D slice of, D the pipelines: all
        under shard_optimizer but embedding tables (their looked-up rows arrive as sparse
        rows, which Keras's optimizer updates as rows) and empty weights."""
        if self.shard is None:
            return set()
        optimizer, model = self.model.optimizer, self.model
        if not isinstance(optimizer, optimizer_copies.ELEMENTWISE):
            raise FitError(
                f"{type(optimizer).__name__} reads a whole variable's gradient in its update "
                "(LAMB's trust ratio, Adafactor's factored moments), so a stage's slice of a "
                "weight cannot be updated alone. Use an elementwise optimizer (SGD, Adam, "
                "AdamW, RMSprop, ...) or drop shard_optimizer. Received: "
                f"shard_optimizer={self.shard!r} with {type(optimizer).__name__}"
            )
        if optimizer.clipnorm is not None:
            raise FitError(
                "Under shard_optimizer a stage replica updates a slice of each weight, so a "
                "whole weight's norm (clipnorm) is not known where it is updated. Use "
                f"clipvalue, or no clipping. Received: clipnorm={optimizer.clipnorm}"
            )
        if self.pipelines == 1:
            log.info(
                "shard_optimizer=%r: one pipeline, so each stage's state has no replicas to "
                "shard over; the stages keep it whole.", self.shard,
            )  # fmt: skip
            return set()
        tables = {id(layer.embeddings) for layer in compat.all_layers(model)
                  if isinstance(layer, keras.layers.Embedding)}  # fmt: skip
        weights = model.trainable_variables
        sliced = {i for i, v in enumerate(weights)
                  if id(v) not in tables and (v.shape.num_elements() or 0) > 0}  # fmt: skip
        kept = [weights[i].path for i in range(len(weights)) if i not in sliced]
        one = len(self.stages) == 1  # no cut: the pipelines are the data replicas
        log.info(
            "shard_optimizer=%r: %s %s sharded over %s %d %s%s.",
            self.shard, "the model's" if one else "each stage's",
            "weights, gradients and optimizer state" if self.shard == "zero3"
            else "optimizer state" + (" and gradients" if self.shard == "zero2" else ""),
            "the" if one else "its", self.pipelines, "data replicas" if one else "pipelines",
            f"; kept whole (embedding tables, their gradients sparse rows): {', '.join(kept)}"
            if kept else "",
        )  # fmt: skip
        return sliced

    def _grid(self) -> tuple[list[int], dict[int, list[str]]]:
        """Takes the grid of stage replicas (grid.py): the pipelines and the devices each
        takes; returns this process's ranks and each rank's devices."""
        grid = stage_grid(len(self.stages), self.placement, self.options, self.tensor)
        self.devices, self.devices_per_pipeline = grid.devices, grid.devices_per_pipeline
        self.pipelines, self.whole_stages = grid.pipelines, grid.whole_stages
        return grid.ranks, grid.rank_devices

    def _place(self, ranks: list[int], devices: dict[int, list[str]]) -> None:
        """Makes this process's stage replicas and moves the model's weights and its
        optimizer's slots into them (see StageStore)."""
        stages = self.stages
        trainable = self.model.trainable_variables
        non_trainable = self.model.non_trainable_variables

        sliced, zero3 = self.sliced, self.shard == "zero3"

        def make():
            made = []
            for rank in ranks:
                pipeline, index = divmod(rank, len(stages))
                stage = stages[index]
                for member, device in enumerate(devices[rank]):
                    with tf.device(device):
                        # Named as the model's own (its path's '/' as '_'), so the optimizer
                        # copy's slots are named as the user's optimizer's for the same
                        # weight (a slice or a part too: its slots are the user's pieces).
                        slices = [
                            _copy(trainable[i], self.held_shape(i), (pipeline, self.pipelines))
                            if i in sliced
                            else None
                            for i in stage.trainable
                        ]
                        copies = [
                            piece
                            if zero3 and piece is not None
                            else _copy(trainable[i], self.held_shape(i))
                            for i, piece in zip(stage.trainable, slices, strict=True)
                        ]
                        statistics = [
                            _copy(non_trainable[i], non_trainable[i].shape)
                            for i in stage.non_trainable
                        ]
                    made.append(
                        StageReplica(
                            stage, pipeline, device, copies, statistics, None, slices, member
                        )
                    )
            return made

        self.replicas = optimizer_copies.outside_strategy(make)
        store = StageStore(self._store_key(), self, self.replicas)
        user = self.model.optimizer
        empty: list[tf.Variable] = []  # the slots made without a value, if it builds now
        if not user.built:  # its slots made empty: each is given its stage's below

            def outside(build):
                def run():
                    with empty_variables() as made:  # in the thread that builds
                        build()
                    empty.extend(made)

                return optimizer_copies.outside_strategy(run)

            compat.build_optimizer_plainly(user, trainable, host_device(self.strategy), outside)
        # The weights move into the stages first, each whole copy dropped as it goes, then
        # the stages' optimizers are built: the whole model and the slots never coexist.
        store.take_weights(self.model)

        def build_optimizers():
            for r in self.replicas:
                with tf.device(r.device):
                    r.optimizer = optimizer_copies.optimizer_copy(user, r.updated)

        optimizer_copies.outside_strategy(build_optimizers)
        store.take_slots(self.model, fresh={id(v) for v in empty})

    def held_shape(self, i: int) -> tuple[int, ...]:
        """The shape of what a stage replica holding weight `i` holds of it, unsliced: its
        tensor-parallel part, or the whole weight."""
        variable = self.model.trainable_variables[i]
        if self.placements is None or self.placements[i].parts == 1:
            return tuple(variable.shape)
        return self.placements[i].shape_of(variable)

    def _make_rings(self) -> dict:
        """Between worker processes: a ring per stage over its pipelines' replicas, and one
        per set of stages holding a tied weight; each a ring per tensor group member (member
        k of each replica holds the same parts). Keyed as ring_of finds them."""
        rings: dict[tuple, ProcessRing] = {}
        if self.whole_stages:
            self._check_shared_here()
            return rings
        tensor = self.tensor
        for r in self.replicas:
            rings[r.stage.index, r.member] = ProcessRing(
                rank=r.pipeline,
                ranks=self.pipelines,
                timeout_seconds=self.options.timeout_seconds,
                group_key_base=block(
                    "pipeline_stage_rings", r.stage.index * tensor + r.member, size=1000
                ),
                device=r.device if tensor > 1 else None,
            )
        # A tied weight's gradient is summed over every replica of the stages holding it:
        # one ring per set of holders, over the pipelines x holders processes.
        for k, holders in enumerate(sorted(set(self.tied.values()))):
            for r in self.replicas:
                if r.stage.index in holders:
                    rings[holders, r.member] = ProcessRing(
                        rank=r.pipeline * len(holders) + holders.index(r.stage.index),
                        ranks=self.pipelines * len(holders),
                        timeout_seconds=self.options.timeout_seconds,
                        group_key_base=block("pipeline_tied_rings", k * tensor + r.member,
                                             size=1000),
                        device=r.device if tensor > 1 else None,
                    )  # fmt: skip
        return rings

    def ring_of(self, r: StageReplica, holders: tuple[int, ...] = ()) -> ProcessRing:
        """The ring between processes that replica `r` sums over: its stage's (or, for a
        weight the stages `holders` share, theirs), of its tensor group member."""
        return self._rings[holders or r.stage.index, r.member]

    def _check_shared_here(self) -> None:
        """Processes that hold whole stages sum a weight several stages hold in one
        process: its holders must be there (a ring between processes is not built)."""
        here = {r.stage.index for r in self.replicas}
        for i, holders in self.tied.items():
            if not set(holders) <= here and set(holders) & here:
                raise FitError(
                    f"{self.model.trainable_variables[i].path} is held by stages "
                    f"{list(holders)}, which are in different worker processes; with several "
                    "devices a process their gradients are not summed between processes "
                    "(not built). Cut so that its stages share a process, or run one device "
                    f"a process. Received: stages {sorted(here)} here"
                )

    def state(self) -> EngineState:
        return EngineState(shards=StageStore.of(self.model))

    # --- data -------------------------------------------------------------------------------------

    def _split_batch(self, batch) -> int:
        size = int(batch_size(unpack(batch)[0]))
        parts = self.pipelines * self.options.micro_batches * self.tensor
        if size % parts:
            raise FitError(
                f"A batch of {size} examples does not split into {self.pipelines} pipeline(s) "
                f"x {self.options.micro_batches} micro-batches"
                + (f" of {self.tensor} tensor-parallel members' rows" if self.tensor > 1 else "")
                + ": make the global batch a "
                f"multiple of {parts} (and batch with drop_remainder=True, or give "
                "steps_per_epoch, so the last batch is full too). "
                f"Received: micro_batches={self.options.micro_batches}, batch of {size}"
            )
        return size // (self.pipelines * self.options.micro_batches)

    # --- training ---------------------------------------------------------------------------------

    def begin(self, global_step: int) -> None:
        self.whole.begin(global_step)
        self._loaded = False  # callbacks may have restored the model: load it into the stages

    def train(self, iterator, n: int, *, bounded: bool, logs: str | None):
        with self.job.explained():
            if not self._loaded:
                self._load()

            def step(batch):
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

            done, _ = each_batch(iterator, n, step)  # a step a call: the program is one step
            return done, (self._read(logs) if logs and done else None)

    def _program(self, micro: int) -> PipelineStep:
        if micro not in self._programs:
            self._programs[micro] = PipelineStep(self, micro)
        return self._programs[micro]

    def _zeros(self) -> list[np.ndarray]:
        return [np.zeros(v.shape, v.dtype) for v in self.metric_variables]

    def reset(self) -> None:
        self.whole.reset()
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
        local = len(strategy.extended.worker_devices)  # each process's arrays counted once
        with self.job.explained():
            values = strategy.experimental_distribute_values_from_function(
                lambda context: tf.constant(
                    flat if context.replica_id_in_sync_group % local == 0 else np.zeros_like(flat)
                )
            )
            total = strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None).numpy()
        out, at = [], 0
        for a in arrays:
            size = int(np.prod(np.shape(a)))
            out.append(total[at : at + size].reshape(np.shape(a)).astype(np.asarray(a).dtype))
            at += size
        return out

    def evaluate(self, data: FitData, steps: int | None) -> dict[str, float]:
        return self.whole.evaluate(data, steps)

    # --- the whole model and the stages -----------------------------------------------------------

    def _load(self) -> None:
        """The stages take the model's statistics (BatchNormalization's): its weights and
        its optimizer's slots are the stages' own already (see StageStore)."""
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


def _backups_per_epoch(callbacks) -> None:
    """Refuses a BackupAndRestore that saves every few steps."""
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


def _copy(variable, shape, piece: tuple[int, int] | None = None) -> keras.Variable:
    """A plain variable of `shape` (the weight's, or a tensor-parallel part's) for
    `variable`, or given `piece` (k, n) as the k-th flat slice of n of that shape (see
    pipeline_home.slice_size); its value is loaded before training."""
    if piece is not None:
        shape = (slice_size(shape, piece[1]),)
    return keras.Variable(
        np.zeros(shape, variable.dtype),
        dtype=variable.dtype,
        trainable=variable.trainable,
        name=variable.path.replace("/", "_"),
    )

"""Sharded optimizer state (ZeRO stage 1) and gradients (stage 2) for synchronous training.

In plain data parallelism every replica keeps the whole optimizer state: with Adam, two
more fp32 copies of every weight. ZeRO (Rajbhandari et al., 2020) splits it over the N
replicas instead. Every step, each replica

  1. packs its gradients into flat buffers, bucket by bucket (clipped first, as Keras clips
     each replica's gradients under a strategy);
  2. reduces each over the ring: stage 1 all-reduces the buffer and keeps its own slice,
     stage 2 reduce-scatters it, so only the slice's sum is ever formed;
  3. applies the user's own optimizer to its slice only, so slot variables exist for 1/N of
     the weights (the slice's weight decay too);
  4. all-gathers the updated slices, and every replica writes the whole model back.

The slices are contiguous ranges of the packed buffer (tfdist.collective.ring's chunks).
How the buffer is cut, the `Partition`, depends on the optimizer: one whose update of a
weight reads only that weight's gradient and slots (SGD, Adam, AdamW, RMSprop, ...) is cut
into N equal ranges, whatever the variables; one that reads a whole variable (LAMB's trust
ratio, Adafactor's factored moments) gets whole variables per replica instead, balanced by
size, as PyTorch's ZeroRedundancyOptimizer does.

The user's optimizer stays the model's optimizer: its `iterations`, its learning rate (a
schedule, or a value callbacks change) and its weight-decay choices drive every slice. It is
built on no variables; each local replica keeps a copy of it (same class and config) whose
slots are built for that replica's slice alone, on its device.

Example:

    with strategy.scope():
        model = ...; model.compile(optimizer="adam", loss=...)
    tfdist.fit(model, data, shard_optimizer="zero2")
    # or: tfdist.fit(model, data, step_hooks=[tfdist.parallel.ShardedUpdate(stage=2)])

The ring runs over the local devices of a mirrored strategy (one program, copies between
devices) or over the worker processes of a multi_worker_mirrored job (tfdist's ProcessRing
on collective point-to-point transfers). The packed weights travel in buckets (like the
gradient ring's fusion), each exchanged and updated after the last is written back, so the
update's temporaries are a bucket's worth.

Stage 3, the weights sharded too, is zero/stage3.py (ShardedParameters); `shard_optimizer="zero3"`
builds it (stage3.shard_hook picks the stage). How the packed weights are cut among the
replicas, and each replica's copy of the optimizer over its pieces, are zero/partition.py;
where the state lives (offload='optimizer': the host), zero/offload.py.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.collective.fusion import DEFAULT_BUCKET_BYTES
from tfdist.collective.keys import block
from tfdist.collective.ring import (
    local_ring_all_gather,
    local_ring_reduce_scatter,
)
from tfdist.collective.transport import ProcessRing
from tfdist.errors import FitError
from tfdist.parallel import host, optimizer_copies, saved_state
from tfdist.parallel.zero.offload import Offload
from tfdist.parallel.zero.partition import LocalReplica, Partition, bucket_variables
from tfdist.strategies import replicas
from tfdist.training import sparse_rows, steps
from tfdist.training.hooks import StepHook
from tfdist.training.job import Job

log = logging.getLogger(__name__)

STAGES = (1, 2)
PARTITIONS = ("auto", "flat", "variables")
# Group keys of a ZeRO ring's edges, apart from the gradient ring's (collective/keys.py): a
# block per ring (compile's optimizer's, then each optimizer a train_step applies itself).
_RING_KEYS = 1000


class ShardingError(FitError):
    """A sharded update was asked for where it cannot work as asked."""


class ShardedUpdate(StepHook):
    """A StepHook that shards the optimizer's state (stage 1) and the gradients (stage 2).

    It ends the update chain: it applies the gradients itself and does not call the next
    link. See the module docstring for what a step does.

    Args:
      stage: 1 (optimizer state sharded; the gradients all-reduced whole) or 2 (gradients
        reduce-scattered as well: each replica forms only its slice's sum); also as
        fit's keyword names them, 'zero1' or 'zero2'.
      partition: 'flat' (equal ranges of the packed weights; for optimizers that update
        each weight on its own), 'variables' (whole variables per replica, balanced by
        size; any optimizer) or 'auto' ('flat' where the optimizer allows it).
      bucket_bytes: the packed weights are exchanged and updated bucket by bucket, each of
        up to this many bytes (a larger variable gets a bucket of its own), so what a step
        holds beside the model and its gradients is a bucket's worth; 'variables'
        partitions use one bucket.
      timeout_seconds: how long a transfer between worker processes may wait for its peer;
        None waits forever.
      offload: None, or 'optimizer' (ZeRO-Offload): each replica's slice of the weights and
        its slots live in host memory, where its update runs; the device keeps the model's
        weights and gradients.
    """

    synchronous_only = True
    keeps_optimizer_state = True
    applies_update = True
    ends_chain = True
    takes_host_scope_models = True  # to refuse it in its own words (build)

    def __init__(
        self,
        stage: int | str = 2,
        *,
        partition: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_seconds=None,
        offload: str | Offload | None = None,
    ):
        stage = {f"zero{n}": n for n in STAGES}.get(stage, stage)
        if stage not in STAGES:
            raise ShardingError(
                f"stage must be 1 or 2 (zero1: optimizer state; zero2: gradients too). "
                f"Received: stage={stage!r}"
            )
        if partition not in PARTITIONS:
            raise ShardingError(
                f"partition must be one of {', '.join(PARTITIONS)}. Received: {partition!r}"
            )
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ShardingError(f"bucket_bytes must be >= 1. Received: {bucket_bytes!r}")
        self.offload = Offload.of(offload, who=self.name_for(stage), error=ShardingError)
        self.stage, self.partition_choice = stage, partition
        self.bucket_bytes, self.timeout_seconds = bucket_bytes, timeout_seconds
        self.partitions: list[Partition] = []
        self.replicas: list[LocalReplica] = []
        # A custom train_step's own optimizers (a GAN's two): id of the optimizer now on the
        # model -> the hook that shards it, over the weights it was built on.
        self.own: dict[int, ShardedUpdate] = {}
        self.ring_index = 0  # which block of ZeRO's group keys this hook's ring takes

    @property
    def name(self) -> str:
        return self.name_for(self.stage)

    @staticmethod
    def name_for(stage: int) -> str:
        return f"shard_optimizer='zero{stage}'"

    # --- building -------------------------------------------------------------------------------

    def build(self, model: keras.Model, job: Job) -> None:
        self.model, self.strategy = model, job.strategy
        if self.already_built(model, job):
            return  # a later fit: the slices keep the optimizer's state
        if host.hosted(model):
            raise ShardingError(
                f"{self.name} keeps every weight on every replica and shards only the "
                "optimizer's state (and gradients), but this model was built in "
                "tfdist.host_scope, which holds its weights on the host. Build it under "
                "strategy.scope() for zero1/zero2, or train it with shard_optimizer='zero3'. "
                f"Received: {self.name} on a host_scope model"
            )
        own = self._own_optimizers(model)  # checked before anything is built
        self._build_for(model, job, model.optimizer, list(model.trainable_variables))
        for k, (attribute, optimizer, variables) in enumerate(own, start=1):
            sibling = ShardedUpdate(
                stage=self.stage, partition=self.partition_choice,
                bucket_bytes=self.bucket_bytes, offload=self.offload,
                timeout_seconds=self.timeout_seconds,
            )  # fmt: skip
            sibling.model, sibling.strategy, sibling.ring_index = model, job.strategy, k
            # The model's optimizer of that name becomes a copy that keeps no slots (its
            # class, config and step count): the slices hold them, as for compile's.
            slotless = optimizer_copies.optimizer_copy(optimizer, [])
            slotless.iterations.assign(optimizer.iterations)
            setattr(model, attribute, slotless)
            sibling._build_for(model, job, slotless, variables, saves=False)
            self.own[id(slotless)] = sibling
        if own:
            log.info(
                "%s shards the state of the optimizers train_step applies itself too: %s",
                self.name, ", ".join(f"{a} ({len(v)} weights)" for a, _, v in own),
            )  # fmt: skip

    def _own_optimizers(self, model: keras.Model) -> list[tuple[str, object, list]]:
        """(attribute, optimizer, the weights it was built on) of each optimizer a custom
        train_step applies itself; refused where it cannot be sharded."""
        found = []
        for attribute, optimizer in steps.own_optimizers(model).items():
            if not optimizer.built:
                raise ShardingError(
                    f"Model {model.name!r}'s train_step applies {attribute} "
                    f"({type(optimizer).__name__}) itself, and it is not built, so the "
                    f"weights it updates are not known before the step; {self.name} shards "
                    "each optimizer's state over the weights it was built on. Build it in "
                    f"compile: self.{attribute}.build(<the weights it updates>) (under a "
                    "mirrored strategy Keras's own fit needs that too). Received: "
                    f"{attribute} not built"
                )
            _split_optimizer(optimizer, f"{self.name} (for {attribute})")
            found.append((attribute, optimizer, compat.optimizer_variables_list(optimizer)))
        return found

    def chain_for(self, optimizer) -> list[StepHook]:
        """The hooks a custom train_step's own `optimizer` applies its updates through."""
        sibling = self.own.get(id(optimizer))
        return [sibling] if sibling is not None else []

    def _build_for(
        self, model: keras.Model, job: Job, optimizer, variables: list, *, saves=True
    ) -> None:
        """Shards `optimizer`'s state over `variables` (the ones its apply is given, in that
        order); `saves`: model.save writes it whole (Keras saves compile's optimizer only)."""
        optimizer, self.scaling = _split_optimizer(optimizer, self.name)
        self.optimizer, self.variables = optimizer, variables
        layout = replicas.one_replica_per_process(job.placement, who=self.name, error=ShardingError)
        devices = list(layout.devices)
        ranks = layout.replicas
        if ranks < 2:
            raise ShardingError(
                f"{self.name} needs at least 2 replicas to shard over; this strategy has "
                f"{ranks}. Use 2 or more devices (tfdist.configure_cpu_devices(2) for logical "
                "CPUs) or worker processes, or drop shard_optimizer. Received: 1 replica"
            )
        dtypes = {v.dtype for v in variables}
        if len(dtypes) != 1 or not tf.as_dtype(next(iter(dtypes))).is_floating:
            raise ShardingError(
                f"{self.name} packs the trainable variables into one buffer, so they must "
                "share one floating-point dtype. Received: "
                + ", ".join(sorted(str(d) for d in dtypes))
            )
        self.dtype = tf.as_dtype(next(iter(dtypes)))
        self.partitions = self._partitions(optimizer, [tuple(v.shape) for v in variables], ranks)
        rank_base = layout.first_replica
        # The user's optimizer keeps iterations and the learning rate (and a loss scale
        # optimizer its scale), no slots.
        outer = self.scaling or optimizer
        if not outer.built:
            outer.build([])
        decays = [
            bool(optimizer.weight_decay) and compat.uses_weight_decay(optimizer, v)
            for v in variables
        ]
        # Offloaded, each replica's slices and slots, and its update, are the host's.
        state_device = self.offload.state_device(self.strategy, None)
        self.replicas = optimizer_copies.outside_strategy(
            lambda: [
                LocalReplica(
                    optimizer,
                    self.partitions,
                    rank=rank_base + d,
                    ranks=ranks,
                    device=state_device or device,
                    variables=variables,
                    decays=decays,
                )
                for d, device in enumerate(devices)
            ]
        )
        self.devices = devices
        if saves:
            saved_state.keep_in_saves(outer, model, self.slot_reader)
        self.ring = None
        if layout.processes > 1:
            self.ring = ProcessRing(
                rank=rank_base,
                ranks=ranks,
                timeout_seconds=self.timeout_seconds,
                group_key_base=block("zero", self.ring_index, size=_RING_KEYS),
            )

    def _partitions(self, optimizer, shapes, ranks: int) -> list[Partition]:
        elementwise = isinstance(optimizer, optimizer_copies.ELEMENTWISE)
        choice = self.partition_choice
        if choice == "flat" and not elementwise:
            raise ShardingError(
                f"{type(optimizer).__name__} needs whole variables under sharding (its update "
                "reads a variable's whole gradient, as LAMB's trust ratio does), so it cannot "
                "be cut into equal flat ranges. Use partition='variables' (or 'auto'), which "
                "gives each replica whole variables. Received: partition='flat'"
            )
        if choice == "variables" or (choice == "auto" and not elementwise):
            return [Partition.by_variable(dict(enumerate(shapes)), ranks)]
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        buckets = bucket_variables(sizes, max(1, self.bucket_bytes // self.dtype.size))
        return [Partition.flat({i: shapes[i] for i in bucket}, ranks) for bucket in buckets]

    # --- one step -------------------------------------------------------------------------------

    def apply(self, grads_and_vars, apply_next):
        del apply_next  # the end of the chain: this hook applies the update itself
        grads_and_vars = self._aligned(grads_and_vars)
        # Positions' rows are summed with the dense gradients; tokens' rows stay apart below.
        grads = sparse_rows.independent_made_dense([g for g, _ in grads_and_vars])
        overflow = tf.constant(0.0)
        if self.scaling is not None:  # mixed_float16: unscale, and note an overflow
            scale = tf.cast(self.scaling.dynamic_scale, tf.float32)
            grads = [None if g is None else tf.convert_to_tensor(g) / scale for g in grads]
            finite = [tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None]
            overflow = 1.0 - tf.cast(tf.reduce_all(tf.stack(finite)), tf.float32)
        grads = compat.clip_gradients(self.optimizer, grads)  # per replica, as Keras clips
        present = [g is not None for g in grads]
        # A gradient that is None stays out (zeros travel for it, and its variable is left
        # alone, as Keras leaves it).
        context = tf.distribute.get_replica_context()
        # An Embedding's rows of ids read from the batch stay apart, as one device's tape
        # holds them (Adam squares each): gathered from every replica, not summed dense.
        rows = {}
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                values = context.all_gather(g.values, axis=0)
                indices = context.all_gather(tf.cast(g.indices, tf.int64), axis=0)
                rows[i] = (values, indices)
        given = [
            tf.zeros(v.shape, self.dtype)  # its rows travel apart
            if i in rows
            else tf.ensure_shape(tf.convert_to_tensor(g), v.shape)
            for i, (g, (_, v)) in enumerate(zip(grads, grads_and_vars, strict=True))
            if g is not None
        ]
        return context.merge_call(
            self._update, args=(given, overflow), kwargs={"present": present, "rows": rows}
        )

    def _aligned(self, grads_and_vars) -> list:
        """The step's (gradient, weight) pairs in the order of the weights this hook
        shards (a train_step may list them in another), None for a weight given none."""
        given = {id(v): g for g, v in grads_and_vars}
        position = {id(v) for v in self.variables}
        stray = [v for _, v in grads_and_vars if id(v) not in position]
        if stray:
            raise ShardingError(
                f"{self.name} shards {type(self.optimizer).__name__}'s state over the "
                f"{len(self.variables)} weights it was built on, and the step applies it to "
                f"{stray[0].path}, which is not one of them. Build the optimizer on every "
                f"weight it updates. Received: {len(stray)} weight(s) outside its build"
            )
        return [(given.get(id(v)), v) for v in self.variables]

    def _finite(self, strategy, overflow) -> tf.Tensor | None:
        """Whether no replica's gradients overflowed (None: no loss scaling). One small
        all-reduce across processes, so every replica takes the same decision."""
        if self.scaling is None:
            return None
        local = tf.add_n(list(strategy.experimental_local_results(overflow)))
        total = self.ring.all_reduce(tf.reshape(local, [1]))[0] if self.ring else local
        return tf.equal(total, 0.0)

    def _update(self, strategy, given, overflow, present: list[bool], rows: dict):
        """In cross-replica context: bucket by bucket, reduce, update each local replica's
        slice, gather, write back. Each bucket starts when the previous one is written, so
        what the update holds beside the gradients is one bucket's worth. Under loss
        scaling a step whose gradients overflowed anywhere changes no weight."""
        variables = self.variables
        optimizer = self.optimizer
        finite = self._finite(strategy, overflow)
        learning_rate = optimizer.learning_rate
        weight_decay = optimizer.weight_decay or 0.0
        positions = [sum(present[:i]) if present[i] else None for i in range(len(present))]
        local = [strategy.experimental_local_results(g) for g in given]
        weights = [
            [strategy.experimental_local_results(v.value)[d] for v in variables]
            for d in range(len(self.devices))
        ]
        started = [r.begin_step(optimizer.iterations) for r in self.replicas]
        written: list = started
        for b, partition in enumerate(self.partitions):
            with tf.control_dependencies(written):
                flats = []
                for d, device in enumerate(self.devices):
                    with tf.device(device):
                        flats.append(self._pack(partition, local, positions, d))
                slices = self._reduced_slices(partition, flats)
                updated = []
                for d, (replica, grad) in enumerate(zip(self.replicas, slices, strict=True)):
                    with tf.device(replica.device):
                        updated.append(
                            replica.update(
                                b,
                                grad,
                                weights[d],
                                present,
                                learning_rate,
                                weight_decay,
                                finite,
                                rows={
                                    i: tuple(strategy.experimental_local_results(t)[d] for t in r)
                                    for i, r in rows.items()
                                },
                            )  # fmt: skip
                        )
                wholes = self._gathered(partition, updated)
                written = []
                for d, whole in enumerate(wholes):
                    with tf.device(self.devices[d]):
                        written.extend(self._write_back(partition, whole, variables, present, d))
        with tf.control_dependencies(written):
            if finite is None:
                optimizer.iterations.assign_add(1)
            else:
                _count_scaled_step(self.scaling, finite)
        return None

    def _pack(self, partition: Partition, local, positions, d: int) -> tf.Tensor:
        parts = []
        for i in partition.order:
            if positions[i] is None:
                parts.append(tf.zeros([partition.sizes[i]], self.dtype))
            else:
                parts.append(tf.reshape(local[positions[i]][d], [-1]))
        return tf.concat(parts, axis=0)

    def _reduced_slices(self, partition: Partition, flats: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each local replica's owned chunk of the bucket's sum over every replica."""
        bounds = partition.bounds
        owned = [replica.chunk for replica in self.replicas]
        if self.ring is not None:  # one replica per process
            (flat,) = flats
            if self.stage == 1:
                start, end = bounds[owned[0]]
                return [self.ring.all_reduce(flat)[start:end]]
            return [self.ring.reduce_scatter(flat, bounds)]
        chunks = []
        for flat, device in zip(flats, self.devices, strict=True):
            with tf.device(device):
                chunks.append([flat[start:end] for start, end in bounds])
        chunks = local_ring_reduce_scatter(chunks, self.devices)
        if self.stage == 1:  # the whole sum on every device, then this replica's slice
            chunks = local_ring_all_gather(chunks, self.devices)
        return [chunks[d][c] for d, c in enumerate(owned)]

    def _gathered(self, partition: Partition, mine: list[tf.Tensor]) -> list[tf.Tensor]:
        """The bucket's whole buffer on every local device, from each replica's chunk."""
        bounds = partition.bounds
        if self.ring is not None:
            return [self.ring.all_gather(mine[0], bounds)]
        chunks = []
        for replica, chunk, device in zip(self.replicas, mine, self.devices, strict=True):
            with tf.device(device):
                row = [tf.zeros([end - start], self.dtype) for start, end in bounds]
                row[replica.chunk] = chunk
                chunks.append(row)
        chunks = local_ring_all_gather(chunks, self.devices)
        out = []
        for row, device in zip(chunks, self.devices, strict=True):
            with tf.device(device):
                out.append(tf.concat(row, axis=0))
        return out

    def _write_back(self, partition: Partition, whole, variables, present, d: int) -> list:
        writes = []
        for i in partition.order:
            if not present[i]:
                continue
            variable = variables[i]
            start = partition.offsets[i]
            value = tf.reshape(whole[start : start + partition.sizes[i]], variable.shape)
            if variable.constraint is not None:
                value = variable.constraint(value)
            component = self.strategy.experimental_local_results(variable.value)[d]
            writes.append(component.assign(value, read_value=False))
        return writes

    # --- checkpoints ----------------------------------------------------------------------------

    def checkpoint_state(self) -> dict:
        state = {"sharded_optimizer_state": _WholeSlots(self)}
        for sibling in self.own.values():
            key = f"sharded_optimizer_state_{sibling.ring_index}"
            state[key] = _WholeSlots(sibling)
        return state

    def slot_names(self) -> list[str]:
        """The optimizer's slots per weight (momentum, velocity, ...), in a fixed order."""
        names = sorted({name for replica in self.replicas for _, name in replica.slots})
        for replica in self.replicas:
            for piece in replica.all_pieces():
                for name in names:
                    slot = replica.slots.get((piece.index, name))
                    if slot is None or tuple(slot.shape) != piece.shape:
                        raise ShardingError(
                            f"{self.name} cannot checkpoint {type(self.optimizer).__name__}"
                            f": its slot {name!r} is not shaped like the weights it updates, so "
                            "the slices cannot be put back together whole. Checkpoint without "
                            "sharding, or use an optimizer whose slots are shaped like the "
                            f"weights (SGD, Adam, AdamW, LAMB, ...). Received: slot {name!r}"
                        )
        return names

    def whole_slots(self) -> dict[str, tf.Tensor]:
        """Every slot of every weight, whole, by "v<variable's index>_<slot>" (the index in
        the weights this hook updates, model.trainable_variables for compile's optimizer:
        names Keras numbers per process are not stable). A
        collective across worker processes: every worker calls it at the same point."""
        out = {}
        for name in self.slot_names():
            for b in range(len(self.partitions)):
                for i, value in self._whole_slot(name, b).items():
                    out[f"v{i}_{name}"] = value
        return out

    def _whole_slot(self, name: str, b: int) -> dict[int, tf.Tensor]:
        """Slot `name` of each weight of partition `b`, whole (a collective)."""
        variables = self.variables
        partition = self.partitions[b]
        mine = []
        for replica in self.replicas:
            pieces = replica.pieces[b]
            flat = [tf.reshape(replica.slots[p.index, name], [-1]) for p in pieces]
            mine.append(tf.concat(flat, 0) if flat else tf.zeros([0], self.dtype))
        whole = self._gathered(partition, mine)[0]
        out = {}
        for i in partition.order:
            start = partition.offsets[i]
            out[i] = tf.reshape(whole[start : start + partition.sizes[i]], variables[i].shape)
        return out

    def slot_reader(self) -> saved_state.BucketReader:
        """Whole slots for a save, a partition's at a time (collectives)."""
        buckets = [partition.order for partition in self.partitions]
        return saved_state.BucketReader(buckets, self._whole_slot, self.slot_names())

    def restore_slots(self, restored: dict[str, tf.Tensor]) -> None:
        """Gives each local replica its slices of whole slots (saved with any number of
        replicas: a resume may change it)."""
        names = self.slot_names()
        for replica in self.replicas:
            for piece in replica.all_pieces():
                for name in names:
                    flat = tf.reshape(restored[f"v{piece.index}_{name}"], [-1])
                    flat = flat[piece.start : piece.end]
                    replica.slots[piece.index, name].assign(tf.reshape(flat, piece.shape))

    # --- what it holds --------------------------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        """Bytes this process holds: the optimizer's slots (all local replicas) and the
        pieces of weights they update."""
        slots = sum(r.slot_bytes() for r in self.replicas)
        pieces = sum(r.piece_bytes() for r in self.replicas)
        return {"optimizer_state": slots, "weight_slices": pieces}


class _WholeSlots(compat.Trackable):
    """The sharded optimizer state as a checkpoint holds it: each slot of each weight whole,
    so a job saved with N replicas resumes with any other number."""

    def __init__(self, hook: ShardedUpdate):
        self.hook = hook

    def _serialize_to_tensors(self):
        return self.hook.whole_slots()

    def _restore_from_tensors(self, restored_tensors):
        self.hook.restore_slots(restored_tensors)
        return tf.no_op()


def _count_scaled_step(scaling, finite) -> None:
    """A LossScaleOptimizer's bookkeeping after a step, as Keras keeps it: a finite step
    counts (and every dynamic_growth_steps-th doubles the scale); an overflow halves the
    scale and restarts the count, and the step is not counted."""

    def counted():
        scaling.iterations.assign_add(1)
        count = tf.convert_to_tensor(scaling.step_counter)
        grow = tf.equal(count, tf.cast(scaling.dynamic_growth_steps - 1, count.dtype))
        scaling.step_counter.assign(tf.where(grow, tf.zeros_like(count), count + 1))
        scaling.dynamic_scale.assign(
            tf.where(grow, scaling.dynamic_scale * 2.0, scaling.dynamic_scale)
        )
        return tf.constant(True)

    def overflowed():
        scaling.step_counter.assign(0)
        scaling.dynamic_scale.assign(scaling.dynamic_scale * 0.5)
        return tf.constant(False)

    tf.cond(finite, counted, overflowed)


def refuse_own_optimizers(model: keras.Model, name: str) -> None:
    """Refuses a model whose custom train_step applies optimizers of its own: the hook
    shards the optimizer compile took, and theirs would stay whole on every replica."""
    own = steps.own_optimizers(model)
    if own:
        listed = ", ".join(f"{attr} ({type(o).__name__})" for attr, o in own.items())
        raise ShardingError(
            f"Model {model.name!r} has its own train_step, which applies {listed} itself; "
            f"{name} shards only the optimizer compile took, so their state would stay whole "
            "on every replica. Train without shard_optimizer (the weights train the same), "
            "or apply self.optimizer in the step. Received: a train_step with optimizers "
            f"{', '.join(own)}"
        )


def _split_optimizer(optimizer, name: str):
    """(the optimizer whose update the slices apply, the LossScaleOptimizer around it or
    None); refused where a sharded update cannot reproduce it."""
    if optimizer is None:
        raise ShardingError(f"{name} shards the optimizer's state, but the model has none.")
    scaling = None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        scaling, optimizer = optimizer, optimizer.inner_optimizer
    if not compat.updates_only_through_update_step(optimizer):
        raise ShardingError(
            f"{name} applies {type(optimizer).__name__}'s update_step to each replica's slice, "
            "but this optimizer keeps state outside update_step (Nadam's momentum schedule, "
            "an optimizer of optimizers), which slices would skip. Use another optimizer "
            f"(Adam, AdamW, SGD, ...) or drop shard_optimizer. Received: "
            f"{type(optimizer).__name__}"
        )
    if optimizer.use_ema:
        raise ShardingError(
            f"{name} does not shard an optimizer with use_ema=True (its moving averages "
            "would be kept per slice and finalize_variable_values reads them whole). "
            "Drop use_ema or shard_optimizer. Received: use_ema=True"
        )
    if optimizer.gradient_accumulation_steps:
        raise ShardingError(
            f"{name} takes tfdist's accumulate_steps=k, which exchanges once per k "
            "micro-batches, instead of the optimizer's gradient_accumulation_steps. "
            f"Received: gradient_accumulation_steps={optimizer.gradient_accumulation_steps}"
        )
    return optimizer, scaling

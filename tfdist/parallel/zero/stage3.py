"""ZeRO stage 3: the weights, their gradients and the optimizer's state sharded over the
replicas; each weight gathered whole only where a layer reads it.

Stages 1 and 2 (zero/sharded.py) shard the optimizer's state and the gradients, but every replica
still keeps every weight whole. Under stage 3 (Rajbhandari et al., 2020) each of the N
replicas keeps 1/N of each weight (a flat, padded slice) and the slots for that slice, on
its device: 3/N of the weights' bytes under Adam, against 3 for plain data parallelism.
Each step:

  1. Forward: each unit (tfdist.parallel.zero.units: by default each layer that owns weights)
     all-gathers its weights from the replicas' slices once its inputs exist, runs, and
     drops them.
  2. Backward: once the gradients of a unit's outputs arrive, the unit gathers its weights
     again and runs its call again under a tape (its activations are recomputed, as FSDP
     with activation checkpointing does), and each weight's gradient is summed over the
     replicas there and then, keeping only this replica's slice of the sum: no gathered
     weight and no whole gradient outlives its unit's backward pass. (An Embedding's
     looked-up rows stay sparse and are summed at the update, as one device applies them.)
  3. Update: each replica applies a copy of the user's optimizer (same class and config,
     slots built for its slices) to its slices, as Keras's optimizer would to the whole.

The collectives of steps 1 and 2 are the strategy's own, so they run in the order they are
made; every replica traces the same program and its tape visits the units in the same
order, so the replicas meet at each one.

How a layer reads a slice-held weight without being rewritten: each trainable weight's
storage (the tf.Variable a Keras variable reads) is a stand-in (`_Sharded`) whose value is
the gather above and whose resource handle is the replica's slice.
`tape.gradient(loss, model.trainable_variables)` - Keras's train_step, and a model's own -
therefore returns a gradient per slice (the sum made in step 2), and `optimizer.apply` (the
step's chain, which this hook ends) updates the slices with it. A model's own train_step
that differentiates its trainable variables and applies the result through its optimizer
works unchanged; one that changes the gradients in between (scales, clips) is refused in
one line, since the update applies what the backward pass summed.

No process keeps the whole model. A model built in tfdist.host_scope is made as the
replicas' slices, and when training first starts they are adopted as they are; one built
under `strategy.scope()` has each weight's slices taken from it and its whole copy
dropped, one weight at a time. From then on the weight's storage is the slices.
Where something reads a weight outside a step (`model.save`, `get_weights`, `predict` and
evaluation, a checkpoint), it is gathered whole for that read, one weight at a time: the
local replicas' slices put together, or across worker processes an all-gather, which every
process must make at the same point (as every process calls fit, and saves). Assigning a
weight (`set_weights`, `load_weights`, a restore) assigns each replica its slice.
tfdist.StepCheckpoint writes each process's slices (tfdist.training.shards), and a job
saved with N replicas resumes with any other number; Keras's own checkpoints read each
weight and slot whole.

Over the local devices of a mirrored strategy (a gather reads the other replicas' slices)
or the worker processes of a multi_worker_mirrored job (one replica each: a gather is an
all-gather). Not built: prefetching the next unit's gather to overlap its transfer with
compute, and a reduce-scatter (TensorFlow's has no CPU kernel; the sum is an all-reduce
of which each replica keeps its slice).
"""

from __future__ import annotations

import re
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.parallel import host, optimizer_copies, saved_state, stand_in
from tfdist.parallel.tensor.layout_map import plan_of
from tfdist.parallel.zero import units
from tfdist.parallel.zero.offload import Offload
from tfdist.parallel.zero.sharded import (
    ShardedUpdate,
    ShardingError,
    _WholeSlots,
    refuse_own_optimizers,
)
from tfdist.strategies import replicas
from tfdist.training import shards as shard_files
from tfdist.training import sparse_rows
from tfdist.training.hooks import StepHook
from tfdist.training.job import Job

NAME = "shard_optimizer='zero3'"
# A checkpoint's slots are made whole in gathers of about this many bytes, not all at
# once: what that adds to a process's peak.
GATHER_BUCKET_BYTES = 4 * 2**20


def shard_hook(stage, offload: str | Offload | None = None, *, model=None) -> StepHook | None:
    """The hook fit's `shard_optimizer` asks for: zero1 and zero2 shard the optimizer's
    state (and the gradients) of whole weights; zero3 the weights too. `offload`
    ('optimizer') keeps the optimizer's state in host memory. None for a model split by a
    tensor-parallel layout: its hook shards its parts over their data groups itself."""
    if model is not None and plan_of(model) is not None:
        return None
    if stage in ("zero3", 3):
        return ShardedParameters(offload=offload)
    return ShardedUpdate(stage, offload=offload)


class ShardedParameters(StepHook):
    """A StepHook that shards the weights, gradients and optimizer state (ZeRO stage 3).

    It ends the update chain: it applies each replica's slice of the gradients to that
    replica's slice of the weights. See the module docstring for what a step does.

    Args:
      offload: None, or 'optimizer' (ZeRO-Offload): each replica's slots live in host
        memory beside a copy of its slice of the weights, where its update runs; the
        updated slice is copied to the device. A device then holds its slice of the weights
        and the gradients, not its slots.

    Example:

        with tfdist.host_scope(strategy):
            model = build_model()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        tfdist.fit(model, data, shard_optimizer="zero3")
    """

    synchronous_only = True
    takes_host_scope_models = True
    keeps_optimizer_state = True
    applies_update = True
    ends_chain = True

    def __init__(self, *, offload: str | Offload | None = None):
        self.offload = Offload.of(offload, who=NAME, error=ShardingError)
        self.shards: list[list[keras.Variable]] = []

    @property
    def name(self) -> str:
        return NAME

    # --- building -------------------------------------------------------------------------------

    def build(self, model: keras.Model, job: Job) -> None:
        self.model, self.strategy = model, job.strategy
        if self.already_built(model, job):
            return  # a later fit: the slices keep the optimizer's state
        refuse_own_optimizers(model, NAME)
        optimizer = model.optimizer
        _check_optimizer(optimizer)
        layout = replicas.one_replica_per_process(job.placement, who=NAME, error=ShardingError)
        if layout.replicas < 2:
            raise ShardingError(
                f"{NAME} shards the weights over the replicas, and this strategy has 1. Use 2 "
                "or more devices (tfdist.configure_cpu_devices(2) for logical CPUs) or worker "
                "processes, or drop shard_optimizer. Received: 1 replica"
            )
        self.ranks, self.first = layout.replicas, layout.first_replica
        self.devices = list(layout.devices)
        self.cut = host.Slices(self.strategy)
        # Every replica in this process (logical devices, GPUs): a gather reads their slices.
        self.local = self.cut.local
        self.units = units.layers(model)
        self.variables = list(model.trainable_variables)
        self.sizes = [int(np.prod(v.shape, dtype=np.int64)) for v in self.variables]
        self.lengths = [self.cut.length(n) for n in self.sizes]
        self.decays = optimizer_copies.decoupled_decays(optimizer, self.variables)
        self.optimizer = optimizer
        if not optimizer.built:
            optimizer.build([])  # iterations and the learning rate; the slices keep the slots

        self._make_slices()
        self._adopt_weights(model)
        self._make_copies(optimizer)
        saved_state.keep_in_saves(optimizer, model, self.slot_reader)
        self._gatherers: dict = {}
        # Per traced graph: (local replica, weight) -> one _Backward per read of the weight
        # (this replica's whole gradient of it, and the part the tape was given).
        self._backward: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _make_slices(self) -> None:
        """Each replica's slice of every weight, on its device (and on the host, offloaded)."""

        def slices(devices=None):
            out = []
            for device in devices or self.devices:
                with tf.device(device):
                    out.append([
                        keras.Variable(
                            np.zeros([k], v.dtype), dtype=v.dtype, name=f"zero3_v{i}",
                            autocast=False,
                        )
                        for i, (v, k) in enumerate(zip(self.variables, self.lengths, strict=True))
                    ])  # fmt: skip
            return out

        self.shards = optimizer_copies.outside_strategy(slices)
        # Offloaded: the optimizer's copies update host copies of the slices (their slots
        # made beside them), each copied to its device after the update.
        self.state_device = self.offload.state_device(self.strategy, None)
        self.updated = self.shards
        if self.offload:
            self.updated = optimizer_copies.outside_strategy(
                lambda: slices([self.state_device] * len(self.devices))
            )

    def _adopt_weights(self, model: keras.Model) -> None:
        """Each weight's storage becomes its slices (see _Sharded)."""
        # Each weight's slices adopted as host_scope made them, or taken from its whole
        # copy (mirrored, or sliced for another layout), which is then dropped, one weight
        # at a time: from here on no process holds the whole model.
        self.storages = []
        dropped = host.Dropped()
        for i, variable in enumerate(self.variables):
            whole = compat.storage_of(variable)
            born = isinstance(whole, host.Sliced) and whole.cut.same(self.cut)
            for d, shards in enumerate(self.shards):
                shards[i].assign(whole.parts[d] if born else self.cut.slice(whole, self.first + d))
            self.storages.append(_Sharded(self, i, whole))
            compat.replace_storage(variable, self.storages[-1])
            dropped.add(whole)  # its values now in the shards
            del whole
        compat.forget_traced_functions(model)  # they read the whole copies
        dropped.free()  # a copy a traced function captured sits in a cycle: freed now
        units.recompute(self.units)

    def _make_copies(self, optimizer) -> None:
        """A copy of the user's optimizer per replica, over its slices, and their slots by
        (weight, slot name)."""
        self.copies = optimizer_copies.outside_strategy(
            lambda: [
                _on(
                    self.state_device or device,
                    lambda s=held: optimizer_copies.optimizer_copy(optimizer, s),
                )
                for device, held in zip(self.devices, self.updated, strict=True)
            ]  # fmt: skip
        )
        self.slots: list[dict[tuple[int, str], keras.Variable]] = []
        for copy in self.copies:
            slots = {}
            for slot in copy.variables:
                found = re.search(r"zero3_v(\d+)_(\w+)$", slot.path)
                if found:
                    slots[int(found.group(1)), found.group(2)] = slot
            self.slots.append(slots)
        self.slot_names = sorted({name for slots in self.slots for _, name in slots})

    # --- the whole weights, on demand -------------------------------------------------------

    def whole(self, i: int) -> tf.Tensor:
        """Weight `i` whole, outside a replica's step (a save, `get_weights`, a callback):
        the local slices put together, or across worker processes an all-gather, which every
        process must make at the same point, as each makes every read of fit's."""
        parts = [shards[i].value for shards in self.shards]
        return self.cut.whole(parts, self.variables[i].shape, NAME)

    def assign_whole(self, i: int, value) -> None:
        """Weight `i` set to `value` (whole): each local replica keeps its slice of it."""
        value = tf.convert_to_tensor(value, self.variables[i].dtype)
        for d, shards in enumerate(self.shards):
            shards[i].assign(self.cut.slice(value, self.first + d))

    def _buckets(self) -> list[tuple[int, ...]]:
        """The weights' positions in runs of about GATHER_BUCKET_BYTES whole (a larger one
        alone), the same on every replica: what one gather makes whole at once."""
        out, size = [[]], 0
        for i, v in enumerate(self.variables):
            bytes_ = self.lengths[i] * self.ranks * tf.as_dtype(v.dtype).size
            if out[-1] and size + bytes_ > GATHER_BUCKET_BYTES:
                out.append([])
                size = 0
            out[-1].append(i)
            size += bytes_
        return [tuple(b) for b in out if b]

    def _wholes(self, slot: str, bucket: tuple[int, ...]) -> list[tf.Tensor]:
        """The whole `slot` of each weight in `bucket`, from every replica's slices,
        all-gathered in one collective."""
        key = (slot, bucket)
        if key not in self._gatherers:
            self._gatherers[key] = tf.function(lambda: self._gather_all_replicas(slot, bucket))
        with stand_in.read_together(NAME, self.strategy):
            flat = self._gatherers[key]()
        total = sum(self.lengths[i] for i in bucket)
        rows = tf.reshape(flat, [self.ranks, total])
        out, at = [], 0
        for i in bucket:
            k = self.lengths[i]
            column = tf.reshape(rows[:, at : at + k], [-1])[: self.sizes[i]]
            out.append(tf.reshape(column, self.variables[i].shape))
            at += k
        return out

    def _gather_all_replicas(self, slot: str, bucket: tuple[int, ...]):
        def replica():
            d = self._local_index()
            # Placed on the replica's device, as the strategy's collectives ask.
            with tf.device(self.devices[d]):
                parts = [tf.reshape(self.slots[d][i, slot].value, [-1]) for i in bucket]
                flat = tf.concat(parts, 0)
                return tf.distribute.get_replica_context().all_gather(
                    flat, axis=0, options=stand_in.read_options()
                )

        gathered = self.strategy.run(replica)
        return self.strategy.experimental_local_results(gathered)[0]

    def _local_index(self) -> int:
        context = tf.distribute.get_replica_context()
        replica = tf.get_static_value(context.replica_id_in_sync_group)
        if replica is None:
            if len(self.devices) == 1:
                return 0
            raise ShardingError(f"{NAME} needs each replica's id when its step is traced.")
        return int(replica) - self.first

    # --- one step -------------------------------------------------------------------------------

    def gathered(self, i: int) -> tf.Tensor:
        """Weight `i` whole on this replica, gathered from every replica's slice where it is
        read: in a unit's forward pass once the unit's inputs exist, and again in its
        backward pass once its outputs' gradients do (units.awaited), so that it lives
        while its layer runs.

        Its backward pass sums this replica's gradient of the whole weight over the replicas
        at once and hands the tape this replica's slice of the sum: no whole gradient
        outlives its layer's backward pass. An Embedding's looked-up rows stay sparse, kept
        for `apply`, which sums them as one device applies them.
        """
        context = tf.distribute.get_replica_context()
        d = self._local_index()
        rank, k, n = self.first + d, self.lengths[i], self.sizes[i]
        shape, ranks = self.variables[i].shape, self.ranks

        def total(flat):
            return context.all_reduce(tf.distribute.ReduceOp.SUM, flat)

        with tf.device(self.devices[d]), tf.control_dependencies(units.awaited()):
            mine = tf.identity(self.shards[d][i].value)  # read on the tape
            # The other replicas' slices, where they are in this process: read, not sent.
            others = [tf.stop_gradient(s[i].value) for s in self.shards] if self.local else []

        @tf.custom_gradient
        def gather(part):
            if others:
                whole = tf.concat([*others[:d], part, *others[d + 1 :]], 0)
            else:
                whole = context.all_gather(part, axis=0)

            def grad(upstream):
                backward = self._backward.setdefault(tf.compat.v1.get_default_graph(), {})
                entry = _Backward.of(upstream, shape, k * ranks, n, lo=rank * k, length=k,
                                     total=total)  # fmt: skip
                backward.setdefault((d, i), []).append(entry)
                return entry.mine

            return tf.reshape(whole if n == k * ranks else whole[:n], shape), grad

        with tf.device(self.devices[d]):  # a read takes its variable's place, not a device
            return gather(mine)

    def shard(self, i: int) -> keras.Variable:
        return self.shards[self._local_index() if self.in_step() else 0][i]

    def in_step(self) -> bool:
        """Whether a replica of this strategy is being traced (its reads gather there)."""
        context = tf.distribute.get_replica_context()
        return context is not None and context.strategy is self.strategy

    def apply(self, grads_and_vars, apply_next):
        del apply_next  # the end of the chain: this hook applies the update itself
        context = tf.distribute.get_replica_context()
        d = self._local_index()
        given = {id(v): g for g, v in grads_and_vars}
        backward = self._backward.get(tf.compat.v1.get_default_graph(), {})
        present = [i for i, v in enumerate(self.variables) if given.get(id(v)) is not None]
        entries = {}
        for i in present:
            kept = backward.pop((d, i), [])  # the replicas' backward passes interleave
            _check_unchanged(given[id(self.variables[i])], [e.mine for e in kept], i, self)
            entries[i] = kept
        slices = self._summed_slices(context, d, entries)
        shards, updated = self.shards[d], self.updated[d]
        if self.offload:  # the host's copies take the slices' values (a restore set those)
            with tf.device(self.state_device):
                for i in present:
                    updated[i].assign(shards[i].value)
        optimizer_copies.apply_with_copy(
            self.optimizer, self.copies[d], [slices[i] for i in present],
            [updated[i] for i in present], [self.decays[i] for i in present],
            self.state_device or self.devices[d],
        )  # fmt: skip
        if self.offload:
            with tf.device(self.devices[d]):
                for i in present:
                    shards[i].assign(updated[i].value)
        return None

    def _summed_slices(self, context, d: int, entries: dict) -> dict:
        """This replica's slice of each weight's gradient summed over the replicas
        (`entries`: weight -> its reads' _Backward), in the weights' order on every replica.
        A dense read's is summed already (in the backward pass); looked-up rows are summed
        here, kept row by row as Keras's optimizers take them, or added to the dense part
        of a weight read both ways (a tied embedding's lookup and logits)."""
        rank, out = self.first + d, {}
        with tf.device(self.devices[d]):
            for i, kept in entries.items():
                summed = [e.mine for e in kept if not e.sparse]
                rows = [e for e in kept if e.sparse]
                k = self.lengths[i]
                if not rows:
                    out[i] = tf.add_n(summed)
                elif summed:
                    local = tf.add_n([e.dense() for e in rows])
                    total = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
                    out[i] = tf.add_n([*summed, total[rank * k : (rank + 1) * k]])
                else:
                    values = tf.concat([e.values for e in rows], 0)
                    where = tf.concat([e.where for e in rows], 0)
                    if sparse_rows.batch_independent(where):
                        # The same ids on every replica: one device's rows are their sum.
                        values = context.all_reduce(tf.distribute.ReduceOp.SUM, values)
                    else:
                        values = context.all_gather(values, axis=0)
                        where = context.all_gather(where, axis=0)
                    out[i] = _in_range(values, where, rank * k, k)
        return out

    # --- checkpoints ----------------------------------------------------------------------------

    def checkpoint_state(self) -> dict:
        return {"sharded_optimizer_state": _WholeSlots(self)}

    def checkpoint_shards(self) -> shard_files.Shards:
        return _SliceShards(self)

    def whole_slots(self) -> dict[str, tf.Tensor]:
        """Every slot of every weight, whole, by "v<index>_<slot>" (collective); nothing in
        a sharded checkpoint's main part (its shards hold the slices)."""
        if shard_files.saving():
            return {}
        out = {}
        for name in self.slot_names:
            for bucket in self._buckets():
                for i, whole in zip(bucket, self._wholes(name, bucket), strict=True):
                    out[f"v{i}_{name}"] = whole
        return out

    def slot_reader(self) -> saved_state.BucketReader:
        """Whole slots for a save, a gather bucket's at a time (collectives)."""
        buckets = self._buckets()

        def gather(name: str, b: int) -> dict[int, tf.Tensor]:
            return dict(zip(buckets[b], self._wholes(name, buckets[b]), strict=True))

        return saved_state.BucketReader(buckets, gather, self.slot_names)

    def restore_slots(self, restored: dict[str, tf.Tensor]) -> None:
        for d, slots in enumerate(self.slots):
            for (i, name), slot in slots.items():
                slot.assign(self.cut.slice(restored[f"v{i}_{name}"], self.first + d))

    # --- what it holds --------------------------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        """Bytes this process's replicas hold: their slices and the slices' slots."""

        def count(variables):
            return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)

        return {
            "weight_slices": sum(count(shards) for shards in self.shards),
            "optimizer_state": sum(count(slots.values()) for slots in self.slots),
        }


class _Sharded(stand_in.WholeStandIn):
    """A weight's storage under zero3 (compat.replace_storage), from the first fit on: its
    value is gathered from the replicas' slices where it is read (in a replica's step,
    ShardedParameters.gathered; elsewhere ShardedParameters.whole), assigning it assigns
    the slices, and its resource handle is the replica's slice, so the tape's gradient for
    the weight is the slice's. Keras's checkpoints hold it whole; tfdist.StepCheckpoint
    writes each process's slices (_SliceShards)."""

    def __init__(self, hook: ShardedParameters, index: int, whole):
        super().__init__(whole, lambda: hook.shard(index))
        self.hook, self.index = hook, index
        self.trainable = True

    def read(self) -> tf.Tensor:
        if self.hook.in_step():
            return self.hook.gathered(self.index)
        return self.hook.whole(self.index)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        del use_locking, name, read_value
        self.hook.assign_whole(self.index, value)


class _SliceShards(shard_files.Shards):
    """zero3's part of a sharded checkpoint: each local replica's slice of each weight and
    of its slots, as a slice of the weight's flattened values (the padding left out)."""

    def __init__(self, hook: ShardedParameters):
        self.hook = hook

    def _pieces(self):
        """(local replica, weight, first element, end) of each non-empty slice here."""
        hook = self.hook
        for d in range(len(hook.shards)):
            for i, (k, n) in enumerate(zip(hook.lengths, hook.sizes, strict=True)):
                lo = (hook.first + d) * k
                if lo < n:
                    yield d, i, lo, min(lo + k, n)

    def _held(self, d: int, i: int) -> list[tuple[str, keras.Variable]]:
        """(key, variable) of weight i's slice on local replica d and of its slots'."""
        hook = self.hook
        held = [(shard_files.weight_key(i), hook.shards[d][i])]
        for name in hook.slot_names:
            if (i, name) in hook.slots[d]:
                held.append((shard_files.slot_key(i, name), hook.slots[d][i, name]))
        return held

    def entries(self) -> list[shard_files.Entry]:
        out = []
        for d, i, lo, hi in self._pieces():
            spec = shard_files.flat_slice(self.hook.sizes[i], lo, hi)
            shape = tuple(self.hook.variables[i].shape)
            for key, variable in self._held(d, i):
                # Made as its bundle is written (the padding cut off: a copy).
                value = lambda v=variable, n=hi - lo: v.value[:n]  # noqa: E731
                out.append(shard_files.Entry(key, value, spec, variable.dtype, (hi - lo,), shape))
        return out

    def wanted(self) -> list[shard_files.Wanted]:
        out = []
        for d, i, lo, hi in self._pieces():
            spec, k = shard_files.flat_slice(self.hook.sizes[i], lo, hi), self.hook.lengths[i]
            shape = tuple(self.hook.variables[i].shape)
            for key, variable in self._held(d, i):
                assign = lambda value, v=variable, k=k: v.assign(shard_files.padded(value, k))  # noqa: E731
                out.append(
                    shard_files.Wanted(key, variable.dtype, assign, spec, weight_shape=shape)
                )
        return out


class _Backward:
    """One read's gradient of a whole weight on one replica: dense, `mine` is this replica's
    slice of it summed over the replicas; sparse (the looked-up rows' values, element by
    element, and their places in the flat weight, kept for the update), `mine` is the part
    of this replica's own rows in its slice. `mine` is what the tape is given."""

    def __init__(self, *, mine, values=None, where=None, padded: int = 0):
        self.mine, self.values, self.where = mine, values, where
        self.sparse, self.padded = values is not None, padded

    @classmethod
    def of(cls, upstream, shape, padded: int, n: int, *, lo: int, length: int, total):
        if isinstance(upstream, tf.IndexedSlices):
            width = n // int(shape[0])
            values = tf.reshape(upstream.values, [-1])
            rows = tf.cast(upstream.indices, tf.int64)[:, None] * width
            where = tf.reshape(rows + tf.range(width, dtype=tf.int64)[None, :], [-1])
            mine = tf.convert_to_tensor(_in_range(values, where, lo, length))
            return cls(mine=mine, values=values, where=where, padded=padded)
        flat = tf.reshape(tf.convert_to_tensor(upstream), [-1])
        summed = total(tf.pad(flat, [[0, padded - n]]) if padded > n else flat)
        return cls(mine=_own(summed[lo : lo + length]), padded=padded)

    def dense(self) -> tf.Tensor:
        return tf.math.unsorted_segment_sum(self.values, self.where, self.padded)


def _in_range(values, where, lo: int, length: int) -> tf.IndexedSlices:
    """The elements of a sparse gradient that fall in the slice [lo, lo + length), as a
    sparse gradient of the slice (each looked-up element kept apart)."""
    keep = (where >= lo) & (where < lo + length)
    return tf.IndexedSlices(
        tf.boolean_mask(values, keep),
        tf.boolean_mask(where, keep) - lo,
        dense_shape=tf.constant([length], tf.int64),
    )


def _check_unchanged(grad, mine: list, i: int, hook: ShardedParameters) -> None:
    """Refuses a gradient the step changed between the tape and the update (scaled, clipped,
    noised): zero3 reduces what the backward pass produced, so it would be lost."""

    def ours(tensor) -> bool:
        if any(tensor is m for m in mine):
            return True
        op = getattr(tensor, "op", None)
        return (
            op is not None
            and op.type in ("AddN", "AddV2", "Identity")
            and all(ours(t) for t in op.inputs)
        )

    if not mine or not ours(grad):
        raise ShardingError(
            f"{NAME} reduces each weight's gradient as the backward pass made it, but the "
            f"step changed the gradient of {hook.variables[i].path} before the update (a "
            "train_step or step hook that scales, clips or adds to gradients, or "
            "accumulate_steps, which weighs each micro-batch's). Apply such changes in the "
            "loss, or use zero2. Received: a changed gradient"
        )


def _check_optimizer(optimizer) -> None:
    optimizer_copies.check_copyable(optimizer, who=f"{NAME}'s slices", error=ShardingError)
    if not isinstance(optimizer, optimizer_copies.ELEMENTWISE):
        raise ShardingError(
            f"{NAME} cuts each weight into N equal flat slices, so its optimizer must update "
            "each element from its own gradient and slots; "
            f"{type(optimizer).__name__} reads whole weights (a trust ratio, factored "
            "moments). Use Adam, AdamW, SGD, RMSprop, Lion, ..., or zero2 with "
            f"partition='variables'. Received: {type(optimizer).__name__}"
        )
    for option in ("clipnorm", "clipvalue"):
        if getattr(optimizer, option) is not None:
            raise ShardingError(
                f"{NAME} applies gradients that arrive summed over the replicas and sliced, so "
                f"Keras's per-replica clipping ({option}) has no whole gradient to clip. Drop "
                f"{option}, or use zero2. Received: {option}={getattr(optimizer, option)}"
            )


def _own(part: tf.Tensor) -> tf.Tensor:
    """`part`, a slice of a larger tensor, in a buffer of its own: TensorFlow's slice of a
    tensor's leading rows shares the whole tensor's buffer, so a slice kept (a replica's
    slice of a weight, of a summed gradient) would keep the whole alive."""
    return tf.raw_ops.DeepCopy(x=part)


def _on(device: str, make):
    with tf.device(device):
        return make()


__all__ = ["ShardedParameters", "shard_hook"]

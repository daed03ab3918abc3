"""Local SGD: each replica takes k optimizer steps on its own, then the replicas average.

Synchronous data parallelism exchanges gradients at every step, and every worker waits for
the slowest at every step. Local SGD (periodic model averaging; Lin et al., 2020, "Don't use
large mini-batches, use local SGD") lets each replica update its own copy of the weights
from its own batches for k steps, then replaces every copy by their mean with one
all-reduce: k times fewer exchanges, and one wait for the slowest worker every k steps.
With k=1, SGD (with or without momentum) is synchronous SGD exactly: the mean of the
replicas' updates is the update of their mean gradient. Post-local SGD (the same paper)
trains synchronously for the first `sync_steps` steps, when early large gradients make
every exchange count, then locally. PyTorch's PostLocalSGDOptimizer and
PeriodicModelAverager are the same idea.

Each replica keeps its own copy of the user's optimizer (optimizer_copies.py: same class and config,
its slots on the replica's device), which counts the user's optimizer's steps and takes its
learning rate, so schedules and callbacks that change the rate work as usual.
`average_optimizer_state=True` averages the slots with the weights (one larger all-reduce;
Adam's moments then agree after every average).

The replicas' weights differ between averages, so every settle (each epoch end, and
before a checkpoint is saved) averages them: what is evaluated and saved is one model.

The base class here, LocalUpdates, is what gossip (gossip.py) shares: a replica applies its
own gradients to its own weights, then a `mix` combines the replicas' weights.

Example:

    tfdist.fit(model, data, average_every=4)
    # or, with the optimizer's state averaged, after 100 synchronous steps:
    tfdist.fit(model, data, step_hooks=[
        tfdist.parallel.LocalSGD(4, average_optimizer_state=True, sync_steps=100)])

Replicas are the local devices of a mirrored strategy, or the worker processes of a
multi_worker_mirrored job (one device each; the average travels over tfdist's ProcessRing).
"""

from __future__ import annotations

import logging
import re

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.collective.keys import group_key_base
from tfdist.collective.ring import local_ring_all_reduce
from tfdist.collective.transport import ProcessRing
from tfdist.errors import FitError
from tfdist.parallel import optimizer_copies
from tfdist.strategies import replicas
from tfdist.training.hooks import StepHook
from tfdist.training.job import Job

log = logging.getLogger(__name__)

# The averaging ring's group keys (collective/keys.py).
LOCAL_SGD_GROUP_KEY_BASE = group_key_base("local_sgd")


class LocalUpdateError(FitError):
    """Local SGD or gossip cannot train this model or strategy as asked."""


class LocalUpdates(StepHook):
    """Each replica applies its own gradients to its own weights; `mix` then combines them.

    It ends the update chain (it applies the gradients itself). Subclasses say how the
    replicas' weights are combined after each step (`mix`) and what that sends.

    Args:
      average_optimizer_state: average the optimizer's slots where the weights are averaged.
      timeout_seconds: how long a transfer between worker processes may wait for its peer;
        None waits forever.
    """

    synchronous_only = True
    keeps_optimizer_state = True
    applies_update = True
    ends_chain = True

    def __init__(self, *, average_optimizer_state: bool = False, timeout_seconds=None):
        self.average_optimizer_state = bool(average_optimizer_state)
        self.timeout_seconds = timeout_seconds
        self.replicas: list[_Replica] = []
        # At each settle: the largest distance (L2) of a replica's weights from the mean of
        # all replicas', and that distance over the mean's norm, before they were averaged
        # (the summary reports the largest).
        self.spreads: list[tuple[float, float]] = []
        self._settle_fn = None

    # --- building -------------------------------------------------------------------------------

    def build(self, model: keras.Model, job: Job) -> None:
        self.model, self.strategy, self.is_chief = model, job.strategy, job.is_chief
        if self.already_built(model, job):
            return  # a later fit: each replica keeps its optimizer's state
        optimizer = model.optimizer
        optimizer_copies.check_copyable(
            optimizer, who=f"{self.name}'s replicas", error=LocalUpdateError
        )
        layout = replicas.one_replica_per_process(
            job.placement, who=self.name, error=LocalUpdateError
        )
        devices = list(layout.devices)
        self.variables = list(model.trainable_variables)
        dtypes = {tf.as_dtype(v.dtype) for v in self.variables}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating:
            raise LocalUpdateError(
                f"{self.name} packs the trainable variables into one buffer to exchange "
                "them, so they must share one floating-point dtype. Received: "
                + ", ".join(sorted(d.name for d in dtypes))
            )
        self.dtype = next(iter(dtypes))
        self.devices = devices
        self.ranks = layout.replicas
        self.rank = layout.first_replica
        # The replica's own gradient is the mean over its own batch; Keras scaled each
        # replica's loss by 1/replicas so that the all-reduced sum would be the global mean.
        self.loss_scale = float(layout.replicas)
        if not optimizer.built:
            optimizer.build([])  # it keeps the step count and the learning rate; no slots
        self.replicas = optimizer_copies.outside_strategy(
            lambda: [_Replica(optimizer, self.variables, device) for device in devices]
        )
        self.sizes = [int(np.prod(v.shape)) for v in self.variables]
        self.processes = layout.processes > 1
        self.sent = optimizer_copies.outside_strategy(
            lambda: tf.Variable(0, dtype=tf.int64, trainable=False, name="bytes_sent")
        )
        self.connect()

    def connect(self) -> None:
        """Sets up the transport between worker processes (when there are several)."""
        self.ring = None
        if self.processes:
            self.ring = ProcessRing(
                rank=self.rank,
                ranks=self.ranks,
                timeout_seconds=self.timeout_seconds,
                group_key_base=LOCAL_SGD_GROUP_KEY_BASE,
            )

    # --- one step -------------------------------------------------------------------------------

    def apply(self, grads_and_vars, apply_next):
        del apply_next  # the end of the chain: this hook applies the update itself
        given = {id(v): g for g, v in grads_and_vars if g is not None}
        grads = [given.get(id(v)) for v in self.variables]
        present = [g is not None for g in grads]
        scaled = [_scaled(g, self.loss_scale) for g in grads if g is not None]
        context = tf.distribute.get_replica_context()
        return context.merge_call(self._update, args=(scaled,), kwargs={"present": present})

    def _update(self, strategy, given, present: list[bool]):
        """In cross-replica context: each local replica's update, then the mix."""
        optimizer = self.model.optimizer
        step = tf.identity(optimizer.iterations)  # the step being taken (from 0)
        local = [strategy.experimental_local_results(g) for g in given]
        per_replica = [[g[d] for g in local] for d in range(len(self.devices))]
        per_replica = self.local_gradients(step, per_replica, present)
        flats = []
        for d, replica in enumerate(self.replicas):
            with tf.device(replica.device):
                weights = self._components(strategy, d)
                flats.append(
                    replica.update(
                        per_replica[d],
                        weights,
                        present,
                        iterations=step,
                        learning_rate=optimizer.learning_rate,
                        weight_decay=optimizer.weight_decay or 0.0,
                        with_slots=self.average_optimizer_state,
                    )
                )
        mixed = self.mix(step, flats)
        writes = self._write_all(strategy, mixed)
        with tf.control_dependencies(writes):
            optimizer.iterations.assign_add(1)
        return None

    def _write_all(self, strategy, flats: list[tf.Tensor]) -> list:
        """Writes each local replica's packed buffer back (weights, and slots if averaged)."""
        writes = []
        for d, replica in enumerate(self.replicas):
            with tf.device(replica.device):
                writes.extend(
                    replica.write(
                        flats[d],
                        self._components(strategy, d),
                        self.sizes,
                        with_slots=self.average_optimizer_state,
                    )
                )
        return writes

    def _components(self, strategy, d: int) -> list:
        return [strategy.experimental_local_results(v.value)[d] for v in self.variables]

    def local_gradients(self, step, grads: list[list], present: list[bool]) -> list[list]:
        """Each local replica's gradients as its update takes them (as they came: local)."""
        del step, present
        return grads

    def mix(self, step: tf.Tensor, flats: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each local replica's packed weights (and slots) after step `step`'s exchange."""
        raise NotImplementedError

    # --- exchanges ------------------------------------------------------------------------------

    def _mean(self, flats: list[tf.Tensor]) -> list[tf.Tensor]:
        """The mean over every replica of each local replica's buffer, on its device; the
        bytes this process sends for it are counted."""
        if self.ranks == 1:
            return list(flats)
        length = int(flats[0].shape[0])
        # A ring all-reduce sends 2 (N-1)/N of the buffer from each rank.
        sent = 2 * (self.ranks - 1) * length * self.dtype.size // self.ranks * len(flats)
        counted = self.sent.assign_add(sent)
        with tf.control_dependencies([counted]):
            if self.ring is not None:
                return [self.ring.all_reduce(flats[0], "mean")]
            sums = local_ring_all_reduce(flats, self.devices)
        out = []
        for total, device in zip(sums, self.devices, strict=True):
            with tf.device(device):
                out.append(total / tf.cast(self.ranks, total.dtype))
        return out

    # --- settling -------------------------------------------------------------------------------

    def settle(self) -> None:
        if self.ranks == 1:
            return
        if self._settle_fn is None:
            self._settle_fn = tf.function(self._average_replicas)
        distance, relative = (float(x) for x in self._settle_fn())
        self.spreads.append((distance, relative))
        if not self.is_chief:
            return
        if distance > 0:
            log.info(
                "%s: replicas' weights averaged (the farthest was %.3g from their mean, "
                "%.3g of its norm)",
                self.name, distance, relative,
            )  # fmt: skip
        else:  # the last step averaged them: the docs promise the line
            log.info("%s: replicas' weights averaged (they were one model already)", self.name)

    def _average_replicas(self) -> tf.Tensor:
        """Every replica's weights (and, if averaged, slots) set to the mean over all
        replicas. Returns [the largest distance of a replica's weights from the mean, that
        over the mean's norm]."""
        strategy = self.strategy
        flats = []
        for d, replica in enumerate(self.replicas):
            with tf.device(replica.device):
                weights = [tf.reshape(w, [-1]) for w in self._components(strategy, d)]
                if self.average_optimizer_state:
                    weights += [tf.reshape(s.value, [-1]) for s in replica.slots]
                flats.append(tf.concat(weights, 0))
        means = self._mean(flats)
        weights_length = sum(self.sizes)
        distances = []
        for d, (flat, mean) in enumerate(zip(flats, means, strict=True)):
            with tf.device(self.devices[d]):
                gap = tf.norm(flat[:weights_length] - mean[:weights_length])
                distances.append(tf.one_hot(self.rank + d, self.ranks) * gap)
        local = tf.add_n(distances)
        every = self.ring.all_reduce(local) if self.ring is not None else local
        distance = tf.reduce_max(every)
        norm = tf.norm(means[0][:weights_length])
        writes = self._write_all(strategy, means)
        with tf.control_dependencies(writes):
            return tf.stack([distance, tf.math.divide_no_nan(distance, norm)])

    # --- checkpoints and reports ----------------------------------------------------------------

    def checkpoint_state(self) -> dict:
        # Each local replica's optimizer copy. Across processes the chief's copy is saved,
        # and every process resumes from it (as PyTorch's post-local SGD saves rank 0's).
        return {f"local_optimizer_{d}": r.optimizer for d, r in enumerate(self.replicas)}

    def summary(self) -> dict[str, float | int | None]:
        # The farthest the replicas were apart at any settle (a settle right after another,
        # as before a save at an epoch's end, finds them together).
        spread = max(self.spreads) if self.spreads else (None, None)
        return {
            "bytes_sent": int(self.sent.numpy()),
            "replica_distance": spread[0],
            "replica_distance_relative": spread[1],
        }


class LocalSGD(LocalUpdates):
    """Local SGD: `every` local optimizer steps per replica, then one average of the weights.

    Args:
      every: local steps between averages (1: average after every step).
      average_optimizer_state: average the optimizer's slots too (Adam's moments, momentum).
      sync_steps: post-local SGD: the first `sync_steps` steps are synchronous (the
        gradients averaged before each update), then local.
      timeout_seconds: how long a transfer between worker processes may wait for its peer.
    """

    def __init__(
        self,
        every: int,
        *,
        average_optimizer_state: bool = False,
        sync_steps: int = 0,
        timeout_seconds=None,
    ):
        for name, value, least in (("average_every", every, 1), ("sync_steps", sync_steps, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise LocalUpdateError(
                    f"{name} must be a whole number >= {least}. Received: {name}={value!r}"
                )
        super().__init__(
            average_optimizer_state=average_optimizer_state, timeout_seconds=timeout_seconds
        )
        self.every, self.sync_steps = every, sync_steps

    @property
    def name(self) -> str:
        return f"average_every={self.every}"

    def local_gradients(self, step, grads, present):
        if not self.sync_steps or self.ranks == 1:
            return grads
        shapes = [tuple(v.shape) for v, p in zip(self.variables, present, strict=True) if p]
        flats = []
        for d, device in enumerate(self.devices):
            with tf.device(device):
                flats.append(
                    tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads[d]], 0)
                )
        # Before sync_steps: every replica takes the mean gradient (synchronous training).
        mixed = tf.cond(step < self.sync_steps, lambda: self._mean(flats), lambda: flats)
        out = []
        for d, device in enumerate(self.devices):
            with tf.device(device):
                sizes = [int(np.prod(s)) for s in shapes]
                out.append(
                    [
                        tf.reshape(p, s)
                        for p, s in zip(tf.split(mixed[d], sizes), shapes, strict=True)
                    ]
                )
        return out

    def mix(self, step, flats):
        if self.ranks == 1:
            return flats
        # The weights agree through the synchronous phase (its gradients were averaged);
        # after it, every `every`-th step ends with an average.
        taken = step + 1
        average = tf.logical_and(taken > self.sync_steps, tf.equal(taken % self.every, 0))
        return tf.cond(average, lambda: self._mean(flats), lambda: list(flats))


class _Replica:
    """One local replica's own weights and optimizer copy, on its device (plain variables:
    build it outside the strategy)."""

    def __init__(self, optimizer, variables, device: str):
        self.device = device
        with tf.device(device):
            self.weights = [
                keras.Variable(np.zeros(v.shape, v.dtype), dtype=v.dtype, name=f"local_w{i}")
                for i, v in enumerate(variables)
            ]
            self.optimizer = optimizer_copies.optimizer_copy(optimizer, self.weights)
        self.constraints = [v.constraint for v in variables]
        self.decays = [
            bool(optimizer.weight_decay) and compat.uses_weight_decay(optimizer, v)
            for v in variables
        ]
        # The copy's slots, weight by weight (Keras names a slot "<reference>_<slot>").
        found = []
        for slot in self.optimizer.variables:
            match = re.search(r"local_w(\d+)_\w+$", slot.path)
            if match:
                found.append((int(match.group(1)), slot))
        self.slots = [slot for _, slot in sorted(found, key=lambda pair: pair[0])]

    def slot_sizes(self) -> list[int]:
        return [int(np.prod(s.shape)) for s in self.slots]

    def update(
        self, grads, weights, present, *, iterations, learning_rate, weight_decay, with_slots
    ):
        """Takes the model's weights on this device, applies `grads` (those `present`), and
        returns the weights (and slots) packed into one buffer."""
        for own, now in zip(self.weights, weights, strict=True):
            own.assign(now)
        self.optimizer.iterations.assign(tf.cast(iterations, self.optimizer.iterations.dtype))
        chosen = [w for w, p in zip(self.weights, present, strict=True) if p]
        decays = [d for d, p in zip(self.decays, present, strict=True) if p]
        lr = tf.cast(learning_rate, self.weights[0].dtype)
        for weight, decay in zip(chosen, decays, strict=True):
            if decay:  # decoupled weight decay first, as Keras's apply makes it
                weight.assign(weight - weight * tf.cast(weight_decay, weight.dtype) * lr)
        optimizer_copies.update_step(
            self.optimizer, list(grads), chosen, learning_rate=learning_rate, weight_decay=0.0
        )
        values = []
        for own, constraint in zip(self.weights, self.constraints, strict=True):
            value = own.value
            if constraint is not None:
                value = constraint(value)
            values.append(tf.reshape(value, [-1]))
        if with_slots:
            values += [tf.reshape(s.value, [-1]) for s in self.slots]
        return tf.concat(values, 0)

    def write(self, flat, components, sizes, *, with_slots) -> list:
        """Writes a packed buffer back: the weights into the model's variables on this
        device (and the slots into the copy's)."""
        pieces = tf.split(flat, sizes + (self.slot_sizes() if with_slots else []))
        writes = []
        for component, piece in zip(components, pieces[: len(sizes)], strict=True):
            writes.append(component.assign(tf.reshape(piece, component.shape), read_value=False))
        if with_slots:
            for slot, piece in zip(self.slots, pieces[len(sizes) :], strict=True):
                writes.append(slot.assign(tf.reshape(piece, slot.shape)))
        return writes


def _scaled(grad, factor: float):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return tf.convert_to_tensor(grad) * factor

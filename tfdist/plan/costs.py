"""The planner's arithmetic: the bytes each device holds and the step time of each layout.

Collectives follow an alpha-beta model over a ring of n members (each message: latency +
bytes / bandwidth, on the slowest link the ring crosses):

  all-reduce       2 (n-1) alpha + 2 (n-1)/n * bytes / beta
  reduce-scatter   (n-1) alpha + (n-1)/n * bytes / beta      (bytes: the whole buffer)
  all-gather       (n-1) alpha + (n-1)/n * bytes / beta      (bytes: the gathered whole)
  point-to-point   alpha + bytes / beta

grouped as tfdist runs each layout:

  data D           the gradients all-reduced over D (tfdist's ring)
  zero1 x D        all-reduce of the gradients, then all-gather of the updated weights
  zero2 x D        reduce-scatter of the gradients, then all-gather of the weights
  zero3 x D        the weights all-gathered forward and again backward, the gradients
                   reduce-scattered (zero/stage3.py)
  pipeline S x D   M micro-batches per step: each stage's forward and backward, an
                   activation sent forward and its gradient back per cut; the bubble,
                   (S-1)/(M+S-1) of the step; each stage's gradients all-reduced over D
  tensor T x D     per split block (Column -> Row), forward an all-gather of every
                   replica's examples (after one of their batch sizes) and one of every
                   replica's partial sums, backward their gradients (two all-reduces), as
                   tfdist's layers run them
                   (tensor/mappings.py: over all T x D replicas); with a cluster's
                   tensor_exchange="group", within the group only (Megatron-LM); the
                   replicated weights' gradients all-reduced over T x D, the split ones'
                   over D
  S x T x D        combined (hybrid_layouts): per micro-batch each device computes 1/T
                   of its stage with its blocks' tensor exchanges (the group's examples),
                   the path M + (S-1)/v slots (v stages a device, interleaved); its
                   stage's state exchanged over D as the data and ZeRO layouts above

Bytes per device at the step's peak, for W the weights' bytes, G the gradients' (as the
weights), O the optimizer's state (slots x W), A the activations one example keeps (ZeRO:
Rajbhandari et al., 2020), then the exchange's buffers (tests/test_peaks.py holds data, ZeRO
1-3 and the pipeline to the allocator's peak per worker process within 15%):

  data        W + G + O                + A x b + G          (the all-reduced gradients)
  zero1       W + G + (O + W)/D        + A x b + 4 buckets  (tfdist keeps its slice's weights
  zero2       W + G + (O + W)/D        + A x b + 3 buckets   too, for its optimizer copy)
  zero3       (W + G + O)/D            + A x b + 2 units' weights and gradients
  pipeline    (W + G + O) of its stage + A of its stage x micro-batch x in flight
              (GPipe: M in flight, 1F1B: S - s on stage s) + G of the micro-batch
              being added to the sum so far (M > 1)
  tensor      (W + G + O) / T of the split blocks + all of the rest + A x b

with b the examples a device computes per step, and a bucket ZeRO's (4 MiB, or the largest
layer's weights if larger): zero1 and zero2 exchange and update the packed gradients bucket
by bucket, each receive taking its buffer only when its step comes, so what the update holds
beside the model and its gradients is the packed bucket, its sum (zero1; zero2's slice of
it) with the ring's working copy, and the gathered bucket. Compute is 3 forward passes' FLOPs (the
backward pass costs two) at the device's peak times `efficiency`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tfdist.collective.fusion import DEFAULT_BUCKET_BYTES
from tfdist.plan.cluster import Cluster, Link, PlanError
from tfdist.plan.layouts import ParallelLayout, hybrid_layouts, layouts_for
from tfdist.plan.model import ModelCost, Unit

# A sharded checkpoint's read: tfdist.training.shards.BUCKET_BYTES (the planner is
# imported without TensorFlow, so the figure is stated here; a test holds them equal).
READ_BUCKET_BYTES = 4 * 2**20

# --- collectives ---------------------------------------------------------------------------


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def reduce_scatter(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def all_gather(nbytes: float, n: int, link: Link) -> float:
    """The reduce-scatter's ring run the other way (on the link's gather figures, if any)."""
    return reduce_scatter(nbytes, n, link.for_gather)


def point_to_point(nbytes: float, link: Link) -> float:
    return link.time(nbytes)


def bubble(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle share of a pipeline's step: (S-1)/(vM+S-1)."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)


# --- layouts -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What the planner predicts for one layout (bytes per device, seconds per step)."""

    layout: ParallelLayout
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    compute: float
    exchange: float
    bubble: float
    speedup: float = 0.0  # against one device's step on the whole batch
    # Beyond what a device holds at rest: at `model.save` (the whole weights and slots a
    # save gathers, one weight at a time) and at a StepCheckpoint's resume on this layout
    # (the slices one read brings back); None where the planner does not model them.
    save_buffers: float | None = None
    restore_buffers: float | None = None

    @property
    def memory(self) -> float:
        """The step's peak per device."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    @property
    def at_rest(self) -> float:
        """What a device holds between steps: its weights and optimizer state."""
        return self.weights + self.optimizer

    @property
    def save_peak(self) -> float | None:
        """The peak per device while `model.save` writes the model (tfdist streams a model
        held in parts through a file, a weight at a time)."""
        return None if self.save_buffers is None else self.at_rest + self.save_buffers

    @property
    def restore_peak(self) -> float | None:
        """The peak per device while a sharded checkpoint is read back on this layout, in
        reads of at most 4 MiB (a slice larger alone)."""
        return None if self.restore_buffers is None else self.at_rest + self.restore_buffers

    @property
    def step(self) -> float:
        return self.compute + self.exchange + self.bubble

    def fits(self, cluster: Cluster) -> bool:
        return self.memory <= cluster.device.memory

    def efficiency(self, devices: int) -> float:
        return self.speedup / devices


@dataclasses.dataclass(frozen=True)
class Training:
    """What is trained: the model's cost, the global batch, the compute precision and the
    bytes of a weight (float32 variables under Keras's mixed precision too)."""

    model: ModelCost
    batch: int
    precision: str = "float32"
    weight_bytes: int = 4
    activation_bytes: int = 4  # of each activation element: 2 under mixed precision
    recompute: bool = False  # activations recomputed in the backward pass (4 forwards)

    def __post_init__(self):
        if not isinstance(self.batch, int) or isinstance(self.batch, bool) or self.batch < 1:
            raise PlanError(
                f"The global batch must be a whole number >= 1. Received: batch={self.batch!r}"
            )

    def activation_scale(self) -> float:
        """Activations were counted in the traced dtype (float32): scaled to `activation_bytes`."""
        return self.activation_bytes / 4


def estimate(layout: ParallelLayout, training: Training, cluster: Cluster) -> Estimate:
    """The bytes per device and the step time of `layout` (see the module)."""
    model, batch = training.model, training.batch
    if layout.devices > cluster.devices:
        raise PlanError(
            f"{layout.name} takes {layout.devices} devices; the cluster has {cluster.devices}"
        )
    scale = training.weight_bytes / 4
    w = model.trainable_bytes * scale
    act = _kept(model.units, training)
    speed = cluster.device.peak(training.precision) * cluster.efficiency
    passes = 4 if training.recompute else 3
    per_example = passes * model.forward_flops
    d, s, t = layout.data, layout.stages, layout.tensor
    # A data-parallel ring spans the other groups' devices: T or S consecutive devices
    # apart (a group stays within a host where it fits).
    data_link = cluster.link(d, stride=t * s)
    one = batch * per_example / speed + update_time(w, model.slots_per_param, cluster)
    if layout.combined or layout.chunks > 1:
        est = _hybrid(layout, training, cluster, speed, data_link)
    elif s > 1:
        est = _pipeline(layout, training, cluster, speed, data_link)
    elif t > 1:
        est = _tensor(layout, training, cluster, w, act, speed, data_link)
    else:
        local = batch / d
        exchange, ww, g, oo = _zero(w, model.slots_per_param, d, layout.zero, data_link)
        forward_backward = local * per_example / speed
        if cluster.overlap and layout.zero == 0:
            exchange = _exposed(model, scale, forward_backward, d, data_link, cluster.fusion_bytes)
        # The update runs on what each device holds the optimizer's state for.
        compute = _pooled(forward_backward, [forward_backward] * layout.devices, cluster)
        compute += update_time(w / (d if layout.zero else 1), model.slots_per_param, cluster)
        largest = max((u.param_bytes * scale for u in model.units), default=0.0)
        # The exchange's buffers at the step's peak: the all-reduced gradients (data), a
        # few of ZeRO's buckets (zero1, zero2: see the module docstring), and for zero3 two
        # gathered units with their gradients (FSDP's accounting).
        bucket = max(float(DEFAULT_BUCKET_BYTES), largest)
        buffers = {0: w, 1: 4 * bucket, 2: 3 * bucket, 3: 2 * largest}[layout.zero]
        buffers = buffers if d > 1 else 0.0
        # model.save of zero3's slices gathers each weight whole with its slots, one weight at
        # a time; the other layouts hold what they save. A resume reads its slices back, a
        # read of at most 4 MiB or one slice at a time (tfdist.training.shards).
        save = (1 + model.slots_per_param) * largest if layout.zero == 3 and d > 1 else 0.0
        restore = max(float(READ_BUCKET_BYTES), largest / (d if layout.zero == 3 else 1))
        est = Estimate(
            layout, ww, g, oo, act * local, buffers, compute, exchange, 0.0,
            save_buffers=save, restore_buffers=restore,
        )  # fmt: skip
    est = dataclasses.replace(est, compute=est.compute + cluster.step_overhead)
    one += cluster.step_overhead
    return dataclasses.replace(est, speedup=one / est.step if est.step else 0.0)


def _zero(w: float, slots: int, d: int, zero: int, link: Link) -> tuple[float, float, float, float]:
    """The exchange over D replicas, and the weights, gradients and optimizer state each
    holds, of `w` bytes of weights under ZeRO stage `zero` (0: plain data parallelism)."""
    o = slots * w
    if zero == 0:
        return all_reduce(w, d, link), w, w, o
    if zero in (1, 2):
        # zero1 all-reduces the gradients, zero2 reduce-scatters them: the backward pass
        # forms each whole gradient first. tfdist's stages 1 and 2 also keep the slice's
        # weights for its optimizer copy; both gather the updated weights.
        reduce = all_reduce(w, d, link) if zero == 1 else reduce_scatter(w, d, link)
        return reduce + all_gather(w, d, link), w, w, (o + w) / d
    return 2 * all_gather(w, d, link) + reduce_scatter(w, d, link), w / d, w / d, o / d


def update_time(held_bytes: float, slots: int, cluster: Cluster) -> float:
    """The optimizer's update of `held_bytes` of weights: it reads the weights, gradients
    and slots and writes the weights and slots, at the memory's bandwidth (what each
    device gets while every device updates at once: the devices update together)."""
    return held_bytes * (3 + 2 * slots) / cluster.device.memory_bandwidth


def _pooled(path: float, busy: list[float], cluster: Cluster) -> float:
    """A step's forward and backward passes where a host's devices share one pool
    (cluster.shared): at least its devices' busy seconds (at one device's speed alone)
    over the pool's throughput."""
    if not cluster.shared:
        return path
    per_host = cluster.devices_per_host
    hosts = [sum(busy[h : h + per_host]) for h in range(0, len(busy), per_host)]
    return max(path, max(hosts) / cluster.shared)


def _exposed(model: ModelCost, scale, compute, d, link, fusion) -> float:
    """The all-reduce time left after the backward pass when buckets of about `fusion`
    bytes of gradients are all-reduced as soon as their layers' backward is done (layers in
    reverse order, one bucket on the link at a time)."""
    total = model.forward_flops or 1.0
    backward = compute * 2 / 3
    clock = link_free = 0.0
    bucket = 0.0
    for unit in reversed(model.units):
        clock += backward * unit.forward_flops / total  # this layer's backward is done
        bucket += unit.param_bytes * scale
        if bucket >= fusion:
            link_free = max(link_free, clock) + all_reduce(bucket, d, link)
            bucket = 0.0
    if bucket:
        link_free = max(link_free, clock) + all_reduce(bucket, d, link)
    return max(0.0, link_free - backward)


def stage_units(
    units: list[Unit], stages: int, cut_before: Sequence[str] | None = None
) -> list[list[Unit]]:
    """The units cut into `stages` contiguous groups: before the units named `cut_before`,
    or else of about equal FLOPs (each cut at the unit boundary nearest its share)."""
    if cut_before is not None:
        names = [u.name for u in units]
        missing = [c for c in cut_before if c not in names]
        if missing or len(cut_before) != stages - 1:
            raise ValueError(
                f"cut_before names {stages - 1} of the model's units for {stages} stages. "
                f"Received: {list(cut_before)} (not units: {missing})"
            )
        starts = [0, *(names.index(c) for c in cut_before), len(units)]
        return [units[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
    total = sum(u.forward_flops for u in units) or 1.0
    groups: list[list[Unit]] = [[]]
    done = 0.0
    for i, unit in enumerate(units):
        cuts_left = stages - len(groups)
        if groups[-1] and cuts_left:
            target = total * len(groups) / stages
            # Strictly nearer: a unit of no FLOPs (a position embedding) stays where it is.
            nearer_now = abs(done - target) < abs(done + unit.forward_flops - target)
            if nearer_now or len(units) - i <= cuts_left:
                groups.append([])
        groups[-1].append(unit)
        done += unit.forward_flops
    return groups


def _pipeline(layout, training, cluster, speed, data_link) -> Estimate:
    model, batch = training.model, training.batch
    s, m, d = layout.stages, layout.micro_batches, layout.data
    scale = training.weight_bytes / 4
    groups = stage_units(model.units, s, layout.cut_before)
    micro = batch / (d * m)
    passes = 4 if training.recompute else 3
    stage_time = [passes * sum(u.forward_flops for u in g) * micro / speed for g in groups]
    held = [sum(u.param_bytes for u in g) * scale for g in groups]
    updates = [update_time(h, model.slots_per_param, cluster) for h in held]
    link = cluster.link(s)
    hops = [
        point_to_point(g[-1].output_bytes * training.activation_scale() * micro, link)
        for g in groups[:-1]
    ]
    # The slowest stage sets the pace: (M + S - 1) slots of its forward + backward, the
    # sends of an activation and its gradient on the way; then its update.
    slot = max(stage_time) + 2 * (max(hops) if hops else 0.0)
    path = (m + s - 1) * slot
    compute = _pooled(m * max(stage_time), [m * st for st in stage_time] * d, cluster)
    idle = max(0.0, path - compute)
    compute += max(updates)
    big = max(range(s), key=lambda i: held[i])
    exchange = all_reduce(held[big], d, data_link)
    # Micro-batches whose activations stage i holds at once: GPipe all M, 1F1B S - i.
    held_at_once = [m if layout.schedule == "gpipe" else min(m, s - i) for i in range(s)]
    activations = max(
        _kept(g, training) * micro * k for g, k in zip(groups, held_at_once, strict=True)
    )
    boundary = max(g[-1].output_bytes for g in groups) * training.activation_scale() * micro
    # With M > 1, a micro-batch's gradients exist beside the sum so far as they are added.
    adding = held[big] if m > 1 else 0.0
    return Estimate(
        layout, held[big], held[big], model.slots_per_param * held[big], activations,
        boundary + adding, compute, exchange, idle,
    )  # fmt: skip


def _tensor(layout, training, cluster, w, act, speed, data_link) -> Estimate:
    model, batch = training.model, training.batch
    t, d = layout.tensor, layout.data
    scale = training.weight_bytes / 4
    split_bytes = model.split_bytes * scale
    rest = w - split_bytes
    local = batch / (d * t)  # each replica's own examples
    passes = 4 if training.recompute else 3
    # Each replica computes its own examples' share: the split layers' 1/T of the group's
    # examples, the rest on its own examples, the same FLOPs either way.
    held = split_bytes / t + rest
    compute = passes * model.forward_flops * local / speed
    compute = _pooled(compute, [compute] * layout.devices, cluster)
    compute += update_time(held, model.slots_per_param, cluster)
    activation = model.block_activation_bytes * training.activation_scale()
    group_batch = local * t
    per_block = _block_exchange(activation, local, t, d, passes - 2, cluster)
    exchange = model.tensor_blocks * per_block
    exchange += all_reduce(rest, t * d, cluster.link(t * d))
    exchange += all_reduce(split_bytes / t, d, data_link)
    return Estimate(
        layout, held, held, model.slots_per_param * held, act * local,
        activation * group_batch, compute, exchange, 0.0,
    )  # fmt: skip


def _kept(units: Sequence[Unit], training: Training) -> float:
    """The activation bytes per example a device keeps for `units`' backward pass: all of
    them, or with recomputation each unit's input only, plus the one unit being recomputed."""
    scale = training.activation_scale()
    if not training.recompute:
        return sum(u.activation_bytes for u in units) * scale
    inputs = sum(u.output_bytes for u in units)  # each unit's input: the one before's output
    return (inputs + max((u.activation_bytes for u in units), default=0.0)) * scale


def _hybrid(layout, training, cluster, speed, data_link) -> Estimate:
    """S stages (v chunks a device, interleaved) x T tensor devices x D data replicas, ZeRO
    over D. Each device computes 1/T of its stage for each micro-batch of B/(D M) examples,
    with its blocks' tensor exchanges on the way; the pipeline's path is M + (S-1)/v of
    those slots; its stage's state is exchanged over D as ZeRO's stage does."""
    model, batch = training.model, training.batch
    s, t, d, m, v, z = (layout.stages, layout.tensor, layout.data, layout.micro_batches,
                        layout.chunks, layout.zero)  # fmt: skip
    scale = training.weight_bytes / 4
    share = model.split_bytes / model.trainable_bytes if model.trainable_bytes else 0.0
    split = share / t + 1 - share  # what of a weight's bytes a tensor device holds
    chunks = stage_units(model.units, s * v, layout.cut_before)  # cut_before: S v - 1 names
    per_device = [[u for c in chunks[i::s] for u in c] for i in range(s)]  # device i: i, i+s..
    held = [sum(u.param_bytes for u in units) * scale * split for units in per_device]
    flops = [sum(u.forward_flops for u in units) for units in per_device]
    micro = batch / (d * m)  # a micro-batch's examples, shared by its tensor group
    passes = 4 if training.recompute else 3
    work = [passes * f * micro / t / speed for f in flops]
    width = model.block_activation_bytes * training.activation_scale()
    total = model.forward_flops or 1.0
    tensor = [
        model.tensor_blocks * f / total * _block_exchange(width, micro / t, t, d, passes - 2, cluster)
        for f in flops
    ] if t > 1 else [0.0] * s  # fmt: skip
    # A cut sends its activation forward and its gradient back, each tensor device its 1/T.
    sends = [c[-1].output_bytes * training.activation_scale() * micro / t for c in chunks[:-1]]
    hop = 2 * v * point_to_point(max(sends), cluster.link(s, stride=t)) if sends else 0.0
    slot = max(w + x for w, x in zip(work, tensor, strict=True)) + hop
    compute = _pooled(m * max(work), [m * w for w in work] * (d * t), cluster)
    big = max(range(s), key=lambda i: held[i])
    h = held[big]
    slots = model.slots_per_param
    compute += update_time(h / (d if z else 1), slots, cluster)
    data, ww, g, oo = _zero(h, slots, d, z, data_link)
    if cluster.overlap and z == 0:  # all-reduced behind the backward passes (as `estimate`)
        data = max(0.0, data - m * max(work))
    exchange = m * (slot - max(work)) + data
    bubble = (s - 1) / v * slot

    # Micro-batches in flight on device i: GPipe all M; 1F1B S - i; interleaved its warm-up's
    # 2(S-i-1) + (v-1)S chunks and one more, each 1/v of its stage.
    def flight(i: int) -> float:
        if layout.schedule == "gpipe":
            return m
        if v > 1:
            return min(m * v, 2 * (s - i - 1) + (v - 1) * s + 1) / v
        return min(m, s - i)

    activations = max(
        _kept(units, training) * micro / t * flight(i) for i, units in enumerate(per_device)
    )
    largest = max((u.param_bytes for u in model.units), default=0) * scale * split
    buffers = (2 * largest if z == 3 else 0.0) + (max(sends) if sends else 0.0)
    buffers += h if m > 1 else 0.0  # a micro-batch's gradients beside the sum so far
    buffers += width * micro if t > 1 else 0.0  # a split block's gathered activation
    return Estimate(layout, ww, g, oo, activations, buffers, compute, exchange, bubble)


def _block_exchange(activation, local, t, d, forwards, cluster) -> float:
    """One split block's exchanges in a step: `activation` bytes per example, `local`
    examples a replica, T devices a tensor group, D groups, `forwards` forward passes (2
    when activations are recomputed)."""
    group_batch = local * t
    if cluster.tensor_exchange == "group":
        # Within the group: an all-gather of its examples and a reduce-scatter of the
        # partial sums, forward and the same backward (Megatron's all-reduce, in bytes).
        link = cluster.link(t)
        one = all_gather(activation * group_batch, t, link) + reduce_scatter(
            activation * group_batch, t, link
        )
        return (forwards + 1) * one
    # tfdist's layers (tensor/mappings.py) gather over every replica: forward an all-gather
    # of each replica's examples and one of each replica's partial sums (its group's
    # examples long); backward their gradients, two all-reduces of those sizes. Each
    # gather of the examples first gathers every replica's batch size (4 bytes).
    n = t * d
    link = cluster.link(n)
    inputs, partials = activation * local * n, activation * group_batch * n
    gathers = all_gather(4 * n, n, link) + all_gather(inputs, n, link)
    per_block = forwards * (gathers + all_gather(partials, n, link))
    return per_block + all_reduce(inputs, n, link) + all_reduce(partials, n, link)


def plan(
    training: Training, cluster: Cluster, devices: int | None = None, *, hybrid: bool = False
) -> list[Estimate]:
    """Every layout on the cluster's devices (or `devices` of them), fitting ones first,
    fastest first; with `hybrid`, the layouts that combine axes too (`hybrid_layouts`,
    some not built in tfdist yet: `ParallelLayout.built`).

    One device training the whole batch is among them (`ParallelLayout()`, named "one
    device"), so a model too small to gain from splitting its step ranks it first, and
    `best_choice` says so.
    """
    n = devices or cluster.devices
    units = len(training.model.units)
    hosts = -(-n // cluster.devices_per_host)
    layouts = layouts_for(n, training.batch, units, hosts=hosts)
    if hybrid:
        more = hybrid_layouts(n, training.batch, units, devices_per_host=cluster.devices_per_host)
        layouts += [x for x in more if x not in layouts]
    if n > 1:
        # The reference every speed-up is measured against is a choice too.
        layouts.append(ParallelLayout())
    estimates = [estimate(x, training, cluster) for x in layouts]
    if not estimates:
        raise PlanError(
            f"No layout of {n} devices takes a global batch of {training.batch}: use a batch "
            f"that {n} divides. Received: batch={training.batch}"
        )
    return sorted(estimates, key=lambda e: (not e.fits(cluster), e.step))


def best_choice(estimates: Sequence[Estimate], cluster: Cluster) -> str:
    """One sentence naming the fastest layout that fits, and saying so when that is one
    device: every split of the step then costs more in exchange than it saves in compute."""
    fitting = [e for e in estimates if e.fits(cluster)]
    if not fitting:
        return (
            "No layout fits: every one holds more than a device's "
            f"{cluster.device.memory / 2**30:.0f} GiB. Use devices with more memory, a "
            "smaller global batch, --recompute, or more devices."
        )
    best = fitting[0]
    if best.layout.devices > 1:
        return f"Best: {best.layout.name}, {best.speedup:.1f}x one device's step."
    split = [e for e in fitting if e.layout.devices > 1]
    if not split:
        return "Best: one device; no layout of several devices fits."
    runner_up = split[0]
    return (
        f"Best: one device. The fastest layout of several devices, {runner_up.layout.name}, "
        f"takes {runner_up.step * 1e3:.3g} ms a step against one device's "
        f"{best.step * 1e3:.3g} ms ({runner_up.speedup:.2g}x): its exchange costs more than "
        "the compute it divides. Train on one device, or give each device more work (a "
        "larger global batch or model)."
    )


def recipe(layout: ParallelLayout, model: ModelCost) -> str:
    """The tfdist calls that train `layout`, to paste: the model's cut points where its
    stages begin (the units whose FLOPs `stage_units` balances), its tensor degree and the
    ZeRO stage, on a strategy of `layout.devices` replicas."""
    lines = [f"# a strategy of {layout.devices} replica(s): tfdist.build_strategy(...)"]
    if layout.stages > 1 or layout.tensor > 1 or layout.zero == 3:
        lines.append(
            "# the model built and compiled under tfdist.host_scope(strategy): no device "
            "holds it whole"
        )
    if layout.tensor > 1:
        # A layout map (derived from the layers' shapes here), which composes with the
        # pipeline and ZeRO; the split layers of tensor_parallel(model, degree=) do not.
        groups = layout.devices // layout.tensor
        lines += [
            f"mesh = keras.distribution.DeviceMesh(({groups}, {layout.tensor}), "
            '["batch", "model"], devices)',
            "tfdist.parallel.tensor_parallel(model, "
            "layout_map=tfdist.parallel.derive_layout_map(model, mesh))",
        ]
    options = []
    if layout.stages > 1:
        groups = stage_units(model.units, layout.stages * layout.chunks, layout.cut_before)
        cuts = [g[0].name for g in groups[1:]]
        interleaved = (
            f", schedule='interleaved', chunks_per_device={layout.chunks}"
            if layout.chunks > 1
            else ""
        )
        options.append(
            f"pipeline=tfdist.parallel.Pipeline(cut_before={cuts}, "
            f"micro_batches={layout.micro_batches}{interleaved})"
        )
    if layout.zero:
        options.append(f"shard_optimizer='zero{layout.zero}'")
    lines.append("tfdist.fit(" + ", ".join(["model", "dataset", *options]) + ")")
    return "\n".join(lines)

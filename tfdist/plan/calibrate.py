"""This machine's figures for the planner, measured: the devices' speed, a model's
efficiency and the links between the local devices as tfdist's collectives use them.

    cluster = calibrate.machine(strategy)                      # a mirrored strategy's devices
    eff = calibrate.efficiency(model, x, y, peak=cluster.device.peak("float32"),
                               flops_per_example=ModelCost.of(model).forward_flops)

- speed: chained 512 x 512 matrix products, on one device alone (the peak) and on every
  device at once (what each gets while all are busy: on a CPU split into logical devices
  they share the cores); `shared` measures the same for a model's own passes, run by the
  strategy's replicas;
- efficiency: a model's forward and backward pass on one device alone, as FLOPs per
  second against that peak; the optimizer's update as the bytes per second each replica
  moves while all update at once;
- links: the strategy's all-reduce and all-gather among its replicas (the collectives the
  data-parallel and tensor-parallel steps run) at four sizes (4 KiB to 8 MiB), each fitted
  to a latency and a bandwidth of the ring formulas in costs.py.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np
import tensorflow as tf

from tfdist.plan.cluster import GIB, Cluster, Device, Link

_SIDE, _CHAIN = 512, 8


def _seconds(fn, *args, repeats: int) -> float:
    fn(*args)  # traced and warmed
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args)
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_speed(devices: list[str], *, repeats: int = 5) -> tuple[float, float]:
    """(FLOP/s of one device alone, FLOP/s each device gets while all run at once)."""
    flops = 2.0 * _SIDE**3 * _CHAIN

    def chain(x):
        for _ in range(_CHAIN):
            x = tf.matmul(x, x) * (1.0 / _SIDE)
        return x

    inputs = []
    for d in devices:
        with tf.device(d):
            inputs.append(tf.random.normal([_SIDE, _SIDE]))
    alone = _seconds(tf.function(lambda x: chain(x)), inputs[0], repeats=repeats)

    @tf.function
    def together(*xs):
        outs = []
        for d, x in zip(devices, xs, strict=True):
            with tf.device(d):
                outs.append(chain(x))
        return outs

    busy = _seconds(together, *inputs, repeats=repeats)
    return flops / alone, flops / busy


def _forward_backward(model):
    """The model's loss and its gradients on a batch (a, b): one forward and backward pass."""
    weights = model.trainable_variables

    def forward_backward(a, b):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=a, y=b, y_pred=model(a, training=True))
        return tape.gradient(loss, weights)

    return forward_backward


def efficiency(model, x, y, *, peak: float, flops_per_example: float, repeats: int = 5) -> float:
    """A model's forward and backward pass on one device alone as a share of `peak` FLOP/s
    (x, y: one device's batch). The optimizer's update is `update_bandwidth`'s."""
    seconds = _seconds(tf.function(_forward_backward(model)), x, y, repeats=repeats)
    achieved = 3 * flops_per_example * int(x.shape[0]) / seconds
    return min(1.0, achieved / peak)


def shared(build, x, y, strategy, *, repeats: int = 5) -> float:
    """How many devices' worth of a model's forward and backward pass the strategy's
    replicas run together: one replica's time alone x the replicas / their time all at
    once (the same batch on each, every replica on its own copy of the weights, as a
    data-parallel step runs them). 1 where they take turns; the replica count where each
    device has its own compute. `build` makes the model (under the strategy's scope)."""
    with strategy.scope():
        model = build()
    forward_backward = _forward_backward(model)
    alone = _seconds(tf.function(forward_backward), x, y, repeats=repeats)
    per_replica = [
        strategy.experimental_distribute_values_from_function(lambda ctx, t=t: t) for t in (x, y)
    ]
    together = tf.function(lambda a, b: strategy.run(forward_backward, args=(a, b)))
    return strategy.num_replicas_in_sync * alone / _seconds(together, *per_replica, repeats=repeats)


def update_bandwidth(build, strategy, *, repeats: int = 5) -> float:
    """Bytes per second each replica's optimizer update moves (weights, gradients and
    slots read, weights and slots written) while every replica updates at once, as a
    data-parallel step runs them. `build` makes the compiled model (under the strategy)."""
    with strategy.scope():
        model = build()
        weights = model.trainable_variables
        model.optimizer.build(weights)
    optimizer = model.optimizer
    slots = sum(1 for v in optimizer.variables if tuple(v.shape) == tuple(weights[0].shape))

    def update():
        optimizer.apply([tf.ones_like(w.value) for w in weights], weights)

    seconds = _seconds(tf.function(lambda: strategy.run(update)), repeats=repeats)
    moved = sum(int(np.prod(w.shape)) * 4 for w in weights) * (3 + 2 * slots)
    return moved / seconds


def links(strategy, *, repeats: int = 5) -> Link:
    """The strategy's all-reduce among its replicas fitted to one Link, and its all-gather
    to the Link's `gathers` (TensorFlow runs them on different terms: here the all-gather
    costs more per byte and per call than the same ring's all-reduce would)."""
    n = strategy.num_replicas_in_sync
    reduce_rows, gather_rows = [], []  # (latency multiplier, bytes multiplier, seconds)
    for length in (2**10, 2**15, 2**19, 2**21):
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx, length=length: tf.ones([length])
        )

        @tf.function
        def reduce(v):
            return strategy.run(
                lambda t: tf.distribute.get_replica_context().all_reduce("sum", t), args=(v,)
            )

        @tf.function
        def gather(v):
            return strategy.run(
                lambda t: tf.distribute.get_replica_context().all_gather(t, axis=0), args=(v,)
            )

        nbytes = 4.0 * length
        seconds = _seconds(reduce, values, repeats=repeats)
        reduce_rows.append((2 * (n - 1), 2 * (n - 1) / n * nbytes, seconds))
        seconds = _seconds(gather, values, repeats=repeats)
        gather_rows.append(((n - 1), (n - 1) * nbytes, seconds))
    return dataclasses.replace(_fitted(reduce_rows), gathers=_fitted(gather_rows))


def _fitted(rows: list[tuple[float, float, float]]) -> Link:
    """The latency and bandwidth that fit (latency x, bytes x, seconds) rows best."""
    a = np.array([[r[0], r[1]] for r in rows])
    t = np.array([r[2] for r in rows])
    (latency, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
    return Link(max(float(latency), 1e-7), 1.0 / max(float(per_byte), 1e-15))


def machine(strategy, *, repeats: int = 5) -> Cluster:
    """This machine as a one-host cluster of the strategy's devices: each device's speed
    alone, the share of the host they get together (`shared`), the links. Efficiency 1 and
    a nominal memory bandwidth: set them per model with `efficiency` and
    `update_bandwidth`."""
    devices = list(strategy.extended.worker_devices)
    alone, busy = matmul_speed(devices, repeats=repeats)
    link = links(strategy, repeats=repeats)
    memory = 8 * GIB  # a logical CPU device has no memory of its own; not a limit here
    return Cluster(
        hosts=1, devices_per_host=len(devices),
        device=Device("cpu", {"float32": alone}, memory),
        intra=link, inter=link, efficiency=1.0, shared=busy * len(devices) / alone,
        name="this machine",
    )  # fmt: skip

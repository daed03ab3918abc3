"""The planner's bytes per device (tfdist.plan) against what each device holds during
tfdist.fit (tfdist.DeviceBytes), for every layout that runs on 4 local devices: data,
ZeRO 1-3, a pipeline with data parallelism, tensor parallelism with and without it.
"""

from __future__ import annotations

import gc

import keras
import numpy as np
import pytest

import tfdist
from tests.test_plan import cluster
from tfdist.plan import ModelCost, ParallelLayout, Training, costs, estimate


def mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu", name="d1"),
            keras.layers.Dense(256, name="d2"),
            keras.layers.Dense(10, name="d3"),
        ]
    )


@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(data=4), ParallelLayout(data=4, zero=1), ParallelLayout(data=4, zero=2), ParallelLayout(data=4, zero=3),
        ParallelLayout(data=2, stages=2, micro_batches=2), ParallelLayout(tensor=2, data=2), ParallelLayout(tensor=4),
    ],
    ids=lambda layout: layout.name,
)  # fmt: skip
def test_the_planned_bytes_are_what_each_device_holds_during_fit(layout):
    """Weights and optimizer state per device, planned, against tfdist.DeviceBytes during
    tfdist.fit (Adam), within 10% on the device that holds the most."""
    gc.collect()
    devices = [f"/cpu:{i}" for i in range(4)]
    strategy = tfdist.build_strategy("mirrored", cluster=None, devices=devices)
    plain = mlp()
    plain.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    cost = ModelCost.of(plain)
    planned = estimate(layout, Training(cost, batch=16), cluster())
    del plain
    pipeline = None
    if layout.stages > 1:  # cut where the planner cuts (the FLOPs halve before d2)
        stages = costs.stage_units(cost.units, layout.stages)
        cut_before = [stage[0].name for stage in stages[1:]]
        pipeline = tfdist.parallel.Pipeline(cut_before=cut_before, micro_batches=2)
    keywords = {"shard_optimizer": f"zero{layout.zero}"} if layout.zero else {}
    scope = (
        pipeline.scope(strategy) if pipeline
        else tfdist.host_scope(strategy) if layout.zero == 3 else strategy.scope()
    )  # fmt: skip
    gc.collect()
    record = tfdist.DeviceBytes()  # before the model: its weights count too
    with scope:
        model = mlp()
        if layout.tensor > 1:
            model = tfdist.parallel.tensor_parallel(model, degree=layout.tensor)
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 64)).astype("float32"), rng.integers(0, 10, size=64)
    tfdist.fit(model, x, y, batch_size=16, verbose=0, callbacks=[record], pipeline=pipeline,
               **keywords)  # fmt: skip
    # The host copy a pipeline or ZeRO-3 keeps on CPU:0 beside its replica is not a device's.
    held = {d: b for d, b in record.added.items() if d != "CPU:0" or not scope_on_host(layout)}
    most = max(held.values())
    assert most == pytest.approx(planned.weights + planned.optimizer, rel=0.10), (held, planned)


def scope_on_host(layout: ParallelLayout) -> bool:
    return layout.stages > 1 or layout.zero == 3

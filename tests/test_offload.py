"""offload='optimizer' (ZeRO-Offload): a sharded optimizer's state in host memory, where its
update runs. This machine has no accelerator, so the saving cannot show in a device's
memory here; what is checked is where each variable lives, by device name (the replicas on
CPU:1 and CPU:2, the host on CPU:0), and that the numbers are those without offload and
Keras's fit on one device, fit called twice.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfdist
from tfdist.parallel.zero import stage3 as zero3

TOLERANCE = 1e-5


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(4),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(True))
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 12)).astype("float32"), rng.integers(0, 4, 64)


def halving():
    """A callback that changes the learning rate each epoch: it must reach the copies that
    update on the host."""
    return keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)


def fit_twice(model, **options) -> list[float]:
    x, y = data()
    kwargs = dict(batch_size=16, shuffle=False, verbose=0, callbacks=[halving()], **options)
    return (
        tfdist.fit(model, x, y, epochs=2, **kwargs).history["loss"]
        + tfdist.fit(model, x, y, epochs=1, **kwargs).history["loss"]
    )


@pytest.fixture(scope="module")
def reference():
    x, y = data()
    model = build()
    kwargs = dict(batch_size=16, shuffle=False, verbose=0, callbacks=[halving()])
    losses = model.fit(x, y, epochs=2, **kwargs).history["loss"]
    losses += model.fit(x, y, epochs=1, **kwargs).history["loss"]
    return model.get_weights(), losses


def device_of(variable) -> str:
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return value.device.rsplit("/", 1)[-1]  # "device:CPU:0"


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_offloaded_state_lives_on_the_host_and_trains_as_without_it(stage, reference):
    strategy = tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:1", "/cpu:2"])
    with tfdist.host_scope(strategy) if stage == "zero3" else strategy.scope():
        model = build()
    losses = fit_twice(model, shard_optimizer=stage, offload="optimizer")
    weights, expected = reference
    assert losses == pytest.approx(expected, abs=TOLERANCE)
    for want, got in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=TOLERANCE)
    hook = next(iter(vars(model)["_tfdist_kept_hooks"].values()))
    assert hook.offload == "optimizer"
    if stage == "zero3":
        assert isinstance(hook, zero3.ShardedParameters)
        slots = [slot for slots in hook.slots for slot in slots.values()]
        on_devices = [shard for shards in hook.shards for shard in shards]
        held = [copy for copies in hook.updated for copy in copies]
    else:
        slots = [slot for replica in hook.replicas for slot in replica.slots.values()]
        on_devices = list(model.trainable_variables)
        held = [v for replica in hook.replicas for v in replica.variables.values()]
    assert slots and {device_of(s) for s in slots} == {"device:CPU:0"}
    assert {device_of(v) for v in held} == {"device:CPU:0"}  # the slices the update writes
    if stage == "zero3":  # each replica's slice of the weights stays on its device
        assert {device_of(s) for s in on_devices} == {"device:CPU:1", "device:CPU:2"}


def test_offload_without_a_sharded_optimizer_is_one_line():
    strategy = tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:1", "/cpu:2"])
    with strategy.scope():
        model = build()
    x, y = data()
    with pytest.raises(tfdist.FitError, match="set shard_optimizer='zero1', 'zero2' or 'zero3'"):
        tfdist.fit(model, x, y, batch_size=16, verbose=0, offload="optimizer")
    with pytest.raises(tfdist.FitError, match="offload must be None or one of 'optimizer'"):
        tfdist.fit(model, x, y, batch_size=16, verbose=0, shard_optimizer="zero1", offload="ssd")

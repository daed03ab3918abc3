"""A model's own train_step / test_step under tfdist.fit: what Keras's fit does with it.

Each case of tests/custom_step_models.py is trained by Keras's own `model.fit` and by
`tfdist.fit` under the same strategy (one device, mirrored over 2 logical CPUs), with the
same batches in the same order: the weights, the epoch logs, every batch's logs and the
evaluation must agree. A custom step means what its author wrote: a loss it does not scale
by the replicas adds the replicas' gradients, under Keras and tfdist alike.

Under central_storage Keras's own fit applies the same updates (the weights are compared
with it), but its metric variables live once on the CPU and every replica updates them, so
its logs are off (0.411 for a mean absolute error of 0.397 in one run); tfdist keeps each
replica's metric state apart, and its logs are compared with mirrored's over as many
replicas. Multi-worker and parameter-server runs are in tests/test_fit_multiworker.py.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests import custom_step_models as models
from tfdist.errors import FitError
from tfdist.strategies import keras_guard

TOLERANCE = 1e-5
TWO_CPUS = ["/cpu:0", "/cpu:1"]


def one_device():
    return tf.distribute.get_strategy()


# Built by tfdist: each strategy then takes collective keys of its own, where several
# plain MirroredStrategy objects in one process would share (and mismatch) them.
def mirrored():
    return tfdist.build_strategy("mirrored", cluster=None, devices=TWO_CPUS)


def central_storage():
    return tfdist.build_strategy("central_storage", cluster=None, devices=TWO_CPUS)


def train(case: str, strategy, *, with_keras: bool):
    """(weights, epoch logs, batch logs, evaluation) of one run."""
    with strategy.scope():
        model, data = models.CASES[case]()
    batches = models.BatchLogs()
    if with_keras:  # Keras's own, which tfdist guards under central_storage
        fit, evaluate = (keras_guard.keras_method(name) for name in ("fit", "evaluate"))
        history = fit(model, data, epochs=models.EPOCHS, verbose=0, callbacks=[batches])
        evaluation = evaluate(model, data, verbose=0, return_dict=True)
    else:
        history = tfdist.fit(model, data, epochs=models.EPOCHS, verbose=0, callbacks=[batches])
        evaluation = tfdist.evaluate(model, data, verbose=0, return_dict=True)
    return model.get_weights(), history.history, batches.batches, evaluation


@pytest.fixture(scope="module")
def keras_runs():
    """Keras's own fit per (case, strategy), computed once."""
    cache = {}

    def get(case: str, strategy_name: str):
        if (case, strategy_name) not in cache:
            strategy = STRATEGIES[strategy_name]()
            cache[case, strategy_name] = train(case, strategy, with_keras=True)
        return cache[case, strategy_name]

    return get


STRATEGIES = {
    "one_device": one_device,
    "mirrored": mirrored,
    "central_storage": central_storage,
}


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def assert_same_logs(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, got, want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=TOLERANCE, err_msg=f"{what} {name}")


@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
@pytest.mark.parametrize("case", sorted(models.CASES))
def test_custom_steps_train_as_under_keras(keras_runs, case, strategy_name):
    weights, history, batches, evaluation = train(
        case, STRATEGIES[strategy_name](), with_keras=False
    )
    keras_weights = keras_runs(case, strategy_name)[0]
    assert max_diff(weights, keras_weights) <= TOLERANCE
    # Keras's central_storage logs are off (see the module docstring): mirrored's instead.
    logs_from = "mirrored" if strategy_name == "central_storage" else strategy_name
    _, keras_history, keras_batches, keras_evaluation = keras_runs(case, logs_from)
    assert_same_logs(history, keras_history, "history")
    assert len(batches) == len(keras_batches)
    for i, (got, want) in enumerate(zip(batches, keras_batches, strict=True)):
        assert_same_logs(got, want, f"batch {i}")
    assert_same_logs(evaluation, keras_evaluation, "evaluate")


def test_the_step_s_own_keys_reach_history():
    """What the issue saw: history {'loss': [0.0, 0.0]} instead of the step's own logs."""
    _, history, _, _ = train("own_keys", mirrored(), with_keras=False)
    assert set(history) == {"mae_loss", "custom_step"}
    assert history["custom_step"] == [8.0, 16.0]  # 8 batches an epoch
    assert history["mae_loss"][1] < history["mae_loss"][0]


def test_a_step_that_returns_no_dict_is_one_clear_error():
    class ReturnsLoss(models.OwnKeysModel):
        def train_step(self, data):
            super().train_step(data)
            return self.mae_tracker.result()

    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    model = ReturnsLoss(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd")
    _, data = models.own_keys()
    with pytest.raises(FitError, match="returns a dict of logs .* Received: a .*Tensor"):
        tfdist.fit(model, data, epochs=1, verbose=0)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_shards_the_optimizers_a_step_applies_itself_and_trains_as_unsharded(stage):
    """keras.io's GAN applies d_optimizer and g_optimizer itself. Under zero1/zero2 each is
    sharded over the weights it was built on, beside the optimizer compile took: each
    replica holds 1/N of each one's slots, the model's d_optimizer and g_optimizer keep none
    (a copy of each: class, config and step count), and the weights equal plain data
    parallelism's over the same replicas (the unsharded optimizers), fit called twice."""
    from tfdist.parallel import ShardedUpdate

    with mirrored().scope():
        reference, data = models.gan()
    for _ in range(2):
        tfdist.fit(reference, data, verbose=0)
    with mirrored().scope():
        model, data = models.gan()
    hook = ShardedUpdate(stage=stage)
    for _ in range(2):
        tfdist.fit(model, data, verbose=0, step_hooks=[hook])
    for want, got in zip(reference.get_weights(), model.get_weights(), strict=True):
        assert np.max(np.abs(want - got)) <= 1e-6
    steps = 2 * len(list(data))
    for attribute in ("d_optimizer", "g_optimizer"):
        optimizer = getattr(model, attribute)
        assert int(optimizer.iterations.numpy()) == steps
        assert len(optimizer.variables) == 2  # its step count and learning rate: no slots
        sibling = hook.chain_for(optimizer)[0]
        whole = 2 * sum(int(np.prod(v.shape)) * 4 for v in sibling.variables)  # Adam: m, v
        held = [replica.slot_bytes() for replica in sibling.replicas]
        assert len(held) == 2 and sum(held) == whole
        assert max(held) <= whole / 2 + 8, (attribute, held, whole)


def test_zero3_refuses_a_step_that_applies_optimizers_of_its_own_in_one_line():
    """zero3 gathers the weights for compile's optimizer's update; a GAN's own optimizers
    would update weights it holds in slices."""
    with mirrored().scope():
        model, data = models.gan()
    with pytest.raises(FitError, match=(
        r"Model 'gan\w*' has its own train_step, which applies d_optimizer \(Adam\), "
        r"g_optimizer \(Adam\) itself; .*Received: a train_step with optimizers "
        r"d_optimizer, g_optimizer"
    )):  # fmt: skip
        tfdist.fit(model, data, verbose=0, shard_optimizer="zero3")


def test_zero_refuses_an_optimizer_a_step_applies_itself_that_is_not_built():
    with mirrored().scope():
        model, data = models.gan()
    model.g_optimizer = keras.optimizers.Adam()
    with pytest.raises(FitError, match=(
        r"applies g_optimizer \(Adam\) itself, and it is not built.* Build it in compile: "
        r"self.g_optimizer.build"
    )):  # fmt: skip
        tfdist.fit(model, data, verbose=0, shard_optimizer="zero2")


def test_the_step_times_measure_the_exchange_of_a_step_s_own_optimizers(caplog):
    """The breakdown timed only the optimizer compile took: a GAN's step said 'exchange
    0.00 ms (0%)'. Its two optimizers' updates (the all-reduce and the update) are timed."""
    with mirrored().scope():
        model, data = models.gan()
    with caplog.at_level("DEBUG", logger="tfdist"):  # verbose=0: fit's lines are debug
        history = tfdist.fit(model, data, verbose=0)
    assert set(history.history) == {"d_loss", "g_loss"}
    line = next(r.getMessage() for r in caplog.records if "exchange" in r.getMessage())
    exchange = float(re.search(r"exchange ([0-9.]+) ms", line).group(1))
    assert exchange > 0.0, line

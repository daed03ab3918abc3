"""Corrections for asynchronous parameter-server training (tfdist.parallel.asynchronous):
the formulas on hand-computed cases in one process, and real parameter-server jobs
(tests/workers/async_worker.py) against Keras's fit and the staleness bound.
"""

from __future__ import annotations

import json
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests import zero_cases
from tests.conftest import run_module
from tfdist.errors import FitError
from tfdist.parallel import (
    BoundedStaleness,
    DelayCompensation,
    MomentumCorrection,
    SynchronousWarmup,
    registry,
)
from tfdist.training.hooks import AsyncStep
from tfdist.training.runners import mode_defaults, runner_for

TOLERANCE = 1e-5


def one_dense(optimizer) -> keras.Model:
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
    model.compile(optimizer, "mse")
    model.build((None, 2))
    return model


def corrected_by(hook, model, grad, moved_to, ticket=0) -> np.ndarray:
    """The gradient `hook` hands on for `grad`, after the kernel moved to `moved_to`
    between the step's read (begin_step) and its update, as another worker's update would."""
    hook.build(model, runner_for(model, tf.distribute.get_strategy()).job)
    kernel = model.trainable_variables[0]
    handed = []

    @tf.function
    def step():
        hook.begin_step(AsyncStep(tf.constant(ticket, tf.int64)))
        with tf.control_dependencies(hook._read.values()):
            moved = kernel.assign(moved_to)
        with tf.control_dependencies([moved]):
            hook.apply([(tf.constant(grad), kernel)], lambda pairs: handed.append(pairs[0][0]))
        return handed[-1]

    return step().numpy()


def test_delay_compensation_applies_its_formula_on_a_hand_computed_case():
    model = one_dense("sgd")
    read = model.get_weights()[0]  # [[a], [b]] as initialised
    g = np.array([[0.5], [-2.0]], "float32")
    moved_to = read + np.array([[0.1], [0.3]], "float32")
    # DC-ASGD-c: g + lambda * g * g * (w_now - w_read), lambda = 0.04.
    got = corrected_by(DelayCompensation(0.04, adaptive=False), model, g, moved_to)
    np.testing.assert_allclose(
        got, [[0.5 + 0.04 * 0.25 * 0.1], [-2.0 + 0.04 * 4.0 * 0.3]], rtol=1e-6
    )
    # DC-ASGD-a, first step: the mean square (1 - m) g^2 over its bias correction (1 - m)
    # is g^2, so lambda_t = lambda_0 / |g|.
    model.set_weights([read])
    got = corrected_by(DelayCompensation(2.0), model, g, moved_to)
    np.testing.assert_allclose(
        got, [[0.5 + 2.0 / 0.5 * 0.25 * 0.1], [-2.0 + 2.0 / 2.0 * 4.0 * 0.3]], rtol=1e-5
    )
    # Weights that did not move: no correction.
    model.set_weights([read])
    np.testing.assert_allclose(
        corrected_by(DelayCompensation(0.04, adaptive=False), model, g, read), g
    )


def test_momentum_correction_lowers_sgd_momentum_by_the_measured_implicit_momentum():
    """Staleness 1 on every update: implicit momentum 1 - 1/2 = 0.5, so SGD's 0.9 is
    applied as 0.4: v <- 0.4 v - lr g, w <- w + v."""
    model = one_dense(keras.optimizers.SGD(0.1, momentum=0.9))
    model.optimizer.build(model.trainable_variables)
    hook = MomentumCorrection()
    hook.build(model, runner_for(model, tf.distribute.get_strategy()).job)
    kernel = model.trainable_variables[0]
    slot = model.optimizer.momentums[0]
    slot.assign([[1.0], [-1.0]])
    w0 = kernel.numpy()
    g = tf.constant([[0.5], [0.25]])

    @tf.function
    def step():
        async_step = AsyncStep(tf.constant(0, tf.int64))
        hook.begin_step(async_step)
        async_step.staleness = tf.constant(1.0)
        hook.apply([(g, kernel)], lambda pairs: model.optimizer.apply(*zip(*pairs, strict=True)))

    step()
    velocity = 0.4 * np.array([[1.0], [-1.0]]) - 0.1 * g.numpy()
    np.testing.assert_allclose(slot.numpy(), velocity, rtol=1e-6)
    np.testing.assert_allclose(kernel.numpy(), w0 + velocity, rtol=1e-6)
    assert hook.summary() == {"momentum_applied": pytest.approx(0.4), "momentum_asked": 0.9}


@pytest.mark.parametrize(
    ("keywords", "optimizer", "message"),
    [
        (
            {"async_correction": "fast"},
            "sgd_momentum",
            "async_correction must be None or one of 'dc', 'momentum'",
        ),
        ({"max_staleness": -1}, "sgd_momentum", "max_staleness must be a whole number >= 0"),
        ({"async_correction": "dc"}, "sgd_momentum", "only parameter_server training makes"),
        ({"max_staleness": 2}, "sgd_momentum", "only parameter_server training makes"),
    ],
)
def test_bad_asynchronous_options_get_one_clear_line(keywords, optimizer, message):
    strategy = tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = zero_cases.mlp(optimizer)
    x, y = zero_cases.data()
    with pytest.raises(FitError, match=message):
        tfdist.fit(model, x, y, batch_size=48, verbose=0, **keywords)


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        (keras.optimizers.Adam(0.01), "needs keras.optimizers.SGD with momentum > 0"),
        (keras.optimizers.SGD(0.1), r"Received: SGD\(momentum=0.0\)"),
        (keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True), "Use nesterov=False"),
    ],
)
def test_momentum_correction_needs_sgd_with_plain_momentum(optimizer, message):
    with pytest.raises(FitError, match=message):
        model = one_dense(optimizer)
        MomentumCorrection().build(model, runner_for(model, tf.distribute.get_strategy()).job)


def test_a_staleness_bound_is_a_whole_number():
    with pytest.raises(FitError, match="max_staleness must be a whole number >= 0"):
        BoundedStaleness(1.5)
    with pytest.raises(FitError, match="async_warmup must be a whole number of steps >= 1"):
        SynchronousWarmup(0)


def test_a_warmup_lifts_the_parameter_servers_default_bound():
    """'auto' bounds staleness at 0 under parameter_server; with a warm-up, the warm-up is
    the bound and 'auto' means none after it. A bound the user names stays."""
    defaults = mode_defaults("parameter_server")
    assert registry.resolve_auto({}, defaults)["max_staleness"] == 0
    assert registry.resolve_auto({"async_warmup": 50}, defaults)["max_staleness"] is None
    named = registry.resolve_auto({"async_warmup": 50, "max_staleness": 2}, defaults)
    assert named["max_staleness"] == 2
    with pytest.raises(FitError, match="async_warmup must be a whole number >= 1"):
        model = one_dense(keras.optimizers.SGD(0.1))
        tfdist.fit(model, np.ones((8, 2)), np.ones((8, 1)), batch_size=4, async_warmup=0)


# --- parameter-server jobs ------------------------------------------------------------------------


def launch(out, workers: int, ps: int) -> None:
    result = run_module(
        "tools.launch", "--chief", "--workers", str(workers), "--ps", str(ps), "--timeout",
        "280", "--", sys.executable, "-m", "tests.workers.async_worker", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def run(out, case: str) -> tuple[list[np.ndarray], dict]:
    arrays = np.load(out / f"{case}.npz")
    weights = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    return weights, json.loads((out / f"{case}.json").read_text())


CASES = (
    "plain", "dc", "momentum", "max_staleness_0", "max_staleness_1", "dc_max_staleness_1",
    "staleness_aware_lr",
)  # fmt: skip


@pytest.mark.multiprocess
def test_with_one_worker_every_correction_trains_as_keras_fit(tmp_path):
    """One worker: staleness 0, so every correction is the identity."""
    launch(tmp_path, workers=1, ps=1)
    model = zero_cases.mlp("sgd_momentum")
    x, y = zero_cases.data()
    model.fit(x, y, batch_size=zero_cases.GLOBAL_BATCH, shuffle=False, verbose=0)
    for case in CASES:
        weights, record = run(tmp_path, case)
        assert zero_cases.max_diff(model.get_weights(), weights) <= TOLERANCE, case
        assert record["history"]["staleness_max"] == [0.0]
    assert run(tmp_path, "momentum")[1]["hook"]["momentum_applied"] == pytest.approx(0.9)
    assert run(tmp_path, "staleness_aware_lr")[1]["rate"] == "StalenessAwareSchedule"
    assert run(tmp_path, "plain")[1]["rate"] != "StalenessAwareSchedule"


@pytest.mark.multiprocess
def test_a_staleness_bound_holds_over_three_workers_and_two_ps(tmp_path):
    launch(tmp_path, workers=3, ps=2)
    for case, bound in (("max_staleness_0", 0), ("max_staleness_1", 1), ("dc_max_staleness_1", 1)):
        _, record = run(tmp_path, case)
        assert record["history"]["staleness_max"][0] <= bound, (case, record)
    _, bounded = run(tmp_path, "max_staleness_0")
    assert bounded["hook"]["staleness_timeouts"] == 0
    # A model's own train_step applies its update itself: the bound holds there too.
    custom = json.loads((tmp_path / "custom_max_staleness_0.json").read_text())
    assert custom["history"]["staleness_max"] == [0.0], custom
    for case in CASES:  # every run trained
        _, record = run(tmp_path, case)
        assert np.isfinite(record["history"]["loss"][0]), case
    # async_warmup: the first epoch's steps took turns; the bound lifted after them.
    _, warmup = run(tmp_path, "warmup")
    assert warmup["history"]["staleness_max"][0] == 0.0, warmup
    assert len(warmup["history"]["loss"]) == 2 and np.isfinite(warmup["history"]["loss"][1])

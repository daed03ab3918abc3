"""ADMM SGD (tfdist.parallel.admm) against the least-squares optimum in closed form.

Four replicas (mirrored over 4 logical CPUs) each always see their own quarter of the data,
drawn from a region of its own, so their own optima differ: ADMM must still reach the
optimum of the whole data, computed by numpy's lstsq.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import FitError
from tfdist.parallel import registry

ROWS, FEATURES, REPLICAS = 32, 6, 4


def least_squares() -> tuple[tf.data.Dataset, np.ndarray]:
    """The data (one global batch, every step; replica k gets rows k*ROWS..) and the
    optimum [kernel; bias] of the mean squared error over all of it."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(loc=k, size=(ROWS, FEATURES)) for k in range(REPLICAS)])
    w = rng.normal(size=(FEATURES, 1))
    y = x @ w + np.repeat(np.arange(REPLICAS), ROWS)[:, None] + rng.normal(0, 0.5, (len(x), 1))
    design = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    best = np.linalg.lstsq(design, y, rcond=None)[0]
    data = tf.data.Dataset.from_tensors((x.astype("float32"), y.astype("float32"))).repeat()
    return data, best


def linear_model(strategy) -> keras.Model:
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def solution(model) -> np.ndarray:
    kernel, bias = model.get_weights()
    return np.concatenate([kernel, bias[:, None]]).astype(np.float64)


@pytest.fixture(scope="module")
def strategy():
    return tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(REPLICAS)]
    )


def test_admm_reaches_the_least_squares_optimum_of_the_whole_data(strategy):
    data, best = least_squares()
    admm = linear_model(strategy)
    tfdist.fit(admm, data, epochs=4, steps_per_epoch=300, verbose=0, admm={"rho": 1.0, "every": 4})
    error = np.linalg.norm(solution(admm) - best) / np.linalg.norm(best)
    assert error < 1e-4, error
    # Each replica ended on the consensus: ADMM's fixed point, where every x_k = z.
    for variable in admm.trainable_variables:
        parts = [p.numpy() for p in strategy.experimental_local_results(variable.value)]
        assert max(np.abs(p - parts[0]).max() for p in parts) < 1e-5
    # Local SGD on the same data and steps (averaging as often) ends farther away: each
    # replica drifts towards its own optimum between averages.
    local = linear_model(strategy)
    tfdist.fit(local, data, epochs=4, steps_per_epoch=300, verbose=0, average_every=4)
    assert np.linalg.norm(solution(local) - best) / np.linalg.norm(best) > 10 * error


def test_two_fits_go_on_from_the_consensus_and_duals_of_the_first(strategy):
    data, _ = least_squares()
    once, twice = linear_model(strategy), linear_model(strategy)
    options = {"rho": 0.5, "every": 3}
    tfdist.fit(once, data, epochs=2, steps_per_epoch=30, verbose=0, admm=options)
    for epoch in range(2):
        tfdist.fit(
            twice, data, epochs=epoch + 1, initial_epoch=epoch, steps_per_epoch=30,
            verbose=0, admm=options,
        )  # fmt: skip
    np.testing.assert_allclose(solution(twice), solution(once), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rho": 0}, r"admm\['rho'\] must be a number > 0\. Received: admm\['rho'\]=0"),
        ({"rho": -1.0}, r"admm\['rho'\] must be a number > 0\. Received: admm\['rho'\]=-1\.0"),
        (
            {"rh": 1.0},
            r"admm takes a dict of rho \(a number > 0\), every \(a whole number >= 1, "
            r"default 1\) \(unknown rh; missing rho\)",
        ),  # fmt: skip
        ({"rho": 1.0, "every": 0}, r"admm\['every'\] must be a whole number >= 1"),
        (2.0, r"admm must be a dict of rho .* Received: admm=2\.0"),
    ],
)
def test_bad_options_get_one_line(strategy, options, message):
    data, _ = least_squares()
    with pytest.raises(FitError, match=message):
        tfdist.fit(linear_model(strategy), data, steps_per_epoch=1, verbose=0, admm=options)


def test_the_flag_s_text_spells_the_same_dict():
    value = registry.mode("admm").value
    assert value.parse("rho=0.5,every=4") == {"rho": 0.5, "every": 4}
    assert value.filled("rho=2") == {"rho": 2, "every": 1}
    assert value.problem("admm", "rho=1,every=2") is None
    assert "unknown speed" in value.problem("admm", "rho=1,speed=2")
    assert "must be a dict" in value.problem("admm", "fast")

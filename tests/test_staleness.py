"""Staleness measurement and the staleness-aware learning rate (tfdist/training/staleness.py)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import compat
from tfdist.app import ConfigError, TrainConfig, Trainer
from tfdist.training.callbacks import WarmupSchedule
from tfdist.training.staleness import StalenessAwareSchedule, StalenessStats, UpdateCounter

pytestmark = pytest.mark.fast


def test_the_counter_measures_the_updates_between_a_read_and_a_claim():
    counter = UpdateCounter()
    read = counter.read()
    counter.variable.assign_add(3)  # three other workers' updates land meanwhile
    assert float(counter.claim(read, after=[])) == 3.0
    assert counter.value() == 4  # theirs and ours
    assert float(counter.claim(counter.read(), after=[])) == 0.0


@pytest.mark.parametrize("name", ["sgd", "adam", "lamb"])
def test_a_stale_update_moves_the_weights_by_the_rate_over_its_staleness(name):
    # Scaling the gradient instead would leave Adam's and LAMB's first step unchanged.
    def first_step(staleness):
        schedule = StalenessAwareSchedule(WarmupSchedule(0.1, warmup_steps=0, total_steps=10))
        optimizer = {
            "sgd": keras.optimizers.SGD,
            "adam": keras.optimizers.Adam,
            "lamb": keras.optimizers.Lamb,
        }[name](schedule)
        weight = keras.Variable(np.ones([4], np.float32))
        optimizer.build([weight])

        @tf.function
        def step():
            with schedule.scaled(tf.constant(staleness, tf.float32)):
                optimizer.apply_gradients([(tf.constant([0.5, -1.0, 2.0, 0.25]), weight)])

        step()
        return 1.0 - weight.numpy()

    fresh, stale = first_step(0.0), first_step(4.0)
    assert np.abs(fresh).min() > 1e-3
    np.testing.assert_allclose(stale, fresh / 4, rtol=1e-4)
    # Staleness 0 and 1 both mean "the parameters it was computed from": full rate.
    np.testing.assert_allclose(first_step(1.0), fresh, rtol=1e-6)


def test_outside_a_step_the_schedule_is_its_base():
    base = WarmupSchedule(0.2, warmup_steps=4, total_steps=10)
    schedule = StalenessAwareSchedule(base)
    assert float(schedule(1)) == pytest.approx(float(base(1)))
    restored = StalenessAwareSchedule.from_config(schedule.get_config())
    assert float(restored(1)) == pytest.approx(float(base(1)))


def test_stats_keep_mean_and_max_per_epoch_and_per_run():
    stats = StalenessStats()
    stats.add(6.0, 3.0, 4)  # one closure: 4 updates, staleness summing to 6, at most 3
    assert stats.epoch_metrics() == {"staleness_mean": 1.5, "staleness_max": 3}
    stats.reset_epoch()
    assert stats.epoch_metrics() == {}
    stats.add(0.0, 0.0, 2)
    assert stats.epoch_metrics() == {"staleness_mean": 0.0, "staleness_max": 0}
    assert stats.run_summary() == (1.0, 3)


def test_staleness_aware_lr_is_refused_for_synchronous_strategies(tmp_path):
    with pytest.raises(ConfigError, match=r"True or False. Received: staleness_aware_lr='yes'"):
        TrainConfig(staleness_aware_lr="yes")
    config = TrainConfig(model="mlp", staleness_aware_lr=True, data_dir=str(tmp_path))
    with pytest.raises(
        tfdist.FitError,
        match=r"staleness_aware_lr corrects for asynchronous updates, which only "
        r"parameter_server training makes.*Received: staleness_aware_lr under one_device",
    ):
        Trainer(config, strategy=tfdist.build_strategy("one_device", cluster=None)).fit()


def test_staleness_aware_lr_wraps_the_optimizer_s_rate_once():
    from tfdist.parallel.asynchronous import StalenessAwareRate

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.3), "mse")
    hook = StalenessAwareRate(True)
    hook.build(model, job=None)
    rate = compat.learning_rate_schedule(model.optimizer)
    assert isinstance(rate, StalenessAwareSchedule) and float(rate(0)) == pytest.approx(0.3)
    hook.build(model, job=None)  # a second fit: already wrapped
    assert compat.learning_rate_schedule(model.optimizer) is rate
    restored = StalenessAwareSchedule.from_config(rate.get_config())
    assert float(restored(5)) == pytest.approx(0.3)

"""What depends on a strategy's kind, asked of tfdist.strategies: each fact holds for its kind
alone, and agrees with the name strategy_kind gives.

Strategies that need a cluster or a TPU stand in as mocks with their TensorFlow class as the
spec (isinstance then holds), so every kind is checked without building it.
"""

from __future__ import annotations

from unittest import mock

import pytest
import tensorflow as tf

import tfdist
from tfdist.layout import MULTI_WORKER_STRATEGIES
from tfdist.strategies import (
    REPLICA_PER_DEVICE_STRATEGIES,
    SINGLE_HOST_STRATEGIES,
    batch_multiple,
    joins_worker_processes,
    needs_coordinator,
    runs_on_tpu,
    strategy_kind,
    strategy_names,
)

pytestmark = pytest.mark.fast

# kind -> a stand-in of TensorFlow's class for it.
STAND_INS = {
    "tpu": tf.distribute.TPUStrategy,
    "parameter_server": tf.distribute.experimental.ParameterServerStrategy,
    "central_storage": tf.distribute.experimental.CentralStorageStrategy,
    "multi_worker_mirrored": tf.distribute.MultiWorkerMirroredStrategy,
    "mirrored": tf.distribute.MirroredStrategy,
    "one_device": tf.distribute.OneDeviceStrategy,
}


@pytest.mark.parametrize("kind", sorted(STAND_INS))
def test_each_fact_holds_for_its_kind_alone(kind):
    strategy = mock.Mock(spec=STAND_INS[kind])
    assert strategy_kind(strategy) == kind
    assert needs_coordinator(strategy) == (kind == "parameter_server")
    assert joins_worker_processes(strategy) == (kind == "multi_worker_mirrored")
    assert runs_on_tpu(strategy) == runs_on_tpu(kind) == (kind == "tpu")
    assert batch_multiple(strategy) == batch_multiple(kind) == (8 if kind == "tpu" else 1)


@pytest.mark.parametrize(
    "name, devices",
    [
        ("one_device", ("/cpu:0",)),
        ("mirrored", ("/cpu:0", "/cpu:1")),
        ("central_storage", ("/cpu:0", "/cpu:1")),
    ],
)
def test_built_single_host_strategies_need_none_of_it(name, devices):
    strategy = tfdist.build_strategy(name, cluster=None, devices=devices)
    assert not needs_coordinator(strategy)
    assert not joins_worker_processes(strategy)
    assert not runs_on_tpu(strategy)
    assert batch_multiple(strategy) == 1


def test_strategy_name_groups_are_strategy_names():
    names = set(strategy_names())
    assert set(REPLICA_PER_DEVICE_STRATEGIES) <= set(SINGLE_HOST_STRATEGIES) <= names
    assert set(MULTI_WORKER_STRATEGIES) <= names
    assert "one_device" not in REPLICA_PER_DEVICE_STRATEGIES


@pytest.mark.parametrize("kind", sorted(STAND_INS))
def test_ray_train_workers_refuse_a_strategy_that_trains_each_alone(monkeypatch, kind):
    pytest.importorskip("ray.train", reason='tfdist.ray needs Ray Train: pip install "tfdist[ray]"')
    import tfdist.ray
    from tfdist.errors import FitError

    context = mock.Mock(get_world_size=mock.Mock(return_value=2))
    monkeypatch.setattr(tfdist.ray.ray.train, "get_context", lambda: context)
    strategy = mock.Mock(spec=STAND_INS[kind])
    if kind == "multi_worker_mirrored":
        tfdist.ray._check_spans_workers(strategy)
    else:
        with pytest.raises(FitError, match=f"a {kind} strategy trains each of them alone"):
            tfdist.ray._check_spans_workers(strategy)

"""Local SGD (tfdist.parallel.local_sgd) and gossip SGD (tfdist.parallel.gossip), against
Keras's own fit on one device and against their own definitions.

In one process over 1, 2 and 4 logical CPUs (mirrored); with real worker processes
(multi_worker_mirrored, 4 workers) through tests/workers/exchange_worker.py.
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
from tests.workers import exchange_worker
from tfdist.errors import FitError
from tfdist.parallel import Gossip, LocalSGD
from tfdist.training.runners import runner_for

TOLERANCE = 1e-5


def mirrored(devices: int):
    return tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(devices)]
    )


def keras_reference(optimizer: str, epochs: int = 1) -> keras.Model:
    """Keras's own fit of the case on one device: the synchronous answer."""
    model = zero_cases.mlp(optimizer)
    x, y = zero_cases.data()
    model.fit(x, y, batch_size=zero_cases.GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model


def train(strategy, optimizer: str, hook=None, epochs: int = 1, **keywords):
    with strategy.scope():
        model = zero_cases.mlp(optimizer)
    x, y = zero_cases.data()
    tfdist.fit(
        model, x, y, batch_size=zero_cases.GLOBAL_BATCH, epochs=epochs, shuffle=False,
        verbose=0, step_hooks=[hook] if hook else (), **keywords,
    )  # fmt: skip
    return model


def replica_weights(model, strategy) -> list[list[np.ndarray]]:
    """Each replica's own copy of the weights (the components of the mirrored variables)."""
    per_variable = [strategy.experimental_local_results(v.value) for v in model.weights]
    return [[c[d].numpy() for c in per_variable] for d in range(strategy.num_replicas_in_sync)]


def test_fit_called_twice_keeps_each_replica_s_optimizer_state():
    """Local SGD that averages every step is synchronous SGD; over two fit calls it trains
    as Keras's two fit calls, momentum carried from the first into the second."""
    want = keras_reference("sgd_momentum")
    x, y = zero_cases.data()
    want.fit(x, y, batch_size=zero_cases.GLOBAL_BATCH, shuffle=False, verbose=0)
    strategy = mirrored(2)
    with strategy.scope():
        model = zero_cases.mlp("sgd_momentum")
    for _ in range(2):
        tfdist.fit(
            model, x, y, batch_size=zero_cases.GLOBAL_BATCH, shuffle=False, verbose=0,
            average_every=1,
        )  # fmt: skip
    assert zero_cases.max_diff(want.get_weights(), model.get_weights()) <= TOLERANCE


@pytest.mark.parametrize("devices", [2, 4])
def test_local_sgd_every_step_equals_synchronous_sgd(devices):
    want = keras_reference("sgd_momentum").get_weights()
    got = train(mirrored(devices), "sgd_momentum", average_every=1).get_weights()
    assert zero_cases.max_diff(want, got) <= TOLERANCE


@pytest.mark.parametrize("topology", ["ring", "exponential"])
def test_gossip_on_two_replicas_is_full_averaging_which_is_synchronous_sgd(topology):
    want = keras_reference("sgd_momentum").get_weights()
    got = train(mirrored(2), "sgd_momentum", gossip=topology).get_weights()
    assert zero_cases.max_diff(want, got) <= TOLERANCE


@pytest.mark.parametrize(
    "keywords", [{"average_every": 4}, {"gossip": "ring"}, {"gossip": "exponential"}]
)
@pytest.mark.parametrize("optimizer", ["adam", "adamw_clipnorm"])
def test_one_replica_trains_as_plain_training(keywords, optimizer):
    want = keras_reference(optimizer).get_weights()
    got = train(mirrored(1), optimizer, **keywords).get_weights()
    assert zero_cases.max_diff(want, got) <= TOLERANCE


def test_post_local_sgd_is_synchronous_for_its_sync_steps():
    """Adam through a synchronous phase covering every step equals Keras's fit (the
    gradients are averaged before each local update); a shorter one then runs locally."""
    want = keras_reference("adam").get_weights()
    whole = LocalSGD(4, sync_steps=zero_cases.STEPS)
    got = train(mirrored(2), "adam", whole).get_weights()
    assert zero_cases.max_diff(want, got) <= TOLERANCE
    assert whole.summary()["bytes_sent"] > 0
    partly = train(mirrored(2), "adam", LocalSGD(4, sync_steps=5)).get_weights()
    assert zero_cases.max_diff(want, partly) > 1e-4  # steps 6-10 were local


def test_local_sgd_averages_every_k_steps_and_at_each_settle():
    strategy = mirrored(4)
    hook = LocalSGD(3)
    model = train(strategy, "sgd_momentum", hook, epochs=2)
    # Steps 3, 6, 9, the settle at the end of epoch 1 (step 10), steps 12, 15, 18 and the
    # settle at 20: 8 averages, each a ring all-reduce over 4 replicas of every weight
    # (2 (N-1)/N of it sent by each replica).
    weights = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert hook.summary()["bytes_sent"] == 8 * 4 * (2 * 3 * weights * 4 // 4)
    replicas = replica_weights(model, strategy)
    for other in replicas[1:]:
        assert zero_cases.max_diff(replicas[0], other) == 0.0  # one model after the settle
    assert len(hook.spreads) == 2 and all(distance > 0 for distance, _ in hook.spreads)
    sync = keras_reference("sgd_momentum", epochs=2).get_weights()
    assert zero_cases.max_diff(sync, model.get_weights()) > 1e-4  # it did train locally


@pytest.mark.parametrize("every", [3, 5])  # 5: each epoch's last step averaged already
def test_each_epoch_end_logs_how_far_apart_the_replicas_were(every, caplog):
    with caplog.at_level("INFO", logger="tfdist"):
        train(mirrored(2), "sgd_momentum", average_every=every, epochs=2)
    lines = [
        r.getMessage() for r in caplog.records if "replicas' weights averaged" in r.getMessage()
    ]
    assert len(lines) == 2, lines
    if every == 5:
        assert all("they were one model already" in line for line in lines), lines
    else:
        assert all("from their mean" in line for line in lines), lines


def test_optimizer_state_is_averaged_only_when_asked():
    strategy = mirrored(2)
    slots = {}
    for average in (False, True):
        hook = LocalSGD(5, average_optimizer_state=average)
        train(strategy, "adam", hook)
        first, second = ([s.numpy() for s in replica.slots] for replica in hook.replicas)
        slots[average] = zero_cases.max_diff(first, second)
    assert slots[True] == 0.0  # the last step (10) averaged them
    assert slots[False] > 1e-6  # each replica's Adam moments are its own


def test_gossip_mixes_by_its_topology():
    """One mixing step on known buffers: the ring averages each replica with its two
    neighbours; the exponential graph with the replica 1, then 2 to its left, which
    averages 4 replicas exactly in 2 steps."""
    strategy = mirrored(4)
    with strategy.scope():
        model = zero_cases.mlp("sgd_momentum")
        model.build((None, 6))
    flats = [tf.constant([float(r), 10.0 * r]) for r in range(4)]
    ring, exponential = Gossip("ring"), Gossip("exponential")
    for hook in (ring, exponential):
        hook.build(model, runner_for(model, strategy).job)

    mixed = [t.numpy() for t in ring.mix(tf.constant(0, tf.int64), flats)]
    for r in range(4):
        expected = (flats[r] + flats[(r - 1) % 4] + flats[(r + 1) % 4]).numpy() / 3
        np.testing.assert_allclose(mixed[r], expected, rtol=1e-6)
    once = exponential.mix(tf.constant(0, tf.int64), flats)
    np.testing.assert_allclose(once[1].numpy(), (flats[1] + flats[0]).numpy() / 2)
    twice = [t.numpy() for t in exponential.mix(tf.constant(1, tf.int64), once)]
    for r in range(4):
        np.testing.assert_allclose(twice[r], [1.5, 15.0], rtol=1e-6)


@pytest.mark.parametrize("topology", ["ring", "exponential"])
def test_gossip_keeps_four_replicas_close_and_reports_how_close(topology):
    strategy = mirrored(4)
    hook = Gossip(topology)
    model = train(strategy, "sgd_momentum", hook, epochs=2)
    # Measured before each epoch's average: nonzero, and small beside the weights.
    assert len(hook.spreads) == 2
    for distance, relative in hook.spreads:
        assert distance > 0 and relative < 0.05, hook.spreads
    replicas = replica_weights(model, strategy)
    assert all(zero_cases.max_diff(replicas[0], r) == 0.0 for r in replicas[1:])
    summary = hook.summary()
    assert summary["replica_distance"] == max(distance for distance, _ in hook.spreads)


def test_a_local_sgd_run_resumes_from_its_step_checkpoint_exactly(tmp_path):
    """Two epochs straight equal one epoch, a new process's fit resuming for the second:
    each replica's optimizer copy (Adam's moments) is in the checkpoint."""
    straight = train(mirrored(2), "adam", LocalSGD(3), epochs=2).get_weights()
    first = tfdist.StepCheckpoint(str(tmp_path))
    train(mirrored(2), "adam", LocalSGD(3), epochs=1, callbacks=[first])
    again = tfdist.StepCheckpoint(str(tmp_path))
    resumed = train(mirrored(2), "adam", LocalSGD(3), epochs=2, callbacks=[again])
    assert zero_cases.max_diff(straight, resumed.get_weights()) <= TOLERANCE


def test_a_model_with_an_embedding_trains_under_gossip():
    """Sparse gradients (an Embedding's looked-up rows) are applied sparse, as Keras's
    optimizers take them."""
    strategy = mirrored(2)
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((4,), dtype="int32"),
                keras.layers.Embedding(20, 8),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(1),
            ]
        )
        model.compile(keras.optimizers.Adam(0.01), "mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(64, 4)).astype("int32")
    y = rng.normal(size=(64, 1)).astype("float32")
    history = tfdist.fit(model, x, y, batch_size=16, epochs=3, verbose=0, gossip="ring")
    assert history.history["loss"][-1] < history.history["loss"][0]


@pytest.mark.parametrize(
    ("strategy", "keywords", "message"),
    [
        (lambda: mirrored(2), {"average_every": 0}, "average_every must be a whole number >= 1"),
        (
            lambda: mirrored(2),
            {"gossip": "star"},
            "gossip must be None or one of 'ring', 'exponential'",
        ),
        (
            lambda: mirrored(2),
            {"average_every": 2, "shard_optimizer": "zero2"},
            "updates the weights its own way, and a step has one update",
        ),
        (
            lambda: mirrored(2),
            {"average_every": 2, "gossip": "ring"},
            "updates the weights its own way, and a step has one update",
        ),
        (lambda: mirrored(2), {"average_every": 2, "callbacks": "backup"}, "StepCheckpoint"),
        (
            lambda: tfdist.build_strategy(
                "central_storage", cluster=None, devices=["/cpu:0", "/cpu:1"]
            ),
            {"gossip": "ring"},
            "works on the steps of a synchronous strategy",
        ),
    ],
)
def test_bad_local_options_get_one_clear_line(strategy, keywords, message, tmp_path):
    if keywords.get("callbacks") == "backup":
        keywords = {**keywords, "callbacks": [keras.callbacks.BackupAndRestore(str(tmp_path))]}
    with pytest.raises(FitError, match=message):
        train(strategy(), "sgd_momentum", **keywords)


def test_an_optimizer_local_copies_cannot_stand_for_is_refused():
    with pytest.raises(FitError, match="global_clipnorm"):
        strategy = mirrored(2)
        with strategy.scope():
            model = zero_cases.mlp("sgd_momentum")
            model.compile(keras.optimizers.SGD(0.1, global_clipnorm=1.0), "mse")
        x, y = zero_cases.data()
        tfdist.fit(model, x, y, batch_size=48, verbose=0, average_every=2)


# --- worker processes -----------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_four_worker_processes_train_as_four_local_replicas(tmp_path):
    """Over 4 worker processes (point-to-point transfers): plain training and local SGD
    averaging every step equal Keras's fit on one device (both are synchronous SGD); local
    SGD every 3 steps and gossip equal the same over 4 local devices (copies), and report
    the replicas' distance."""
    result = run_module(
        "tools.launch", "--workers", "4", "--timeout", "280", "--",
        sys.executable, "-m", "tests.workers.exchange_worker", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    want = keras_reference("sgd_momentum", epochs=exchange_worker.EPOCHS).get_weights()
    for rank in range(4):
        for case in ("plain", "average_every_1"):
            got = _weights(tmp_path / f"worker_{rank}" / f"{case}.npz")
            assert zero_cases.max_diff(want, got) <= TOLERANCE, (rank, case)
    for case, make in (
        ("average_every_3", lambda: LocalSGD(3)),
        ("gossip_ring", lambda: Gossip("ring")),
        ("gossip_exponential", lambda: Gossip("exponential")),
    ):
        local = make()
        want = train(
            mirrored(4), "sgd_momentum", local, epochs=exchange_worker.EPOCHS
        ).get_weights()
        distance = max(local.spreads)[0]
        assert distance > 0
        for rank in range(4):
            here = tmp_path / f"worker_{rank}"
            assert zero_cases.max_diff(want, _weights(here / f"{case}.npz")) <= TOLERANCE, case
            summary = json.loads((here / f"{case}.json").read_text())
            assert summary["bytes_sent"] > 0
            assert summary["replica_distance"] == pytest.approx(distance, rel=1e-4), case


def _weights(path) -> list[np.ndarray]:
    arrays = np.load(path)
    return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]

"""Sharded optimizer state and gradients (tfdist.parallel.zero.sharded) and gradient accumulation
(tfdist.parallel.accumulate), against unsharded training and Keras's own fit.

In one process over 2, 3 and 4 logical CPUs (mirrored), and with real worker processes
(multi_worker_mirrored, 2 and 3 workers: tests/workers/zero_worker.py).
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
from tests.conftest import run_module, run_python
from tests.workers import zero_worker
from tfdist.errors import FitError
from tfdist.parallel import Accumulate, Partition, ShardedUpdate, ShardingError
from tfdist.parallel.zero.partition import slot_bytes

# The worker-process tests share one module fixture (three jobs) and one pytest worker
# (their xdist_group).

TOLERANCE = 1e-5


def mirrored(devices: int):
    return tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(devices)]
    )


def train(strategy, optimizer: str, **keywords):
    with strategy.scope():
        model = zero_cases.mlp(optimizer)
    x, y = zero_cases.data()
    tfdist.fit(
        model, x, y, batch_size=zero_cases.GLOBAL_BATCH, shuffle=False, verbose=0, **keywords
    )
    return model


# --- how the weights are cut ------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7])
def test_flat_partition_covers_every_weight_once_in_equal_ranges(ranks):
    shapes = [(6, 13), (13,), (13, 9), (9,), (9, 3), (3,)]
    partition = Partition.flat(dict(enumerate(shapes)), ranks)
    lengths = [end - start for start, end in partition.bounds]
    assert max(lengths) - min(lengths) <= 1 and sum(lengths) == 247
    covered = np.zeros(247, int)
    for chunk in range(ranks):
        at = partition.bounds[chunk][0]
        for piece in partition.pieces(chunk):
            assert piece.shape == (piece.end - piece.start,)
            first = partition.offsets[piece.index] + piece.start
            assert first == at  # pieces tile the chunk in buffer order
            covered[first : first + piece.end - piece.start] += 1
            at += piece.end - piece.start
        assert at == partition.bounds[chunk][1]
    assert (covered == 1).all()


def test_variable_partition_keeps_variables_whole_and_balances_them():
    shapes = [(100, 10), (10,), (10, 300), (300,), (300, 2), (2,)]
    partition = Partition.by_variable(dict(enumerate(shapes)), 2)
    owners = {}
    for chunk in range(2):
        for piece in partition.pieces(chunk):
            assert piece.shape == shapes[piece.index] and piece.start == 0
            owners[piece.index] = chunk
    assert sorted(owners) == list(range(len(shapes)))
    loads = [end - start for start, end in partition.bounds]
    assert loads == [3000, 1000 + 10 + 300 + 600 + 2]  # the largest alone; the rest together


# --- one process, several devices -------------------------------------------------------------


@pytest.mark.parametrize(
    "devices, optimizers",
    [
        # Each optimizer under both stages once; 247 weights do not split evenly over 3.
        (2, ["sgd_momentum", "adamw_clipnorm"]),
        (3, ["adam", "lamb"]),
        (4, ["sgd_momentum"]),
    ],
)
def test_sharded_updates_equal_unsharded_training_over_local_devices(devices, optimizers):
    strategy = mirrored(devices)
    for optimizer in optimizers:
        plain = train(strategy, optimizer)
        # Stage 1, stage 2, and (for the first optimizer of each layout) stage 2 in buckets of
        # 50 weights (variables larger than a bucket get one of their own).
        layouts = ((1, 1 << 22), (2, 1 << 22), (2, 200))
        for stage, bucket_bytes in layouts if optimizer == optimizers[0] else layouts[:2]:
            hook = ShardedUpdate(stage, bucket_bytes=bucket_bytes)
            sharded = train(strategy, optimizer, step_hooks=[hook])
            diff = zero_cases.max_diff(plain.get_weights(), sharded.get_weights())
            assert diff <= TOLERANCE, (optimizer, stage, bucket_bytes, diff)
            assert int(sharded.optimizer.iterations.numpy()) == zero_cases.STEPS
            # The user's optimizer keeps no slots; each replica holds its slice's.
            assert slot_bytes(sharded.optimizer) == 0
            per_replica = [r.slot_bytes() for r in hook.replicas]
            whole = slot_bytes(plain.optimizer)
            if hook.partitions[0].whole:  # whole variables per replica: balanced, not exact
                assert sum(per_replica) == whole
            else:
                for got in per_replica:  # 1/N of each bucket, to an element per slot
                    assert abs(got - whole / devices) <= 2 * 4 * len(hook.partitions)


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_fit_called_twice_trains_as_keras_fit_called_twice(stage):
    """The slices' optimizer state goes on from one fit call to the next, as Keras's
    optimizer's slots do (it was lost: 0.024 away after two one-epoch fits)."""
    x, y = zero_cases.data()
    reference = zero_cases.mlp("adam")
    for _ in range(2):
        reference.fit(x, y, batch_size=zero_cases.GLOBAL_BATCH, shuffle=False, verbose=0)
    with mirrored(2).scope():
        model = zero_cases.mlp("adam")
    for _ in range(2):
        tfdist.fit(
            model, x, y, batch_size=zero_cases.GLOBAL_BATCH, shuffle=False, verbose=0,
            shard_optimizer=stage,
        )  # fmt: skip
    assert zero_cases.max_diff(reference.get_weights(), model.get_weights()) <= TOLERANCE
    assert int(model.optimizer.iterations.numpy()) == 2 * zero_cases.STEPS


def test_a_fit_that_would_leave_sharded_optimizer_state_behind_is_one_line():
    # Keras's own optimizer was never built on the whole weights: it said "Unknown
    # variable"; zero1 -> zero2 would have started the slots again from zero, silently.
    x, y = zero_cases.data()
    strategy = mirrored(2)
    with strategy.scope():
        model = zero_cases.mlp("adam")
    tfdist.fit(model, x, y, batch_size=48, verbose=0, shard_optimizer="zero1")
    for keywords in ({}, {"shard_optimizer": "zero2"}, {"accumulate_steps": 2}):
        with pytest.raises(FitError, match=r"held by shard_optimizer='zero1' from an earlier "
                           r"tfdist.fit.*or compile the model again"):  # fmt: skip
            tfdist.fit(model, x, y, batch_size=48, verbose=0, **keywords)
    tfdist.fit(model, x, y, batch_size=48, verbose=0, shard_optimizer="zero1")  # goes on
    with strategy.scope():
        model.compile(keras.optimizers.Adam(0.01), "mse")  # a new optimizer: any mode
    tfdist.fit(model, x, y, batch_size=48, verbose=0, accumulate_steps=2)


def test_accumulation_equals_one_larger_batch_and_composes_with_sharding():
    x, y = zero_cases.data()
    keras_model = zero_cases.mlp("adam")  # Keras's own fit, one device, whole batches
    reference = keras_model.fit(x, y, batch_size=48, shuffle=False, verbose=0).history
    strategy = mirrored(2)
    for keywords in (
        {"accumulate_steps": 4},  # micro-batches of 6 per replica
        {"accumulate_steps": 4, "shard_optimizer": "zero2"},
        {"accumulate_steps": 2, "shard_optimizer": "zero1"},
    ):
        with strategy.scope():
            model = zero_cases.mlp("adam")
        history = tfdist.fit(model, x, y, batch_size=48, shuffle=False, verbose=0, **keywords)
        diff = zero_cases.max_diff(keras_model.get_weights(), model.get_weights())
        assert diff <= TOLERANCE, (keywords, diff)
        # One optimizer step per batch, and the logs count every micro-batch's examples.
        assert int(model.optimizer.iterations.numpy()) == zero_cases.STEPS
        for key, values in reference.items():
            np.testing.assert_allclose(history.history[key], values, atol=1e-5)


def test_accumulation_exchanges_once_per_step():
    strategy = mirrored(2)
    exchanges = []

    class CountExchanges(tfdist.StepHook):
        def apply(self, grads_and_vars, apply_next):
            exchanges.append(1)  # traced once per exchange in the step's graph
            return apply_next(grads_and_vars)

    with strategy.scope():
        model = zero_cases.mlp("sgd_momentum")
    x, y = zero_cases.data()
    tfdist.fit(
        model, x, y, batch_size=48, steps_per_epoch=1, verbose=0,
        step_hooks=[Accumulate(4), CountExchanges()],
    )  # fmt: skip
    assert len(exchanges) == 2  # one per replica's traced step, not 4 per replica


# --- what is refused, and how -------------------------------------------------------------------


def test_bad_sharding_and_accumulation_options_get_one_clear_line(tmp_path):
    x, y = zero_cases.data()
    two = mirrored(2)
    cases = [
        (two, {"accumulate_steps": 5}, "accumulate_steps=5 must divide each replica's batch"),
        (two, {"accumulate_steps": 0}, "accumulate_steps must be a whole number >= 1"),
        (
            two,
            {"shard_optimizer": "zero4"},
            "shard_optimizer must be None or one of 'zero1', 'zero2', 'zero3'",
        ),
        (mirrored(1), {"shard_optimizer": "zero2"}, "needs at least 2 replicas"),
        (
            two,
            {
                "shard_optimizer": "zero2",
                "callbacks": [keras.callbacks.BackupAndRestore(str(tmp_path))],
            },
            "Use tfdist.StepCheckpoint",
        ),
        (
            tfdist.build_strategy("central_storage", cluster=None, devices=["/cpu:0", "/cpu:1"]),
            {"shard_optimizer": "zero1"},
            "works on the steps of a synchronous strategy",
        ),
        (
            two,
            {"step_hooks": [ShardedUpdate(2, partition="flat")]},
            "Lamb needs whole variables under sharding",
        ),
    ]
    for strategy, keywords, message in cases:
        with strategy.scope():
            model = zero_cases.mlp("lamb" if "step_hooks" in keywords else "adam")
        with pytest.raises(FitError, match=message):
            tfdist.fit(model, x, y, batch_size=48, verbose=0, **keywords)
    for optimizer, message in (
        (lambda: keras.optimizers.Adam(use_ema=True), "does not shard an optimizer with use_ema"),
        (keras.optimizers.Nadam, "keeps state outside update_step"),
    ):
        with two.scope():
            model = zero_cases.mlp("adam")
            model.compile(optimizer(), "mse")
        with pytest.raises(ShardingError, match=message):
            tfdist.fit(model, x, y, batch_size=48, verbose=0, shard_optimizer="zero2")


@pytest.mark.parametrize("initial_scale", [2.0**15, 2.0**60], ids=["finite", "overflows"])
def test_mixed_float16_loss_scaling_under_sharding_equals_unsharded(initial_scale):
    """Dynamic loss scaling: a scale of 2**60 overflows float16 in the first steps, which
    must be skipped alike (weights kept, the scale halved, the step not counted)."""
    strategy = mirrored(2)
    x, y = zero_cases.data()
    models = {}
    for shard in (None, "zero2"):
        with strategy.scope():
            models[shard] = zero_cases.mixed_float16(initial_scale)
        tfdist.fit(
            models[shard], x, y, batch_size=48, shuffle=False, verbose=0, shard_optimizer=shard
        )
    plain, sharded = models[None], models["zero2"]
    assert zero_cases.max_diff(plain.get_weights(), sharded.get_weights()) <= TOLERANCE
    for name in ("iterations", "dynamic_scale", "step_counter"):
        want, got = (getattr(m.optimizer, name).numpy() for m in (plain, sharded))
        assert want == got, (name, want, got)
    if initial_scale > 2.0**40:  # the overflowing steps were skipped
        assert plain.optimizer.iterations.numpy() < zero_cases.STEPS


# --- worker processes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resumed_jobs(tmp_path_factory):
    """3 jobs, one after the other, on one StepCheckpoint directory each for plain, zero2 and
    zero3 Adam: 4 workers train an epoch and save; 2 resume for the next; 3 for the one after. The
    3-worker job also trains every case of tests/zero_cases.py unsharded and sharded, and the
    2-worker job keras-hub's Gemma under zero3 (a job's start costs more than its cases; over
    2 and 4 replicas they run in this process)."""
    out = tmp_path_factory.mktemp("zero_jobs")
    for epochs, workers in ((1, 4), (2, 2), (3, 3)):
        result = run_module(
            "tools.launch", "--workers", str(workers), "--timeout", "280", "--",
            sys.executable, "-m", "tests.workers.zero_worker", str(out), "resume", str(epochs),
            *(["gemma"] if workers == 2 else []),
            *(["matrix"] if workers == 3 else []),
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return out


@pytest.mark.xdist_group("process_heavy")
@pytest.mark.multiprocess
def test_a_whole_read_made_by_one_worker_only_is_one_clear_error_not_a_hang(tmp_path):
    """After zero3, worker 0 alone calls get_weights (a collective, as each process holds a
    slice): within the read's timeout it gets one error saying every worker must read. It
    gives up where the processes meet before the read, so no collective is aborted
    (TensorFlow's abort of a timed-out collective has crashed the process)."""
    result = run_module(
        "tools.launch", "--workers", "2", "--timeout", "240", "--",
        sys.executable, "-m", "tests.workers.zero_worker", str(tmp_path), "alone",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    found = json.loads((tmp_path / "alone.txt").read_text())
    assert "every process must make at the same point" in found["message"], found
    assert "on every worker" in found["message"], found
    assert found["seconds"] < 40, found  # the read's 5 s, not the 45 s the other worker stays
    assert "Collective has timed out" not in result.stdout + result.stderr


@pytest.mark.xdist_group("zero_jobs")
@pytest.mark.multiprocess
def test_sharded_updates_equal_unsharded_training_across_worker_processes(resumed_jobs):
    workers = 3
    out = resumed_jobs / f"matrix_{workers}"

    def weights(task: str, name: str) -> list[np.ndarray]:
        arrays = np.load(out / task / f"{name}.npz")
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]

    tasks = [f"worker_{i}" for i in range(workers)]
    for optimizer, stage in zero_worker.RUNS:
        if stage is None:
            continue
        plain = weights("worker_0", f"{optimizer}_plain")
        for task in tasks:
            got = weights(task, f"{optimizer}_{stage}")
            assert zero_cases.max_diff(plain, got) <= TOLERANCE, (optimizer, stage, task)
    for task in tasks:
        two = weights(task, "two_outputs_plain")
        got = weights(task, "two_outputs_zero2_accumulate2")
        assert zero_cases.max_diff(two, got) <= TOLERANCE, task
        # keras.io's GAN: both optimizers its train_step applies are sharded, 1/3 a worker
        gan = weights(task, "gan_plain")
        assert zero_cases.max_diff(gan, weights(task, "gan_zero2")) <= TOLERANCE, task
        slots = json.loads((out / task / "gan_zero2_slots.json").read_text())
        for attribute, found in slots.items():
            assert found["model_optimizer_variables"] == 2, (task, attribute)  # no slots
            assert found["held"] <= found["whole"] / workers + 8, (task, attribute, found)


@pytest.mark.xdist_group("zero_jobs")
@pytest.mark.multiprocess
def test_zero3_trains_keras_hubs_gemma_across_two_worker_processes_as_keras_on_one_device(
    resumed_jobs,
):
    from tools import keras_hub_models

    reference = keras_hub_models.gemma_causal_lm()
    reference.fit(keras_hub_models.token_data(), epochs=2, verbose=0, shuffle=False)
    for task in ("worker_0", "worker_1"):
        arrays = np.load(resumed_jobs / "gemma_2" / f"{task}.npz")
        got = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
        assert zero_cases.max_diff(reference.get_weights(), got) <= TOLERANCE, task


@pytest.mark.xdist_group("zero_jobs")
@pytest.mark.multiprocess
def test_a_sharded_job_resumes_with_other_numbers_of_workers_as_an_unsharded_one(resumed_jobs):
    """4 workers train an epoch and save; 2 resume for the next; 3 for the one after."""
    for epochs, workers in ((1, 4), (2, 2), (3, 3)):
        for task in range(workers):
            here = resumed_jobs / f"epoch{epochs}" / f"worker_{task}"
            plain = np.load(here / "plain.npz")
            for mode in ("zero2", "zero3"):
                sharded = np.load(here / f"{mode}.npz")
                diff = zero_cases.max_diff(
                    [plain[k] for k in sorted(plain.files)],
                    [sharded[k] for k in sorted(sharded.files)],
                )
                assert diff <= TOLERANCE, (mode, epochs, workers, task, diff)
            for mode in ("plain", "zero2", "zero3"):  # resumed: the steps of every launch so far
                steps = json.loads((here / f"{mode}.json").read_text())["iterations"]
                assert steps == zero_cases.STEPS * epochs, (mode, epochs)
    # zero3's checkpoints were written in parts: each process its slices, merged into one
    # bundle beside the chief's checkpoint, which holds no weight and no slot.
    directory = resumed_jobs / "checkpoints_zero3" / "checkpoints"
    saved = sorted(directory.glob("ckpt-*.index"))
    assert saved
    for index in saved:
        prefix = str(index)[: -len(".index")]
        main = tf.compat.v1.train.NewCheckpointReader(prefix).get_variable_to_shape_map()
        assert not [k for k in main if "kernel" in k or "slot" in k.lower()], sorted(main)
        parts = tf.compat.v1.train.NewCheckpointReader(prefix + ".shards/merged")
        shapes = parts.get_variable_to_shape_map()
        assert "trainable/0" in shapes and "trainable/0/.slot/momentum" in shapes, shapes
        # The flat weight, its slices from every process put together.
        kernel = zero_cases.mlp("adam").trainable_variables[0]
        assert shapes["trainable/0"] == [int(np.prod(kernel.shape))]


def test_the_binary_shards_and_accumulates_as_it_trains_unsharded(tmp_path):
    """experiments.train's --shard_optimizer and --accumulate_steps, through its Trainer."""
    from tfdist.app import TrainConfig, Trainer

    def weights(**options):
        config = TrainConfig(
            model="mlp", optimizer="adam", shuffle_buffer=0, global_batch_size=32, epochs=1,
            steps_per_epoch=6, eval_every=0, data_dir=str(tmp_path / "data"), **options,
        )  # fmt: skip
        trainer = Trainer(config, strategy=mirrored(2))
        trainer.fit()
        return trainer.model.get_weights()

    plain = weights()
    for options in (
        {"shard_optimizer": "zero2", "accumulate_steps": 2},
        {"shard_optimizer": "zero1"},
    ):
        assert zero_cases.max_diff(plain, weights(**options)) <= TOLERANCE, options
    with pytest.raises(FitError, match="accumulate_steps=3 must divide each replica's batch"):
        weights(accumulate_steps=3)


def test_a_model_trained_with_sharding_saves_and_loads_without_tfdist(tmp_path):
    with mirrored(2).scope():
        model = zero_cases.mlp("adam")
    x, y = zero_cases.data()
    tfdist.fit(model, x, y, batch_size=48, verbose=0, shard_optimizer="zero2")
    model.save(tmp_path / "model.keras")
    np.savez(tmp_path / "trained.npz", *model.get_weights())
    script = (
        "import sys, keras, numpy as np\n"
        f"model = keras.saving.load_model({str(tmp_path / 'model.keras')!r})\n"
        "assert not any(m.startswith('tfdist') for m in sys.modules)\n"
        f"np.savez({str(tmp_path / 'loaded.npz')!r}, *model.get_weights())\n"
    )
    result = run_python([sys.executable, "-c", script], fresh=True)
    assert result.returncode == 0, result.stderr[-3000:]
    trained, loaded = (np.load(tmp_path / f"{n}.npz") for n in ("trained", "loaded"))
    assert all(np.array_equal(trained[k], loaded[k]) for k in trained.files)

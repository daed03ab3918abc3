"""tfdist's ring all-reduce: the schedule on paper; fusion, compression and the ring over
logical CPUs in this process (alone, in MirroredStrategy, under Keras' model.fit); then real
worker processes against TensorFlow's own all-reduce for every dtype, awkward lengths and
2, 3 and 4 workers."""

from __future__ import annotations

import csv
import json
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import run_module
from tfdist.collective import (
    RingAllReduce,
    all_gather_schedule,
    chunk_bounds,
    fused_all_reduce,
    local_ring_all_reduce,
    pack,
    plan_buckets,
    reduce_scatter_schedule,
    replicas,
    unpack,
)

# Largest difference from TensorFlow's result, relative to the result's magnitude: a few
# units in the last place of each dtype (the ring adds in another order). Integers: exact.
TOLERANCE = {
    "float16": 4e-3,
    "bfloat16": 3e-2,
    "float32": 1e-6,
    "float64": 1e-14,
    "int32": 0,
    "int64": 0,
}


@pytest.mark.parametrize("length", [0, 1, 2, 3, 7, 10, 1001])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_chunks_cover_the_buffer_and_differ_by_at_most_one(length, ranks):
    bounds = chunk_bounds(length, ranks)
    sizes = [end - start for start, end in bounds]
    assert len(bounds) == ranks and sum(sizes) == length
    assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_the_schedule_sums_every_chunk_on_every_rank(ranks):
    """Plays the ring by hand: what each rank sends in a step is what its neighbour expects."""
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 100, size=ranks) for _ in range(ranks)]  # one element per chunk
    held = [list(d) for d in data]
    for schedule, combine in (
        (reduce_scatter_schedule, lambda mine, got: mine + got),
        (all_gather_schedule, lambda mine, got: got),
    ):
        steps = [schedule(r, ranks) for r in range(ranks)]
        for s in range(ranks - 1):
            outgoing = [held[r][steps[r][s][0]] for r in range(ranks)]
            for r in range(ranks):
                sent_by_left, wanted = steps[(r - 1) % ranks][s][0], steps[r][s][1]
                assert sent_by_left == wanted  # the left neighbour sends the chunk r expects
                held[r][wanted] = combine(held[r][wanted], outgoing[(r - 1) % ranks])
    total = np.sum(data, axis=0)
    assert all(list(h) == list(total) for h in held)


CPUS = [f"/cpu:{i}" for i in range(4)]  # conftest splits the CPU into 4 logical devices


def test_buckets_keep_one_dtype_and_respect_the_byte_limit():
    tensors = [
        tf.zeros([10]),  # 40 bytes
        tf.zeros([5], tf.int32),
        tf.zeros([10]),
        tf.zeros([100]),  # 400 bytes: larger than a bucket, alone
        tf.zeros([3], tf.int32),
        tf.zeros([2]),
    ]
    assert plan_buckets(tensors, 100) == [[0, 2], [1, 4], [3], [5]]
    assert plan_buckets(tensors, 1 << 20) == [[0, 2, 3, 5], [1, 4]]
    assert plan_buckets(tensors, 0) == [[i] for i in range(6)]  # fusion off
    with pytest.raises(ValueError, match="bucket_bytes must be >= 0"):
        plan_buckets(tensors, -1)


def test_pack_and_unpack_round_trip_every_shape():
    rng = np.random.default_rng(0)
    shapes = [(3, 3, 2, 4), (), (0,), (7,), (1, 5), (0, 3)]
    tensors = [tf.constant(rng.normal(size=s), tf.float32) for s in shapes]
    flat = pack(tensors)
    assert flat.shape == [sum(int(np.prod(s)) for s in shapes)]
    for original, back in zip(tensors, unpack(flat, tensors), strict=True):
        assert back.shape == original.shape
        np.testing.assert_array_equal(back.numpy(), original.numpy())


@pytest.mark.parametrize("length", [0, 1, 3, 1001])
@pytest.mark.parametrize("devices", [1, 2, 3, 4])
def test_ring_over_local_devices_sums_exactly(length, devices):
    rng = np.random.default_rng(length)
    values = [rng.integers(-1000, 1000, size=length) for _ in range(devices)]
    flats = []
    for value, device in zip(values, CPUS, strict=False):
        with tf.device(device):
            flats.append(tf.constant(value, tf.int64))
    sums = local_ring_all_reduce(flats, CPUS[:devices])
    for device, total in zip(CPUS, sums, strict=False):
        assert total.device.endswith(device.replace("/cpu:", "CPU:"))
        np.testing.assert_array_equal(total.numpy(), np.sum(values, axis=0))


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_a_gather_read_where_the_replicas_lie_is_tensorflows_gather(devices):
    """replicas.all_gather against ReplicaContext.all_gather in one step: the same rows (of
    uneven counts on every replica) and the same gradients, with no collective in the step.
    (tfdist's strategy: TensorFlow's own would start its collective keys where another
    strategy of other devices in this process started, which poisons the process.)"""
    strategy = tfdist.build_strategy("mirrored", cluster=None, devices=CPUS[:devices])
    rows = sum(range(1, devices + 1))
    stacked = tf.constant(np.arange(3 * rows, dtype="float32").reshape(rows, 3))

    def step(gather):
        def replica():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            x = tf.gather(stacked, _rows_of(r, devices))
            with tf.GradientTape() as tape:
                tape.watch(x)
                whole = gather(x)
                # Each replica weighs the rows its own way: its gradient is not the others'.
                loss = tf.reduce_sum(whole * tf.cast(r + 1, tf.float32) * tf.range(3.0))
            return whole, tape.gradient(loss, x)

        return strategy.run(replica)

    def tensorflows(x):
        return tf.distribute.get_replica_context().all_gather(x, axis=0)

    want = tf.function(lambda: step(tensorflows), autograph=False)
    got = tf.function(lambda: step(replicas.all_gather), autograph=False)
    (want_whole, want_grad), (got_whole, got_grad) = want(), got()
    local = strategy.experimental_local_results
    assert [w.shape for w in local(got_whole)] == [(rows, 3)] * devices
    assert [g.shape[0] for g in local(got_grad)] == list(range(1, devices + 1))
    for w, g in zip(
        local(want_whole) + local(want_grad), local(got_whole) + local(got_grad), strict=True
    ):
        np.testing.assert_array_equal(g.numpy(), w.numpy())
    ops = [op.type for op in got.get_concrete_function().graph.get_operations()]
    assert not [t for t in ops if t.startswith("Collective")]
    assert "CollectiveGatherV2" in {
        op.type for op in want.get_concrete_function().graph.get_operations()
    }


def _rows_of(replica, devices):
    """Replica r's rows of the stacked weights: r + 1 of them."""
    starts = tf.constant(np.cumsum([0, *range(1, devices + 1)]), tf.int32)
    return tf.range(starts[replica], starts[replica + 1])


@pytest.mark.parametrize("compression", [None, "float16", "bfloat16"])
@pytest.mark.parametrize("bucket_bytes", [0, 48, 1 << 20])
def test_fusion_and_compression_round_trip(bucket_bytes, compression):
    rng = np.random.default_rng(1)
    shapes = [(4, 3), (), (0,), (9,), (2, 2, 2)]
    per_replica = []
    for device in CPUS[:3]:
        with tf.device(device):
            tensors = [tf.constant(rng.normal(size=s), tf.float32) for s in shapes]
            tensors.append(tf.constant(rng.integers(-9, 9, size=(5,)), tf.int32))
        per_replica.append(tensors)
    summed = fused_all_reduce(
        per_replica,
        lambda flats: local_ring_all_reduce(flats, CPUS[:3]),
        bucket_bytes=bucket_bytes,
        compression=compression,
    )
    tolerance = {None: 1e-6, "float16": 4e-3, "bfloat16": 3e-2}[compression]
    for i in range(len(shapes) + 1):
        expected = np.sum([replica[i].numpy() for replica in per_replica], axis=0)
        for replica in summed:
            assert replica[i].dtype == per_replica[0][i].dtype  # float32 comes back float32
            assert replica[i].shape == per_replica[0][i].shape
            got = replica[i].numpy()
            if expected.dtype.kind == "i":
                np.testing.assert_array_equal(got, expected)  # never compressed
            elif expected.size:
                scale = max(float(np.abs(expected).max()), 1.0)
                assert float(np.abs(got - expected).max()) <= tolerance * scale


def fit_weights(strategy, *, steps=4):
    """A small Keras model trained with model.fit under `strategy`; same data and init."""
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32 * steps, 8)).astype("float32"), rng.integers(0, 3, 32 * steps)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), history.history["loss"]


@pytest.fixture(scope="module")
def default_fit():
    return fit_weights(tfdist.build_strategy("mirrored", cluster=None))


@pytest.mark.parametrize("fusion_bytes", [0, None])
def test_keras_fit_under_mirrored_with_the_ring_matches_the_default(default_fit, fusion_bytes):
    strategy = tfdist.build_strategy(
        "mirrored", cluster=None, all_reduce="ring", fusion_bytes=fusion_bytes
    )
    ops = strategy.extended._cross_device_ops
    assert isinstance(ops, RingAllReduce)
    weights, losses = fit_weights(strategy)
    assert ops.rings_built > 0  # the gradients did go over the ring
    assert (
        max(float(np.abs(a - b).max()) for a, b in zip(weights, default_fit[0], strict=True))
        <= 1e-6
    )
    assert losses == pytest.approx(default_fit[1], abs=1e-6)
    assert losses[-1] < losses[0]


def test_compressed_gradients_train_close_to_the_default(default_fit):
    strategy = tfdist.build_strategy(
        "mirrored", cluster=None, all_reduce="ring", compression="bfloat16"
    )
    weights, losses = fit_weights(strategy)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(weights, default_fit[0], strict=True))
    assert 0 < diff <= 1e-2  # bfloat16 sums differ a little, and only a little
    assert losses == pytest.approx(default_fit[1], abs=1e-2)


def results(stdout: str, marker: str = "ALLREDUCE_RESULT ") -> list[dict]:
    return [json.loads(line.split(marker, 1)[1]) for line in stdout.splitlines() if marker in line]


# Every dtype the ring takes, on the odd ring (3 workers: chunks of unequal length, several
# rings at once). Process rings of 2 and 4 train exactly in tests/test_training.py (2 workers,
# unfused), tests/test_zero.py (2, 3 and 4 workers) and tests/test_local_sgd.py (4).
ALL_DTYPES = "float16,bfloat16,float32,float64,int32,int64"


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers, dtypes", [(3, ALL_DTYPES)])
def test_ring_matches_tensorflows_all_reduce(workers, dtypes):
    result = run_module(
        "tools.launch", "--workers", str(workers), "--timeout", "240", "--",
        sys.executable, "-m", "tests.workers.allreduce_worker", dtypes,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    cases = results(result.stdout)
    # ranks x dtypes x lengths x reductions
    assert len(cases) == workers * len(dtypes.split(",")) * 6 * 2
    assert {case["dtype"] for case in cases} == set(dtypes.split(","))
    for case in cases:
        assert case["shape_ok"], case
        assert case["diff"] <= TOLERANCE[case["dtype"]] * max(case["scale"], 1.0), case
        assert case["naive_diff"] <= TOLERANCE[case["dtype"]] * max(case["scale"], 1.0), case
    fused = results(result.stdout, "FUSED_RESULT ")
    assert len(fused) == workers * 2 * 3 * 3  # ranks x eager/traced x buckets x compressions
    for case in fused:
        assert case["same_layout"], case
        for dtype, diff, scale in zip(case["dtypes"], case["diffs"], case["scales"], strict=True):
            wire = case["compression"] if dtype == "float32" and case["compression"] else dtype
            assert diff <= TOLERANCE[wire] * max(scale, 1.0), case


@pytest.mark.multiprocess
def test_mismatched_shapes_fail_clearly_instead_of_hanging():
    result = run_module(
        "tools.launch",
        "--workers",
        "2",
        "--timeout",
        "150",
        "--",
        sys.executable,
        "-m",
        "tests.workers.allreduce_worker",
        "--mismatch",
    )
    assert "timed out" not in result.stdout
    errors = [case["error"] for case in results(result.stdout)]
    assert any(
        "another rank passed a different shape or dtype (Shape mismatch" in e for e in errors
    ), result.stdout[-3000:]


def test_the_benchmark_compares_cross_device_ops_and_writes_csv_and_plot(tmp_path):
    """A run of tools.allreduce_bench --mode local, cut short: the figures are not checked
    (benchmarks are not timed tests), only that every implementation ran and agreed."""
    csv_path, png = tmp_path / "bench.csv", tmp_path / "bench.png"
    result = run_module(
        "tools.allreduce_bench", "--mode", "local", "--workers", "2", "--iters", "1",
        "--out_csv", str(csv_path), "--plot", str(png),
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = list(csv.DictReader(csv_path.read_text().splitlines()))
    assert [r["implementation"] for r in rows] == [
        "tfdist RingAllReduce",
        "tfdist RingAllReduce (no fusion)",
        "ReductionToOneDevice",
        "HierarchicalCopyAllReduce",
    ]
    assert all(r["agree"] == "True" and float(r["seconds"]) > 0 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""Strategy wiring: the batch arithmetic, and what each strategy's training consumes."""

from __future__ import annotations

import sys

import pytest
import tensorflow as tf

import tfdist
from tests.conftest import run_module
from tfdist.data import (
    DataError,
    PipelineOptions,
    distribute_dataset,
    plan_batches,
    prepare_synthetic,
)
from tfdist.data.distribute import PAD_LABEL, BatchPlan, pad_to_whole_steps
from tools.smoke import parse_results


@pytest.fixture(scope="module")
def synthetic():
    return prepare_synthetic(image_shape=(4, 4, 1), num_examples=64)


def input_fn(data, **options):
    options = PipelineOptions(**{"shuffle_buffer": 0, **options})
    return lambda context, batch_size: data.dataset(
        "train", batch_size=batch_size, input_context=context, options=options
    )


@pytest.mark.parametrize(
    "name, kwargs, per_replica",
    [
        ("one_device", {}, 32),
        ("mirrored", {"devices": ("/cpu:0", "/cpu:1")}, 16),
        ("mirrored", {}, 8),
    ],
)
def test_per_replica_batches_come_from_the_global_batch(
    synthetic, name, kwargs, per_replica, caplog
):
    caplog.set_level("INFO", logger="tfdist.data.distribute")
    strategy = tfdist.build_strategy(name, cluster=None, **kwargs)
    dataset = distribute_dataset(strategy, input_fn(synthetic), global_batch_size=32)
    images, labels = next(iter(dataset))
    shards = strategy.experimental_local_results(images)
    assert [s.shape[0] for s in shards] == [per_replica] * strategy.num_replicas_in_sync
    assert (
        f"Global batch 32 = {strategy.num_replicas_in_sync} replica(s) x {per_replica} per replica"
        in caplog.text
    )


def test_replicas_of_one_step_get_different_examples(synthetic):
    strategy = tfdist.build_strategy("mirrored", cluster=None, devices=("/cpu:0", "/cpu:1"))
    images, _ = next(iter(distribute_dataset(strategy, input_fn(synthetic), global_batch_size=8)))
    first, second = strategy.experimental_local_results(images)
    assert not bool(tf.reduce_all(first == second))


def test_indivisible_global_batch_names_both_numbers():
    strategy = tfdist.build_strategy("mirrored", cluster=None)
    with pytest.raises(
        DataError,
        match=r"global batch size 30 does not split evenly over the 4 replicas.*e\.g\. 28 or 32",
    ):
        plan_batches(strategy, 30)
    with pytest.raises(DataError, match=r"positive integer"):
        plan_batches(strategy, 0)


@pytest.mark.multiprocess
def test_two_worker_multi_worker_mirrored_reads_tfrecords_exactly_once(tmp_path):
    result = run_module(
        "tools.launch", "--workers", "2", "--timeout", "240", "--",
        sys.executable, "-m", "experiments.input_check", "--strategy=multi_worker_mirrored",
        f"--data_dir={tmp_path}", "--global_batch_size=64",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    by_task = parse_results(result.stdout, marker="INPUT_RESULT ")
    assert set(by_task) == {"worker:0", "worker:1"}
    results = list(by_task.values())
    ids = results[0]["ids"] + results[1]["ids"]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 1438  # every training example once
    assert not set(results[0]["ids"]) & set(results[1]["ids"])
    assert (
        "reads 2 of 4 files" in result.stdout
        and "Global batch 64 = 2 replica(s) x 32" in result.stdout
    )


def labelled(count: int) -> tf.data.Dataset:
    """`count` examples (image = label = index) in batches of 3, the last one partial."""
    images = tf.reshape(tf.range(count, dtype=tf.float32), [count, 1, 1])
    return tf.data.Dataset.from_tensor_slices((images, tf.range(count))).batch(3)


@pytest.mark.parametrize(
    "count, batches_per_step, batches",
    [(10, 2, 4), (9, 3, 3), (9, 1, 3), (1, 4, 4), (0, 2, 0)],
)
def test_padding_gives_whole_steps_of_full_batches(count, batches_per_step, batches):
    padded = list(
        pad_to_whole_steps(labelled(count), batch_size=3, batches_per_step=batches_per_step)
    )
    assert len(padded) == batches
    assert all(images.shape == (3, 1, 1) and labels.shape == (3,) for images, labels in padded)
    labels = [int(x) for _, batch in padded for x in batch]
    images = [int(x) for batch, _ in padded for x in tf.reshape(batch, [-1])]
    real = [x for x in labels if x != PAD_LABEL]
    assert real == list(range(count))  # every example once, in order, before the padding
    assert labels == real + [PAD_LABEL] * (len(labels) - count)
    assert images[count:] == [0] * (len(images) - count)


def test_padded_evaluation_feeds_every_replica_a_full_batch(synthetic):
    strategy = tfdist.build_strategy("mirrored", cluster=None)  # 4 replicas
    test_examples = synthetic.info.num_examples["test"]  # 16: one full step of 12, then 4

    def dataset_fn(context, batch_size):
        options = PipelineOptions(repeat=False, shuffle_buffer=0, drop_remainder=False)
        dataset = synthetic.dataset(
            "test", batch_size=batch_size, input_context=context, options=options
        )
        per_pipeline = context.num_replicas_in_sync // context.num_input_pipelines
        return pad_to_whole_steps(dataset, batch_size=batch_size, batches_per_step=per_pipeline)

    steps = list(distribute_dataset(strategy, dataset_fn, global_batch_size=12))
    assert len(steps) == 2
    shards = [labels for _, step in steps for labels in strategy.experimental_local_results(step)]
    assert [s.shape[0] for s in shards] == [3] * 8
    real = tf.concat([s[s != PAD_LABEL] for s in shards], axis=0)
    expected = tf.concat(
        [
            labels
            for _, labels in synthetic.dataset(
                "test",
                batch_size=64,
                options=PipelineOptions(repeat=False, shuffle_buffer=0, drop_remainder=False),
            )
        ],
        axis=0,
    )
    assert real.shape[0] == test_examples
    assert sorted(real.numpy().tolist()) == sorted(expected.numpy().tolist())


def test_padding_needs_images_of_a_fixed_shape():
    ragged = tf.data.Dataset.range(3).map(lambda i: (tf.zeros([i + 1]), tf.cast(i, tf.int32)))
    with pytest.raises(DataError, match=r"needs images of a fixed shape"):
        pad_to_whole_steps(ragged.batch(1), batch_size=2, batches_per_step=1)


@pytest.mark.parametrize(
    "plan, advice",
    [
        (BatchPlan("tpu", 32, 8), "a multiple of 64 wastes none"),
        (BatchPlan("tpu", 64, 8), None),
        (BatchPlan("mirrored", 12, 4), None),
    ],
)
def test_tpu_batches_that_cores_would_pad_are_pointed_out(plan, advice):
    text = plan.describe()
    assert text.startswith(f"Global batch {plan.global_batch_size} = {plan.replicas} replica(s)")
    assert (advice in text) if advice else ("TPU cores pad" not in text)

"""The TFRecord pipeline: exactly-once sharding, order control, and corrupt files."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tfdist.data import DataError, PipelineOptions, tfrecord_dataset, write_tfrecords
from tfdist.data.pipeline import explain_data_error

pytestmark = pytest.mark.fast

ONE_EPOCH = PipelineOptions(
    repeat=False, shuffle_buffer=0, drop_remainder=False, deterministic=True
)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """101 examples in 4 shards: a count that divides by neither 2 nor 3 pipelines."""
    directory = tmp_path_factory.mktemp("records")
    write_tfrecords(
        {
            "id": np.arange(101, dtype=np.int64),
            "x": np.arange(202, dtype=np.float32).reshape(101, 2),
        },
        str(directory),
        name="data",
        num_shards=4,
    )
    return str(directory / "data")


def context(pipelines, index):
    return tf.distribute.InputContext(
        num_input_pipelines=pipelines, input_pipeline_id=index, num_replicas_in_sync=pipelines
    )


def ids_of(dataset):
    return [int(i) for batch in dataset for i in batch["id"].numpy()]


@pytest.mark.parametrize("pipelines", [1, 2, 3, 5])
@pytest.mark.parametrize("shard_by", ["auto", "example"])
def test_every_example_is_read_exactly_once_per_epoch(records, pipelines, shard_by, caplog):
    caplog.set_level("INFO", logger="tfdist.data.pipeline")
    options = PipelineOptions(
        repeat=False, shuffle_buffer=64, seed=3, drop_remainder=False, shard_by=shard_by
    )
    seen = []
    for index in range(pipelines):
        seen += ids_of(
            tfrecord_dataset(
                records, batch_size=8, input_context=context(pipelines, index), options=options
            )
        )
    assert sorted(seen) == list(range(101))
    if pipelines > 1:
        # 4 files of 26/25/25/25 examples: even over 2 pipelines (51/50), uneven over 3
        # (26/50/25: one pipeline would hold twice another), too few for 5.
        by_file = shard_by == "auto" and pipelines == 2
        expected = "sharded by file" if by_file else "sharded by example"
        assert sum(expected in r.message for r in caplog.records) == pipelines
        if shard_by == "auto" and pipelines == 3:
            assert "by file the shares would be 26/50/25 examples" in caplog.text


def test_uneven_file_shards_asked_for_are_read_with_a_warning(records, caplog):
    options = PipelineOptions(repeat=False, shuffle_buffer=0, drop_remainder=False, shard_by="file")
    seen = [ids_of(tfrecord_dataset(records, batch_size=8, input_context=context(3, i),
                                    options=options)) for i in range(3)]  # fmt: skip
    assert sorted(sum(seen, [])) == list(range(101))
    assert sorted(len(ids) for ids in seen) == [25, 26, 50]
    assert "Sharding by file as asked gives uneven shares (26/50/25 examples)" in caplog.text


def test_no_shuffle_and_deterministic_gives_a_fixed_order(records):
    first = ids_of(tfrecord_dataset(records, batch_size=10, options=ONE_EPOCH))
    second = ids_of(tfrecord_dataset(records, batch_size=10, options=ONE_EPOCH))
    assert first == second and sorted(first) == list(range(101))


def test_seeded_shuffle_repeats_and_differs_from_file_order(records):
    options = PipelineOptions(
        repeat=False, shuffle_buffer=128, seed=7, drop_remainder=False, deterministic=True
    )
    a = ids_of(tfrecord_dataset(records, batch_size=10, options=options))
    b = ids_of(tfrecord_dataset(records, batch_size=10, options=options))
    assert a == b
    assert a != ids_of(tfrecord_dataset(records, batch_size=10, options=ONE_EPOCH))


def test_repeat_batches_and_maps(records):
    dataset = tfrecord_dataset(
        records,
        batch_size=16,
        options=PipelineOptions(shuffle_buffer=0, cache=True),
        map_fn=lambda batch: batch["x"] * 2.0,
    )
    batches = list(dataset.take(20))  # 320 examples > 101: it repeats
    assert all(b.shape == (16, 2) for b in batches)  # drop_remainder keeps shapes static
    assert dataset.element_spec.shape.as_list() == [16, 2]


def test_forcing_file_sharding_with_too_few_files_is_explained(records):
    with pytest.raises(
        DataError,
        match=r"needs at least one file per input pipeline, but 4 file\(s\) are shared by 5 pipelines",
    ):
        tfrecord_dataset(
            records,
            batch_size=4,
            input_context=context(5, 0),
            options=PipelineOptions(shard_by="file"),
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shuffle_buffer": -1}, r"shuffle_buffer must be a whole number >= 0"),
        ({"shard_by": "host"}, r"shard_by must be one of auto, file, example"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(DataError, match=message):
        PipelineOptions(**kwargs)


@pytest.fixture
def truncated(tmp_path):
    write_tfrecords({"id": np.arange(40, dtype=np.int64)}, str(tmp_path), name="data", num_shards=2)
    shard = tmp_path / "data-00001-of-00002.tfrecord"
    content = shard.read_bytes()
    shard.write_bytes(content[: len(content) - 25])  # cut into the last record
    return tmp_path, shard


def test_a_truncated_file_fails_naming_the_file(truncated):
    directory, shard = truncated
    with pytest.raises(tf.errors.InvalidArgumentError) as excinfo:
        ids_of(tfrecord_dataset(str(directory), batch_size=4, options=ONE_EPOCH))
    error = explain_data_error(excinfo.value)
    assert isinstance(error, DataError)
    assert str(error).startswith(f'"{shard}" holds 19 readable record(s) but its metadata says 20')
    assert "skip_corrupt=True" in str(error)


def test_skip_mode_drops_bad_records_and_warns_once_with_a_count(truncated, caplog):
    directory, shard = truncated
    options = PipelineOptions(
        repeat=False, shuffle_buffer=0, drop_remainder=False, skip_corrupt=True
    )
    dataset = tfrecord_dataset(str(directory), batch_size=4, options=options)
    for _ in range(2):  # two epochs read the bad file twice; the warning says it once
        seen = ids_of(dataset)
        assert len(seen) == 39 and len(set(seen)) == 39  # the good file's 20, the other's 19
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert warned == [f'skipped 1 unreadable record(s) of 20 in "{shard}" (skip_corrupt=True): '
                      "the file is truncated or corrupt from there on."], warned  # fmt: skip


def test_a_flipped_byte_is_caught_too(tmp_path):
    write_tfrecords({"id": np.arange(30, dtype=np.int64)}, str(tmp_path), name="data")
    shard = tmp_path / "data-00000-of-00001.tfrecord"
    content = bytearray(shard.read_bytes())
    content[len(content) // 2] ^= 0xFF
    shard.write_bytes(bytes(content))
    with pytest.raises(tf.errors.InvalidArgumentError) as excinfo:
        ids_of(tfrecord_dataset(str(tmp_path), batch_size=4, options=ONE_EPOCH))
    assert "readable record(s) but its metadata says 30" in str(explain_data_error(excinfo.value))

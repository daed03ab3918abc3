"""Writing TFRecords with a sidecar, finding them again, and refusing what does not match."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tfdist.data import DataError, find_records, tfrecord_dataset, write_tfrecords
from tfdist.data.pipeline import PipelineOptions
from tfdist.data.records import check_first_record

pytestmark = pytest.mark.fast

ONE_EPOCH = PipelineOptions(
    repeat=False, shuffle_buffer=0, drop_remainder=False, deterministic=True
)


def arrays(n=23):
    rng = np.random.default_rng(1)
    return {
        "image": rng.integers(0, 256, size=(n, 4, 4, 3)).astype(np.uint8),
        "dense": rng.normal(size=(n, 5)).astype(np.float32),
        "exact": rng.normal(size=(n, 2)).astype(np.float64),
        "half": rng.normal(size=(n, 3)).astype(np.float16),
        "label": rng.integers(0, 10, size=n).astype(np.int64),
        "small": rng.integers(-5, 5, size=(n, 2)).astype(np.int32),
        "flag": rng.integers(0, 2, size=n).astype(bool),
        "id": np.arange(n, dtype=np.int64),
    }


def read_all(source, **kwargs):
    batches = list(tfrecord_dataset(source, batch_size=7, options=ONE_EPOCH, **kwargs))
    return {k: np.concatenate([b[k].numpy() for b in batches]) for k in batches[0]}


@pytest.mark.parametrize("compression, shards", [(None, 1), (None, 4), ("GZIP", 3)])
def test_round_trip_keeps_values_dtypes_shapes_and_count(tmp_path, compression, shards):
    data = arrays()
    meta = write_tfrecords(
        data, str(tmp_path), name="set", num_shards=shards, compression=compression
    )
    assert meta.num_examples == 23 and len(meta.shards) == shards
    assert sum(s.num_examples for s in meta.shards) == 23
    suffix = ".tfrecord.gz" if compression else ".tfrecord"
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"set-{i:05d}-of-{shards:05d}{suffix}" for i in range(shards)] + ["set.meta.json"]
    )
    back = read_all(str(tmp_path))
    order = np.argsort(back["id"])
    assert len(back["id"]) == 23
    for key, value in data.items():
        assert back[key].dtype == value.dtype, key
        np.testing.assert_array_equal(back[key][order], value, err_msg=key)


def test_writes_from_a_dataset_of_dicts(tmp_path):
    dataset = tf.data.Dataset.range(10).map(
        lambda i: {"x": tf.fill([3], tf.cast(i, tf.float32)), "y": i}
    )
    meta = write_tfrecords(dataset, str(tmp_path), name="ds", num_shards=2)
    assert meta.num_examples == 10
    assert meta.features["x"].shape == (3,) and meta.features["y"].dtype == "int64"
    back = read_all(str(tmp_path / "ds"))
    assert sorted(back["y"].tolist()) == list(range(10))


def test_sources_resolve_to_the_same_files(tmp_path):
    write_tfrecords(arrays(), str(tmp_path), name="a", num_shards=3)
    by_dir = find_records(str(tmp_path))
    assert find_records(str(tmp_path / "a")) == by_dir
    assert find_records(str(tmp_path / "a.meta.json")) == by_dir
    assert find_records(str(tmp_path / "a-*")) == by_dir
    subset = find_records(str(tmp_path / "a-0000[02]-*"))
    assert [os.path.basename(p) for p in subset.paths] == [
        "a-00000-of-00003.tfrecord",
        "a-00002-of-00003.tfrecord",
    ]
    assert sum(subset.counts) == 23 - by_dir.counts[1]


def test_no_temporary_files_are_left_and_existing_data_is_kept(tmp_path):
    write_tfrecords(arrays(), str(tmp_path), name="a", num_shards=2)
    with pytest.raises(DataError, match=r"A dataset named 'a' already exists.*overwrite=True"):
        write_tfrecords(arrays(5), str(tmp_path), name="a")
    assert find_records(str(tmp_path)).metadata.num_examples == 23  # untouched
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_a_failed_write_leaves_no_dataset_behind(tmp_path):
    def examples():
        yield {"x": np.zeros(3, np.float32)}
        yield {"x": np.zeros(4, np.float32)}  # shape changes: the writer must give up cleanly

    with pytest.raises(
        DataError,
        match=r"Feature 'x' of example 1 has shape \(4,\) but the first example's is \(3,\)",
    ):
        write_tfrecords(examples(), str(tmp_path), name="bad", num_shards=2)
    assert os.listdir(tmp_path) == []  # no shard, no temporary file, no sidecar


@pytest.mark.parametrize(
    "examples, message",
    [
        ({"x": np.zeros((0, 2), np.float32)}, r"No examples to write"),
        ({"x": np.zeros(3), "y": np.zeros(4)}, r"lengths differ"),
        ({"x": np.zeros((2, 2), np.complex64)}, r"dtype complex64, which tfdist cannot store"),
        ([(1, 2)], r"Each element must be a mapping of feature name to value"),
    ],
)
def test_unwritable_input_is_explained(tmp_path, examples, message):
    with pytest.raises(DataError, match=message):
        write_tfrecords(examples, str(tmp_path))


def test_nothing_matches(tmp_path):
    with pytest.raises(
        DataError, match=r"No TFRecord files match '.*/missing-\*'.*tools.make_tfrecords"
    ):
        find_records(str(tmp_path / "missing-*"))
    with pytest.raises(
        DataError, match=r"No tfdist TFRecord dataset in .*no \*\.meta\.json sidecar"
    ):
        find_records(str(tmp_path))


def test_missing_sidecar_is_explained(tmp_path):
    write_tfrecords(arrays(), str(tmp_path), name="a")
    os.remove(tmp_path / "a.meta.json")
    with pytest.raises(DataError, match=r"metadata file .*a\.meta\.json is missing"):
        find_records(str(tmp_path / "a-*"))


def test_two_datasets_in_one_directory_need_a_name(tmp_path):
    write_tfrecords(arrays(), str(tmp_path), name="a")
    write_tfrecords(arrays(), str(tmp_path), name="b")
    with pytest.raises(DataError, match=r"holds 2 tfdist datasets \(a, b\); name one"):
        find_records(str(tmp_path))


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda m: m["features"]["dense"].update(shape=[6]),
            r"'dense' .* holds 5 float_list value\(s\) but .* says 6",
        ),
        (lambda m: m["features"].update(extra=m["features"]["label"]), r"have no feature 'extra'"),
        (
            lambda m: m["features"]["image"].update(shape=[4, 4, 4]),
            r"'image' .* holds 48 bytes but .* says 64",
        ),
        (
            lambda m: m["features"]["label"].update(encoding="float_list"),
            r"'label' .* holds 1 int64_list value",
        ),
        (lambda m: m.update(format="other/9"), r"is not valid \(format is 'other/9'"),
    ],
)
def test_sidecar_that_disagrees_with_the_records_is_caught_up_front(tmp_path, edit, message):
    write_tfrecords(arrays(), str(tmp_path), name="a")
    path = tmp_path / "a.meta.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=message):
        check_first_record(find_records(str(tmp_path)))

"""Tests for tfdist.data.tfds: TFDS datasets under tfdist's (image, label) contract, offline.

Two sources of TFDS data without a network: tfds.testing.mock_data for a real catalogue
dataset (mnist), and a small builder defined here that TFDS prepares from local files.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdist.data import DataError, PipelineOptions, prepare_dataset

pytestmark = pytest.mark.fast

NUM_TRAIN, NUM_TEST = 150, 40
TRAIN_FILES = 2  # fewer than 3 pipelines, so 3 pipelines must shard by example
ONE_EPOCH = PipelineOptions(shuffle_buffer=0, repeat=False, drop_remainder=False)


class TfdistLocalDigits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn digits (pixels scaled to 0..255) read from .npz files in the manual_dir."""

    VERSION = tfds.core.Version("1.0.0")
    MANUAL_DOWNLOAD_INSTRUCTIONS = "The test writes train.npz and test.npz into the manual_dir."
    # TFDS looks beside a builder's source for a checksums file, and for a class in a package
    # (tests.test_data_tfds) that lookup needs the importlib_resources backport, which TFDS
    # requires only on Python < 3.9. This builder downloads nothing, so it has no checksums:
    # no source folder spares the lookup.
    code_path = None

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(8, 8, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        return {
            split: self._generate_examples(dl_manager.manual_dir / f"{split}.npz")
            for split in ("train", "test")
        }

    def _generate_examples(self, path):
        with np.load(path) as arrays:
            for i, (image, label) in enumerate(zip(arrays["image"], arrays["label"], strict=True)):
                yield i, {"image": image, "label": int(label)}


def _digits() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The first examples of scikit-learn's digits (shipped in its wheel), split in two."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images * 15).astype(np.uint8)[..., np.newaxis]  # 0..16 -> 0..240
    labels = digits.target.astype(np.int64)
    return {
        "train": (images[:NUM_TRAIN], labels[:NUM_TRAIN]),
        "test": (
            images[NUM_TRAIN : NUM_TRAIN + NUM_TEST],
            labels[NUM_TRAIN : NUM_TRAIN + NUM_TEST],
        ),
    }


@pytest.fixture(scope="module")
def local_digits(tmp_path_factory):
    """(data_dir, source arrays) of TfdistLocalDigits, prepared once for the module."""
    manual_dir = tmp_path_factory.mktemp("manual")
    data_dir = tmp_path_factory.mktemp("tfds")
    arrays = _digits()
    for split, (images, labels) in arrays.items():
        np.savez(manual_dir / f"{split}.npz", image=images, label=labels)
    builder = TfdistLocalDigits(data_dir=str(data_dir))
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(
            manual_dir=str(manual_dir), num_shards=TRAIN_FILES
        )
    )
    return str(data_dir), arrays


def _examples(dataset: tf.data.Dataset) -> collections.Counter:
    """The (label, pixel bytes) of every example in a dataset of contract batches."""
    seen = collections.Counter()
    for images, labels in dataset.as_numpy_iterator():
        pixels = np.rint(images * 255).astype(np.uint8)
        seen.update((int(y), x.tobytes()) for x, y in zip(pixels, labels, strict=True))
    return seen


def test_mocked_mnist_meets_the_contract():
    with tfds.testing.mock_data(num_examples=12, policy=tfds.testing.MockPolicy.USE_CODE):
        data = prepare_dataset("tfds:mnist", data_dir="/nonexistent/tfds")
        assert data.info.name == "tfds:mnist"
        assert data.info.image_shape == (28, 28, 1)
        assert data.info.num_classes == 10
        assert dict(data.info.num_examples) == {"train": 12, "test": 12}
        images, labels = next(iter(data.dataset("train", batch_size=4, options=ONE_EPOCH)))
    assert images.shape == (4, 28, 28, 1)
    assert images.dtype == tf.float32
    assert labels.shape == (4,)
    assert labels.dtype == tf.int32
    assert float(tf.reduce_min(images)) >= 0.0
    assert 0.0 < float(tf.reduce_max(images)) <= 1.0  # scaled into [0, 1], not all black
    assert all(0 <= y < 10 for y in labels.numpy())


def test_local_builder_info(local_digits):
    data_dir, _ = local_digits
    data = prepare_dataset("tfds:tfdist_local_digits", data_dir=data_dir)
    assert data.info.name == "tfds:tfdist_local_digits"
    assert data.info.image_shape == (8, 8, 1)
    assert data.info.num_classes == 10
    assert dict(data.info.num_examples) == {"train": NUM_TRAIN, "test": NUM_TEST}


@pytest.mark.parametrize("split", ["train", "test"])
def test_local_builder_reads_the_source_examples(local_digits, split):
    data_dir, arrays = local_digits
    data = prepare_dataset("tfds:tfdist_local_digits", data_dir=data_dir)
    images, labels = arrays[split]
    expected = collections.Counter(
        (int(y), x.tobytes()) for x, y in zip(images, labels, strict=True)
    )
    assert _examples(data.dataset(split, batch_size=32, options=ONE_EPOCH)) == expected


@pytest.mark.parametrize("pipelines", [2, 3])  # 2: one file each; 3: an even slice each
def test_input_pipelines_read_each_example_once(local_digits, pipelines, caplog):
    data_dir, arrays = local_digits
    data = prepare_dataset("tfds:tfdist_local_digits", data_dir=data_dir)
    seen = collections.Counter()
    sizes = []
    with caplog.at_level("INFO", logger="tfdist.data.tfds"):
        for pipeline in range(pipelines):
            context = tf.distribute.InputContext(
                num_input_pipelines=pipelines,
                input_pipeline_id=pipeline,
                num_replicas_in_sync=pipelines,
            )
            mine = _examples(
                data.dataset("train", batch_size=16, input_context=context, options=ONE_EPOCH)
            )
            seen += mine
            sizes.append(mine.total())
    images, labels = arrays["train"]
    assert seen == collections.Counter(
        (int(y), x.tobytes()) for x, y in zip(images, labels, strict=True)
    )
    assert min(sizes) > 0, sizes
    expected_mode = "sharded by file" if pipelines <= TRAIN_FILES else "sharded by example"
    assert sum(expected_mode in r.getMessage() for r in caplog.records) == pipelines


def test_forced_file_sharding_with_too_few_files_is_an_error(local_digits):
    data_dir, _ = local_digits
    data = prepare_dataset("tfds:tfdist_local_digits", data_dir=data_dir)
    context = tf.distribute.InputContext(num_input_pipelines=3, input_pipeline_id=0)
    with pytest.raises(DataError, match=r"2 file\(s\) for 3 pipelines.*shard_by='file'"):
        data.dataset(
            "train", batch_size=8, input_context=context, options=PipelineOptions(shard_by="file")
        )


def test_unknown_split_is_an_error(local_digits):
    data_dir, _ = local_digits
    data = prepare_dataset("tfds:tfdist_local_digits", data_dir=data_dir)
    with pytest.raises(DataError, match=r"train, test\. Received: split='validation'"):
        data.dataset("validation", batch_size=8)


def test_unprepared_dataset_says_how_to_prepare_it(tmp_path):
    with pytest.raises(DataError) as raised:
        prepare_dataset("tfds:mnist", data_dir=str(tmp_path))
    message = str(raised.value)
    assert "tfds build mnist" in message
    assert str(tmp_path) in message
    assert "download_and_prepare()" in message


def test_unknown_name_is_an_error():
    with pytest.raises(
        DataError, match=r"no dataset called 'no_such_dataset_xyz'.*Received: name="
    ):
        prepare_dataset("tfds:no_such_dataset_xyz")


def test_unknown_name_suggests_close_names():
    with pytest.raises(DataError, match=r"Close names: .*\bmnist\b"):
        prepare_dataset("tfds:mnits")

"""Datasets by name: digits from scikit-learn's wheel, synthetic images, and the contract."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

from tfdist.data import DataError, PipelineOptions, find_records, prepare_dataset

pytestmark = pytest.mark.fast

ONE_EPOCH = PipelineOptions(
    repeat=False, shuffle_buffer=0, drop_remainder=False, deterministic=True
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def test_digits_are_written_once_with_a_fixed_split(data_dir):
    digits = prepare_dataset("digits", data_dir=data_dir)
    assert digits.info.num_examples == {"train": 1438, "test": 359}
    assert (digits.info.image_shape, digits.info.num_classes) == ((8, 8, 1), 10)
    train = find_records(os.path.join(data_dir, "digits", "train"))
    assert len(train.paths) == 4
    mtime = os.path.getmtime(train.metadata_path)
    prepare_dataset("digits", data_dir=data_dir)  # cached: nothing is rewritten
    assert os.path.getmtime(train.metadata_path) == mtime
    test_ids = find_records(os.path.join(data_dir, "digits", "test"))
    assert test_ids.metadata.features["id"].dtype == "int64"


def test_digits_follow_the_image_contract_and_hold_the_real_images(data_dir):
    from sklearn.datasets import load_digits

    digits = prepare_dataset("digits", data_dir=data_dir)
    images, labels = [], []
    for image, label in digits.dataset("test", batch_size=64, options=ONE_EPOCH):
        assert image.dtype == tf.float32 and label.dtype == tf.int32
        images.append(image.numpy())
        labels.append(label.numpy())
    images, labels = np.concatenate(images), np.concatenate(labels)
    assert images.shape == (359, 8, 8, 1) and images.min() >= 0.0 and images.max() <= 1.0
    # Every test image is one of scikit-learn's, with its label.
    reference = load_digits()
    lookup = {
        img.astype(np.uint8).tobytes(): lab
        for img, lab in zip(reference.images, reference.target, strict=True)
    }
    restored = (images[..., 0] * 16).round().astype(np.uint8)
    assert [lookup[img.tobytes()] for img in restored] == labels.tolist()


def test_the_binary_s_own_digits_read_back_as_a_tfrecord_directory(data_dir):
    digits = prepare_dataset("digits", data_dir=data_dir)
    again = prepare_dataset("tfrecord:" + os.path.join(data_dir, "digits"))
    assert (again.info.image_shape, again.info.num_classes) == ((8, 8, 1), 10)
    assert again.info.num_examples == digits.info.num_examples
    batches = [d.dataset("test", batch_size=359, options=ONE_EPOCH) for d in (digits, again)]
    (a, la), (b, lb) = (next(iter(batch)) for batch in batches)
    assert np.array_equal(a.numpy(), b.numpy()) and np.array_equal(la.numpy(), lb.numpy())


def test_digits_written_without_their_classes_are_written_again(tmp_path):
    from tfdist.data import write_tfrecords

    for split, n in (("train", 3), ("test", 2)):  # an older tfdist's sidecars: no classes
        write_tfrecords({"image": np.zeros((n, 8, 8, 1), np.uint8),
                         "label": np.zeros(n, np.int64)}, str(tmp_path / "digits"), name=split)  # fmt: skip
    digits = prepare_dataset("digits", data_dir=str(tmp_path))
    assert digits.info.num_examples == {"train": 1438, "test": 359}


@pytest.mark.parametrize(
    "label, shown",
    [(np.zeros((4, 2), np.int64), r"int64\[2\] per example"),
     (np.zeros(4, np.float32), r"float32\[\] per example")],
    ids=["one-hot rows", "floats"],
)  # fmt: skip
def test_a_tfrecord_directory_s_labels_of_another_shape_are_named(tmp_path, label, shown):
    from tfdist.data import write_tfrecords

    for split in ("train", "test"):
        write_tfrecords({"image": np.zeros((4, 8, 8, 1), np.uint8), "label": label},
                        str(tmp_path), name=split, attributes={"classes": 2})  # fmt: skip
    with pytest.raises(DataError, match=shown + r".*labels.argmax\(axis=1\)"):
        prepare_dataset(f"tfrecord:{tmp_path}")


def test_synthetic_has_the_asked_shape_and_is_seeded():
    data = prepare_dataset("synthetic", image_shape=(32, 32, 3), num_classes=5, num_examples=100)
    assert data.info.image_shape == (32, 32, 3) and data.info.num_examples["train"] == 100
    first = next(iter(data.dataset("train", batch_size=16, options=ONE_EPOCH)))
    again = next(
        iter(
            prepare_dataset(
                "synthetic", image_shape=(32, 32, 3), num_classes=5, num_examples=100
            ).dataset("train", batch_size=16, options=ONE_EPOCH)
        )
    )
    assert first[0].shape == (16, 32, 32, 3) and int(tf.reduce_max(first[1])) < 5
    np.testing.assert_array_equal(first[0].numpy(), again[0].numpy())


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("mnist", {}, r"Unknown dataset 'mnist'\. Valid names: digits, synthetic, tfds:NAME"),
        (
            "npz:/data/pets.npz",
            {},
            r"Convert it to TFRecords first: python -m tools\.make_tfrecords --source "
            r"npz:/data/pets.npz --out_dir OUT, then train with --dataset=tfrecord:OUT\.",
        ),
        ("images:/no/such/folder", {}, r"No such folder: /no/such/folder\."),
        (
            "synthetic",
            {"image_shape": (32, 32)},
            r"image_shape must be \(height, width, channels\)",
        ),
    ],
)
def test_bad_names_and_options(name, kwargs, message):
    with pytest.raises(DataError, match=message):
        prepare_dataset(name, **kwargs)


def test_bad_split(data_dir):
    with pytest.raises(
        DataError, match=r"split must be one of train, test\. Received: split='validation'"
    ):
        prepare_dataset("digits", data_dir=data_dir).dataset("validation", batch_size=4)

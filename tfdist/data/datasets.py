"""Image classification datasets by name, all honouring one contract.

Every dataset yields batches of ``(image, label)``: ``image`` float32 [batch, H, W, C] in
[0, 1], ``label`` int32 [batch] (the contract in contract.py). Names:

  digits      scikit-learn's 8x8 handwritten digits (1,797 real images, 10 classes), shipped
              inside the scikit-learn wheel; converted to TFRecords on first use
  synthetic   random images and labels of any shape and count, for benchmarks
  tfds:NAME   a TensorFlow Datasets dataset already prepared in a data_dir (never downloads)
  tfrecord:DIR  the train and test splits tools.make_tfrecords wrote to DIR (your own data)
  images:DIR  a folder of images, one sub-folder per class (Keras's image_dataset_from_
              directory layout); converted to TFRecords in the data_dir on first use

    >>> data = prepare_dataset("digits", data_dir="/tmp/tfdist-data")   # writes TFRecords once
    >>> data.info.num_examples
    {'train': 1438, 'test': 359}
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping

import numpy as np
import tensorflow as tf

from tfdist.data.contract import SPLITS, DatasetInfo, ImageDataset, check_split, split_index
from tfdist.data.images import IMAGES_PREFIX, prepare_image_folder
from tfdist.data.pipeline import PipelineOptions, as_written, finish, tfrecord_dataset
from tfdist.data.records import META_SUFFIX, DataError, find_records, write_tfrecords
from tfdist.storage import PATH_ERRORS, check_writable_directory

log = logging.getLogger(__name__)

DATA_DIR_ENV = "TFDIST_DATA_DIR"


def default_data_dir() -> str:
    """$TFDIST_DATA_DIR, else ~/.cache/tfdist."""
    return os.environ.get(DATA_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "tfdist")


# --- TFRecords on disk (digits, and any tfdist TFRecord dataset) ------------------------------


@dataclasses.dataclass(frozen=True)
class TFRecordImages:
    """Images and labels stored as tfdist TFRecords, one directory prefix per split."""

    info: DatasetInfo
    sources: Mapping[str, str]  # split -> dataset prefix (DIR/NAME)
    image_key: str = "image"
    label_key: str = "label"
    image_scale: float = 1.0  # multiplies the stored pixel values into [0, 1]

    def dataset(self, split, *, batch_size, input_context=None, options=None):
        check_split(split)
        scale, image_key, label_key = self.image_scale, self.image_key, self.label_key

        shape = self.info.image_shape

        @as_written
        def to_contract(batch):
            images = tf.reshape(batch[image_key], [-1, *shape])  # [B, H, W] gains its channel
            return tf.cast(images, tf.float32) * scale, tf.cast(batch[label_key], tf.int32)

        return tfrecord_dataset(
            self.sources[split],
            batch_size=batch_size,
            input_context=input_context,
            options=options,
            map_fn=to_contract,
        )


DIGITS_SHARDS = {"train": 4, "test": 2}


def prepare_digits(data_dir: str | None = None) -> TFRecordImages:
    """scikit-learn's digits as TFRecords in data_dir/digits, written on first use.

    The train/test split is fixed (a seeded permutation, 20% test), so every worker and
    every run sees the same examples. Each example keeps its index in scikit-learn's array
    as the "id" feature, which lets tests check that sharding reads each example once.
    Writing is atomic, so several workers preparing the data at once is harmless.
    """
    directory = os.path.join(data_dir or default_data_dir(), "digits")
    prefixes = {split: os.path.join(directory, split) for split in SPLITS}
    # Written again when missing, or written before the sidecar kept the classes and the
    # pixels' scale (which --dataset=tfrecord:DIR reads).
    if not all(
        tf.io.gfile.exists(p + META_SUFFIX) and "classes" in find_records(p).metadata.attributes
        for p in prefixes.values()
    ):
        check_writable_directory(directory, name="data_dir")
        from sklearn.datasets import load_digits  # deferred: only the first use needs it

        digits = load_digits()
        images = digits.images.astype(np.uint8)[..., np.newaxis]  # pixel values 0..16
        labels = digits.target.astype(np.int64)
        for split in ("test", "train"):
            index = split_index(len(labels), split)
            write_tfrecords(
                {"image": images[index], "label": labels[index], "id": index.astype(np.int64)},
                directory,
                name=split,
                num_shards=DIGITS_SHARDS[split],
                overwrite=True,
                attributes={"classes": [str(c) for c in range(10)], "image_scale": 1 / 16},
            )
        log.info("Wrote the digits dataset as TFRecords to %s", directory)
    counts = {split: find_records(prefixes[split]).metadata.num_examples for split in SPLITS}
    return TFRecordImages(
        DatasetInfo("digits", (8, 8, 1), 10, counts), prefixes, image_scale=1.0 / 16.0
    )


TFRECORD_PREFIX = "tfrecord:"


def prepare_tfrecord_dir(directory: str) -> TFRecordImages:
    """The train and test splits `tools.make_tfrecords` wrote to `directory`.

    Each split is the dataset named after it (train.meta.json, test.meta.json) with an
    "image" feature ([H, W, C] or [H, W]) and an integer "label"; the classes and the scale
    of the pixels come from the sidecar (uint8 pixels without a scale are taken as 0..255).
    """
    prefixes = {split: os.path.join(directory, split) for split in SPLITS}
    missing = [s for s, p in prefixes.items() if not tf.io.gfile.exists(p + META_SUFFIX)]
    if missing:
        raise DataError(
            f"{directory} has no {' and no '.join(missing)} split ({missing[0]}{META_SUFFIX}). "
            "Write each with python -m tools.make_tfrecords --source ... --split "
            f"{missing[0]} --out_dir {directory}. Received: --dataset={TFRECORD_PREFIX}{directory}"
        )
    metas = {split: find_records(prefix).metadata for split, prefix in prefixes.items()}
    train = metas["train"]
    image, label = train.features.get("image"), train.features.get("label")
    if image is None or label is None or len(image.shape) not in (2, 3):
        raise DataError(
            f"{prefixes['train']} needs an 'image' feature of shape [H, W, C] or [H, W] and a "
            f"'label'; it has {', '.join(f'{k} {list(v.shape)}' for k, v in train.features.items())}. "
            "Name the arrays image and label when writing it."
        )
    if list(label.shape) or not label.dtype.startswith(("int", "uint")):
        raise DataError(
            f"{prefixes['train']}'s label is {label.dtype}{list(label.shape)} per example; the "
            "binary trains on one integer class per example (int64[]). Write the labels as an "
            "integer array of shape (N,), e.g. labels.argmax(axis=1) for one-hot rows."
        )
    counts_seen = []
    for meta in metas.values():  # labels counted per split: the test split may hold more
        classes = meta.attributes.get("classes")
        counts_seen.append(len(classes) if isinstance(classes, list) else classes)
    count = max(counts_seen) if all(isinstance(c, int) for c in counts_seen) else None
    if not isinstance(count, int) or count < 1:
        raise DataError(
            f"{prefixes['train']}{META_SUFFIX} does not say how many classes there are (its "
            "labels are not integers, or it was written before tfdist recorded them). "
            "Write it again with python -m tools.make_tfrecords."
        )
    for split, meta in metas.items():
        if meta.features.get("image") != image:
            raise DataError(
                f"The {split} split's images in {directory} are {meta.features.get('image')}, the "
                f"train split's {image}: write both from the same source."
            )
    scale = train.attributes.get("image_scale", 1 / 255 if image.dtype == "uint8" else 1.0)
    shape = tuple(image.shape) if len(image.shape) == 3 else (*image.shape, 1)
    counts = {split: meta.num_examples for split, meta in metas.items()}
    name = TFRECORD_PREFIX + directory
    return TFRecordImages(DatasetInfo(name, shape, count, counts), prefixes, image_scale=scale)


# --- synthetic --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SyntheticImages:
    """Random images and labels held in memory, for benchmarks (no input cost to speak of).

    A fixed bank of `info.num_examples[split]` examples is generated from `seed`;
    training repeats it. Labels are random, so there is nothing to learn.
    """

    info: DatasetInfo
    seed: int = 0

    def dataset(self, split, *, batch_size, input_context=None, options=None):
        check_split(split)
        options = options or PipelineOptions()
        rng = np.random.default_rng([self.seed, SPLITS.index(split)])
        count = self.info.num_examples[split]
        images = rng.random((count, *self.info.image_shape), dtype=np.float32)
        labels = rng.integers(0, self.info.num_classes, size=count).astype(np.int32)
        dataset = tf.data.Dataset.from_tensor_slices((images, labels))
        if input_context is not None and input_context.num_input_pipelines > 1:
            dataset = dataset.shard(
                input_context.num_input_pipelines, input_context.input_pipeline_id
            )
        return finish(dataset, batch_size=batch_size, options=options)


def prepare_synthetic(
    *,
    image_shape: tuple[int, int, int] = (32, 32, 3),
    num_classes: int = 10,
    num_examples: int = 4096,
    seed: int = 0,
) -> SyntheticImages:
    """A synthetic dataset (cf. tf-models-official's use_synthetic_data)."""
    if len(image_shape) != 3 or min(image_shape) < 1:
        raise DataError(f"image_shape must be (height, width, channels). Received: {image_shape!r}")
    info = DatasetInfo(
        "synthetic",
        tuple(image_shape),
        num_classes,
        {"train": num_examples, "test": max(1, num_examples // 4)},
    )
    return SyntheticImages(info, seed)


# --- by name ----------------------------------------------------------------------------------

_PREPARERS: dict[str, Callable[..., ImageDataset]] = {
    "digits": lambda data_dir=None: prepare_digits(data_dir),
    "synthetic": lambda data_dir=None, **kwargs: prepare_synthetic(**kwargs),
}
TFDS_PREFIX = "tfds:"


def dataset_names() -> list[str]:
    return [*_PREPARERS, TFDS_PREFIX + "NAME", TFRECORD_PREFIX + "DIR", IMAGES_PREFIX + "DIR"]


def prepare_dataset(name: str, *, data_dir: str | None = None, **kwargs) -> ImageDataset:
    """The dataset called `name`, prepared for reading (digits writes its TFRecords once).

    Args:
      name: 'digits', 'synthetic', 'tfds:NAME', 'tfrecord:DIR' (what tools.make_tfrecords
        wrote to DIR: its train and test splits) or 'images:DIR' (a folder of class folders,
        converted into data_dir on first use).
      data_dir: where datasets live; default $TFDIST_DATA_DIR or ~/.cache/tfdist (for TFDS,
        TFDS's own default).
      **kwargs: options of the dataset (synthetic: image_shape, num_classes, num_examples,
        seed).

    Raises:
      DataError: unknown name, or a TFDS dataset that is not prepared in data_dir.
    """
    try:
        return _prepare(name, data_dir=data_dir, **kwargs)
    except PATH_ERRORS as e:  # a path on a filesystem TensorFlow cannot open, ...
        reason = e.message.strip().splitlines()[0] if e.message.strip() else type(e).__name__
        where = name[len(TFRECORD_PREFIX) :] if name.startswith(TFRECORD_PREFIX) else data_dir
        raise DataError(
            f"The dataset {name!r} cannot be read from {where or default_data_dir()} "
            f"({type(e).__name__}: {reason}). Give a directory this process can read and "
            "write: a local path, or a gs:// path with credentials."
        ) from None


def _prepare(name: str, *, data_dir: str | None, **kwargs) -> ImageDataset:
    if name.startswith(TFRECORD_PREFIX) and name[len(TFRECORD_PREFIX) :]:
        return prepare_tfrecord_dir(name[len(TFRECORD_PREFIX) :], **kwargs)
    if name.startswith(IMAGES_PREFIX):
        folder = name[len(IMAGES_PREFIX) :]
        if not folder:
            raise DataError(
                f"{IMAGES_PREFIX} needs a folder, e.g. --dataset={IMAGES_PREFIX}/data/pets"
            )
        written = prepare_image_folder(folder, data_dir or default_data_dir())
        return prepare_tfrecord_dir(written, **kwargs)
    if name.startswith(TFDS_PREFIX):
        from tfdist.data.tfds import prepare_tfds  # deferred: importing TFDS takes seconds

        return prepare_tfds(name[len(TFDS_PREFIX) :], data_dir=data_dir, **kwargs)
    if name not in _PREPARERS:
        convert = ""
        if name.startswith("npz:"):  # a source tools.make_tfrecords converts
            convert = (
                " Convert it to TFRecords first: python -m tools.make_tfrecords --source "
                f"{name} --out_dir OUT, then train with --dataset=tfrecord:OUT."
            )
        raise DataError(
            f"Unknown dataset {name!r}. Valid names: {', '.join(dataset_names())}.{convert} "
            f"Received: name={name!r}"
        )
    return _PREPARERS[name](data_dir=data_dir, **kwargs)

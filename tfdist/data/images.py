"""A folder of images, one sub-folder per class (as keras.utils.image_dataset_from_directory
reads it), as tfdist TFRecords.

`image_folder` reads the folder (labels number the class folders in sorted order; train and
test split by the same seeded permutation as the digits, 20% test). tools.make_tfrecords
writes it where the user says (`--source images:DIR`); `prepare_image_folder` writes it
once into the data directory, under a name drawn from the folder's path and listing, so the
binary trains `--dataset=images:DIR` directly: converted on first use, as the digits are,
and again only when the folder changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from tfdist.data.contract import split_index
from tfdist.data.records import META_SUFFIX, DataError

log = logging.getLogger(__name__)

IMAGES_PREFIX = "images:"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
SPLITS_OF_A_FOLDER = ("train", "test", "all")


@dataclasses.dataclass(frozen=True)
class ImageFolder:
    """One split of a folder: its image files, their labels and the class names."""

    directory: str
    split: str
    files: list[str]
    labels: list[int]
    classes: list[str]

    def examples(self) -> Iterator[dict[str, Any]]:
        """Each file decoded to uint8 [H, W, C] with its label (all must share one shape)."""
        return _decoded(self.files, self.labels)


def image_folder(directory: str, split: str) -> ImageFolder:
    """The `split` ('train', 'test' or 'all') of the class folders in `directory`.

    Raises:
      DataError: no such folder, no images in class folders, or an unknown split.
    """
    if not directory:
        raise DataError(f"{IMAGES_PREFIX} needs a folder, e.g. {IMAGES_PREFIX}/data/pets")
    if not os.path.isdir(directory):
        raise DataError(f"No such folder: {directory}. Received: {IMAGES_PREFIX}{directory}")
    if split not in SPLITS_OF_A_FOLDER:
        raise DataError(
            f"The split of an image folder is one of {', '.join(SPLITS_OF_A_FOLDER)} (test is "
            f"a fixed 20%, train the rest). Received: split={split}"
        )
    classes, files, labels = _listing(directory)
    index = split_index(len(files), split)
    return ImageFolder(
        directory, split, [files[i] for i in index], [labels[i] for i in index], classes
    )


def _listing(directory: str) -> tuple[list[str], list[str], list[int]]:
    classes = sorted(
        entry.name for entry in os.scandir(directory)
        if entry.is_dir() and not entry.name.startswith(".")
    )  # fmt: skip
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(
            entry.path for entry in os.scandir(os.path.join(directory, name))
            if entry.is_file() and entry.name.lower().endswith(IMAGE_SUFFIXES)
        )  # fmt: skip
        files += found
        labels += [label] * len(found)
    if not files:
        raise DataError(
            f"{directory} holds no images in class sub-folders ({', '.join(IMAGE_SUFFIXES)}). "
            "Put each class's images in a folder of its own: DIR/cat/1.png, DIR/dog/2.png, ..."
        )
    return classes, files, labels


def _decoded(files: list[str], labels: list[int]) -> Iterator[dict[str, Any]]:
    import tensorflow as tf

    first = None
    for path, label in zip(files, labels, strict=True):
        try:
            with open(path, "rb") as f:
                image = tf.io.decode_image(f.read(), expand_animations=False).numpy()
        except tf.errors.OpError as e:
            raise DataError(
                f"Cannot decode {path} as an image ({e.message.strip().splitlines()[0]}). "
                "Remove it or replace it with a PNG, JPEG, BMP or GIF file."
            ) from None
        if image.dtype != np.uint8:  # 16-bit PNGs
            image = (image.astype(np.float64) / np.iinfo(image.dtype).max * 255).round()
            image = image.astype(np.uint8)
        if first is None:
            first = image.shape
        elif image.shape[:2] != first[:2]:
            raise DataError(
                f"{path} is {image.shape[0]}x{image.shape[1]}, but the first image was "
                f"{first[0]}x{first[1]}: every image of a dataset needs one size. Resize them "
                "(e.g. with Pillow or ImageMagick) before converting."
            )
        elif image.shape[2] != first[2]:
            raise DataError(
                f"{path} has {image.shape[2]} colour channel(s), but the first image had "
                f"{first[2]}: every image of a dataset needs the same ones (1 grey, 3 RGB, "
                "4 RGBA). Convert them to one mode before converting."
            )
        yield {"image": image, "label": np.int64(label)}


# The shards each split is written in, as for the digits: workers shard by file.
_SHARDS = {"train": 4, "test": 2}


def prepare_image_folder(directory: str, data_dir: str) -> str:
    """Writes the folder's train and test splits as TFRecords under `data_dir` the first time
    (and when the folder's listing changes) and returns the directory they are in.

    The name of that directory comes from the folder's absolute path and each image's path,
    size and modification time, so an unchanged folder is read, not converted again.
    Writing is atomic: several workers preparing at once is harmless.
    """
    import tensorflow as tf

    from tfdist.data.records import write_tfrecords
    from tfdist.storage import check_writable_directory

    directory = os.path.abspath(os.path.expanduser(directory))
    if not os.path.isdir(directory):
        raise DataError(f"No such folder: {directory}. Received: {IMAGES_PREFIX}{directory}")
    classes, files, _ = _listing(directory)
    signature = hashlib.sha256(directory.encode())
    for path in files:
        stat = os.stat(path)
        signature.update(f"\0{os.path.relpath(path, directory)}\0{stat.st_size}\0"
                         f"{stat.st_mtime_ns}".encode())  # fmt: skip
    name = f"images-{os.path.basename(directory) or 'root'}-{signature.hexdigest()[:12]}"
    out = os.path.join(data_dir, name)
    if all(tf.io.gfile.exists(os.path.join(out, s + META_SUFFIX)) for s in _SHARDS):
        return out
    check_writable_directory(out, name="data_dir")
    for split, shards in _SHARDS.items():
        folder = image_folder(directory, split)
        write_tfrecords(
            folder.examples(),
            out,
            name=split,
            num_shards=shards,
            overwrite=True,
            attributes={"classes": folder.classes, "image_scale": 1 / 255},
        )
    log.info(
        "Converted %d images of %d classes in %s to TFRecords in %s (once: later runs read "
        "them, until the folder changes)",
        len(files), len(classes), directory, out,
    )  # fmt: skip
    return out

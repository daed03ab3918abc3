"""TensorFlow Datasets (TFDS) datasets that are already prepared on disk, under tfdist's contract.

tfdist never downloads: a TFDS dataset must have been built into a data_dir beforehand (on a
machine with internet access, ``tfds build NAME --data_dir=DIR``, then copy DIR here).

    >>> data = prepare_tfds("mnist", data_dir="/data/tensorflow_datasets")
    >>> data.info.image_shape, data.info.num_classes
    ((28, 28, 1), 10)
    >>> batches = data.dataset("train", batch_size=64)   # (float32 [64,28,28,1], int32 [64])

Each input pipeline of a strategy reads a disjoint part of a split: whole files when the
split has at least one file per pipeline, otherwise an even slice of its examples.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Mapping

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdist.data.contract import SPLITS, DatasetInfo
from tfdist.data.pipeline import PipelineOptions, as_written, finish
from tfdist.data.records import DataError

log = logging.getLogger(__name__)

# tfdist's "test" split is TFDS's "test" when the dataset has one, else its "validation".
_TFDS_SPLITS = {"train": ("train",), "test": ("test", "validation")}
_MAX_INTERLEAVE = 16  # the files read at once, as in tfdist's TFRecord pipeline
_MOCKING_MODULE = "tensorflow_datasets.testing.mocking"


@dataclasses.dataclass(frozen=True)
class TFDSImages:
    """A prepared TFDS image classification dataset, read as (image, label) batches.

    Build it with `prepare_tfds` (or `prepare_dataset("tfds:NAME")`), which checks the data
    is on disk and derives `info` from the TFDS metadata.
    """

    info: DatasetInfo
    builder: tfds.core.DatasetBuilder
    splits: Mapping[str, str]  # tfdist split -> TFDS split
    num_shards: Mapping[str, int | None]  # files per tfdist split; None when unknown (mocked)
    image_key: str = "image"
    label_key: str = "label"
    image_scale: float = 1.0  # multiplies the stored pixel values into [0, 1]
    add_channel: bool = False  # the stored images are [H, W]; the contract wants [H, W, C]

    def dataset(
        self,
        split: str,
        *,
        batch_size: int,
        input_context: tf.distribute.InputContext | None = None,
        options: PipelineOptions | None = None,
    ) -> tf.data.Dataset:
        """This input pipeline's batches of one split.

        Args:
          split: 'train' or 'test' (TFDS's 'validation' when the dataset has no 'test').
          batch_size: examples per batch — the per-replica batch under a strategy.
          input_context: which input pipeline this is; None reads the whole split.
          options: PipelineOptions; default shuffles with a 10,000-example buffer and
            repeats.

        Returns:
          A dataset of (image float32 [B, H, W, C] in [0, 1], label int32 [B]), prefetched.

        Raises:
          DataError: an unknown split, or sharding by file was forced with fewer files than
            input pipelines.
        """
        if split not in self.splits:
            raise DataError(
                f"split must be one of {', '.join(self.splits)}. Received: split={split!r}"
            )
        options = options or PipelineOptions()
        tfds_split, read_context = self._shard(split, input_context, options.shard_by)
        data_options = tf.data.Options()
        # TFDS interleaves files non-deterministically when it shuffles them without a seed,
        # unless the options say otherwise; say what tfdist's options ask for.
        data_options.deterministic = options.deterministic
        read_config = tfds.ReadConfig(
            options=data_options,
            shuffle_seed=options.seed,
            input_context=read_context,
            interleave_cycle_length=_MAX_INTERLEAVE,
            # Caching is tfdist's choice (options.cache), not TFDS's guess from the size.
            try_autocache=False,
        )
        dataset = self.builder.as_dataset(
            split=tfds_split,
            shuffle_files=options.shuffle_buffer > 0,
            read_config=read_config,
            # Only the image and the label are decoded; other features (ids, captions,
            # boxes) would cost time and shuffle-buffer memory for nothing.
            decoders=tfds.decode.PartialDecoding({self.image_key: True, self.label_key: True}),
        )
        image_key, label_key = self.image_key, self.label_key
        scale, add_channel = self.image_scale, self.add_channel

        # Converting whole batches after batching keeps uint8 pixels in the cache and the
        # shuffle buffer (a quarter of the memory of float32) and vectorises the cast.
        @as_written
        def to_contract(batch):
            image = tf.cast(batch[image_key], tf.float32)
            if scale != 1.0:
                image = image * scale
            if add_channel:
                image = image[..., tf.newaxis]
            return image, tf.cast(batch[label_key], tf.int32)

        return finish(dataset, batch_size=batch_size, options=options, map_fn=to_contract)

    def _shard(
        self, split: str, input_context: tf.distribute.InputContext | None, shard_by: str
    ) -> tuple[tfds.typing.SplitArg, tf.distribute.InputContext | None]:
        """The TFDS split to read and the input context to hand to TFDS, for this pipeline."""
        tfds_split = self.splits[split]
        pipelines = input_context.num_input_pipelines if input_context else 1
        files = self.num_shards[split]
        enough_files = files is not None and files >= pipelines
        if shard_by == "file" and not enough_files:
            raise DataError(
                f"Sharding by file needs at least one file per input pipeline, but the "
                f"{tfds_split!r} split of {self.info.name} has {files or 'an unknown number of'} "
                f"file(s) for {pipelines} pipelines, so some workers would get no data. Use "
                f"shard_by='example' (or 'auto'). Received: shard_by={shard_by!r}"
            )
        if pipelines == 1:
            return tfds_split, None
        pipeline = input_context.input_pipeline_id
        if shard_by != "example" and enough_files:
            log.info(
                "Input pipeline %d of %d reads %d of %d files of %s[%s] (sharded by file)",
                pipeline, pipelines, len(range(pipeline, files, pipelines)), files,
                self.info.name, tfds_split,
            )  # fmt: skip
            return tfds_split, input_context
        # An even slice of the examples, resolved by TFDS into per-file skip/take from the
        # split's exact counts. Unlike dataset.shard(), it does not depend on every pipeline
        # seeing the examples in the same order (TFDS decodes in parallel, and under
        # deterministic=False may reorder), and each pipeline reads only its own examples.
        log.info(
            "Input pipeline %d of %d reads slice %d of %d of the examples of %s[%s] in %s file(s) "
            "(sharded by example: %s)",
            pipeline, pipelines, pipeline, pipelines, self.info.name, tfds_split,
            files if files is not None else "an unknown number of",
            "as asked" if shard_by == "example" else "fewer files than pipelines",
        )  # fmt: skip
        return tfds.even_splits(tfds_split, n=pipelines)[pipeline], None


def prepare_tfds(name: str, *, data_dir: str | None = None) -> TFDSImages:
    """A TFDS image classification dataset that is already prepared in data_dir.

    Nothing is downloaded or generated: the dataset must have been built beforehand.

    Args:
      name: a TFDS name, optionally with config and version ('mnist', 'cifar10:3.0.2').
      data_dir: the directory TFDS built the dataset into; None uses TFDS's default
        ($TFDS_DATA_DIR, else ~/tensorflow_datasets).

    Returns:
      A TFDSImages whose info is taken from the dataset's TFDS metadata.

    Raises:
      DataError: the name is unknown to TFDS, the dataset is not prepared in data_dir, or it
        does not fit tfdist's contract (no fixed image shape, no class label, no train or
        test split).
    """
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError:
        raise DataError(_unknown_name_message(name)) from None
    mocked = _mock_data_active()
    if not mocked and not builder.is_prepared():
        raise DataError(
            f"The TFDS dataset {name!r} is not prepared in {builder.data_dir}, and tfdist never "
            f"downloads. On a machine with internet access run `tfds build {name} "
            f"--data_dir=DIR` (or `tfds.builder({name!r}, data_dir=DIR).download_and_prepare()`), "
            f"copy DIR to this machine, then pass data_dir=DIR (--data_dir=DIR to the binaries). "
            f"Received: name={name!r}, data_dir={data_dir!r}"
        )
    features = builder.info.features
    image_key, label_key = _supervised_keys(builder.info, name)
    image_shape, scale, add_channel = _image_contract(features[image_key], image_key, name)
    num_classes = _num_classes(features[label_key], label_key, name)
    splits, num_shards, counts = _splits(builder, name, mocked=mocked)
    info = DatasetInfo(f"tfds:{name}", image_shape, num_classes, counts)
    return TFDSImages(info, builder, splits, num_shards, image_key, label_key, scale, add_channel)


def _mock_data_active() -> bool:
    """Whether tfds.testing.mock_data is in effect.

    mock_data points every builder at a data_dir that does not exist, so is_prepared() is
    False, yet as_dataset() serves generated examples and the split metadata is empty. It
    always replaces DatasetBuilder.download_and_prepare with a no-op defined in TFDS's
    mocking module, which is what this looks for: outside that context manager the check
    that the data is on disk stays in force.
    """
    patched = tfds.core.DatasetBuilder.download_and_prepare
    return getattr(patched, "__module__", None) == _MOCKING_MODULE


def _unknown_name_message(name: str) -> str:
    base = name.split(":")[0].split("/")[0]
    # Community datasets would be looked up online; the registered names cost nothing.
    close = difflib.get_close_matches(base, tfds.list_builders(with_community_datasets=False), n=5)
    hint = f" Close names: {', '.join(close)}." if close else ""
    return (
        f"TFDS has no dataset called {base!r}.{hint} See `tfds.list_builders()` for all names. "
        f"Received: name={name!r}"
    )


def _supervised_keys(info: tfds.core.DatasetInfo, name: str) -> tuple[str, str]:
    """The image and label feature names: TFDS's supervised_keys, else 'image' and 'label'."""
    keys = info.supervised_keys
    features = info.features
    if isinstance(keys, tuple) and len(keys) >= 2 and all(isinstance(k, str) for k in keys[:2]):
        image_key, label_key = keys[0], keys[1]
    else:
        image_key, label_key = "image", "label"
    missing = [k for k in (image_key, label_key) if k not in features]
    if missing:
        raise DataError(
            f"tfdist reads TFDS datasets as (image, label) through their supervised_keys, or "
            f"the features 'image' and 'label'; {name} has supervised_keys={keys!r} and "
            f"features {sorted(features)}, so there is no {missing[0]!r}. Received: name={name!r}"
        )
    return image_key, label_key


def _image_contract(feature, key: str, name: str) -> tuple[tuple[int, int, int], float, bool]:
    """The image shape under the contract, the pixel scale into [0, 1], and whether a channel
    axis must be added."""
    shape = tuple(feature.shape)
    if len(shape) not in (2, 3) or any(d is None or d < 1 for d in shape):
        raise DataError(
            f"tfdist's image contract needs a fixed image shape (height, width[, channels]) so "
            f"that examples batch together, but the {key!r} feature of {name} has shape {shape} "
            f"(None is a size that varies per image). Resize the images into a dataset of one "
            f"shape first. Received: name={name!r}"
        )
    dtype = np.dtype(feature.np_dtype)
    # Unsigned integers span [0, max] (uint8 pixels 0..255); floats are taken as already in
    # [0, 1].
    scale = 1.0 / np.iinfo(dtype).max if dtype.kind == "u" else 1.0
    image_shape = (*shape, 1) if len(shape) == 2 else shape
    return tuple(int(d) for d in image_shape), scale, len(shape) == 2


def _num_classes(feature, key: str, name: str) -> int:
    if not isinstance(feature, tfds.features.ClassLabel):
        raise DataError(
            f"tfdist needs the label to be a tfds.features.ClassLabel, which knows its number "
            f"of classes, but the {key!r} feature of {name} is a {type(feature).__name__}. "
            f"Received: name={name!r}"
        )
    return int(feature.num_classes)


def _splits(
    builder: tfds.core.DatasetBuilder, name: str, *, mocked: bool
) -> tuple[dict[str, str], dict[str, int | None], dict[str, int]]:
    """tfdist split -> TFDS split, its number of files, and its number of examples."""
    available = builder.info.splits
    if mocked and not available:
        # Mocked data without metadata files knows no splits and serves any name; its file
        # count is unknown and its example count is what the mock generates.
        splits = {split: split for split in SPLITS}
        counts = {
            split: int(builder.as_dataset(split=split).cardinality().numpy()) for split in SPLITS
        }
        return splits, dict.fromkeys(SPLITS), counts
    splits = {}
    for split in SPLITS:
        candidates = _TFDS_SPLITS[split]
        found = [c for c in candidates if c in available]
        if not found:
            raise DataError(
                f"tfdist's {split!r} split is read from TFDS's "
                f"{' or '.join(repr(c) for c in candidates)} split, but {name} has only "
                f"{', '.join(repr(s) for s in available) or 'no splits'}. Received: name={name!r}"
            )
        splits[split] = found[0]
    num_shards = {split: int(available[s].num_shards) for split, s in splits.items()}
    counts = {split: int(available[s].num_examples) for split, s in splits.items()}
    return splits, num_shards, counts

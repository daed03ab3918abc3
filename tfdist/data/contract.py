"""The contract every image dataset honours, whatever its source.

A dataset yields batches of ``(image, label)``: ``image`` float32 [batch, H, W, C] in [0, 1],
``label`` int32 [batch], for the splits in SPLITS. The datasets by name (datasets.py) and the
TFDS datasets (tfds.py) both build on this module, and neither on the other's definitions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import numpy as np
import tensorflow as tf

from tfdist.data.pipeline import PipelineOptions
from tfdist.data.records import DataError

SPLITS = ("train", "test")
# The fixed train/test split of the data tfdist splits itself (the digits, image folders):
# a seeded permutation, TEST_FRACTION of it the test split, so every worker and run agree.
TEST_FRACTION = 0.2
SPLIT_SEED = 0


def split_index(n: int, split: str) -> np.ndarray:
    """The sorted indices of `split` ('train', 'test', or 'all') among n examples."""
    if split == "all":
        return np.arange(n)
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    n_test = int(round(n * TEST_FRACTION))
    return np.sort(order[:n_test] if split == "test" else order[n_test:])


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    name: str
    image_shape: tuple[int, int, int]
    num_classes: int
    num_examples: Mapping[str, int]


class ImageDataset(Protocol):
    """A dataset that builds (image, label) batches for one input pipeline."""

    info: DatasetInfo

    def dataset(
        self,
        split: str,
        *,
        batch_size: int,
        input_context: tf.distribute.InputContext | None = None,
        options: PipelineOptions | None = None,
    ) -> tf.data.Dataset: ...


def check_split(split: str) -> None:
    """Raises DataError unless `split` is one of SPLITS."""
    if split not in SPLITS:
        raise DataError(f"split must be one of {', '.join(SPLITS)}. Received: split={split!r}")

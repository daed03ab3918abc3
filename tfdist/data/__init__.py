"""Input pipelines: TFRecord writing and reading, datasets by name, strategy wiring."""

from tfdist.data.contract import DatasetInfo, ImageDataset
from tfdist.data.datasets import (
    dataset_names,
    default_data_dir,
    prepare_dataset,
    prepare_digits,
    prepare_synthetic,
)
from tfdist.data.distribute import BatchPlan, distribute_dataset, plan_batches
from tfdist.data.pipeline import PipelineOptions, tfrecord_dataset
from tfdist.data.records import DataError, Metadata, find_records, write_tfrecords
from tfdist.data.streams import worker_shuffle

__all__ = [
    "BatchPlan",
    "DataError",
    "DatasetInfo",
    "ImageDataset",
    "Metadata",
    "PipelineOptions",
    "dataset_names",
    "default_data_dir",
    "distribute_dataset",
    "find_records",
    "plan_batches",
    "prepare_dataset",
    "prepare_digits",
    "prepare_synthetic",
    "tfrecord_dataset",
    "worker_shuffle",
    "write_tfrecords",
]

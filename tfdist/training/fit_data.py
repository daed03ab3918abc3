"""The data `tfdist.fit` accepts, in the three forms Keras users already write.

1. A `tf.data.Dataset` batched with the GLOBAL batch, as for `model.fit`: tfdist splits each
   batch over the replicas (`experimental_distribute_dataset`) and shards it over workers.
2. A `dataset_fn(input_context)` returning PER-REPLICA batches, as for
   `strategy.distribute_datasets_from_function`: each input pipeline builds its own.
3. Arrays (numpy, tensors, dicts or lists of them) with `batch_size`, as for `model.fit(x, y)`.

`FitData` turns any of them into what a runner iterates — a distributed dataset for the
synchronous strategies, a per-worker dataset for parameter_server — and knows where a resumed
run continues: the batches already trained are skipped before the data is distributed, so a
resumed run reads exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.data.pipeline import explain_data_error
from tfdist.data.streams import numbered_streams, worker_shuffle
from tfdist.errors import FitError

log = logging.getLogger(__name__)

# Keras's own default, for arrays given without a batch size.
DEFAULT_BATCH_SIZE = 32
# The seed of the shuffle of arrays: the same order on every synchronous worker (_from_arrays).
ARRAY_SHUFFLE_SEED = 20_240_601


@dataclasses.dataclass(frozen=True)
class FitData:
    """One input of `fit` or `evaluate`, in whichever form the user gave it.

    Attributes:
      dataset: the global-batched dataset (forms 1 and 3), or None.
      dataset_fn: the per-replica dataset function (form 2), or None.
      num_batches: batches in one pass over the data, when tf.data can tell; else None.
      infinite: the data repeats without end.
      sample_batch: the first batch, for building the model and checking its shape.
      rebuild: builds `dataset` again inside a per-worker dataset function, where its shuffle
        takes the worker's own seed (arrays); None sends `dataset` to every worker as it is.
    """

    dataset: tf.data.Dataset | None
    dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset] | None
    num_batches: int | None
    sample_batch: Any
    infinite: bool = False
    global_batch: int | None = None
    rebuild: Callable[[], tf.data.Dataset] | None = None

    @property
    def form(self) -> str:
        return "dataset_fn" if self.dataset_fn is not None else "dataset"

    def distribute(self, strategy: tf.distribute.Strategy, *, skip: int = 0, repeat: bool = False):
        """The data as `strategy`'s steps consume it, `skip` global batches in.

        Args:
          strategy: any synchronous strategy (parameter_server: see `per_worker`).
          skip: global batches to leave out at the start (a resumed run's position).
          repeat: repeat the data without end (the steps per epoch then bound an epoch).
        """
        if self.dataset is not None:
            dataset = _positioned(self.dataset, skip=skip, repeat=repeat)
            return strategy.experimental_distribute_dataset(dataset)
        user_fn = self.dataset_fn

        def per_pipeline(context: tf.distribute.InputContext) -> tf.data.Dataset:
            # Each pipeline feeds num_replicas / num_pipelines replicas a batch per step.
            replicas_here = context.num_replicas_in_sync // context.num_input_pipelines
            return _positioned(user_fn(context), skip=skip * replicas_here, repeat=repeat)

        return strategy.distribute_datasets_from_function(per_pipeline)

    def per_worker(self, coordinator) -> Any:
        """Per-worker datasets for parameter-server training: each worker streams its own copy.

        Every worker reads the whole data, repeated, and should read it in an order of its
        own: else the workers apply the same batch one after another. Arrays are shuffled
        with each worker's own seed, as is every tfdist pipeline; a `dataset_fn` gets it from
        `tfdist.data.worker_shuffle`. A Dataset built beforehand goes to every worker as
        it is: shuffled with a seed (or under a global seed) it reads the same order on all.
        """
        if self.dataset is not None and self.rebuild is None:
            workers = compat.worker_count(coordinator.strategy)
            if workers > 1:
                log.warning(
                    "A tf.data.Dataset built before fit goes to each of the %d parameter-server "
                    "workers as it is, so they read the same batches in the same order and "
                    "apply each one %d times (docs/benchmarks.md: 0.38 against 0.80 test accuracy). Pass a "
                    "dataset_fn(input_context) that shuffles with "
                    "tfdist.data.worker_shuffle instead, or arrays.",
                    workers, workers,
                )  # fmt: skip
            return coordinator.create_per_worker_dataset(self.dataset.repeat())
        strategy, rebuild, user_fn = coordinator.strategy, self.rebuild, self.dataset_fn

        def per_worker_fn():
            if rebuild is not None:
                return rebuild().repeat()
            return strategy.distribute_datasets_from_function(
                lambda context: user_fn(context).repeat()
            )

        with numbered_streams(strategy):  # the function is traced here, once
            return coordinator.create_per_worker_dataset(per_worker_fn)

    def class_weighted(self, class_weight: dict[int, float]) -> FitData:
        """This data with each example weighted by its class, as Keras's `class_weight`.

        The label of a batch is its class id (rounded), or for one-hot labels the argmax;
        classes missing from `class_weight` weigh 1. The weights become the batches'
        sample weights, so they reach the loss and `weighted_metrics`.
        """
        table = _class_weight_table(class_weight)
        x, y, sample_weight = unpack(self.sample_batch)
        if y is None or isinstance(y, (dict, list, tuple)):
            raise FitError(
                "class_weight weighs examples by their label, so it needs data of (x, y) with "
                "one label tensor (a model with a single output). For several outputs, pass "
                "per-example weights as the batches' third element. Received: labels of "
                f"{'none' if y is None else type(y).__name__}"
            )
        if sample_weight is not None:
            raise FitError(
                "class_weight and sample_weight both weigh examples; pass one of them (for "
                "both, multiply the class weight into the sample weights yourself). "
                "Received: data with sample weights and class_weight"
            )

        def weighted(*batch):
            x, y, _ = unpack(batch)
            if y.shape.rank is not None and y.shape.rank >= 2 and y.shape[-1] != 1:
                classes = tf.argmax(y, axis=-1, output_type=tf.int32)
            else:
                classes = tf.cast(tf.round(tf.reshape(y, tf.shape(y)[:1])), tf.int32)
            # A class beyond the table (none weighed) weighs 1, as a missing key does.
            padded = tf.concat([table, [1.0]], 0)
            index = tf.where((classes >= 0) & (classes < len(table)), classes, len(table))
            return x, y, tf.gather(padded, index)

        if self.dataset is not None:
            rebuild = self.rebuild
            return dataclasses.replace(
                self,
                dataset=self.dataset.map(weighted, num_parallel_calls=tf.data.AUTOTUNE),
                sample_batch=weighted(*self.sample_batch),
                rebuild=None if rebuild is None else lambda: rebuild().map(weighted),
            )
        user_fn = self.dataset_fn
        return dataclasses.replace(
            self,
            dataset_fn=lambda context: user_fn(context).map(
                weighted, num_parallel_calls=tf.data.AUTOTUNE
            ),
            sample_batch=weighted(*self.sample_batch),
        )

    def local(self) -> tf.data.Dataset:
        """The data as one process reads it whole (parameter_server's evaluation)."""
        if self.dataset is not None:
            return self.dataset
        return self.dataset_fn(tf.distribute.InputContext())


def _class_weight_table(class_weight) -> tf.Tensor:
    if not isinstance(class_weight, dict) or not class_weight:
        raise FitError(
            "class_weight maps class ids to weights, e.g. {0: 1.0, 1: 5.0}. "
            f"Received: class_weight={class_weight!r}"
        )
    bad = [k for k in class_weight if not isinstance(k, (int, np.integer)) or k < 0]
    if bad:
        raise FitError(
            f"class_weight's keys are class ids, whole numbers 0 or more. Received: key {bad[0]!r}"
        )
    try:
        weights = [float(class_weight.get(c, 1.0)) for c in range(int(max(class_weight)) + 1)]
    except (TypeError, ValueError):
        raise FitError(
            f"class_weight's values are numbers. Received: class_weight={class_weight!r}"
        ) from None
    return tf.constant(weights, tf.float32)


def split_arrays(x, y, sample_weight, validation_split: float):
    """(train, validation): each a tuple (x, y, sample_weight), the validation part the last
    `validation_split` of the examples, taken before any shuffling (Keras's rule)."""
    if not isinstance(validation_split, (int, float)) or not 0 <= validation_split < 1:
        raise FitError(
            "validation_split is the fraction of the examples held out for validation, a "
            f"number from 0 to 1 (excluded). Received: validation_split={validation_split!r}"
        )
    if isinstance(x, tf.data.Dataset) or (callable(x) and not hasattr(x, "shape")):
        raise FitError(
            "validation_split holds out the last examples of arrays; a dataset or dataset "
            "function cannot be split that way. Pass validation_data= (a dataset of its own), "
            f"or the data as arrays. Received: x of type {type(x).__name__}"
        )
    parts = (x, y, sample_weight)
    leaves = [leaf for leaf in tf.nest.flatten(parts) if leaf is not None]
    examples = int(np.shape(leaves[0])[0])
    split_at = int(np.floor(examples * (1.0 - validation_split)))
    if split_at in (0, examples):
        raise FitError(
            f"validation_split={validation_split} of {examples} examples leaves "
            f"{'no training' if split_at == 0 else 'no validation'} example. Use a fraction "
            f"that holds out between 1 and {examples - 1} examples."
        )

    def part(start, stop):
        return tuple(
            None if p is None else tf.nest.map_structure(lambda a: a[start:stop], p) for p in parts
        )

    return part(0, split_at), part(split_at, None)


def _positioned(dataset: tf.data.Dataset, *, skip: int, repeat: bool) -> tf.data.Dataset:
    if repeat:
        dataset = dataset.repeat()
    return dataset.skip(skip) if skip else dataset


def make_fit_data(
    x: Any,
    y: Any = None,
    *,
    sample_weight: Any = None,
    batch_size: int | None = None,
    shuffle: bool = False,
    strategy: tf.distribute.Strategy,
    what: str = "x",
    for_training: bool = False,
) -> FitData:
    """Recognises the form of `x` (and `y`, `sample_weight`) and checks it once.

    Args:
      for_training: the data trains (a last batch that splits unevenly over the replicas
        then weighs its examples a little differently from one device; in evaluation every
        example counts once whatever the split).

    Raises:
      FitError: the data is of no form fit knows, arguments contradict the form, or a batch
        does not split evenly over the replicas.
    """
    replicas = strategy.num_replicas_in_sync
    if isinstance(x, tf.data.Dataset):
        _no_extra_arrays(what, y=y, sample_weight=sample_weight, batch_size=batch_size)
        sample = _first_batch(x, what)
        batch = _batch_size_of(sample)
        if batch is not None and batch % replicas:
            raise FitError(
                f"The first batch of `{what}` holds {batch} examples, which does not split "
                f"evenly over the {replicas} replicas in sync. tfdist.fit takes a dataset "
                "batched with the GLOBAL batch (as model.fit does): batch it with a multiple "
                f"of {replicas}, e.g. dataset.batch({max(replicas, batch // replicas * replicas)}"
                f"). Received: batch of {batch}"
            )
        return FitData(x, None, _known_batches(x), sample, _is_infinite(x), batch)
    if callable(x) and not isinstance(x, (np.ndarray, tf.Tensor, dict, list, tuple)):
        _no_extra_arrays(what, y=y, sample_weight=sample_weight, batch_size=batch_size)
        _check_dataset_fn(x, what)
        probe = x(
            tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                       num_replicas_in_sync=replicas)
        )  # fmt: skip
        if not isinstance(probe, tf.data.Dataset):
            raise FitError(
                f"The dataset function passed as `{what}` must return a tf.data.Dataset of "
                "per-replica batches. Received: a function returning "
                f"{type(probe).__name__}"
            )
        sample = _first_batch(probe, what)
        per_replica = _batch_size_of(sample)
        return FitData(
            None,
            x,
            _known_batches(probe),
            sample,
            _is_infinite(probe),
            None if per_replica is None else per_replica * replicas,
        )
    if x is None:
        raise FitError(
            f"No data: pass `{what}` as a tf.data.Dataset batched with the global batch, a "
            "dataset_fn(input_context) returning per-replica batches, or arrays with "
            "batch_size."
        )
    if isinstance(x, keras.utils.PyDataset) or inspect.isgenerator(x):
        raise FitError(
            f"tfdist.fit reads tf.data pipelines and arrays; `{what}` is a "
            f"{type(x).__name__}. Wrap it with tf.data.Dataset.from_generator(...) and batch "
            "it with the global batch."
        )
    return _from_arrays(
        x, y, sample_weight=sample_weight, batch_size=batch_size, shuffle=shuffle,
        replicas=replicas, what=what, for_training=for_training,
    )  # fmt: skip


def _from_arrays(
    x, y, *, sample_weight, batch_size, shuffle, replicas, what, for_training
) -> FitData:
    batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise FitError(f"batch_size must be a positive whole number. Received: {batch_size!r}")
    if batch_size % replicas:
        raise FitError(
            f"batch_size={batch_size} (the global batch) does not split evenly over the "
            f"{replicas} replicas in sync; use a multiple of {replicas}. "
            f"Received: batch_size={batch_size}"
        )
    parts = tuple(part for part in (x, y, sample_weight) if part is not None)
    if sample_weight is not None and y is None:
        raise FitError(f"sample_weight needs labels: pass `y` with `{what}`.")
    try:
        sizes = {int(np.shape(leaf)[0]) for leaf in tf.nest.flatten(parts)}
    except (IndexError, TypeError) as e:
        raise FitError(
            f"`{what}`, y and sample_weight must be arrays (or dicts/lists of arrays) with "
            f"the examples along their first axis. Received: {type(x).__name__} ({e})"
        ) from None
    if len(sizes) != 1:
        raise FitError(
            f"`{what}`, y and sample_weight must hold the same number of examples. "
            f"Received: first dimensions {sorted(sizes)}"
        )
    (examples,) = sizes

    def build():
        dataset = tf.data.Dataset.from_tensor_slices(parts if len(parts) > 1 else parts[0])
        if shuffle:
            # Synchronous workers split the same global batch, so they must shuffle alike: a
            # fixed seed gives each epoch a new order that is the same on all of them. (A
            # parameter-server worker's own copy takes its own offset of the seed.)
            dataset = worker_shuffle(dataset, examples, ARRAY_SHUFFLE_SEED)
        return dataset.batch(batch_size)

    dataset = build()
    last = examples % batch_size
    if last % replicas and for_training:
        log.warning(
            "The last batch of %s holds %d of %d examples, which does not split evenly over "
            "the %d replicas: its replicas weigh their examples a little differently from one "
            "device. Use a number of examples that divides by %d, or drop it with a dataset "
            "and .batch(..., drop_remainder=True).",
            what, last, examples, replicas, replicas,
        )  # fmt: skip
    return FitData(
        dataset,
        None,
        _known_batches(dataset),
        _first_batch(dataset, what),
        False,
        batch_size,
        rebuild=build if shuffle and for_training else None,
    )


def _no_extra_arrays(what, **given) -> None:
    extra = sorted(name for name, value in given.items() if value is not None)
    if extra:
        raise FitError(
            f"`{what}` is a dataset, which carries its own labels, weights and batching; "
            f"{', '.join(extra)} apply to arrays only. Put them in the dataset's elements, "
            "(x, y) or (x, y, sample_weight), batched with the global batch. "
            f"Received: {', '.join(f'{name}=...' for name in extra)}"
        )


def _check_dataset_fn(fn, what) -> None:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # a builtin or a callable object: let the call tell
    required = [
        p for p in parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip
    if len(required) > 1:
        raise FitError(
            f"A dataset function passed as `{what}` takes one argument, the "
            "tf.distribute.InputContext, and returns per-replica batches. Received: a "
            f"function of {len(required)} required arguments ({', '.join(p.name for p in required)})"
        )


def _first_batch(dataset: tf.data.Dataset, what: str):
    try:
        return next(iter(dataset.take(1)))
    except StopIteration:
        raise FitError(f"`{what}` yields no batch: the dataset is empty.") from None
    except tf.errors.InvalidArgumentError as error:
        explained = explain_data_error(error)  # a corrupt record in a tfdist pipeline
        if explained is None:
            raise
        raise explained from None


def _batch_size_of(batch) -> int | None:
    for leaf in tf.nest.flatten(batch):
        if leaf is not None and getattr(leaf, "shape", None) is not None and leaf.shape.rank:
            return int(leaf.shape[0])
    return None


def _known_batches(dataset: tf.data.Dataset) -> int | None:
    cardinality = int(dataset.cardinality())
    return cardinality if cardinality >= 0 else None


def _is_infinite(dataset: tf.data.Dataset) -> bool:
    return int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY)


def unpack(batch) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) of a batch, as Keras reads one."""
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple):
        return batch, None, None
    if len(batch) == 1:
        return batch[0], None, None
    if len(batch) == 2:
        return batch[0], batch[1], None
    if len(batch) == 3:
        return batch
    raise FitError(
        "A batch is x, (x,), (x, y) or (x, y, sample_weight); wrap several inputs in a tuple "
        f"or dict as x. Received: a tuple of {len(batch)} elements"
    )

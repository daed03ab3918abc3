"""The input pipeline over a tfdist TFRecord dataset, for one input pipeline of a strategy.

  list files -> shard per input pipeline (by file, or by example when there are fewer files
  than pipelines) -> parallel interleave (each file checked against its sidecar count)
  -> [cache] -> seeded shuffle -> repeat -> batch -> parse + map -> prefetch

Records stay serialized until they are batched: one parse per batch costs a fraction of one
per record, which on a 2-core host is CPU the model keeps (tools/input_bench.py: the
per-record version trained at 0.89 of in-memory data, the batched one at 1.00).

Example, inside the dataset function a strategy calls once per input pipeline:

    def dataset_fn(context):
        return tfrecord_dataset("/data/digits/train", input_context=context,
                                batch_size=context.get_per_replica_batch_size(64))
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Sequence

import tensorflow as tf

from tfdist import logs
from tfdist.data.records import (
    DataError,
    RecordFiles,
    batch_parse_fn,
    check_first_record,
    find_records,
)
from tfdist.data.streams import worker_shuffle

log = logging.getLogger(__name__)

SHARD_BY_CHOICES = ("auto", "file", "example")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """How a TFRecord pipeline reads, shuffles and repeats.

    Args:
      shuffle_buffer: examples in the shuffle buffer; 0 disables shuffling (and the file
        order shuffle), which together with `deterministic` gives a fully fixed order.
      seed: seed of the file and example shuffles; None draws a fresh one per run. Each
        parameter-server worker shuffles with its own offset of it (streams.worker_shuffle).
      cache: keep the (serialized) examples in memory after the first epoch.
      repeat: repeat forever (training); False gives exactly one epoch (evaluation).
      drop_remainder: drop a last, partial batch, so every batch has the same static shape
        (TPUs need this; a synchronous step expects full per-replica batches).
      deterministic: produce elements in a fixed order even when reading in parallel.
      skip_corrupt: drop unreadable records and warn with a count, instead of failing.
      shard_by: 'auto' (by file when there are at least as many files as input pipelines,
        otherwise by example), 'file' or 'example'.
    """

    shuffle_buffer: int = 10_000
    seed: int | None = None
    cache: bool = False
    repeat: bool = True
    drop_remainder: bool = True
    deterministic: bool = False
    skip_corrupt: bool = False
    shard_by: str = "auto"

    def __post_init__(self):
        if not isinstance(self.shuffle_buffer, int) or self.shuffle_buffer < 0:
            raise DataError(
                "shuffle_buffer must be a whole number >= 0 (0 disables shuffling). "
                f"Received: shuffle_buffer={self.shuffle_buffer!r}"
            )
        if self.shard_by not in SHARD_BY_CHOICES:
            raise DataError(
                f"shard_by must be one of {', '.join(SHARD_BY_CHOICES)}. "
                f"Received: shard_by={self.shard_by!r}"
            )


def tfrecord_dataset(
    source: str | RecordFiles,
    *,
    batch_size: int,
    input_context: tf.distribute.InputContext | None = None,
    options: PipelineOptions | None = None,
    map_fn: Callable | None = None,
) -> tf.data.Dataset:
    """Builds this input pipeline's dataset of batches from a tfdist TFRecord dataset.

    Args:
      source: a dataset directory, NAME prefix, sidecar or shard pattern (see find_records),
        or an already resolved RecordFiles.
      batch_size: examples per batch — the per-replica batch under a strategy.
      input_context: which input pipeline this is; None reads everything.
      options: PipelineOptions; default shuffles with a 10,000-example buffer and repeats.
      map_fn: applied to each batch (a dict of feature tensors), in parallel.

    Returns:
      A dataset of batches, prefetched.

    Raises:
      DataError: no files match, the sidecar disagrees with the records, or file sharding
        was forced with fewer files than input pipelines.
    """
    options = options or PipelineOptions()
    files = source if isinstance(source, RecordFiles) else find_records(source)
    check_first_record(files)
    pipelines = input_context.num_input_pipelines if input_context else 1
    pipeline = input_context.input_pipeline_id if input_context else 0
    paths, counts, example_shards = _shard(files, pipelines, pipeline, options.shard_by)

    compression = files.metadata.compression or ""
    file_list = tf.data.Dataset.from_tensor_slices((list(paths), tf.constant(counts, tf.int64)))
    if options.shuffle_buffer:
        file_list = worker_shuffle(file_list, len(paths), options.seed)

    @as_written
    def read_file(path, expected):
        records = _checked_records(path, expected, compression, skip=options.skip_corrupt)
        # Sharding inside each file keeps exactly-once reading independent of the order in
        # which the interleave visits files.
        return records.shard(example_shards, pipeline) if example_shards > 1 else records

    dataset = file_list.interleave(
        read_file,
        cycle_length=min(len(paths), 16),
        block_length=1,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=options.deterministic,
    )
    parse = as_written(batch_parse_fn(files.metadata))
    return finish(
        dataset,
        batch_size=batch_size,
        options=options,
        # A user's map_fn is converted by autograph, as tf.data converts it (parse is not).
        map_fn=parse if map_fn is None else lambda records: map_fn(parse(records)),
    )


def finish(
    dataset: tf.data.Dataset,
    *,
    batch_size: int,
    options: PipelineOptions,
    map_fn: Callable | None = None,
) -> tf.data.Dataset:
    """The common tail of every tfdist pipeline: cache, shuffle, repeat, batch, map, prefetch."""
    if options.cache:
        dataset = dataset.cache()
    if options.shuffle_buffer:
        dataset = worker_shuffle(dataset, options.shuffle_buffer, options.seed)
    if options.repeat:
        dataset = dataset.repeat()
    dataset = dataset.batch(batch_size, drop_remainder=options.drop_remainder)
    if map_fn is not None:
        dataset = dataset.map(
            map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=options.deterministic
        )
    data_options = tf.data.Options()
    # Every pipeline shards itself; TensorFlow's AUTO policy would shard a second time (and
    # warn) when the dataset reaches experimental_distribute_dataset.
    data_options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF
    )
    data_options.deterministic = options.deterministic
    return dataset.with_options(data_options).prefetch(tf.data.AUTOTUNE)


def _shard(
    files: RecordFiles, pipelines: int, pipeline: int, shard_by: str
) -> tuple[tuple[str, ...], tuple[int, ...], int]:
    """This pipeline's files, their expected counts, and the example-level shard count."""
    n = len(files.paths)
    if shard_by == "file" and n < pipelines:
        raise DataError(
            f"Sharding by file needs at least one file per input pipeline, but {n} file(s) "
            f"are shared by {pipelines} pipelines, so some workers would get no data. Write "
            f"the data in at least {pipelines} shards, or use shard_by='example' (or 'auto'). "
            f"Received: {files.metadata_path}"
        )
    if pipelines == 1:
        return files.paths, files.counts, 1
    shares = _balanced_file_shares(files.counts, pipelines) if n >= pipelines else None
    sizes = [sum(files.counts[i] for i in share) for share in shares] if shares else []
    # By file when the shares are even: within one file's worth of examples, and within
    # _MAX_FILE_IMBALANCE of each other (4 files over 3 workers would give one twice the
    # others, whose examples a repeating pipeline would then show twice as often).
    even = bool(sizes) and (
        max(sizes) - min(sizes) <= max(files.counts)
        and max(sizes) <= min(sizes) * (1 + _MAX_FILE_IMBALANCE)
    )
    if shard_by == "example" or (shard_by == "auto" and not even):
        if shard_by == "example":
            why = "as asked"
        elif n < pipelines:
            why = "fewer files than pipelines"
        else:
            why = f"by file the shares would be {'/'.join(map(str, sizes))} examples"
        logs.once(
            log,
            logging.INFO,
            "Input pipeline %d of %d reads every %d%s example of %d file(s) (sharded by "
            "example: %s)",
            pipeline, pipelines, pipelines, _ordinal_suffix(pipelines), n, why,
        )  # fmt: skip
        return files.paths, files.counts, pipelines
    mine = shares[pipeline]
    logs.once(
        log,
        logging.INFO,
        "Input pipeline %d of %d reads %d of %d files, %d examples (sharded by file; the "
        "pipelines' shares: %s examples)",
        pipeline, pipelines, len(mine), n, sizes[pipeline], "/".join(map(str, sizes)),
    )  # fmt: skip
    if not even:
        logs.once(
            log,
            logging.WARNING,
            "Sharding by file as asked gives uneven shares (%s examples): the pipelines with "
            "less data repeat theirs more often. shard_by='auto' shards by example instead.",
            "/".join(map(str, sizes)),
        )
    return tuple(files.paths[i] for i in mine), tuple(files.counts[i] for i in mine), 1


# How far apart (relative to the smallest) file shares may be before 'auto' shards by example.
_MAX_FILE_IMBALANCE = 0.1


def _balanced_file_shares(counts: Sequence[int], pipelines: int) -> list[list[int]]:
    """Files (indices) per pipeline: the largest file first to the least loaded pipeline, so
    shares differ by at most one file's worth. The same on every pipeline (deterministic)."""
    shares: list[list[int]] = [[] for _ in range(pipelines)]
    loads = [0] * pipelines
    for i in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
        least = min(range(pipelines), key=lambda p: (loads[p], len(shares[p]), p))
        shares[least].append(i)
        loads[least] += counts[i]
    return [sorted(share) for share in shares]


def _ordinal_suffix(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


# Records counted per check: enough that the per-element cost of the check disappears.
_CHECK_BLOCK = 256


def _checked_records(path, expected, compression: str, *, skip: bool) -> tf.data.Dataset:
    """The records of one file, checked against the count its sidecar promises.

    TensorFlow's own error for a truncated or corrupt record does not name the file. Reading
    with ignore_errors turns the first bad record into an early end of the file; an empty
    end-marker block then compares the records read with the sidecar's count and either
    fails naming the file (the default) or warns with the number of records dropped (skip
    mode). Counting happens per block of records, not per record.
    """
    records = tf.data.TFRecordDataset(path, compression_type=compression).ignore_errors()
    blocks = records.batch(_CHECK_BLOCK).map(as_written(lambda block: (block, False)))
    end = tf.data.Dataset.from_tensors((tf.zeros([0], tf.string), True))

    @as_written
    def check(count, item):
        block, is_end = item
        ok = tf.logical_or(tf.logical_not(is_end), tf.equal(count, expected))
        if skip:
            message = tf.strings.format(
                "skipped {} unreadable record(s) of {} in {} (skip_corrupt=True): "
                "the file is truncated or corrupt from there on.",
                (expected - count, expected, path),
            )
            done = tf.cond(ok, lambda: tf.constant(True), lambda: _warn_once(message))
        else:
            message = tf.strings.format(
                "tfdist: {} holds {} readable record(s) but its metadata says {}: the file is "
                "truncated or corrupt, or the sidecar belongs to other data. Re-create the "
                "dataset, or pass skip_corrupt=True (the binary's --skip_corrupt) to train on the readable records.",
                (path, count, expected),
            )
            done = tf.debugging.Assert(ok, [message])
        with tf.control_dependencies([done]):
            return count + tf.size(block, out_type=tf.int64), tf.identity(block)

    return blocks.concatenate(end).scan(tf.constant(0, tf.int64), check).unbatch()


def as_written(function: Callable) -> Callable:
    """One of tfdist's own dataset functions, traced as written: tf.data would convert it
    with autograph first, which costs a process about 0.3 s at its first pipeline, and its
    Python conditions are on settings, not on tensors."""
    return tf.autograph.experimental.do_not_convert(function)


def _warn_once(message: tf.Tensor) -> tf.Tensor:
    """Warns once per process (each epoch reads the file again), through tfdist's logger."""

    def warn(text) -> bool:
        logs.once(log, logging.WARNING, "%s", text.numpy().decode())
        return True

    done = tf.py_function(warn, [message], tf.bool)
    done.set_shape([])
    return done


def explain_data_error(error: tf.errors.OpError) -> DataError | None:
    """The DataError behind a TensorFlow error raised by a tfdist pipeline, if it is one.

    A truncated file is detected inside the running pipeline, where only a TensorFlow
    assertion can stop it; this recovers tfdist's message from the wrapped error so a
    training loop can show it alone.
    """
    match = re.search(r"tfdist: (.*?)\]", error.message, flags=re.S)
    return DataError(match.group(1).replace('\\"', '"').replace("\\'", "'")) if match else None

"""Input pipeline benchmark: is training ever input-bound on tfdist's TFRecord pipeline?

One run writes synthetic 32x32x3 uint8 images (int64 labels) as TFRecords in 8 shards, then
measures, with the variants interleaved (A B C, B C A, C A B, ...) so the shared machine's
noise hits them alike:

  A. reading one epoch, no model: examples/s and process CPU time per 1,000 examples;
  B. training a small CNN (Conv 32 -> Conv 64 -> global pool -> Dense 10) with a custom
     tf.function step for --train_steps steps after a warm-up: steps/s and CPU per step.

Variants (--read_variants, --train_variants):
  in-memory    tf.data.Dataset.from_tensor_slices of the same arrays (the baseline)
  serial       TFRecordDataset over the files in turn, plain maps, no parallel calls, no
               prefetch, no shuffle
  tfdist       tfdist.data.tfrecord_dataset (parallel interleave, per-file count checks,
               batched parsing, AUTOTUNE, prefetch)

Every variant yields the same (image float32 in [0, 1], label int32) batches, and all but
serial share tfdist's tail (`finish`: shuffle 10,000, batch, map, prefetch), so a ratio to
in-memory is the cost of reading and parsing records alone.

  python -m tools.input_bench                       # about 4 minutes on 2 cores
  python -m tools.input_bench --num_examples 10000 --repeats 3 --train_steps 20

Prints a table per part and writes every figure to --out_csv. A benchmark, not a test: it
reports numbers and checks nothing.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdist.data.pipeline import PipelineOptions, finish, tfrecord_dataset  # noqa: E402
from tfdist.data.records import (  # noqa: E402
    RecordFiles,
    batch_parse_fn,
    find_records,
    write_tfrecords,
)

IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
NUM_SHARDS = 8
WARMUP_STEPS = 10


# --- data -------------------------------------------------------------------------------------


def make_examples(num_examples: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random uint8 images and int64 labels: the dtypes real image data is stored in."""
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, size=(num_examples, *IMAGE_SHAPE), dtype=np.uint8),
        "label": rng.integers(0, NUM_CLASSES, size=num_examples).astype(np.int64),
    }


def to_contract(batch):
    """A batch of stored features -> tfdist's (image float32 in [0, 1], label int32)."""
    return tf.cast(batch["image"], tf.float32) / 255.0, tf.cast(batch["label"], tf.int32)


def memory_dataset(examples, *, batch_size: int, options: PipelineOptions) -> tf.data.Dataset:
    return finish(
        tf.data.Dataset.from_tensor_slices(examples),
        batch_size=batch_size,
        options=options,
        map_fn=to_contract,
    )


def serial_dataset(
    files: RecordFiles, *, batch_size: int, options: PipelineOptions
) -> tf.data.Dataset:
    """The naive reader: one file after another, nothing in parallel, no prefetch."""
    dataset = tf.data.TFRecordDataset(
        list(files.paths), compression_type=files.metadata.compression or ""
    )
    if options.repeat:
        dataset = dataset.repeat()
    parse = batch_parse_fn(files.metadata)
    return dataset.batch(batch_size, drop_remainder=options.drop_remainder).map(
        lambda records: to_contract(parse(records))
    )


def tfdist_dataset(
    files: RecordFiles, *, batch_size: int, options: PipelineOptions
) -> tf.data.Dataset:
    return tfrecord_dataset(files, batch_size=batch_size, options=options, map_fn=to_contract)


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    build: Callable[..., tf.data.Dataset]  # (*, batch_size, options) -> dataset of batches


def make_variants(examples: dict[str, np.ndarray], files: RecordFiles) -> dict[str, Variant]:
    """Every pipeline the benchmark knows, by name; in-memory (the baseline) first."""
    variants = (
        Variant("in-memory", "from_tensor_slices of the same arrays + tfdist's finish() (baseline)",
                functools.partial(memory_dataset, examples)),
        Variant("serial", "TFRecordDataset over the files in turn, no parallel calls, no prefetch, "
                "no shuffle", functools.partial(serial_dataset, files)),
        Variant("tfdist", "tfdist.data.tfrecord_dataset (interleave, checks, batched parse, prefetch)",
                functools.partial(tfdist_dataset, files)),
    )  # fmt: skip
    return {variant.name: variant for variant in variants}


DEFAULT_READ_VARIANTS = ("in-memory", "serial", "tfdist")
VARIANT_NAMES = DEFAULT_READ_VARIANTS
DEFAULT_TRAIN_VARIANTS = ("in-memory", "serial", "tfdist")


# --- measuring --------------------------------------------------------------------------------


def read_epoch(dataset: tf.data.Dataset) -> tuple[int, float, float]:
    """Examples in one pass over `dataset`, its wall-clock seconds and process CPU seconds.

    The pass runs as a dataset reduction, so no Python runs per batch.
    """
    start, cpu = time.perf_counter(), time.process_time()
    count = dataset.reduce(
        tf.constant(0, tf.int64), lambda n, batch: n + tf.shape(batch[0], tf.int64)[0]
    )
    count = int(count)
    return count, time.perf_counter() - start, time.process_time() - cpu


def small_cnn() -> keras.Model:
    """Conv 32 -> Conv 64 -> global average pool -> Dense 10, on 32x32x3 images."""
    return keras.Sequential(
        [
            keras.Input(IMAGE_SHAPE),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(NUM_CLASSES),
        ]
    )


def make_train_step(model: keras.Model) -> Callable:
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # The iterator goes into the function so that taking the next batch is part of the
    # step, as in tfdist's training loop; one trace serves every variant (same batch spec).
    @tf.function
    def train_step(iterator):
        images, labels = next(iterator)
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return train_step


def train_steps_per_second(
    train_step: Callable, dataset: tf.data.Dataset, *, steps: int
) -> tuple[float, float]:
    """Steps per second over `steps` timed steps, and the process CPU seconds per step.

    Process CPU time counts the input pipeline's threads as well as the model's: on a
    machine with few cores, what the pipeline burns the model cannot use.
    """
    iterator = iter(dataset)
    # The warm-up absorbs tracing, the pipeline's start-up and the shuffle buffer's filling.
    for _ in range(WARMUP_STEPS):
        loss = train_step(iterator)
    float(loss)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loss = train_step(iterator)
    float(loss)
    return steps / (time.perf_counter() - start), (time.process_time() - cpu) / steps


@dataclass
class Row:
    part: str
    variant: str
    unit: str
    values: list[float]  # one per repeat, in the order they ran
    baseline: list[float]  # the in-memory values of the same repeats
    cpu_ms: float  # median process CPU milliseconds per `cpu_per`
    cpu_per: str  # '1k examples' or 'step'

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def ratio(self) -> float:
        """This variant's median over the baseline's median."""
        return self.median / statistics.median(self.baseline)

    @property
    def paired_ratio(self) -> float:
        """The median of each repeat's ratio to the baseline's run in the same repeat.

        Runs of one repeat are seconds apart, so this cancels load that drifts between
        repeats (other jobs on a shared machine) better than the ratio of medians.
        """
        return statistics.median(v / b for v, b in zip(self.values, self.baseline, strict=True))


# --- reporting --------------------------------------------------------------------------------


def print_table(title: str, rows: list[Row]) -> None:
    decimals = 0 if rows[0].median >= 100 else 2
    header = (
        f"{'variant':<13}{'median ' + rows[0].unit:>18}{'min':>11}{'max':>11}"
        f"{'ratio':>8}{'paired':>8}{'CPU ms/' + rows[0].cpu_per:>19}"
    )
    print(f"\n{title}\n{header}\n{'-' * len(header)}")
    for row in rows:
        print(
            f"{row.variant:<13}{row.median:>18,.{decimals}f}{min(row.values):>11,.{decimals}f}"
            f"{max(row.values):>11,.{decimals}f}{row.ratio:>8.3f}{row.paired_ratio:>8.3f}"
            f"{row.cpu_ms:>19.1f}"
        )


def write_csv(path: str, rows: list[Row], settings: dict) -> None:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["part", "variant", "unit", "median", "min", "max", "ratio_vs_in_memory",
             "paired_ratio_vs_in_memory", "cpu_ms", "cpu_ms_per", "repeats", "values",
             *settings]
        )  # fmt: skip
        for row in rows:
            writer.writerow(
                [row.part, row.variant, row.unit, f"{row.median:.4f}", f"{min(row.values):.4f}",
                 f"{max(row.values):.4f}", f"{row.ratio:.4f}", f"{row.paired_ratio:.4f}",
                 f"{row.cpu_ms:.2f}", row.cpu_per,
                 len(row.values), " ".join(f"{v:.4f}" for v in row.values), *settings.values()]
            )  # fmt: skip


# --- main -------------------------------------------------------------------------------------


def _variant_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in VARIANT_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(VARIANT_NAMES)}. Received: {text!r}"
        )
    # The baseline runs first in every repeat; each ratio is against it.
    return ("in-memory", *(name for name in names if name != "in-memory"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.input_bench",
        description="Benchmark reading and training from in-memory data, serial TFRecords\n"
        "and tfdist's TFRecord pipeline, in one run.",
        epilog="examples:\n"
        "  python -m tools.input_bench                       # the default run, ~4 min on 2 cores\n"
        "  python -m tools.input_bench --parts read --repeats 9\n"
        "  python -m tools.input_bench --parts train --train_variants tfdist,serial\n\n"
        "variants: " + ", ".join(VARIANT_NAMES) + " (in-memory is always the baseline)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--num_examples",
        type=int,
        default=30_000,
        help="examples written, and read per epoch (default: %(default)s)",
    )
    add("--batch_size", type=int, default=128, help="(default: %(default)s)")
    add(
        "--parts",
        default="read,train",
        help="which parts to run: read, train or both (default: %(default)s)",
    )
    add(
        "--repeats",
        type=int,
        default=5,
        help="epochs read per variant, interleaved (default: %(default)s)",
    )
    add(
        "--read_variants",
        type=_variant_list,
        default=DEFAULT_READ_VARIANTS,
        metavar="LIST",
        help=f"variants to read from (default: {','.join(DEFAULT_READ_VARIANTS)})",
    )
    add(
        "--train_steps",
        type=int,
        default=60,
        help=f"timed steps per training run, after {WARMUP_STEPS} warm-up steps (default: %(default)s)",
    )
    add(
        "--train_repeats",
        type=int,
        default=4,
        help="training runs per variant, interleaved (default: %(default)s)",
    )
    add(
        "--train_variants",
        type=_variant_list,
        default=DEFAULT_TRAIN_VARIANTS,
        metavar="LIST",
        help=f"variants to train from (default: {','.join(DEFAULT_TRAIN_VARIANTS)})",
    )
    add(
        "--work_dir",
        help="where to write the TFRecords (default: a temporary directory, removed at the end)",
    )
    add("--out_csv", default="/tmp/input_bench.csv", help="(default: %(default)s)")
    args = parser.parse_args(argv)  # fmt: skip
    for name in ("num_examples", "batch_size", "repeats", "train_steps", "train_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1. Received: --{name}={getattr(args, name)}")
    if args.num_examples < args.batch_size * NUM_SHARDS:
        parser.error(
            f"--num_examples must be at least {NUM_SHARDS} batches ({args.batch_size * NUM_SHARDS}) "
            f"to time anything. Received: --num_examples={args.num_examples}"
        )
    args.parts = {part.strip() for part in args.parts.split(",")}
    if not args.parts or not args.parts <= {"read", "train"}:
        parser.error(f"--parts must be read, train or read,train. Received: --parts={args.parts}")
    return args


def rotated(names: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """The variants' order in one repeat: A B C, then B C A, C A B, ...

    No variant always runs first (after a cold cache) or last (as another job's load
    builds up); the paired ratios compare runs of the same repeat.
    """
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="tfdist-input-bench-")
    try:
        return run(args, work_dir)
    finally:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)


def run(args: argparse.Namespace, work_dir: str) -> int:
    batch = args.batch_size
    started = time.perf_counter()
    print(
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPU(s), "
        f"load average {os.getloadavg()[0]:.2f}; {args.num_examples:,} examples of "
        f"{'x'.join(map(str, IMAGE_SHAPE))} uint8 in {NUM_SHARDS} shards, batch {batch}"
    )
    examples = make_examples(args.num_examples)
    write_tfrecords(examples, work_dir, name="train", num_shards=NUM_SHARDS, overwrite=True)
    files = find_records(os.path.join(work_dir, "train"))
    variants = make_variants(examples, files)
    used = [*(args.read_variants if "read" in args.parts else ()),
            *(args.train_variants if "train" in args.parts else ())]  # fmt: skip
    for variant in variants.values():
        if variant.name in used:
            print(f"  {variant.name:<12} {variant.description}")
    rows: list[Row] = []

    if "read" in args.parts:
        names = args.read_variants
        epoch = PipelineOptions(repeat=False)  # tfdist's defaults otherwise: shuffle 10,000
        rates = {name: [] for name in names}
        cpu = {name: [] for name in names}
        for repeat in range(args.repeats):
            for name in rotated(names, repeat):
                count, wall, cpu_seconds = read_epoch(
                    variants[name].build(batch_size=batch, options=epoch)
                )
                rates[name].append(count / wall)
                cpu[name].append(1e6 * cpu_seconds / count)
        part = [
            Row("read", name, "examples/s", rates[name], rates["in-memory"],
                statistics.median(cpu[name]), "1k examples")
            for name in names
        ]  # fmt: skip
        rows += part
        print_table(
            f"A. Reading one epoch, no model ({args.repeats} epochs per variant, interleaved)",
            part,
        )

    if "train" in args.parts:
        names = args.train_variants
        train_step = make_train_step(small_cnn())
        training = PipelineOptions()  # tfdist's defaults: shuffle 10,000, repeat
        rates = {name: [] for name in names}
        cpu = {name: [] for name in names}
        for repeat in range(args.train_repeats):
            for name in rotated(names, repeat):
                dataset = variants[name].build(batch_size=batch, options=training)
                rate, cpu_seconds = train_steps_per_second(
                    train_step, dataset, steps=args.train_steps
                )
                rates[name].append(rate)
                cpu[name].append(1e3 * cpu_seconds)
        part = [
            Row("train", name, "steps/s", rates[name], rates["in-memory"],
                statistics.median(cpu[name]), "step")
            for name in names
        ]  # fmt: skip
        rows += part
        print_table(
            f"B. Training Conv32-Conv64-GAP-Dense10, {args.train_steps} steps after "
            f"{WARMUP_STEPS} warm-up ({args.train_repeats} runs per variant, interleaved)",
            part,
        )

    print(
        "\nratio: median / in-memory median; paired: median over repeats of the run's rate / "
        "the in-memory run's rate in the same repeat"
    )
    settings = {
        "num_examples": args.num_examples,
        "batch_size": batch,
        "train_steps": args.train_steps,
        "cpus": os.cpu_count(),
        "tensorflow": tf.__version__,
    }
    write_csv(args.out_csv, rows, settings)
    print(
        f"wrote {args.out_csv}; {time.perf_counter() - started:.0f} s, load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

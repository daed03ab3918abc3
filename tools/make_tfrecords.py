"""Write a dataset as tfdist TFRecords (shards plus a metadata sidecar), with a progress bar.

  python -m tools.make_tfrecords --source digits --out_dir /data/digits          # train split
  python -m tools.make_tfrecords --source npz:/data/train.npz --out_dir /data/mine
  python -m tools.make_tfrecords --source tfds:mnist --data_dir ~/tensorflow_datasets \\
      --split test --out_dir /data/mnist

Sources:
  digits      scikit-learn's 8x8 digits (image uint8 [8, 8, 1] in 0..16, label, id), split
              into train/test exactly as tfdist.data.prepare_digits does, or --split all
  npz:PATH    a numpy .npz file: each array is a feature, its first axis indexes examples;
              loaded without pickle, so object arrays are refused
  tfds:NAME   a TFDS split already prepared in --data_dir; nothing is downloaded
  images:DIR  a folder with one sub-folder of images (PNG, JPEG, BMP, GIF) per class, as
              keras.utils.image_dataset_from_directory reads it; labels number the class
              folders in sorted order; train/test split as for digits

Each sidecar keeps the classes (names, or the count of integer labels) and the scale of the
pixels, so `python -m experiments.train --dataset=tfrecord:OUT_DIR` trains on the train and
test splits written there.

Exit codes: 0 written, 2 a mistake in the flags or the data (one "error: ..." line on stderr).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tfdist.errors import TfdistError  # cheap: tfdist imports TensorFlow only on demand

if TYPE_CHECKING:
    from tfdist.data.records import Metadata

# Before anything imports TensorFlow: its C++ start-up chatter would bury the summary.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

EXIT_ERROR = 2
COMPRESSIONS = {"none": None, "gzip": "GZIP"}
DIGITS_SPLITS = ("train", "test", "all")
# Dataset names become file names and find_records() glob patterns: no glob characters.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class UsageError(TfdistError):
    """A mistake in the flags or the input this tool can explain in one line."""


# --- sources ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """What to write: the examples, how many there are (None: unknown) and a description."""

    examples: Mapping[str, Any] | Iterable[Mapping[str, Any]]
    total: int | None
    description: str
    # Kept in the sidecar for readers: "classes" (names or a count), "image_scale".
    attributes: Mapping[str, Any] = field(default_factory=dict)


def digits_source(argument: str, *, split: str, data_dir: str | None) -> Source:
    """scikit-learn's bundled digits; train/test as tfdist.data.prepare_digits splits them."""
    del argument, data_dir  # digits takes neither
    import numpy as np
    from sklearn.datasets import load_digits

    from tfdist.data.contract import split_index

    if split not in DIGITS_SPLITS:
        raise UsageError(
            f"--split must be one of {', '.join(DIGITS_SPLITS)} for --source digits. "
            f"Received: --split={split}"
        )
    digits = load_digits()
    images = digits.images.astype(np.uint8)[..., np.newaxis]  # pixel values 0..16
    labels = digits.target.astype(np.int64)
    index = split_index(len(labels), split)  # prepare_digits's split: --split test is its test
    examples = {"image": images[index], "label": labels[index], "id": index.astype(np.int64)}
    return Source(
        examples,
        len(index),
        f"scikit-learn digits ({split})",
        {"classes": [str(c) for c in range(10)], "image_scale": 1 / 16},
    )


def images_source(directory: str, *, split: str, data_dir: str | None) -> Source:
    """A folder with one sub-folder of images per class, as Keras's
    image_dataset_from_directory reads it (tfdist.data.images: labels number the class
    folders in sorted order; train and test split as for the digits)."""
    del data_dir
    from tfdist.data.images import image_folder

    if split not in DIGITS_SPLITS:
        raise UsageError(
            f"--split must be one of {', '.join(DIGITS_SPLITS)} for --source images (test is "
            f"a fixed 20%, train the rest). Received: --split={split}"
        )
    folder = image_folder(directory, split)
    return Source(
        folder.examples(),
        len(folder.files),
        f"{len(folder.classes)} classes of images in {directory} ({split})",
        {"classes": folder.classes, "image_scale": 1 / 255},
    )


def npz_source(path: str, *, split: str, data_dir: str | None) -> Source:
    """The arrays of a .npz file, one feature each, loaded without unpickling anything."""
    del split, data_dir  # the split only names the output
    import zipfile

    import numpy as np

    if not path:
        raise UsageError("--source npz: needs a path, e.g. --source npz:/data/train.npz")
    if not os.path.isfile(path):
        raise UsageError(f"No such .npz file: {path}. Received: --source npz:{path}")
    try:
        loaded = np.load(path, allow_pickle=False)
        if not hasattr(loaded, "files"):  # a .npy file: one bare array, no feature names
            raise UsageError(
                f"{path} is a single .npy array, not an .npz archive of named features; save "
                "one with np.savez(path, image=..., label=...)"
            )
        with loaded:
            arrays = {key: loaded[key] for key in loaded.files}
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        reason = (
            "it is not an .npz archive, or it holds pickled Python objects (object arrays), "
            "which this tool never unpickles; store numeric or string arrays"
            if "allow_pickle" in str(e)
            else str(e)
        )
        raise UsageError(f"Cannot read {path}: {reason}") from None
    if not arrays:
        raise UsageError(f"{path} holds no arrays")
    scalars = [key for key, value in arrays.items() if value.ndim == 0]
    if scalars:
        raise UsageError(
            f"Every array in {path} needs a first axis that indexes examples, but "
            f"{', '.join(scalars)} {'is a scalar' if len(scalars) == 1 else 'are scalars'}"
        )
    lengths = {key: len(value) for key, value in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise UsageError(
            f"The arrays in {path} must have one entry per example, but their lengths "
            f"differ: {', '.join(f'{k}={n}' for k, n in lengths.items())}"
        )
    return Source(arrays, next(iter(lengths.values())), f"{path} ({', '.join(arrays)})")


def tfds_source(name: str, *, split: str, data_dir: str | None) -> Source:
    """A split of a TFDS dataset prepared in data_dir, read offline."""
    import logging

    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise UsageError(
            "--source tfds: needs TensorFlow Datasets: pip install tensorflow-datasets"
        ) from None
    # TFDS warns through absl about every version folder it looks into; errors come from us.
    logging.getLogger("absl").setLevel(logging.ERROR)
    if not name:
        raise UsageError("--source tfds: needs a dataset name, e.g. --source tfds:mnist")
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except ValueError as e:  # DatasetNotFoundError lists every known dataset: keep line one
        raise UsageError(f"{str(e).splitlines()[0]} Received: --source tfds:{name}") from None
    if not builder.is_prepared():
        raise UsageError(
            f"The TFDS dataset {name} is not prepared in {builder.data_dir}, and this tool "
            "never downloads. Prepare it where there is network access "
            f"(tfds.builder({name!r}, data_dir=DIR).download_and_prepare()), copy DIR here "
            "and pass --data_dir DIR."
        )
    try:
        total = builder.info.splits[split].num_examples
    except (KeyError, ValueError) as e:
        known = ", ".join(builder.info.splits) or "none"
        raise UsageError(
            f"The TFDS dataset {name} has no split {split!r} ({e}). Its splits: {known}. "
            f"Received: --split={split}"
        ) from None
    dataset = builder.as_dataset(split=split, shuffle_files=False)
    return Source(_flatten_each(dataset.as_numpy_iterator()), total, f"TFDS {name} ({split})")


def _flatten_each(elements: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """TFDS nests features (e.g. {'objects': {'label': ...}}); TFRecords want flat names."""

    def flatten(mapping: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
        for key, value in mapping.items():
            if isinstance(value, Mapping):
                yield from flatten(value, f"{prefix}{key}/")
            else:
                yield prefix + key, value

    for element in elements:
        yield dict(flatten(element))


SOURCES: dict[str, Callable[..., Source]] = {
    "digits": digits_source,
    "npz": npz_source,
    "tfds": tfds_source,
    "images": images_source,
}
SOURCE_FORMS = ("digits", "npz:PATH", "tfds:NAME", "images:DIR")


def load_source(source: str, *, split: str, data_dir: str | None) -> Source:
    kind, colon, argument = source.partition(":")
    # digits takes no argument; npz and tfds always do.
    if kind not in SOURCES or (kind == "digits") == bool(colon):
        raise UsageError(
            f"--source must be one of {', '.join(SOURCE_FORMS)}. Received: --source={source}"
        )
    if data_dir is not None and kind != "tfds":
        raise UsageError(
            f"--data_dir is where prepared TFDS datasets live; --source {kind} does not use "
            f"it. Received: --data_dir={data_dir}"
        )
    return SOURCES[kind](argument, split=split, data_dir=data_dir)


# --- progress ---------------------------------------------------------------------------------


class ProgressBar:
    """A one-line progress bar redrawn in place on a terminal; silent anywhere else.

    Call it with the number of examples done so far (write_tfrecords' `progress`).
    """

    def __init__(self, total: int | None, *, stream=None, width: int = 30, interval: float = 0.1):
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.interval = interval
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._done = 0

    def __call__(self, done: int) -> None:
        self._done = done
        now = time.perf_counter()
        if self.enabled and now - self._last_draw >= self.interval:
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        if self.enabled and self._done:  # nothing drawn before an early error: stay silent
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        rate = self._done / elapsed
        if self.total:
            fraction = min(self._done / self.total, 1.0)
            filled = int(self.width * fraction)
            bar = (
                "=" * filled
                + (">" if filled < self.width else "")
                + " " * (self.width - filled - 1)
            )
            eta = (self.total - self._done) / rate if rate > 0 and fraction < 1 else 0.0
            line = (
                f"[{bar[: self.width]}] {self._done:,}/{self.total:,} {fraction:4.0%} "
                f"{rate:,.0f} examples/s ETA {eta:.0f}s"
            )
        else:
            line = f"{self._done:,} examples {rate:,.0f} examples/s {elapsed:.0f}s"
        self.stream.write("\r" + line + "\x1b[K")  # \x1b[K clears what a longer line left
        self.stream.flush()


# --- main -------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line, like every other error of this tool, instead of usage + message.
        self.exit(EXIT_ERROR, f"error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer. Received: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m tools.make_tfrecords",
        description="Write a dataset as tfdist TFRecord shards plus a NAME.meta.json sidecar,\n"
        "readable with tfdist.data.tfrecord_dataset('OUT_DIR/NAME', batch_size=...).",
        epilog="examples:\n"
        "  python -m tools.make_tfrecords --source digits --out_dir /tmp/digits\n"
        "  python -m tools.make_tfrecords --source digits --split test --num_shards 2 "
        "--out_dir /tmp/digits\n"
        "  python -m tools.make_tfrecords --source npz:train.npz --out_dir /tmp/mine "
        "--compression gzip\n"
        "  python -m tools.make_tfrecords --source tfds:mnist --data_dir ~/tensorflow_datasets "
        "--out_dir /tmp/mnist\n"
        "  python -m tools.make_tfrecords --source images:photos --split test --out_dir /tmp/pets"
        "\n\n"
        "exit codes: 0 written; 2 a mistake in the flags or the data (one 'error:' line).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--source",
        required=True,
        metavar="SOURCE",
        help="digits (scikit-learn's 8x8 digits), npz:PATH (a numpy .npz file, one feature "
        "per array, first axis = examples), tfds:NAME (a TFDS dataset prepared in --data_dir) "
        "or images:DIR (a folder with one sub-folder of images per class)",
    )
    parser.add_argument(
        "--out_dir", required=True, help="directory to write to (created if missing)"
    )
    parser.add_argument(
        "--name",
        help="dataset name: files NAME-0000i-of-0000N.tfrecord and NAME.meta.json "
        "(default: the split, e.g. train)",
    )
    parser.add_argument(
        "--split",
        default="train",
        help="digits and images: train, test (a fixed 20%%) or all; tfds: any TFDS split, "
        "e.g. test or 'train[:10%%]'; npz: only names the output (default: %(default)s)",
    )
    parser.add_argument(
        "--num_shards",
        type=_positive_int,
        default=4,
        help="files to spread the examples over (default: %(default)s)",
    )
    parser.add_argument(
        "--compression",
        type=str.lower,
        choices=sorted(COMPRESSIONS),
        default="none",
        help="shard compression; readers find it in the sidecar (default: %(default)s)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing dataset of the same name (its old shard files are removed)",
    )
    parser.add_argument(
        "--data_dir",
        help="where prepared TFDS datasets live (tfds: sources only; default: TFDS's own, "
        "$TFDS_DATA_DIR or ~/tensorflow_datasets)",
    )
    return parser


def _counting_labels(examples) -> tuple[Any, Callable[[], int | None]]:
    """The examples, and a function giving the largest integer "label" among them once they
    are written (None: no integer labels)."""
    import numpy as np

    if isinstance(examples, Mapping):
        labels = np.asarray(examples.get("label", []))
        highest = (
            int(labels.max())
            if labels.ndim == 1 and labels.size and np.issubdtype(labels.dtype, np.integer)
            else None
        )
        return examples, lambda: highest

    seen: list[int | None] = [None]

    def counted():
        for example in examples:
            label = np.asarray(example.get("label", 0.5))
            if label.ndim == 0 and np.issubdtype(label.dtype, np.integer):
                seen[0] = max(int(label), -1 if seen[0] is None else seen[0])
            yield example

    return counted(), lambda: seen[0]


def default_name(split: str) -> str:
    """A file-safe dataset name from a split such as 'train[:10%]'."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", split).strip("_") or "data"


def summary(
    meta: Metadata, *, out_dir: str, meta_path: str, seconds: float, description: str
) -> str:
    """The lines printed after writing: files, examples per shard, bytes, the sidecar."""
    import tensorflow as tf

    sizes = [tf.io.gfile.stat(os.path.join(out_dir, shard.file)).length for shard in meta.shards]
    lines = [
        f"Wrote {meta.num_examples:,} examples of {description} in {seconds:.1f} s:",
        f"  {'file':<40}{'examples':>10}{'bytes':>14}",
    ]
    shown = meta.shards if len(meta.shards) <= 10 else meta.shards[:8]
    for shard, size in zip(shown, sizes, strict=False):
        lines.append(f"  {shard.file:<40}{shard.num_examples:>10,}{size:>14,}")
    if len(shown) < len(meta.shards):
        lines.append(f"  ... {len(meta.shards) - len(shown)} more")
    total = sum(sizes)
    lines += [
        f"  {'total: ' + str(len(meta.shards)) + ' files':<40}{meta.num_examples:>10,}{total:>14,}"
        f"  ({total / 2**20:.1f} MiB)",
        "  features: "
        + ", ".join(f"{key} {spec.dtype}{list(spec.shape)}" for key, spec in meta.features.items()),
        f"  sidecar:  {meta_path}",
        f"Read it with tfdist.data.tfrecord_dataset({os.path.join(out_dir, meta.name)!r}, "
        "batch_size=...)",
    ]
    if "image" in meta.features and "label" in meta.features and "classes" in meta.attributes:
        lines.append(
            f"With a train and a test split there, train on it: python -m experiments.train "
            f"--dataset=tfrecord:{out_dir}"
        )
    return "\n".join(lines)


def remove_stale_shards(meta: Metadata, out_dir: str) -> list[str]:
    """Shards of an overwritten dataset that the new one did not rewrite (other shard count)."""
    import tensorflow as tf

    keep = {shard.file for shard in meta.shards}
    pattern = re.compile(rf"^{re.escape(meta.name)}-\d{{5}}-of-\d{{5}}\.tfrecord(\.gz)?$")
    stale = [
        path
        for path in tf.io.gfile.glob(os.path.join(out_dir, meta.name + "-*"))
        if pattern.match(os.path.basename(path)) and os.path.basename(path) not in keep
    ]
    for path in stale:
        tf.io.gfile.remove(path)
    return sorted(stale)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return convert(args)
    except (TfdistError, OSError) as e:  # UsageError and tfdist's DataError are TfdistErrors
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR


def convert(args: argparse.Namespace) -> int:
    name = args.name if args.name is not None else default_name(args.split)
    if not _NAME_RE.match(name):
        raise UsageError(
            "--name may only hold letters, digits, '_', '-' and '.' (it becomes file names "
            f"and a glob pattern). Received: --name={name}"
        )
    # Load the source's module imports only now, after the flags are known to be sane.
    import tensorflow as tf

    from tfdist.data.records import META_SUFFIX, write_tfrecords

    meta_path = os.path.join(args.out_dir, name + META_SUFFIX)
    if tf.io.gfile.exists(meta_path) and not args.overwrite:
        raise UsageError(
            f"A dataset named {name!r} already exists in {args.out_dir}. Pass --overwrite to "
            f"replace it, or choose another --name. Received: --name={name}"
        )
    source = load_source(args.source, split=args.split, data_dir=args.data_dir)
    examples, highest_label = _counting_labels(source.examples)

    def attributes() -> dict[str, Any]:
        # A label feature of integers numbers the classes: tfdist's binary reads the count.
        counted = {} if highest_label() is None else {"classes": highest_label() + 1}
        return {**counted, **source.attributes}

    start = time.perf_counter()
    bar = ProgressBar(source.total)
    try:
        meta = write_tfrecords(
            examples,
            args.out_dir,
            name=name,
            num_shards=args.num_shards,
            compression=COMPRESSIONS[args.compression],
            overwrite=args.overwrite,
            progress=bar,
            attributes=attributes,
        )
    except tf.errors.OpError as e:  # an unwritable out_dir, a corrupt TFDS file, ...
        raise UsageError(
            f"TensorFlow failed reading the source or writing to {args.out_dir}: {e.message}"
        ) from None
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    if args.overwrite:
        stale = remove_stale_shards(meta, args.out_dir)
        if stale:
            print(f"Removed {len(stale)} shard file(s) of the replaced dataset, e.g. {stale[0]}")
    print(
        summary(
            meta,
            out_dir=args.out_dir,
            meta_path=meta_path,
            seconds=seconds,
            description=source.description,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

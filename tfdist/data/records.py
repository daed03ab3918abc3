"""TFRecord shards of tf.train.Example with a metadata sidecar, written atomically.

A dataset on disk is N shard files plus ``<name>.meta.json``, which records every feature's
dtype, shape and encoding and how many examples each shard holds. A reader needs no
hand-written feature spec, and can tell a truncated shard from a complete one.

    >>> meta = write_tfrecords({"image": images, "label": labels}, "/data/digits", name="train",
    ...                        num_shards=4)
    >>> meta.num_examples, [s.file for s in meta.shards][:1]
    (1438, ['train-00000-of-00004.tfrecord'])

Shards are written under temporary names and renamed when complete, and the sidecar is
renamed last: a crash never leaves files that look like a finished dataset.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.errors import TfdistError
from tfdist.storage import temporary_suffix, write_atomically

FORMAT = "tfdist.tfrecords/1"
META_SUFFIX = ".meta.json"
COMPRESSIONS = {None: "", "GZIP": ".gz"}
_SHARD_RE = re.compile(r"^(?P<name>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.tfrecord(\.gz)?$")

# How each numpy dtype is stored in a tf.train.Example. Integers go to int64_list and float32
# to float_list, so other tools can read the records; bytes keep uint8 images compact and
# float16/float64 exact.
_INT_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint16", "uint32"}
_BYTES_DTYPES = {"uint8", "float16", "float64"}


class DataError(TfdistError, ValueError):
    """Input data that cannot be read as asked; the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """One feature of every example: its numpy dtype, its shape and how it is encoded."""

    dtype: str
    shape: tuple[int, ...]
    encoding: str  # 'int64_list' | 'float_list' | 'bytes' | 'string'

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    file: str  # file name, relative to the sidecar's directory
    num_examples: int


@dataclasses.dataclass(frozen=True)
class Metadata:
    """The sidecar of a TFRecord dataset."""

    name: str
    features: Mapping[str, FeatureSpec]
    shards: tuple[ShardInfo, ...]
    compression: str | None = None
    # What a reader needs beyond the features, e.g. "classes" (their names, or a count) and
    # "image_scale" (what maps the stored pixels into [0, 1]); see tools/make_tfrecords.py.
    attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_examples(self) -> int:
        return sum(s.num_examples for s in self.shards)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "name": self.name,
                "compression": self.compression,
                "num_examples": self.num_examples,
                "features": {k: dataclasses.asdict(v) for k, v in self.features.items()},
                "shards": [dataclasses.asdict(s) for s in self.shards],
                **({"attributes": dict(self.attributes)} if self.attributes else {}),
            },
            indent=2,
            allow_nan=False,
        )

    @classmethod
    def from_json(cls, text: str, *, path: str) -> Metadata:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT!r}")
            features = {
                k: FeatureSpec(v["dtype"], tuple(v["shape"]), v["encoding"])
                for k, v in raw["features"].items()
            }
            shards = tuple(ShardInfo(s["file"], int(s["num_examples"])) for s in raw["shards"])
            attributes = raw.get("attributes", {})
            if not isinstance(attributes, dict):
                raise ValueError(f"attributes is {type(attributes).__name__}, expected an object")
            meta = cls(raw["name"], features, shards, raw.get("compression"), attributes)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(
                f"The TFRecord metadata file {path} is not valid ({e}). Re-create the dataset "
                "with tfdist.data.write_tfrecords (or python -m tools.make_tfrecords)."
            ) from None
        if meta.num_examples != raw.get("num_examples", meta.num_examples):
            raise DataError(
                f"The TFRecord metadata file {path} is inconsistent: its shards add up to "
                f"{meta.num_examples} examples but it says {raw['num_examples']}. Re-create it."
            )
        return meta


# --- writing --------------------------------------------------------------------------------


def write_tfrecords(
    examples: Mapping[str, np.ndarray] | tf.data.Dataset | Iterable[Mapping[str, Any]],
    out_dir: str,
    *,
    name: str = "data",
    num_shards: int = 1,
    compression: str | None = None,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    attributes: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
) -> Metadata:
    """Writes examples to `num_shards` TFRecord files and a metadata sidecar, atomically.

    Args:
      examples: a mapping of feature name to an array whose first axis indexes examples; or a
        tf.data.Dataset (e.g. a TFDS split) or iterable whose elements are mappings of feature
        name to value. Every example must have the same shape per feature.
      out_dir: the directory to write to (created if missing; any tf.io.gfile path).
      name: the dataset's name: files are ``<name>-00000-of-0000N.tfrecord`` and
        ``<name>.meta.json``.
      num_shards: how many files to spread the examples over (round-robin).
      compression: None or 'GZIP'.
      overwrite: replace an existing dataset of the same name instead of failing.
      progress: called with the number of examples written so far, every 256 examples and
        at the end.
      attributes: kept in the sidecar for readers (Metadata.attributes), or a function
        called once every example is written that returns them (e.g. classes seen).

    Returns:
      The Metadata written to the sidecar.

    Raises:
      DataError: the examples are empty or inconsistent, or the dataset exists already.
    """
    if compression not in COMPRESSIONS:
        raise DataError(
            f"compression must be None or 'GZIP'. Received: compression={compression!r}"
        )
    if not isinstance(num_shards, int) or num_shards < 1:
        raise DataError(
            f"num_shards must be a positive integer. Received: num_shards={num_shards!r}"
        )
    meta_path = os.path.join(out_dir, name + META_SUFFIX)
    if tf.io.gfile.exists(meta_path) and not overwrite:
        raise DataError(
            f"A dataset named {name!r} already exists in {out_dir}. Pass overwrite=True to "
            f"replace it, or choose another name. Received: name={name!r}"
        )
    tf.io.gfile.makedirs(out_dir)
    files = [
        f"{name}-{i:05d}-of-{num_shards:05d}.tfrecord{COMPRESSIONS[compression]}"
        for i in range(num_shards)
    ]
    # A unique suffix per writer: two processes preparing the same data (every worker of a
    # job on first use) must not write into each other's half-finished files.
    token = temporary_suffix()
    temporary = [os.path.join(out_dir, f + token) for f in files]
    counts = [0] * num_shards
    features: dict[str, FeatureSpec] | None = None
    writers = [tf.io.TFRecordWriter(p, options=compression or "") for p in temporary]
    try:
        for i, example in enumerate(_iter_examples(examples)):
            if features is None:
                features = {k: _spec_of(k, v) for k, v in example.items()}
            writers[i % num_shards].write(_encode(example, features, index=i))
            counts[i % num_shards] += 1
            if progress is not None and (i + 1) % 256 == 0:
                progress(i + 1)
        for writer in writers:
            writer.close()
        if features is None:
            raise DataError(f"No examples to write to {out_dir}: the input is empty.")
        meta = Metadata(
            name,
            features,
            tuple(ShardInfo(f, c) for f, c in zip(files, counts, strict=True)),
            compression,
            dict((attributes() if callable(attributes) else attributes) or {}),
        )
        for tmp, final in zip(temporary, files, strict=True):
            tf.io.gfile.rename(tmp, os.path.join(out_dir, final), overwrite=True)
        write_atomically(meta_path, meta.to_json(), suffix=token)
    finally:
        for writer in writers:
            writer.close()
        for tmp in temporary:
            if tf.io.gfile.exists(tmp):
                tf.io.gfile.remove(tmp)
    if progress is not None:
        progress(meta.num_examples)
    return meta


def _iter_examples(examples) -> Iterator[Mapping[str, np.ndarray]]:
    if isinstance(examples, Mapping):
        arrays = {k: np.asarray(v) for k, v in examples.items()}
        lengths = {k: len(v) for k, v in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise DataError(
                f"Every feature needs one entry per example, but the lengths differ: {lengths}"
            )
        for i in range(next(iter(lengths.values()), 0)):
            yield {k: v[i] for k, v in arrays.items()}
        return
    if isinstance(examples, tf.data.Dataset):
        examples = examples.as_numpy_iterator()
    for example in examples:
        if not isinstance(example, Mapping):
            raise DataError(
                "Each element must be a mapping of feature name to value, e.g. "
                "{'image': ..., 'label': ...} (a TFDS split without as_supervised). "
                f"Received an element of type {type(example).__name__}"
            )
        yield {k: np.asarray(v) for k, v in example.items()}


def _spec_of(key: str, value: np.ndarray) -> FeatureSpec:
    dtype = value.dtype
    if dtype.kind in "SUO":
        if value.shape:
            raise DataError(
                f"Feature {key!r}: only scalar strings are supported. Received shape {value.shape}"
            )
        return FeatureSpec("string", (), "string")
    name = dtype.name
    if name in _INT_DTYPES:
        encoding = "int64_list"
    elif name == "float32":
        encoding = "float_list"
    elif name in _BYTES_DTYPES:
        encoding = "bytes"
    else:
        raise DataError(
            f"Feature {key!r} has dtype {name}, which tfdist cannot store; cast it first."
        )
    return FeatureSpec(name, tuple(int(d) for d in value.shape), encoding)


def _encode(
    example: Mapping[str, np.ndarray], specs: Mapping[str, FeatureSpec], *, index: int
) -> bytes:
    if example.keys() != specs.keys():
        raise DataError(
            f"Example {index} has features {sorted(example)} but the first had {sorted(specs)}."
        )
    feature = {}
    for key, spec in specs.items():
        value = example[key]
        if spec.encoding != "string" and tuple(value.shape) != spec.shape:
            raise DataError(
                f"Feature {key!r} of example {index} has shape {tuple(value.shape)} but the first "
                f"example's is {spec.shape}; TFRecord features here have one fixed shape."
            )
        if spec.encoding == "int64_list":
            feature[key] = tf.train.Feature(
                int64_list=tf.train.Int64List(value=value.ravel().astype(np.int64))
            )
        elif spec.encoding == "float_list":
            feature[key] = tf.train.Feature(float_list=tf.train.FloatList(value=value.ravel()))
        elif spec.encoding == "bytes":
            raw = np.ascontiguousarray(value, dtype=spec.dtype).tobytes()
            feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[raw]))
        else:
            text = value.item()
            raw = text.encode() if isinstance(text, str) else bytes(text)
            feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[raw]))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


# --- finding and checking -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RecordFiles:
    """The shard files a reader will read, with their sidecar."""

    paths: tuple[str, ...]
    counts: tuple[int, ...]  # examples per file, from the sidecar
    metadata: Metadata
    metadata_path: str


def find_records(source: str) -> RecordFiles:
    """Resolves a dataset directory or a shard file pattern to its files and sidecar.

    Args:
      source: a directory holding one tfdist TFRecord dataset, a dataset's sidecar
        (``.../train.meta.json``), its prefix (``.../train``), or a glob pattern of shard
        files (``.../train-*``).

    Raises:
      DataError: nothing matches, the sidecar is missing or invalid, or the files belong to
        different datasets.
    """
    if tf.io.gfile.isdir(source):
        sidecars = sorted(tf.io.gfile.glob(os.path.join(source, "*" + META_SUFFIX)))
        if len(sidecars) != 1:
            names = [os.path.basename(s)[: -len(META_SUFFIX)] for s in sidecars]
            raise DataError(
                f"The directory {source} holds {len(sidecars)} tfdist datasets "
                f"({', '.join(names) or 'none'}); name one, e.g. {os.path.join(source, 'NAME')}."
                if sidecars
                else f"No tfdist TFRecord dataset in {source}: no *{META_SUFFIX} sidecar. "
                "Write one with tfdist.data.write_tfrecords or python -m tools.make_tfrecords."
            )
        return _from_sidecar(sidecars[0])
    if source.endswith(META_SUFFIX):
        return _from_sidecar(source)
    if tf.io.gfile.exists(source + META_SUFFIX):
        return _from_sidecar(source + META_SUFFIX)
    matches = sorted(tf.io.gfile.glob(source))
    shards = [m for m in matches if _SHARD_RE.match(os.path.basename(m))]
    if not shards:
        raise DataError(
            f"No TFRecord files match {source!r}"
            + (f" ({len(matches)} other file(s) do)" if matches else "")
            + ". Expected a dataset directory, its NAME prefix or a pattern like DIR/NAME-*; "
            "check the path, or create the data with python -m tools.make_tfrecords."
        )
    names = {_SHARD_RE.match(os.path.basename(m))["name"] for m in shards}
    directories = {os.path.dirname(m) for m in shards}
    if len(names) > 1 or len(directories) > 1:
        raise DataError(
            f"The pattern {source!r} matches shards of {len(names) * len(directories)} datasets "
            f"({', '.join(sorted(names))}); narrow it to one, e.g. DIR/NAME-*."
        )
    full = _from_sidecar(os.path.join(directories.pop(), names.pop() + META_SUFFIX))
    chosen = [full.paths.index(p) for p in shards if p in full.paths]
    if len(chosen) != len(shards):
        stray = sorted(set(shards) - set(full.paths))
        raise DataError(f"{stray[0]} matches {source!r} but is not listed in {full.metadata_path}.")
    return dataclasses.replace(
        full,
        paths=tuple(full.paths[i] for i in chosen),
        counts=tuple(full.counts[i] for i in chosen),
    )


def _from_sidecar(path: str) -> RecordFiles:
    if not tf.io.gfile.exists(path):
        raise DataError(
            f"The TFRecord dataset's metadata file {path} is missing: the dataset was not "
            "written by tfdist, or its writing did not finish. Re-create it with "
            "tfdist.data.write_tfrecords or python -m tools.make_tfrecords."
        )
    with tf.io.gfile.GFile(path) as f:
        meta = Metadata.from_json(f.read(), path=path)
    directory = os.path.dirname(path)
    paths = tuple(os.path.join(directory, s.file) for s in meta.shards)
    missing = [p for p in paths if not tf.io.gfile.exists(p)]
    if missing:
        raise DataError(
            f"{len(missing)} shard file(s) listed in {path} are missing, e.g. {missing[0]}. "
            "Restore them or re-create the dataset."
        )
    return RecordFiles(paths, tuple(s.num_examples for s in meta.shards), meta, path)


def check_first_record(files: RecordFiles) -> None:
    """Parses the first record of the first non-empty shard against the sidecar.

    A sidecar that disagrees with the records (another dataset's, or edited) would otherwise
    fail deep inside a training step; here it fails at once, naming the file and the feature.

    Raises:
      DataError: a feature is missing, has another kind, or another number of values.
    """
    non_empty = [(p, c) for p, c in zip(files.paths, files.counts, strict=True) if c]
    if not non_empty:
        return
    path, count = non_empty[0]
    compression = files.metadata.compression or ""
    try:
        # Eagerly, even when a dataset function is being traced (parameter-server workers'
        # datasets are built inside a tf.function).
        with tf.init_scope():
            first = next(iter(tf.data.TFRecordDataset(path, compression_type=compression).take(1)))
            serialized = first.numpy()
    except StopIteration:
        raise DataError(
            f"{path} holds no records but {files.metadata_path} says it has {count}: the file "
            "is truncated. Re-create the dataset."
        ) from None
    except tf.errors.OpError as e:
        raise DataError(
            f"Cannot read the first record of {path}: {e.message}. The file is corrupt, or "
            f"not {'GZIP-compressed' if compression else 'uncompressed'} as "
            f"{files.metadata_path} says."
        ) from None
    example = tf.train.Example.FromString(serialized)
    for key, spec in files.metadata.features.items():
        if key not in example.features.feature:
            raise DataError(
                f"The records of {path} have no feature {key!r}, which {files.metadata_path} "
                f"lists; the sidecar belongs to other data. Found: {sorted(example.features.feature)}"
            )
        feature = example.features.feature[key]
        kind = feature.WhichOneof("kind")
        expected_kind = {"int64_list": "int64_list", "float_list": "float_list"}.get(
            spec.encoding, "bytes_list"
        )
        values = getattr(feature, kind).value if kind else []
        if kind != expected_kind or (
            spec.encoding in ("int64_list", "float_list") and len(values) != spec.size
        ):
            raise DataError(
                f"Feature {key!r} in {path} holds {len(values)} {kind} value(s) but "
                f"{files.metadata_path} says {spec.size} {expected_kind} value(s) "
                f"(dtype {spec.dtype}, shape {list(spec.shape)}); the sidecar disagrees with the "
                "records. Re-create the dataset."
            )
        if spec.encoding == "bytes":
            expected_bytes = spec.size * np.dtype(spec.dtype).itemsize
            if len(values[0]) != expected_bytes:
                raise DataError(
                    f"Feature {key!r} in {path} holds {len(values[0])} bytes but "
                    f"{files.metadata_path} says {expected_bytes} (dtype {spec.dtype}, shape "
                    f"{list(spec.shape)}); the sidecar disagrees with the records."
                )


def batch_parse_fn(metadata: Metadata) -> Callable[[tf.Tensor], dict[str, tf.Tensor]]:
    """A function that parses a batch of serialized examples into typed, shaped tensors.

    One parse op per batch rather than per record: on a small CPU every per-record op is
    time the model does not get (tools/input_bench.py measures it).
    """
    spec = {}
    for key, feature in metadata.features.items():
        if feature.encoding == "int64_list":
            spec[key] = tf.io.FixedLenFeature([feature.size], tf.int64)
        elif feature.encoding == "float_list":
            spec[key] = tf.io.FixedLenFeature([feature.size], tf.float32)
        else:
            spec[key] = tf.io.FixedLenFeature([], tf.string)

    def parse(records: tf.Tensor) -> dict[str, tf.Tensor]:
        parsed = tf.io.parse_example(records, spec)
        # A batch that dropped its remainder has a static size; keep it in the shapes.
        batch = records.shape[0] if records.shape[0] is not None else -1
        out = {}
        for key, feature in metadata.features.items():
            value = parsed[key]
            if feature.encoding == "bytes":
                value = tf.io.decode_raw(value, tf.dtypes.as_dtype(feature.dtype))
            if feature.encoding != "string":
                value = tf.reshape(tf.cast(value, feature.dtype), [batch, *feature.shape])
            out[key] = value
        return out

    return parse

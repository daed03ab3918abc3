"""tools.make_tfrecords: the command line writes what tfdist's reader reads back."""

import numpy as np

from tests.conftest import run_module
from tfdist.data import PipelineOptions, find_records, tfrecord_dataset

ONE_EPOCH = PipelineOptions(repeat=False, shuffle_buffer=0, drop_remainder=False)


def test_npz_round_trip_through_the_command_line(tmp_path):
    arrays = {
        "x": np.arange(60, dtype=np.float32).reshape(20, 3),
        "y": np.arange(20, dtype=np.int64),
    }
    np.savez(tmp_path / "data.npz", **arrays)
    out = tmp_path / "out"
    result = run_module(
        "tools.make_tfrecords", f"--source=npz:{tmp_path / 'data.npz'}", f"--out_dir={out}",
        "--name=table", "--num_shards=3", "--compression=gzip",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    files = find_records(str(out / "table"))
    assert len(files.paths) == 3 and files.metadata.compression == "GZIP"
    batches = list(tfrecord_dataset(str(out / "table"), batch_size=8, options=ONE_EPOCH))
    y = np.concatenate([b["y"].numpy() for b in batches])
    x = np.concatenate([b["x"].numpy() for b in batches])
    np.testing.assert_array_equal(x[np.argsort(y)], arrays["x"])


def test_digits_split_matches_the_library(tmp_path):
    result = run_module(
        "tools.make_tfrecords", "--source=digits", "--split=test", f"--out_dir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert find_records(str(tmp_path / "test")).metadata.num_examples == 359


def test_mistakes_end_with_one_error_line(tmp_path):
    result = run_module(
        "tools.make_tfrecords", f"--source=npz:{tmp_path / 'missing.npz'}", f"--out_dir={tmp_path}"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: No such .npz file: {tmp_path / 'missing.npz'}. Received: --source npz:{tmp_path / 'missing.npz'}"
    ]

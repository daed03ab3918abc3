"""tools.make_tfrecords: the command line writes what tfdist's reader reads back.

One test runs it as a process (`python -m tools.make_tfrecords`); the others call its
`main(argv)`, the function that process runs, which returns the exit code and prints the
one error line (a process costs a TensorFlow start-up each).
"""

import json
import re
import sys

import numpy as np

from tests.conftest import run_module, run_python
from tfdist.data import PipelineOptions, find_records, prepare_dataset, tfrecord_dataset
from tools import make_tfrecords


def convert(capsys, *argv: str) -> tuple[int, str, list[str]]:
    """tools.make_tfrecords's main on `argv`: (exit code, stdout, its error lines)."""
    code = make_tfrecords.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.startswith("error:")]


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


def test_digits_split_matches_the_library(tmp_path, capsys):
    code, _, errors = convert(capsys, "--source=digits", "--split=test", f"--out_dir={tmp_path}")
    assert code == 0, errors
    assert find_records(str(tmp_path / "test")).metadata.num_examples == 359


def test_mistakes_end_with_one_error_line(tmp_path, capsys):
    code, _, errors = convert(
        capsys, f"--source=npz:{tmp_path / 'missing.npz'}", f"--out_dir={tmp_path}"
    )
    assert code == 2
    assert errors == [
        f"error: No such .npz file: {tmp_path / 'missing.npz'}. Received: --source npz:{tmp_path / 'missing.npz'}"
    ]


def write_png_folder(root, sizes: dict[str, list[tuple[int, int]]]) -> None:
    """root/<class>/<i>.png, grayscale, one per size listed; pixels encode the class."""
    import tensorflow as tf

    for label, (name, shapes) in enumerate(sorted(sizes.items())):
        (root / name).mkdir(parents=True)
        for i, (h, w) in enumerate(shapes):
            image = np.full((h, w, 1), 40 * label + i, np.uint8)
            (root / name / f"{i}.png").write_bytes(tf.io.encode_png(image).numpy())


def test_the_binary_trains_an_image_folder_directly_converted_once(tmp_path, caplog):
    """--dataset=images:DIR: the folder is written as TFRecords into the data_dir on first
    use (as the digits are), read again while it is unchanged, converted anew when not."""
    folder = tmp_path / "pngs"
    write_png_folder(folder, {c: [(8, 8)] * 20 for c in ("cat", "dog", "owl")})
    data_dir = tmp_path / "cache"

    def prepared():
        caplog.clear()
        data = prepare_dataset(f"images:{folder}", data_dir=str(data_dir))
        converted = [r for r in caplog.records if r.getMessage().startswith("Converted ")]
        return data, converted

    data, converted = prepared()
    assert len(converted) == 1 and "60 images of 3 classes" in converted[0].getMessage()
    assert data.info.num_classes == 3 and data.info.image_shape == (8, 8, 1)
    assert data.info.num_examples == {"train": 48, "test": 12}  # the digits' 20% split
    images, labels = next(iter(data.dataset("train", batch_size=48, options=ONE_EPOCH)))
    np.testing.assert_array_equal(np.round(images.numpy()[:, 0, 0, 0] * 255) // 40, labels)
    assert prepared()[1] == []  # unchanged: read, not converted again
    (folder / "owl" / "20.png").write_bytes((folder / "owl" / "0.png").read_bytes())
    data, converted = prepared()
    assert len(converted) == 1  # a new image: converted again
    assert data.info.num_examples == {"train": 49, "test": 12}

    result = run_module(
        "experiments.train", f"--dataset=images:{folder}", f"--data_dir={data_dir}",
        "--model=mlp", "--epochs=1", "--global_batch_size=16", f"--model_dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Converted " not in result.stderr  # the run before wrote them
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["eval_accuracy"] is not None  # 49 // 16 steps


def test_an_image_folder_trains_in_the_binary(tmp_path, capsys):
    # Three classes of 8x8 PNGs, as keras.utils.image_dataset_from_directory reads them.
    write_png_folder(tmp_path / "pngs", {c: [(8, 8)] * 20 for c in ("cat", "dog", "owl")})
    for split in ("train", "test"):
        code, out, errors = convert(
            capsys, f"--source=images:{tmp_path / 'pngs'}", f"--split={split}",
            f"--out_dir={tmp_path / 'data'}", "--num_shards=2",
        )  # fmt: skip
        assert code == 0, errors
    assert "--dataset=tfrecord:" in out
    meta = find_records(str(tmp_path / "data" / "train")).metadata
    assert meta.attributes["classes"] == ["cat", "dog", "owl"] and meta.num_examples == 48
    # Each image's pixels encode its class folder (40 * label + index).
    batch = next(iter(tfrecord_dataset(str(tmp_path / "data" / "train"), batch_size=48,
                                       options=ONE_EPOCH)))  # fmt: skip
    np.testing.assert_array_equal(batch["image"].numpy()[:, 0, 0, 0] // 40, batch["label"])

    result = run_module(
        "experiments.train", f"--dataset=tfrecord:{tmp_path / 'data'}", "--model=mlp",
        "--epochs=1", "--global_batch_size=16", f"--model_dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["eval_accuracy"] is not None  # 48 // 16 steps
    assert "mlp on tfrecord:" in result.stderr and "(48 training examples)" in result.stderr

    # A shard cut short, met in the middle of training by a job of 2 workers under
    # --max_restarts 2: one error line on each, naming it and the flag, exit 2, and no restart
    # (every attempt would meet it). With --skip_corrupt the run trains on the readable
    # records and says once how many it dropped.
    shard = tmp_path / "data" / "train-00001-of-00002.tfrecord"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    train = ["experiments.train", f"--dataset=tfrecord:{tmp_path / 'data'}", "--model=mlp",
             "--epochs=1", "--global_batch_size=8", "--shuffle_buffer=0"]  # fmt: skip
    result = run_module(
        "tools.launch", "--workers", "2", "--max_restarts", "2", "--", sys.executable, "-m",
        *train, f"--model_dir={tmp_path / 'corrupt'}",
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 2 and "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "] error:" in line]
    # The worker reading that shard names it; its peer, sharded onto the other file, reports
    # losing it (restartable on its own): the usage error decides for the job.
    assert any(str(shard) in e and "--skip_corrupt" in e for e in errors), errors
    assert out.count("[launch] starting") == 1, out[-3000:]  # not restarted
    assert "[launch] not restarting: " in out
    result = run_module(*train, "--skip_corrupt")
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = rf'skipped \d+ unreadable record\(s\) of 24 in "{re.escape(str(shard))}"'
    assert len(re.findall(skipped, result.stderr + result.stdout)) == 1, result.stderr[-3000:]


def test_image_folder_mistakes_end_with_one_error_line(tmp_path, capsys):
    write_png_folder(tmp_path / "mixed", {"a": [(8, 8), (8, 8)], "b": [(9, 8)]})
    (tmp_path / "broken" / "a").mkdir(parents=True)
    (tmp_path / "broken" / "a" / "x.png").write_bytes(b"not a png")
    (tmp_path / "empty").mkdir()
    write_png_folder(tmp_path / "colours", {"a": [(8, 8)]})
    import tensorflow as tf

    (tmp_path / "colours" / "b").mkdir()
    rgb = tf.io.encode_png(np.zeros((8, 8, 3), np.uint8)).numpy()
    (tmp_path / "colours" / "b" / "0.png").write_bytes(rgb)
    for folder, message in [
        ("colours", "b/0.png has 3 colour channel(s), but the first image had 1"),
        ("mixed", "b/0.png is 9x8, but the first image was 8x8: every image of a dataset"),
        ("broken", "Cannot decode"),
        ("empty", "holds no images in class sub-folders"),
    ]:
        code, _, errors = convert(
            capsys, f"--source=images:{tmp_path / folder}", "--split=all",
            f"--out_dir={tmp_path / 'out'}",
        )  # fmt: skip
        assert code == 2 and len(errors) == 1 and message in errors[0], errors


def test_the_binary_names_a_tfrecord_dir_without_a_test_split(tmp_path, capsys):
    np.savez(tmp_path / "d.npz", image=np.zeros((10, 4, 4), np.uint8), label=np.arange(10) % 2)
    code, _, errors = convert(capsys, f"--source=npz:{tmp_path / 'd.npz'}", f"--out_dir={tmp_path}")
    assert code == 0, errors
    result = run_module("experiments.train", f"--dataset=tfrecord:{tmp_path}", "--epochs=1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {tmp_path} has no test split (test.meta.json). Write each with python -m "
        f"tools.make_tfrecords --source ... --split test --out_dir {tmp_path}. Received: "
        f"--dataset=tfrecord:{tmp_path}"
    ], result.stderr[-2000:]


def test_import_tfdist_makes_its_subpackages_usable():
    # In a fresh process: this one imported tfdist.data above.
    done = run_python(
        [sys.executable, "-c", "import tfdist; print(tfdist.data.tfrecord_dataset.__name__)"],
        timeout=120, fresh=True,
    )  # fmt: skip
    assert done.stdout.strip() == "tfrecord_dataset", done.stderr[-2000:]

"""The evaluator task: evaluates each checkpoint beside training, skips bad ones, and stops.

The in-process tests evaluate the checkpoints of a short one-device run; the multi-process
test runs two training workers and the evaluator through tools.launch and the binary.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys

import numpy as np
import pytest

import tfdist
from tests.conftest import run_module
from tfdist.app import TrainConfig, Trainer
from tfdist.app.evaluator import (
    EvaluatorError,
    EvaluatorTimeoutError,
    evaluate_checkpoints,
)

# One worker runs this module: its tests share costly module fixtures.

# Four steps, a checkpoint after each; the manager keeps the newest three (steps 2, 3, 4).
SHORT = dict(model="mlp", epochs=1, steps_per_epoch=4, checkpoint_every=1, eval_every=0)


@pytest.fixture(scope="module")
def data_dir(digits_dir):
    return digits_dir


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):
    """A finished run's model_dir, and the eval accuracy its trainer reported."""
    model_dir = str(tmp_path_factory.mktemp("trained"))
    config = TrainConfig(data_dir=data_dir, model_dir=model_dir, **SHORT)
    result = Trainer(config, strategy=tfdist.build_strategy("one_device", cluster=None)).fit()
    return model_dir, result


@pytest.fixture
def run_dir(trained, tmp_path):
    """A copy of the finished run that a test may damage."""
    copy = tmp_path / "run"
    shutil.copytree(trained[0], copy)
    return copy


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_skips_a_partial_and_a_vanished_checkpoint_and_stops_at_the_final_step(
    run_dir, trained, data_dir, caplog
):
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("*.index")) == [
        "ckpt-2.index", "ckpt-3.index", "ckpt-4.index",
    ]  # fmt: skip
    data = next(checkpoints.glob("ckpt-2.data-*"))
    with open(data, "r+b") as f:  # a half-written checkpoint
        f.truncate(os.path.getsize(data) // 2)
    for path in checkpoints.glob("ckpt-3.*"):  # deleted by the trainer before it was read
        path.unlink()
    config = TrainConfig(data_dir=data_dir, model_dir=str(run_dir), **SHORT)

    with caplog.at_level(logging.INFO, logger="tfdist"):
        records = evaluate_checkpoints(config, poll_seconds=0.1, timeout_seconds=30)

    warnings = [  # ours only: TensorFlow may warn of retracing in the same window
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("tfdist")
    ]
    assert len(warnings) == 2, warnings
    assert re.match(r"Skipping checkpoint .*ckpt-2: it cannot be read, it is partial", warnings[0])
    assert re.match(r"Skipping checkpoint .*ckpt-3: it disappeared", warnings[1])
    assert [r.step for r in records] == [4]
    assert "Evaluated up to the final step 4" in caplog.text
    # The trainer's own evaluation of the same weights, up to float summation order.
    # The same examples counted: the trainer's Keras metric is float32, the evaluator's a
    # float64 ratio, hence 1e-7 and not 0.
    assert records[0].eval_accuracy == pytest.approx(trained[1].eval_accuracy, abs=1e-7)
    assert records[0].eval_loss == pytest.approx(trained[1].eval_loss, rel=1e-5)
    lines = read_jsonl(run_dir / "eval.jsonl")
    assert lines == [
        {
            "step": 4,
            "eval_loss": records[0].eval_loss,
            "eval_accuracy": records[0].eval_accuracy,
            "checkpoint": str(checkpoints / "ckpt-4"),
        }
    ]
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "logs/eval").iterdir())

    # A restarted evaluator finds step 4 in eval.jsonl and evaluates nothing twice; a line
    # its predecessor was killed in the middle of is removed, so the file stays JSON lines.
    with open(run_dir / "eval.jsonl", "a") as f:
        f.write('{"step": 9, "eval_lo')
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        assert evaluate_checkpoints(config, poll_seconds=0.1, timeout_seconds=30) == []
    assert "Removed 1 line(s) of" in caplog.text and '{"step": 9, "eval_lo' in caplog.text
    assert read_jsonl(run_dir / "eval.jsonl") == lines


def test_evaluates_a_run_on_a_non_local_filesystem(trained, data_dir):
    # ram://, one of TensorFlow's own filesystems, stands for gs://: every read and write of
    # model_dir goes through tf.io.gfile.
    import tensorflow as tf

    model_dir = f"ram://tfdist-eval-{os.getpid()}/run"
    for local in tf.io.gfile.glob(os.path.join(trained[0], "*")):  # copy the finished run
        for directory, _, files in tf.io.gfile.walk(local):
            target = model_dir + directory[len(trained[0]) :]
            tf.io.gfile.makedirs(target)
            for name in files:
                tf.io.gfile.copy(os.path.join(directory, name), f"{target}/{name}")
    config = TrainConfig(data_dir=data_dir, model_dir=model_dir, **SHORT)
    records = evaluate_checkpoints(config, poll_seconds=0.1, timeout_seconds=30)
    assert [r.step for r in records] == [2, 3, 4]
    assert records[-1].eval_accuracy == pytest.approx(trained[1].eval_accuracy, abs=1e-7)
    with tf.io.gfile.GFile(f"{model_dir}/eval.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [2, 3, 4]
    assert tf.io.gfile.glob(f"{model_dir}/logs/eval/events.out.tfevents.*")
    # A restarted evaluator reads eval.jsonl back from there and evaluates nothing twice.
    assert evaluate_checkpoints(config, poll_seconds=0.1, timeout_seconds=30) == []


def test_an_empty_model_dir_times_out_with_a_clear_message(tmp_path, data_dir):
    config = TrainConfig(data_dir=data_dir, model_dir=str(tmp_path / "nothing"), **SHORT)
    with pytest.raises(
        EvaluatorTimeoutError,
        match=r"No new checkpoint in .*nothing/checkpoints for 2 s \(0 evaluated here, none "
        r"seen yet; the run ends at step 4\)\. Check that the training tasks are running .* "
        r"Received: timeout_seconds=2",
    ):
        evaluate_checkpoints(config, poll_seconds=0.2, timeout_seconds=2)
    assert not (tmp_path / "nothing").exists()  # the evaluator wrote nothing


def test_a_finished_run_ends_the_evaluation_before_the_step_it_expected(run_dir, data_dir):
    # The evaluator thinks the run has 10 steps; the chief's summary.json says it ended.
    config = TrainConfig(
        data_dir=data_dir, model_dir=str(run_dir), **{**SHORT, "steps_per_epoch": 10}
    )
    records = evaluate_checkpoints(config, poll_seconds=0.1, timeout_seconds=30)
    assert [r.step for r in records] == [2, 3, 4]


def test_a_summary_of_another_epoch_count_does_not_end_the_evaluation(run_dir, data_dir):
    # A run resumed with more epochs: the summary.json of its first part is not the end.
    config = TrainConfig(data_dir=data_dir, model_dir=str(run_dir), **{**SHORT, "epochs": 3})
    with pytest.raises(EvaluatorTimeoutError, match=r"3 evaluated here, the newest at step 4"):
        evaluate_checkpoints(config, poll_seconds=0.1, timeout_seconds=1)


def test_a_checkpoint_of_another_model_is_an_error(run_dir, data_dir):
    config = TrainConfig(data_dir=data_dir, model_dir=str(run_dir), **{**SHORT, "model": "cnn"})
    with pytest.raises(
        EvaluatorError,
        match=r"ckpt-2 does not hold the model the evaluator built \(model='cnn' on 'digits'\)"
        r".* Run the evaluator with the same model and dataset flags",
    ):
        evaluate_checkpoints(config, poll_seconds=0.1, timeout_seconds=5)


def test_the_binary_on_the_evaluator_task_exits_1_when_no_checkpoint_comes(tmp_path, data_dir):
    # The workers' addresses lead nowhere: the evaluator must not try to reach them, even
    # with --strategy=multi_worker_mirrored on its command line.
    tf_config = {
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "evaluator": ["127.0.0.1:3"]},
        "task": {"type": "evaluator", "index": 0},
    }
    result = run_module(
        "experiments.train", "--strategy=multi_worker_mirrored", "--model=mlp",
        "--eval_timeout=1", "--eval_poll_seconds=0.2", f"--data_dir={data_dir}",
        f"--model_dir={tmp_path}", env={"TF_CONFIG": json.dumps(tf_config)}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: No new checkpoint in"), errors


def load_weights(path):
    saved = np.load(path)
    return [saved[name] for name in saved.files]


@pytest.mark.multiprocess
def test_evaluator_task_evaluates_every_checkpoint_of_a_multi_worker_run(data_dir, tmp_path):
    def launch(name, *launch_flags):
        return run_module(
            "tools.launch", "--workers", "2", *launch_flags, "--timeout", "240", "--",
            sys.executable, "-m", "experiments.train", "--strategy=multi_worker_mirrored",
            "--model=mlp", "--epochs=2", "--eval_every=0", "--checkpoint_every=30",
            "--eval_poll_seconds=0.2", "--eval_timeout=120", f"--data_dir={data_dir}",
            f"--model_dir={tmp_path / name}", f"--save_weights_to={tmp_path / name / 'weights'}",
            timeout=300,
        )  # fmt: skip

    result = launch("with", "--evaluator")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[launch] evaluator:0 exit 0" in result.stdout
    model_dir = tmp_path / "with"
    # 22 steps an epoch: checkpoints at the epoch ends and at step 30, all three kept.
    saved = [int(s) for s in re.findall(r"\[worker:0\] .*Saved checkpoint .*ckpt-(\d+)$",
                                        result.stdout, re.M)]  # fmt: skip
    assert saved == [22, 30, 44]
    evals = read_jsonl(model_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == saved
    assert all(e["checkpoint"].endswith(f"ckpt-{e['step']}") for e in evals)
    accuracies = [e["eval_accuracy"] for e in evals]
    assert accuracies[-1] > 0.9 and accuracies[0] > 0.5, accuracies  # measured: .90 .92 .97
    assert any(
        p.name.startswith("events.out.tfevents") for p in (model_dir / "logs/eval").iterdir()
    )
    assert "evaluated 3 checkpoint(s); the last, step 44" in result.stdout

    # The chief reports the same final accuracy, and training did not see the evaluator.
    with open(model_dir / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 44 and summary["replicas"] == 2
    assert summary["eval_accuracy"] == pytest.approx(accuracies[-1], abs=1e-7)  # float32 metric
    assert sorted(os.listdir(model_dir / "weights")) == ["worker_0.npz", "worker_1.npz"]
    alone = launch("without")
    assert alone.returncode == 0, alone.stdout[-3000:]
    for worker in ("worker_0.npz", "worker_1.npz"):
        a = load_weights(model_dir / "weights" / worker)
        b = load_weights(tmp_path / "without" / "weights" / worker)
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))

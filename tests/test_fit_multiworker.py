"""tfdist.fit with real processes: multi_worker_mirrored and parameter_server jobs.

The tests launch tests/workers/fit_worker.py — a user's own script — through tools.launch,
then check what every task wrote against Keras's own model.fit on one device. Starting a
job costs more than most of what it trains, so the checks that need the same layout and no
fault share one job (the `two_workers` and `parameter_servers` fixtures), which runs their
modes one after another.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

import tfdist
from tests import custom_step_models, fit_models
from tests.conftest import REPO, run_module
from tfdist.exit_codes import EXIT_PREEMPTED
from tools import keras_io_models

pytestmark = pytest.mark.multiprocess

WEIGHTS_TOLERANCE = 1e-5
LOGS_TOLERANCE = 1e-4


def launch(mode: str, out, *layout: str) -> str:
    result = run_module(
        "tools.launch", *layout, "--timeout", "280", "--",
        sys.executable, "-m", "tests.workers.fit_worker", mode, str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return result.stdout


def written(out, task: str, name: str) -> tuple[list[np.ndarray], dict]:
    arrays = np.load(out / task / f"{name}.npz")
    weights = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    return weights, json.loads((out / task / f"{name}.json").read_text())


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def references():
    """Keras's own fit and evaluate on one device, per case."""
    return fit_models.keras_references()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """One job of 2 workers (multi_worker_mirrored) running the modes these tests check:
    (the directory each mode wrote to, by mode; the job's output)."""
    out = tmp_path_factory.mktemp("two_workers")
    modes = ("equivalence", "callbacks", "custom", "batch_norm", "dropin", "keras_io", "per_call")
    output = launch(",".join(modes), out, "--workers", "2")
    return {mode: out / mode for mode in modes}, output


@pytest.fixture(scope="module")
def parameter_servers(tmp_path_factory):
    """One parameter-server job (a chief, 3 workers, 2 ps) running the user model and the
    custom steps: (the directory each mode wrote to, by mode; the job's output)."""
    out = tmp_path_factory.mktemp("parameter_servers")
    modes = ("ps", "custom_ps", "dropin_ps")
    output = launch(",".join(modes), out, "--chief", "--workers", "3", "--ps", "2")
    return {mode: out / mode for mode in modes}, output


@pytest.mark.xdist_group("fit_two_workers")
def test_two_workers_match_keras_on_one_device(references, two_workers):
    tmp_path = two_workers[0]["equivalence"]
    for name, (weights, history, evaluation) in references.items():
        for task in ("worker_0", "worker_1"):
            got, logs = written(tmp_path, task, name)
            assert max_diff(got, weights) <= WEIGHTS_TOLERANCE, (name, task)
            for key, values in history.items():
                np.testing.assert_allclose(logs["history"][key], values, atol=LOGS_TOLERANCE)
            for key, value in evaluation.items():
                assert logs["evaluate"][key] == pytest.approx(value, abs=LOGS_TOLERANCE)


@pytest.mark.xdist_group("fit_two_workers")
def test_many_steps_a_call_on_two_workers_train_what_one_step_a_call_trains(
    references, two_workers
):
    tmp_path = two_workers[0]["per_call"]
    for task in ("worker_0", "worker_1"):
        one, one_logs = written(tmp_path, task, "cnn_1")
        assert max_diff(one, references["cnn"][0]) <= WEIGHTS_TOLERANCE, task
        for steps in (4, "auto"):
            got, logs = written(tmp_path, task, f"cnn_{steps}")
            assert max_diff(got, one) <= 1e-6, (task, steps)
            for key, values in one_logs["history"].items():
                np.testing.assert_allclose(logs["history"][key], values, atol=1e-6)


@pytest.mark.xdist_group("fit_two_workers")
def test_two_workers_train_keras_io_s_masked_and_embedded_models_as_one_device(two_workers):
    """keras.io's seq2seq Transformer (its loss masked by the padding: each worker holds its
    own count of tokens) and ViT (its position Embedding's rows, AdamW) across two worker
    processes: one device's weights and losses (tests/test_one_device_math.py's figures)."""
    tmp_path = two_workers[0]["keras_io"]
    for name, (make, data) in keras_io_models.ONE_DEVICE_MATH.items():
        reference = make()
        history = reference.fit(data(), epochs=2, verbose=0, shuffle=False).history
        for task in ("worker_0", "worker_1"):
            got, logs = written(tmp_path, task, name)
            diff = keras_io_models.max_diff(reference, got)
            assert diff <= WEIGHTS_TOLERANCE, (name, task, diff)
            np.testing.assert_allclose(logs["history"]["loss"], history["loss"], atol=1e-5)


@pytest.mark.xdist_group("fit_two_workers")
def test_the_multi_worker_tutorial_s_model_fit_with_the_one_line_trains_as_tfdist_fit(
    two_workers,
):
    """The tensorflow.org multi-worker tutorial's script, with `tfdist.patch_keras()` added:
    its model.fit, evaluate and predict give what tfdist's own calls give, on both workers."""
    tmp_path = two_workers[0]["dropin"]
    want, want_logs = written(tmp_path, "worker_0", "tfdist")
    for task in ("worker_0", "worker_1"):
        got, logs = written(tmp_path, task, "dropin")
        assert max_diff(got, want) <= WEIGHTS_TOLERANCE, task
        assert logs["history"] == pytest.approx(want_logs["history"]), task
        assert logs["history"]["loss"][-1] < logs["history"]["loss"][0]
        predicted_rows = logs["evaluate"].pop("predicted_rows")
        assert predicted_rows == 128  # one global batch, every row on every worker
        assert logs["evaluate"] == pytest.approx(want_logs["evaluate"]), task
        assert "multi_worker_mirrored across worker processes" in logs["without"]
        assert "tfdist.patch_keras()" in logs["without"]
        # Keras's own predict (not guarded: it works there) gives every row on every worker,
        # as tfdist.predict does.
        assert logs["keras_predict"]["rows"] == 128, logs["keras_predict"]
        assert logs["keras_predict"]["diff"] <= 1e-6, logs["keras_predict"]
        # model.save on one path from both workers: written once, by the chief.
        assert logs["opened_for_writing"] == (1 if task == "worker_0" else 0), task
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert max_diff(loaded.get_weights(), written(tmp_path, "worker_0", "dropin")[0]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.keras", "worker_0", "worker_1"]


@pytest.mark.xdist_group("fit_two_workers")
def test_callbacks_stop_together_and_only_the_chief_writes(two_workers):
    tmp_path = two_workers[0]["callbacks"]
    (_, chief), (_, other) = (written(tmp_path, t, "cnn") for t in ("worker_0", "worker_1"))
    epochs = len(chief["history"]["loss"])
    assert 1 < epochs < 20  # EarlyStopping ended it, on both workers at the same epoch
    assert chief == other
    shared = tmp_path / "shared"
    assert sorted(p.name for p in shared.glob("ckpt-*")) == [
        f"ckpt-{e:02d}.weights.h5" for e in range(1, epochs + 1)
    ]
    # CSVLogger appends: a second writer would have doubled the rows.
    rows = (shared / "log.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + epochs
    assert rows[0].split(",") == ["epoch", "accuracy", "loss", "val_accuracy", "val_loss"]
    for part in ("train", "validation", "step_time"):  # step_time: tfdist's breakdown
        assert len(list((shared / "tb" / part).glob("events.out.tfevents.*"))) == 1
    # ModelCheckpoint(verbose=1) speaks for the chief's writes only: worker 1 writes into
    # scratch, silently.
    output = two_workers[1]
    saying = [x for x in output.splitlines() if "saving model to" in x]
    assert saying and all(x.startswith("[worker:0] ") for x in saying), saying
    assert "tfdist-worker-" not in output


@pytest.mark.xdist_group("fit_parameter_servers")
def test_parameter_server_trains_a_user_model(parameter_servers):
    # 3 workers and 2 ps: the model's variables are whole (below ps_min_shard_bytes), placed
    # round-robin on the two ps tasks.
    tmp_path, output = parameter_servers[0]["ps"], parameter_servers[1]
    _, logs = written(tmp_path, "chief_0", "mlp")
    assert logs["evaluate"]["accuracy"] > 0.6  # ten classes: chance is 0.1
    # tfdist.predict reads the weights from the ps: its argmax gives evaluate's accuracy.
    assert logs["evaluate"]["predicted_accuracy"] == pytest.approx(
        logs["evaluate"]["accuracy"], abs=1e-6
    )
    assert logs["history"]["loss"][-1] < logs["history"]["loss"][0]
    assert "val_accuracy" in logs["history"]
    assert "parameter_server test accuracy" in output
    # A second fit traces nothing new and counts on from the first's 4 x 40 updates, as
    # Keras's does (a schedule would otherwise start again).
    assert logs["evaluate"]["first_traces"] > 0
    assert logs["evaluate"]["second_fit_traces"] == 0
    assert logs["evaluate"]["iterations"] == 5 * 40
    assert logs["evaluate"]["second_fit_loss"] < logs["history"]["loss"][0]
    # The default bound (max_staleness=0) holds in it too: its tickets count from 0 again.
    assert logs["history"]["staleness_max"] == [0] * 4
    assert logs["evaluate"]["second_fit_staleness_max"] == 0
    assert logs["evaluate"]["zero2"].startswith(
        "shard_optimizer='zero2' works on the steps of a synchronous strategy"
    ), logs["evaluate"]["zero2"]


def test_variables_split_across_ps_tasks_train_and_back_up(tmp_path):
    """experiments/own_model's 590 KB kernel is split over 2 ps: it trains shard by shard,
    BackupAndRestore writes the whole variables each epoch, and the model learns."""
    result = run_module(
        "tools.launch", "--chief", "--workers", "2", "--ps", "2", "--timeout", "200", "--",
        sys.executable, "-m", "experiments.own_model", f"--backup_dir={tmp_path / 'backup'}",
    )  # fmt: skip
    assert "[launch] chief:0 exit 0" in result.stdout, result.stdout[-3000:]
    assert re.search(
        r"\[chief:0\].*sequential/dense/kernel \(589,824 bytes\) is split across the ps tasks "
        r"in 2 shards of 576/576 rows",
        result.stdout,
    ), result.stdout[-3000:]
    accuracy = float(re.search(r"\[chief:0\] test loss \S+, test accuracy (\S+)", result.stdout)[1])
    assert accuracy > 0.6  # ten classes: chance is 0.1
    assert "Traceback" not in result.stdout


@pytest.mark.xdist_group("fit_two_workers")
def test_custom_steps_on_two_workers_match_keras_under_mirrored(two_workers):
    """The keras.io custom-step model and a step with its own keys, on 2 worker processes,
    against Keras's own fit under mirrored over 2 replicas (the same batches)."""
    tmp_path = two_workers[0]["custom"]
    for name in custom_step_models.CASES:
        strategy = tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:0", "/cpu:1"])
        with strategy.scope():
            model, data = custom_step_models.CASES[name]()
        batches = custom_step_models.BatchLogs()
        history = model.fit(data, epochs=custom_step_models.EPOCHS, verbose=0, callbacks=[batches])
        evaluation = model.evaluate(data, verbose=0, return_dict=True)
        for task in ("worker_0", "worker_1"):
            got, logs = written(tmp_path, task, name)
            assert max_diff(got, model.get_weights()) <= WEIGHTS_TOLERANCE, (name, task)
            for key, values in history.history.items():
                np.testing.assert_allclose(logs["history"][key], values, atol=WEIGHTS_TOLERANCE)
            assert len(logs["batches"]) == len(batches.batches)
            for got_batch, want in zip(logs["batches"], batches.batches, strict=True):
                assert set(got_batch) == set(want)
                for key, value in want.items():
                    assert got_batch[key] == pytest.approx(value, abs=WEIGHTS_TOLERANCE)
            for key, value in evaluation.items():
                assert logs["evaluate"][key] == pytest.approx(value, abs=WEIGHTS_TOLERANCE)


@pytest.mark.xdist_group("fit_parameter_servers")
def test_the_parameter_server_tutorial_s_model_fit_with_the_one_line_trains(parameter_servers):
    """3 workers and 2 ps: the tutorial's model.fit(dataset_fn, epochs, steps_per_epoch),
    with `tfdist.patch_keras()` added, trains through tfdist.fit (which Keras 3 cannot run)."""
    _, logs = written(parameter_servers[0]["dropin_ps"], "chief_0", "dropin")
    losses = logs["history"]["loss"]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert {"accuracy", "staleness_max"} <= set(logs["history"])  # tfdist's record of the run


@pytest.mark.xdist_group("fit_parameter_servers")
def test_custom_steps_run_under_parameter_server(parameter_servers):
    """3 workers and 2 ps: the model's own train_step runs on the workers (its tracker and
    its step counter move), its own keys reach the history and the batch logs."""
    tmp_path = parameter_servers[0]["custom_ps"]
    _, keras_io = written(tmp_path, "chief_0", "keras_io")
    assert set(keras_io["history"]) >= {"loss", "mae"}
    assert keras_io["history"]["loss"][-1] < keras_io["history"]["loss"][0]
    assert set(keras_io["evaluate"]) == {"loss", "mae"}
    _, own = written(tmp_path, "chief_0", "own_keys")
    assert set(own["history"]) >= {"mae_loss", "custom_step"}
    assert own["history"]["mae_loss"][0] > 0  # the step's own tracker was updated
    assert own["history"]["custom_step"][-1] > own["history"]["custom_step"][0] > 0
    assert len(own["batches"]) == 16
    assert all(batch["mae_loss"] > 0 for batch in own["batches"])  # never the zeros of no step


def test_a_model_made_outside_the_scope_is_one_line_and_not_restarted(tmp_path):
    """Each worker would train a model of its own: refused before any step, exit 2, one
    line per worker, no traceback, and the launcher does not restart a usage error."""
    result = run_module(
        "tools.launch", "--workers", "2", "--max_restarts", "2", "--timeout", "200", "--",
        sys.executable, "-m", "tests.workers.fit_worker", "outside_scope", str(tmp_path),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if "error: Model " in line]
    assert len(errors) == 2, output[-3000:]
    for index in range(2):
        assert re.search(
            rf"\[worker:{index}\] error: Model 'sequential\S*' was created outside any "
            rf"strategy's scope, but this process is worker:{index} of a multi_worker_mirrored "
            r"job \(2 workers, from the TF_CONFIG environment variable\)",
            output,
        ), output[-3000:]
    assert "Traceback" not in output
    assert "restarting" not in output.lower().replace("not restarting", "")


@pytest.mark.xdist_group("fit_two_workers")
def test_batch_norm_moving_statistics_are_one_model_on_every_worker(two_workers):
    """Unsynchronised BatchNormalization keeps a copy per replica; tfdist warns once and
    averages them at every epoch end, so both workers save and evaluate the same model."""
    tmp_path, output = two_workers[0]["batch_norm"], two_workers[1]
    (chief, chief_logs), (other, other_logs) = (
        written(tmp_path, task, "batch_norm") for task in ("worker_0", "worker_1")
    )
    assert max_diff(chief, other) == 0.0  # moving statistics included
    assert chief_logs == other_logs
    # tfdist.predict on each worker: every prediction, in order, from the one model.
    plain, data = fit_models.batch_norm()
    plain.set_weights(chief)
    want = plain.predict(data, verbose=0)
    for task in ("worker_0", "worker_1"):
        np.testing.assert_allclose(np.load(tmp_path / task / "predictions.npy"), want, atol=1e-6)
    for task in ("worker:0", "worker:1"):
        warnings = re.findall(
            rf"\[{task}\] .*BatchNormalization layer\(s\) with synchronized=False", output
        )
        assert len(warnings) == 1, output[-3000:]
    spreads = [
        float(s)
        for s in re.findall(
            r"\[worker:0\] .*averaged over 2 replicas \(largest spread between them: (\S+)\)",
            output,
        )
    ]
    assert len(spreads) >= 2 and max(spreads) > 0  # the copies had drifted apart


def test_sigterm_in_a_users_script_backs_up_at_that_step_and_the_rerun_resumes_there(
    references, tmp_path
):
    """A user's fit script with BackupAndRestore (save_freq="epoch"): SIGTERM to worker:1 in
    epoch 2 makes both workers back up at the same step and exit 42; the launcher's restart
    resumes at that step and ends on the weights of Keras's uninterrupted fit."""
    result = run_module(
        "tools.launch", "--workers", "2", "--max_restarts", "1", "--timeout", "280", "--",
        sys.executable, "-m", "tests.workers.stop_worker", "sigterm", str(tmp_path),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    stopped = re.search(r"\[worker:1\] preempted: SIGTERM at step (\d+); backup saved in", output)
    assert stopped, output[-4000:]
    step = int(stopped.group(1))
    assert 8 + 3 <= step < 16  # in epoch 2, at or after the signal's batch
    assert f"[worker:0] preempted: SIGTERM at step {step}" in output  # the same step
    assert re.search(
        rf"worker:\d was preempted \(state saved, exit code {EXIT_PREEMPTED}\)", output
    )
    assert f"Resuming from the backup at epoch 2, step {step - 8} of 8" in output
    assert "Traceback" not in output
    for task in ("worker_0", "worker_1"):
        arrays = np.load(tmp_path / task / "cnn.npz")
        got = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
        assert max_diff(got, references["cnn"][0]) <= WEIGHTS_TOLERANCE


@pytest.mark.parametrize("layout", ["zero3", "pipeline"])
def test_a_killed_shard_or_stage_is_one_line_and_the_restart_equals_the_uninterrupted_run(
    references, tmp_path, layout
):
    """Under zero3 (each process holds half of every weight) or a 2-stage pipeline (a stage
    each), worker:1 is SIGKILLed at step 11 of 16: worker:0 stops with one line naming it
    and the checkpoint a restart resumes from; the restarted job resumes at step 10 and ends
    on the weights of Keras's uninterrupted fit on one device."""
    done = subprocess.run(
        [
            sys.executable, "-m", "tools.launch", "--workers", "2", "--grace", "120",
            "--max_restarts", "1", "--timeout", "400", "--",
            sys.executable, "-m", "tests.workers.stop_worker", f"sigkill_{layout}", str(tmp_path),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=450,
        env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "[launch] worker:1 was killed by SIGKILL" in output, output[-6000:]
    lines = [line for line in output.splitlines() if line.startswith("[worker:0] error:")]
    assert len(lines) == 1 and "Lost worker:1" in lines[0], output[-4000:]
    assert "resumes from" in lines[0] and lines[0].count("ckpt-10") == 1, lines[0]
    assert "Traceback" not in output
    assert output.count("Restored ") == 2 and "ckpt-10" in output.split("Restored ")[1]
    for task in ("worker_0", "worker_1"):
        arrays = np.load(tmp_path / task / "cnn.npz")
        got = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
        assert max_diff(got, references["cnn"][0]) <= WEIGHTS_TOLERANCE, task


def test_a_killed_worker_is_one_line_on_the_survivor_and_the_restart_resumes_its_backup(
    references, tmp_path
):
    """worker:1 is SIGKILLed mid-epoch 2; worker:0, blocked in the step's all-reduce, stops
    within a minute with one line naming worker:1 and the restartable code, no traceback;
    the launcher restarts the job, which resumes from the backup taken every step (at the
    crash's step) and ends on the weights of Keras's uninterrupted fit."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tools.launch", "--workers", "2", "--grace", "120",
            "--max_restarts", "1", "--timeout", "380", "--",
            sys.executable, "-m", "tests.workers.stop_worker", "sigkill", str(tmp_path),
        ],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
    )  # fmt: skip
    arrived: list[tuple[float, str]] = []  # (when, line), read as the launcher prints them
    reader = threading.Thread(
        target=lambda: arrived.extend((time.monotonic(), line) for line in proc.stdout)
    )
    reader.start()
    marker = tmp_path / "shared" / "signalled"
    while not marker.exists() and proc.poll() is None and time.monotonic() - started < 240:
        time.sleep(0.05)
    killed_at = time.monotonic()
    proc.wait(timeout=360)
    reader.join(timeout=30)
    output = "".join(line for _, line in arrived)
    assert marker.exists(), output[-4000:]
    assert proc.returncode == 0, output[-4000:]
    assert "[launch] worker:1 was killed by SIGKILL" in output
    lines = [line for line in output.splitlines() if line.startswith("[worker:0] error:")]
    assert len(lines) == 1 and "Lost worker:1" in lines[0], output[-4000:]
    assert "Traceback" not in output
    # The first attempt ended by itself (the launcher's SIGTERM found worker:0 blocked in the
    # all-reduce) within a minute, before the launcher's 120 s grace ran out.
    assert re.search(r"\[launch\] worker:0 (stopped|exit 1)$", output, re.M), output[-4000:]
    restarted = [t for t, line in arrived if line.startswith("[launch] starting 2 tasks")]
    assert len(restarted) == 2 and restarted[1] - killed_at < 60, output[-4000:]
    assert "Resuming from the backup at epoch 2, step 3 of 8" in output, output[-4000:]
    for task in ("worker_0", "worker_1"):
        arrays = np.load(tmp_path / task / "cnn.npz")
        got = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
        assert max_diff(got, references["cnn"][0]) <= WEIGHTS_TOLERANCE, task

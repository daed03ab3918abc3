"""Parameter-server training under real process deaths: a killed worker is survived, a killed
ps ends the job with one explained error, and a restart resumes from the last checkpoint.

Every job runs through tools.launch and the training binary; the test kills the task's real
process (found by its TF_CONFIG among the launcher's children) with SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorflow as tf

from tests.conftest import REPO, task_pid
from tfdist.training.faults import ClusterTaskFailed, explain_cluster_error, lost_worker

STEPS = 360  # ~6 s of mlp steps on 2 workers: long enough to kill something mid-way
CHECKPOINT_EVERY = 40


def train_argv(model_dir: Path, data_dir: str, *launch_flags: str, workers: int = 2) -> list[str]:
    return [
        sys.executable, "-m", "tools.launch", "--chief", "--workers", str(workers), "--ps", "1",
        "--timeout", "240", *launch_flags, "--",
        "python", "-m", "experiments.train", "--strategy=parameter_server", "--model=mlp",
        "--epochs=2", f"--steps_per_epoch={STEPS // 2}", "--eval_every=0",
        f"--checkpoint_every={CHECKPOINT_EVERY}", "--optimizer=sgd", "--learning_rate=0.05",
        f"--data_dir={data_dir}", f"--model_dir={model_dir}",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(digits_dir):
    return digits_dir


def kill_after_first_checkpoint(proc: subprocess.Popen, model_dir: Path, task: str) -> float:
    """SIGKILLs `task` once training has checkpointed; returns when (monotonic seconds).
    A checkpoint counts once the manager's state file names it: its `.index` appears while
    it is still being written (a ps killed then is a case of its own, not tested here)."""
    deadline = time.monotonic() + 180
    log = model_dir.parent / f"{model_dir.name}.log"  # where both callers write the job's
    while not (model_dir / "checkpoints" / "checkpoint").exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"the job ended (exit {proc.returncode}) before its first checkpoint:\n"
                + log.read_text()[-4000:]
            )
        assert time.monotonic() < deadline, (
            "no checkpoint within 180 s:\n" + log.read_text()[-4000:]
        )
        time.sleep(0.05)
    assert not (model_dir / "summary.json").exists()
    pid = task_pid(proc.pid, task)
    assert pid is not None, f"no process plays {task}"
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def run_and_kill(model_dir: Path, data_dir: str, task: str, *launch_flags: str):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    log_path = model_dir.parent / f"{model_dir.name}.log"
    model_dir.mkdir()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            train_argv(model_dir, data_dir, *launch_flags),
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            killed_at = kill_after_first_checkpoint(proc, model_dir, task)
            proc.wait(timeout=200)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, log_path.read_text(), time.monotonic() - killed_at


def read_summary(model_dir: Path) -> dict:
    return json.loads((model_dir / "summary.json").read_text())


# What the coordinator raised from fetch() when this test's ps was killed (abridged).
PS_GONE = (
    "Graph execution error:\n\n2 root error(s) found.\n  (0) UNAVAILABLE:  failed to connect to "
    "all addresses; last error: UNKNOWN: ipv4:127.0.0.1:49365: Failed to connect to remote host: "
    "Connection refused\n  (1) CANCELLED:  Function was cancelled before it was started"
)
CLUSTER = {
    "chief": ["127.0.0.1:49360"],
    "worker": ["127.0.0.1:49363", "127.0.0.1:4936"],
    "ps": ["127.0.0.1:49364", "127.0.0.1:49365"],
}


@pytest.mark.parametrize(
    ("error", "task"),
    [
        (tf.errors.UnavailableError(None, None, PS_GONE), "ps:1"),
        (tf.errors.AbortedError(None, None, "from remote target /job:ps/replica:0/task:0"), "ps:0"),
        (tf.errors.CancelledError(None, None, "cancelled"), None),
    ],
)
def test_a_cluster_error_names_the_task_and_where_a_restart_resumes(error, task):
    explained = explain_cluster_error(
        error, cluster=CLUSTER, step=130, total_steps=600, checkpoint_step=100,
        checkpoint_dir="/runs/a/checkpoints",
    )  # fmt: skip

    assert isinstance(explained, ClusterTaskFailed) and explained.exit_code == 1
    assert explained.task == task
    message = str(explained)
    assert message.startswith(f"parameter server {task} is unreachable" if task else "a parameter")
    assert (
        "stopped after scheduling step 130 of 600; the last checkpoint in /runs/a/checkpoints is "
        "at step 100, where a restart resumes (30 steps are run again)"
    ) in message
    assert "\n" not in message and "--max_restarts" in message
    assert "Received: " + type(error).__name__ in message
    if task == "ps:1":
        assert message.endswith("Received: UnavailableError: (0) UNAVAILABLE:  failed to connect "
                                "to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:49365: "
                                "Failed to connect to remote host: Connection refused")  # fmt: skip


def test_other_errors_are_left_alone():
    error = tf.errors.InvalidArgumentError(None, None, "bad shape")
    assert explain_cluster_error(
        error, cluster=CLUSTER, step=1, total_steps=2, checkpoint_step=None, checkpoint_dir=None
    ) is None  # fmt: skip


@pytest.mark.multiprocess
def test_a_worker_that_never_starts_and_one_killed_later_are_survived(data_dir, tmp_path):
    """3 workers: worker:2 exits the moment it starts, so the chief starts with the other two
    and names the missing one; worker:1 is SIGKILLed after the first checkpoint. worker:0
    trains on to every step: the dead worker's closures are run again."""
    model_dir, log_path = tmp_path / "run", tmp_path / "run.log"
    model_dir.mkdir()
    argv = train_argv(model_dir, data_dir, workers=3)
    split = argv.index("--") + 1  # every task runs the binary, but worker:2 exits at once
    argv[split:split] = ["python", "-m", "tests.workers.fail_as", "worker:2", "--"]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"},
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        # Timed from the chief's first line of tfdist's, as it looks for its peers (its
        # start-up before is the host's load: under two fault loops a forked chief's runtime
        # took 30 s to start after TensorFlow's first line).
        chief_started, named = None, None
        while proc.poll() is None and named is None:
            text = log_path.read_text()
            if chief_started is None and re.search(r"\[chief:0\] [\d:]+ \w+ tfdist: ", text):
                chief_started = time.monotonic()
            if re.search(
                # the list may name worker:1 too, if it is still starting
                r"\[chief:0\].* waiting up to 15 s more for .*worker:2",
                text,
            ):
                named = time.monotonic() - (chief_started or time.monotonic())
            time.sleep(0.1)
        killed_at = kill_after_first_checkpoint(proc, model_dir, "worker:1")
        proc.wait(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log_path.read_text()
    assert proc.returncode == 0, output[-3000:]
    # The chief names the missing worker as soon as it has the others, within 30 s of its
    # first wait (under two fault loops at once, 30 s from the launch was start-up alone).
    assert chief_started is not None and named is not None and named < 30, output[-3000:]
    assert re.search(
        r"Starting parameter-server training with 2 of 3 workers: worker:2 \(\S+\) did not start",
        output,
    )
    assert (
        "[launch] worker:2 failed with exit code 3; parameter-server training continues" in output
    )
    assert "[launch] worker:1 was killed by SIGKILL; parameter-server training continues on " in (
        output
    )
    assert "the program finished despite losing worker:1" in output
    summary = read_summary(model_dir)
    # The step counter lives on the coordinator: the dead worker's closures were re-run.
    assert summary["steps"] == STEPS, summary
    assert summary["resumed_from_step"] == 0
    # At most the closure that was running when the worker died is applied twice.
    assert STEPS <= summary["applied_updates"] <= STEPS + 1, summary
    repeated = summary["applied_updates"] - STEPS
    assert (f"{repeated} update(s) reached the parameters twice" in output) == (repeated > 0)
    assert 0 <= summary["staleness_mean"] <= summary["staleness_max"], summary
    assert "Traceback" not in output
    print(f"finished {time.monotonic() - killed_at:.1f} s after the kill; summary {summary}")


@pytest.mark.multiprocess
def test_a_killed_ps_ends_the_attempt_with_one_message_and_the_restart_resumes(data_dir, tmp_path):
    model_dir = tmp_path / "run"

    code, output, _ = run_and_kill(model_dir, data_dir, "ps:0", "--max_restarts", "1")

    assert code == 0, output[-3000:]
    errors = re.findall(r"\[chief:0\] error: (.*)", output)
    assert len(errors) == 1, output[-3000:]
    match = re.match(
        r"parameter server ps:0 is unreachable, and parameter-server training cannot continue "
        r"without the variables it holds\. Training stopped after scheduling step (\d+) of "
        rf"{STEPS}; the last checkpoint in \S+ is at step (\d+), where a restart resumes "
        r"\(\d+ steps are run again\)\. Restart the job .* Received: \w+Error: ",
        errors[0],
    )
    assert match, errors[0]
    stopped, checkpoint = int(match.group(1)), int(match.group(2))
    assert 0 < checkpoint <= stopped < STEPS
    assert "Traceback" not in output
    assert "[launch] ps:0 was killed by SIGKILL; parameter-server training cannot continue" in (
        output
    )
    assert "[launch] ps:0 failed with exit code 137 (SIGKILL); restarting the job" in output
    summary = read_summary(model_dir)
    # The checkpoint named, unless the ps died while the next one was being written and that
    # one still came out complete.
    assert checkpoint <= summary["resumed_from_step"] <= stopped, summary
    assert summary["steps"] == STEPS, summary


# What fetch() raised on the chief for a step that had finished on worker:1, killed since.
RESULT_LOST = (
    "2 root error(s) found.\n  (0) UNAVAILABLE: {{function_node __wrapped__Identity_device_/job:"
    "chief/replica:0/task:0/device:CPU:0}} recvmsg:Connection reset by peer\nAdditional GRPC "
    "error information from remote target /job:worker/replica:0/task:1 while calling "
    "/tensorflow.eager.EagerService/Enqueue:"
)


@pytest.mark.parametrize(
    ("message", "worker"),
    [(RESULT_LOST, "worker:1"), (PS_GONE, None), ("cancelled", None)],
)
def test_a_lost_result_of_a_dead_worker_is_told_apart_from_a_dead_ps(message, worker):
    error = tf.errors.UnavailableError(None, None, message)
    assert lost_worker(error, cluster=CLUSTER) == worker

"""Storage faults end a job in one line on every task and lose nothing; one job per model_dir.

Real faults on real filesystems: a small tmpfs filled mid-run and a model_dir made read-only
mid-run (both in a user and mount namespace of the test's own, where an unprivileged process
may mount), and a file-size limit set on a running process (prlimit). Each job is two worker
processes under tfdist-launch (the file-size one a single process), and each resume is held
to an uninterrupted run's weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO, run_python
from tfdist.exit_codes import EXIT_STORAGE
from tools.chaos import running_tasks

pytestmark = pytest.mark.multiprocess
TOLERANCE = 1e-5


def _namespaces_allowed() -> bool:
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(
    not _namespaces_allowed(), reason="this host allows no unprivileged user and mount namespaces"
)


def train(model_dir, data_dir, weights_dir, *, workers: int = 2, epochs: int = 3) -> list[str]:
    """The binary under tfdist-launch: 2 workers, checkpoints every 5 of 66 steps."""
    binary = [
        sys.executable, "-m", "experiments.train", "--model=mlp", f"--epochs={epochs}",
        "--checkpoint_every=5", "--eval_every=0", "--seed=3", f"--data_dir={data_dir}",
        f"--model_dir={model_dir}", f"--save_weights_to={weights_dir}",
    ]  # fmt: skip
    if workers == 1:
        return [*binary, "--strategy=one_device"]
    return [sys.executable, "-m", "tfdist.launch", "--workers", str(workers), "--max_restarts",
            "2", "--", *binary, "--strategy=multi_worker_mirrored"]  # fmt: skip


def _env() -> dict[str, str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    return env


@pytest.fixture(scope="module")
def data_dir(digits_dir):
    return digits_dir


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    """The 2-worker run nothing stops: its chief's weights."""
    here = tmp_path_factory.mktemp("uninterrupted")
    whole = run_python(train(here / "run", data_dir, here / "w"), env=_env(), timeout=400)
    assert whole.returncode == 0, whole.stdout[-3000:]
    return _weights(here / "w" / "worker_0.npz")


def _weights(path) -> list[np.ndarray]:
    with np.load(path) as saved:
        return [saved[k] for k in saved.files]


def _in_namespace(script: str, tmp_path) -> subprocess.CompletedProcess:
    """Runs a bash script as root of a user and mount namespace of its own."""
    path = tmp_path / "script.sh"
    path.write_text("set -u\n" + script)
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "bash", str(path)], cwd=REPO,
        env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _job_lines(output: str) -> dict[str, list[str]]:
    """Each task's `error:` lines, by task (the launcher prefixes them)."""
    lines: dict[str, list[str]] = {}
    for match in re.finditer(r"^\[(worker:\d)\] (error: .*)$", output, re.M):
        lines.setdefault(match[1], []).append(match[2])
    return lines


def _fault_then_resume(tmp_path, data_dir, fault: str, undo: str) -> tuple[str, str, str]:
    """A 2-worker job on a 64 MB tmpfs meets `fault` once ckpt-10 is written (the job's
    processes stopped meanwhile: the 66-step run takes a few seconds, and under load it
    ended before a fault made after it); then `undo`, and the same command again. Returns the first run's output, the second's, and the list
    of the checkpoint directory between them."""
    disk, run = tmp_path / "disk", tmp_path / "disk" / "run"
    disk.mkdir()
    command = shlex.join(train(run, data_dir, tmp_path / "w"))
    script = f"""
mount -t tmpfs -o size=64m tmpfs {disk}
{command} > {tmp_path}/first.log 2>&1 &
job=$!
until [ -e {run}/checkpoints/ckpt-10.index ] || ! kill -0 $job 2>/dev/null; do sleep 0.05; done
pkill -STOP -f -- "--model_dir={run}( |$)"  # the job waits while the fault is made
{fault}
pkill -CONT -f -- "--model_dir={run}( |$)"
wait $job; echo "first exit $?" >> {tmp_path}/first.log
ls -a {run}/checkpoints > {tmp_path}/listing
{undo}
{command} > {tmp_path}/second.log 2>&1
echo "second exit $?" >> {tmp_path}/second.log
cp -r {run} {tmp_path}/kept
"""
    done = _in_namespace(script, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = (tmp_path / "first.log").read_text(), (tmp_path / "second.log").read_text()
    return first, second, (tmp_path / "listing").read_text()


def _check_fault_and_resume(first, second, listing, cause: str, uninterrupted, tmp_path):
    assert f"first exit {EXIT_STORAGE}" in first, first[-3000:]
    errors = _job_lines(first)
    # One line on every task, naming the path and the cause.
    assert sorted(errors) == ["worker:0", "worker:1"], first[-3000:]
    for lines in errors.values():
        assert len(lines) == 1, lines
        # Whichever write met the fault first: a checkpoint, or the run's history beside it.
        written = r"Cannot write (the checkpoint \S+/checkpoints/ckpt-\d+|the run's history \S+)"
        assert re.search(written, lines[0]), lines[0]
        assert cause in lines[0] and "run the same command again" in lines[0], lines[0]
    assert "Traceback" not in first
    assert "not restarting: worker:" in first and "storage fault" in first
    assert "restarting the job" not in first
    # The half-written checkpoint is gone, or, where the fault also refused its removal (a
    # read-only remount after its directory was made), the warning says so and the resume
    # removes it. The one the chief's line names is still there.
    if "_temp" in listing:
        assert "Could not remove the half-written checkpoint" in first, (listing, first[-3000:])
        assert "Removed what an earlier run left of a checkpoint it could not finish" in second
    assert not list((tmp_path / "kept" / "checkpoints").glob("*_temp*"))
    named = re.search(r"resumes from \S+/(ckpt-\d+), the last complete", errors["worker:0"][0])
    if named is None:  # the history's line: "it resumes from the last checkpoint"
        assert "resumes from the last checkpoint" in errors["worker:0"][0], errors
        steps = [int(m) for m in re.findall(r"^ckpt-(\d+)\.index$", listing, re.M)]
        named = [None, f"ckpt-{max(steps)}"]
    assert f"{named[1]}.index" in listing.split(), (errors, listing)
    # The same command resumes there and ends where the uninterrupted run does.
    assert "second exit 0" in second, second[-3000:]
    assert "Restored " in second and f"{named[1]}" in second
    summary = json.loads((tmp_path / "kept" / "summary.json").read_text())
    assert summary["steps"] == 66 and summary["steps_trained"] == 66, summary
    assert summary["resume_points"] == [int(named[1].split("-")[1])], summary
    resumed = _weights(tmp_path / "w" / "worker_0.npz")
    assert (
        max(float(np.max(np.abs(a - b))) for a, b in zip(resumed, uninterrupted, strict=True))
        <= TOLERANCE
    )


# (the fault, its undoing, the cause the line names), in a shell inside the namespace.
MID_RUN_FAULTS = {
    "disk full": (
        "dd if=/dev/zero of={disk}/filler bs=1M count=100 2>/dev/null",
        "rm {disk}/filler",
        "no space left on the device",
    ),
    # A read-only mount of the model_dir over itself: what is opened from now on is
    # read-only (a remount of the tmpfs itself is refused while the job holds files open).
    "model_dir read-only": (
        "mount --bind {run} {run} && mount -o remount,bind,ro {run}",
        "umount {run}",
        "the filesystem is read-only",
    ),
}


@needs_namespaces
@pytest.mark.xdist_group("storage_uninterrupted")  # the uninterrupted job runs once
@pytest.mark.parametrize("fault", MID_RUN_FAULTS)
def test_a_fault_mid_run_is_one_line_on_every_task_and_the_resume_loses_nothing(
    tmp_path, data_dir, uninterrupted, fault
):
    disk = tmp_path / "disk"
    make, undo, cause = (text.format(disk=disk, run=disk / "run") for text in MID_RUN_FAULTS[fault])
    first, second, listing = _fault_then_resume(tmp_path, data_dir, fault=make, undo=undo)
    _check_fault_and_resume(first, second, listing, cause, uninterrupted, tmp_path)


def test_a_file_size_limit_met_mid_run_is_one_line_and_keeps_the_last_checkpoint(
    tmp_path, data_dir
):
    if subprocess.run(["prlimit", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no prlimit on this host")
    run = tmp_path / "run"
    proc = subprocess.Popen(train(run, data_dir, tmp_path / "w", workers=1), cwd=REPO,
                            env=_env(), stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "ckpt-10.index").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.02)
    # Files of the running process may grow no larger than 1 KB from now on.
    subprocess.run(["prlimit", f"--pid={proc.pid}", "--fsize=1024"], check=True)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_STORAGE, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "a file reached the file-size limit" in errors[0], stderr[-3000:]
    assert "ulimit -f" in errors[0] and "Traceback" not in stderr
    names = os.listdir(run / "checkpoints")
    assert not [n for n in names if "_temp" in n], names
    # ckpt-10's files may exist before its save is done: a limit met while it finishes
    # discards it (the one before stays), so the newest kept is 10 or 5, never less.
    kept = [int(n[5:-6]) for n in names if n.startswith("ckpt-") and n.endswith(".index")]
    assert max(kept) >= 5, names
    resumed = run_python(train(run, data_dir, tmp_path / "w", workers=1), env=_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == summary["steps_trained"] == 66
    assert summary["resumed_from_step"] == max(kept), (summary, names)


def _kill_job(launcher: subprocess.Popen) -> None:
    """SIGKILL to each task of the launcher's job (each has a session of its own), then to the
    launcher."""
    for pid in running_tasks(launcher.pid).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    launcher.kill()


def test_a_second_job_on_a_model_dir_is_refused_on_every_task_and_leaves_the_first_alone(
    tmp_path, data_dir
):
    """Job B on job A's model_dir: one line on each of its tasks, exit 74, no restart, and
    nothing of A's touched. (A dead job's lock taken over: tests/test_storage_causes.py, with
    a real process gone.)"""
    run = tmp_path / "run"
    # Job A: long enough to be running while job B starts.
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(train(run, data_dir, tmp_path / "wa", epochs=1000), cwd=REPO,
                                 env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "ckpt-5.index").exists():
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        lock = json.loads((run / "tfdist.lock").read_text())
        started = time.monotonic()
        second = run_python(train(run, data_dir, tmp_path / "wb", epochs=60), env=_env())
        assert second.returncode == EXIT_STORAGE, second.stdout[-3000:]
        errors = _job_lines(second.stdout)
        assert sorted(errors) == ["worker:0", "worker:1"], second.stdout[-3000:]
        for lines in errors.values():
            assert len(lines) == 1 and "is in use by another job" in lines[0], lines
            assert f"pid {lock['pid']}" in lines[0] and lock["host"] in lines[0], lines
        assert "Traceback" not in second.stdout
        assert "restarting the job" not in second.stdout
        assert time.monotonic() - started < 120
        assert first.poll() is None, log.read_text()[-3000:]  # job A trains on
        # B wrote nothing: the lock is A's, and B's weights folder was never made.
        assert json.loads((run / "tfdist.lock").read_text())["token"] == lock["token"]
        assert not (tmp_path / "wb").exists()
    finally:
        _kill_job(first)
        first.wait(timeout=60)


@needs_namespaces
def test_a_model_dir_read_only_from_the_start_is_one_line_on_every_task(tmp_path, data_dir):
    run = tmp_path / "disk" / "run"
    run.mkdir(parents=True)
    command = shlex.join(train(run, data_dir, tmp_path / "w"))
    done = _in_namespace(
        f"mount --bind {run} {run} && mount -o remount,bind,ro {run}\n"
        f'{command} > {tmp_path}/job.log 2>&1; echo "exit $?" >> {tmp_path}/job.log\n',
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    output = (tmp_path / "job.log").read_text()
    assert "exit 2" in output, output[-3000:]  # the chief's: the command names a bad model_dir
    errors = _job_lines(output)
    assert sorted(errors) == ["worker:0", "worker:1"], output[-3000:]
    assert "cannot be written" in errors["worker:0"][0] and "Read-only" in errors["worker:0"][0]
    # The other worker was building the model with the chief when it stopped.
    assert errors["worker:1"][0].startswith("error: Lost worker:0"), errors
    assert "Traceback" not in output and "restarting the job" not in output

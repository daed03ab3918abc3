"""What a failed write stands for, and model_dir's lock, in this process (the faults
themselves, on real filesystems and jobs, are tests/test_storage_faults.py)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from tfdist.exit_codes import EXIT_STORAGE, exit_code_for
from tfdist.storage import CAUSES, cause_of, fault
from tfdist.training import model_dir_lock
from tfdist.training.model_dir_lock import LOCK_FILE, ModelDirInUseError, hold, let_go

pytestmark = pytest.mark.fast


def _named(cause):
    return None if cause is None else cause.name


@pytest.mark.parametrize(
    "error, name",
    [
        # TensorFlow's local filesystem, as measured (tests/test_storage_faults.py).
        (tf.errors.ResourceExhaustedError(None, None, "ckpt-66_temp/part-00000; No space left "
                                          "on device [Op:SaveV2]"), "no space left on the device"),
        (tf.errors.PermissionDeniedError(None, None, "run/.tmp; Read-only file system"),
         "the filesystem is read-only"),
        (tf.errors.OutOfRangeError(None, None, "ckpt-20.data; File too large"),
         "a file reached the file-size limit"),
        # Python's own writes (Keras's export, the lock).
        (OSError(errno.ENOSPC, "No space left on device"), "no space left on the device"),
        (OSError(errno.EROFS, "Read-only file system"), "the filesystem is read-only"),
        (OSError(errno.EFBIG, "File too large"), "a file reached the file-size limit"),
        (PermissionError(errno.EACCES, "Permission denied"), "permission denied"),
        (FileNotFoundError(errno.ENOENT, "No such file"), "the directory vanished"),
        # Remote filesystems raise the same classes with their own words: the class decides.
        (tf.errors.ResourceExhaustedError(None, None, "gs://b/run: quota"),
         "no space left on the device"),
        (tf.errors.PermissionDeniedError(None, None, "gs://b/run: 403 Forbidden"),
         "permission denied"),
        (tf.errors.NotFoundError(None, None, "s3://b/run: NoSuchBucket"), "the directory vanished"),
        (tf.errors.UnavailableError(None, None, "gs://b/run: 503"),
         "the storage service did not answer"),
        # Not a storage fault: a bug or a mistake propagates as it is.
        (tf.errors.InvalidArgumentError(None, None, "shape mismatch"), None),
        (ValueError("no space left"), None),
        (OSError(errno.EBADF, "Bad file descriptor"), None),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else None,
)  # fmt: skip
def test_each_failed_write_stands_for_its_cause(error, name):
    assert _named(cause_of(error)) == name


def test_a_fault_is_one_line_and_says_whether_a_restart_helps():
    full, unanswered = CAUSES[0], CAUSES[-1]
    error = fault(full, what="checkpoint", path="/r/checkpoints/ckpt-20", resume="from ckpt-15")
    assert str(error) == (
        "Cannot write the checkpoint /r/checkpoints/ckpt-20: no space left on the device. "
        "Free space there, or give the job a larger disk; then run the same command again: "
        "it resumes from ckpt-15."
    )
    assert exit_code_for(error) == EXIT_STORAGE and not error.restartable
    passing = fault(unanswered, what="history", path="gs://b/r/history.jsonl", resume="there")
    assert passing.restartable and exit_code_for(passing) not in (0, EXIT_STORAGE)


def _lock_of(model_dir, **fields):
    now = time.time()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "parent_pid": 1,
              "started": now, "renewed": now, "token": "theirs", **fields}  # fmt: skip
    (model_dir / LOCK_FILE).write_text(json.dumps(record))


def test_the_lock_is_re_entrant_in_a_process_and_let_go_by_its_last_hold(tmp_path):
    hold(str(tmp_path))
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
    hold(str(tmp_path))  # StepCheckpoint and RunRecord of one fit
    let_go(str(tmp_path))
    assert (tmp_path / LOCK_FILE).exists()
    let_go(str(tmp_path))
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_live_job_s_lock_is_refused_and_a_dead_one_s_is_taken_over(tmp_path, caplog):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock_of(tmp_path, pid=alive.pid)
        with pytest.raises(
            ModelDirInUseError, match=rf"in use by another job \(host .*pid {alive.pid}"
        ):
            hold(str(tmp_path))
    finally:
        alive.kill()
        alive.wait()
    hold(str(tmp_path))  # its process is gone now
    try:
        assert "is no longer running" in caplog.text
        assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] != "theirs"
    finally:
        let_go(str(tmp_path))


def test_another_host_s_lock_is_refused_until_it_goes_stale(tmp_path, monkeypatch):
    _lock_of(tmp_path, host="elsewhere")
    with pytest.raises(ModelDirInUseError, match="host elsewhere"):
        hold(str(tmp_path))
    _lock_of(tmp_path, host="elsewhere", renewed=time.time() - 2 * model_dir_lock.STALE_SECONDS)
    hold(str(tmp_path))
    let_go(str(tmp_path))


def test_a_held_lock_is_renewed(tmp_path, monkeypatch):
    monkeypatch.setattr(model_dir_lock, "RENEW_SECONDS", 0.1)
    hold(str(tmp_path))
    try:
        first = json.loads((tmp_path / LOCK_FILE).read_text())["renewed"]
        time.sleep(0.5)
        assert json.loads((tmp_path / LOCK_FILE).read_text())["renewed"] > first
    finally:
        let_go(str(tmp_path))


def test_the_lock_makes_a_model_dir_that_is_not_there_yet(tmp_path):
    model_dir = str(tmp_path / "new" / "run")
    hold(model_dir)
    assert os.path.exists(os.path.join(model_dir, LOCK_FILE))
    let_go(model_dir)


def test_a_resume_removes_what_a_failed_save_could_not(tmp_path, caplog):
    """A save that failed on storage that then refused its clean-up too (a read-only
    remount) leaves ckpt-N_temp behind: the next run's restore removes it, and says so."""
    import logging

    from tfdist.training.checkpoints import CHECKPOINT_SUBDIR, Checkpoints

    left = tmp_path / CHECKPOINT_SUBDIR / "ckpt-22_temp"
    left.mkdir(parents=True)
    (left / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"half")
    checkpoints = Checkpoints(
        tf.train.Checkpoint(step=tf.Variable(0)), model_dir=str(tmp_path), is_chief=True,
        max_to_keep=2,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="tfdist"):
        assert checkpoints.restore_latest() is None  # nothing complete to resume
    assert not left.exists()
    assert "Removed what an earlier run left of a checkpoint it could not finish: ckpt-22_temp" in (
        caplog.text
    )

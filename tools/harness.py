"""What the benchmarks in tools/ share: a job through tfdist-launch, timed, and its summary;
medians over repeats; the CSV they write.

    job = harness.launch(["python", "-m", "tools.ps_bench", "--task"], layout=["--chief",
                         "--workers=1", "--ps=2"], timeout=600)
    summary = harness.train(["--strategy=parameter_server", "--epochs=3"],
                            layout=["--chief", "--workers=2", "--ps=1"], model_dir=d, timeout=600)
    harness.median(rows, "eval_accuracy")

A job runs from the repository root (the tools and experiments are run from the checkout),
without this process's TF_CONFIG and with TensorFlow's C++ logs quiet. A job that fails
raises JobFailed with the tail of its output: a benchmark never reports a failed run.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The last characters of a failed job's output that its error shows.
_TAIL = 3000


class JobFailed(RuntimeError):
    """A benchmark's job exited with an error (the message ends with its output's tail)."""


@dataclasses.dataclass(frozen=True)
class Job:
    """A finished job: its exit status, its output (stdout and stderr), its wall time."""

    returncode: int
    output: str
    seconds: float


def resident(field: str) -> int:
    """VmRSS (resident now) or VmHWM (its high-water mark) of this process, in bytes, from
    /proc/self/status; 0 where it has no such field."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def environment() -> dict[str, str]:
    """This process's environment for a job: no TF_CONFIG (the launcher sets each task's),
    TensorFlow's C++ logs at warnings and above."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run(command: Sequence[str], *, timeout: float | None = None, what: str = "the job") -> Job:
    """Runs `command` from the repository root and times it.

    Raises:
      JobFailed: it exited with an error (or ran past `timeout` seconds).
    """
    start = time.perf_counter()
    try:
        done = subprocess.run(
            list(command), cwd=REPO, env=environment(), capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise JobFailed(f"{what} ran past {timeout:.0f} s:\n{_text(e.stdout)[-_TAIL:]}") from None
    job = Job(done.returncode, done.stdout + done.stderr, time.perf_counter() - start)
    if job.returncode:
        raise JobFailed(f"{what} failed (exit {job.returncode}):\n{job.output[-_TAIL:]}")
    return job


def launch(
    task: Sequence[str],
    *,
    layout: Sequence[str],
    timeout: float | None = None,
    what: str = "the job",
) -> Job:
    """Runs `task` on every task of a local job that tfdist-launch starts with the flags
    `layout` (e.g. ["--chief", "--workers=2", "--ps=1"]); the launcher gives up after
    `timeout` seconds, and this waits a minute more for it to say so."""
    launcher = [sys.executable, "-m", "tfdist.launch", *layout]
    if timeout is not None:
        launcher.append(f"--timeout={timeout:g}")
    wait = None if timeout is None else timeout + 60
    return run([*launcher, "--", *task], timeout=wait, what=what)


def train(
    flags: Sequence[str],
    *,
    layout: Sequence[str],
    model_dir: str | os.PathLike,
    timeout: float | None = None,
    what: str = "the job",
) -> dict:
    """Trains once with experiments.train under tfdist-launch; returns the run's
    summary.json with the job's wall time added as `job_seconds`."""
    task = [sys.executable, "-m", "experiments.train", *flags, f"--model_dir={model_dir}"]
    job = launch(task, layout=layout, timeout=timeout, what=what)
    return {**read_summary(model_dir), "job_seconds": job.seconds}


def read_summary(model_dir: str | os.PathLike) -> dict:
    """The summary.json a training run wrote in `model_dir`."""
    return json.loads((Path(model_dir) / "summary.json").read_text())


def task_records(out: str | os.PathLike, tasks: int) -> list[dict]:
    """The task<i>.json each of a job's `tasks` worker tasks wrote in `out`, in task order."""
    return [json.loads((Path(out) / f"task{i}.json").read_text()) for i in range(tasks)]


def median(rows: Iterable[Mapping], key: str) -> float:
    """The median of `key` over `rows`."""
    return statistics.median(row[key] for row in rows)


def write_csv(
    path: str | os.PathLike, rows: Sequence[Mapping], columns: Sequence[str] | None = None
):
    """Writes `rows` to `path` as CSV, with `columns` (default: every key of the rows, in
    the order they first appear) in that order; keys of a row that are not columns are
    left out, and a column a row lacks is empty."""
    columns = list(columns or dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def keep_earlier(path: str | os.PathLike) -> Path | None:
    """An earlier run's file at `path` moved aside to the first free NAME.N.SUFFIX (a
    benchmark run again never overwrites what the last one recorded); its new path, or
    None where there was none."""
    path = Path(path)
    if not path.exists():
        return None
    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(kept)
    return kept


def _text(output) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


__all__ = [
    "REPO",
    "Job",
    "JobFailed",
    "environment",
    "keep_earlier",
    "launch",
    "median",
    "read_summary",
    "run",
    "train",
    "write_csv",
]

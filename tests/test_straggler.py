"""The launcher's straggler knob (tfdist/launch/straggler.py): real processes held up."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import run_module
from tfdist.launch.straggler import Straggle, Straggler, StragglerError, parse_pause, parse_slow

pytestmark = pytest.mark.fast

# Counts as fast as it can and prints the count every 10 ms.
COUNTER = (
    "import time\n"
    "n, last = 0, time.monotonic()\n"
    "while True:\n"
    "    n += 1\n"
    "    if time.monotonic() - last > 0.01:\n"
    "        print(n, flush=True); last = time.monotonic()\n"
)


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1].split()[0]


def test_the_knob_reads_task_factor_and_pause():
    assert parse_slow("worker:1=2") == Straggle("worker:1", factor=2.0)
    assert parse_pause("worker:2=20+5") == Straggle("worker:2", pause_at=20.0, pause_seconds=5.0)
    for bad in ("worker1=2", "worker:1=0.5", "worker:1"):
        with pytest.raises(StragglerError, match="--slow takes TASK=FACTOR"):
            parse_slow(bad)
    with pytest.raises(StragglerError, match="--pause takes TASK=AT\\+SECONDS"):
        parse_pause("worker:1=20")


def test_a_paused_process_stops_and_goes_on_and_is_never_left_stopped():
    proc = subprocess.Popen(
        [sys.executable, "-c", COUNTER], stdout=subprocess.DEVNULL, start_new_session=True
    )
    said = []
    try:
        straggler = Straggler(
            Straggle("worker:1", pause_at=0.2, pause_seconds=30),
            pid=lambda: proc.pid,
            say=said.append,
        )
        straggler.start()
        deadline = time.monotonic() + 10
        while state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert state(proc.pid) == "T"  # stopped, mid-pause
        straggler.stop()  # long before the pause would end
        assert state(proc.pid) in ("R", "S")
        assert said == ["worker:1 stopped for 30 s (--pause)", "worker:1 goes on"]
    finally:
        proc.kill()
        proc.wait()


def test_a_slowed_process_is_stopped_for_its_share_of_the_time():
    proc = subprocess.Popen(
        [sys.executable, "-c", COUNTER], stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        straggler = Straggler(Straggle("worker:1", factor=4), pid=lambda: proc.pid, say=print)
        straggler.start()
        samples = []
        for _ in range(100):
            samples.append(state(proc.pid) == "T")
            time.sleep(0.013)
        straggler.stop()
        # Stopped 75 ms of every 100: most samples find it stopped, some running.
        assert 0.5 < sum(samples) / len(samples) < 0.95, sum(samples)
        assert state(proc.pid) != "T"
    finally:
        proc.kill()
        proc.wait()


def test_a_straggler_must_be_a_task_of_the_job():
    result = run_module(
        "tools.launch", "--workers", "2", "--slow", "worker:2=2", "--", sys.executable, "-c", "0"
    )
    assert result.returncode == 2
    assert "--slow and --pause name a task of this job (worker:0, worker:1)" in result.stderr
    assert "Traceback" not in result.stderr

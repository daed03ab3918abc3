"""Shared test set-up: quiet TensorFlow, four logical CPUs, and helpers to run binaries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parents[1]
NUM_CPU_DEVICES = 4


def pytest_configure(config):
    # Logical devices can only be set before TensorFlow initialises its runtime, so the whole
    # session gets its four CPUs here, before any test touches TensorFlow.
    from tfdist.devices import configure_cpu_devices

    configure_cpu_devices(NUM_CPU_DEVICES)


def run_module(
    module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Runs `python -m module args...` from the repository root and captures its output."""
    full_env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def task_pid(launcher_pid: int, task: str) -> int | None:
    """The pid of the launcher's child that plays `task` ("worker:1"), from its TF_CONFIG.

    Fault tests kill that real process; None while the launcher has not started it.
    """
    task_type, index = task.split(":")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        for variable in environ:
            if variable.startswith(b"TF_CONFIG="):
                role = json.loads(variable[len(b"TF_CONFIG=") :])["task"]
                if role == {"type": task_type, "index": int(index)}:
                    return int(entry.name)
    return None

"""tfdist.this_task and friends: this process's place in the job, read from the environment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import tfdist
from tests.conftest import REPO

pytestmark = pytest.mark.fast

SYNC = {"chief": ["h:1"], "worker": ["h:2", "h:3"]}
PS = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4", "h:5"]}


@pytest.mark.parametrize(
    "cluster, task, expected",
    [
        (SYNC, ("chief", 0), ("chief", 0, 0, 3, True)),
        (SYNC, ("worker", 1), ("worker", 1, 2, 3, False)),
        ({"worker": ["h:1", "h:2"]}, ("worker", 0), ("worker", 0, 0, 2, True)),
        ({"worker": ["h:1", "h:2"]}, ("worker", 1), ("worker", 1, 1, 2, False)),
        (PS, ("chief", 0), ("chief", 0, None, 2, True)),
        (PS, ("worker", 1), ("worker", 1, 1, 2, False)),
        (PS, ("ps", 1), ("ps", 1, None, 2, False)),
        ({**SYNC, "evaluator": ["h:9"]}, ("evaluator", 0), ("evaluator", 0, None, 3, False)),
    ],
)
def test_this_task_reads_the_cluster(monkeypatch, cluster, task, expected):
    tf_config = {"cluster": cluster, "task": {"type": task[0], "index": task[1]}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    info = tfdist.this_task()
    assert (info.type, info.index, info.rank, info.num_workers, info.is_chief) == expected
    assert tfdist.is_chief() is expected[4]
    assert tfdist.num_workers() == expected[3]


def test_a_process_on_its_own_is_the_only_worker_and_chief(no_tf_config):
    assert tfdist.this_task() == tfdist.TaskInfo("worker", 0, 0, 1, True)
    assert tfdist.num_replicas() == 1


QUIET = """
import logging, tfdist
tfdist.setup_logging(quiet_workers=True)
print("printed", flush=True)
logging.getLogger("tfdist.test").info("an info line")
logging.getLogger("tfdist.test").error("an error line")
"""


@pytest.mark.parametrize("index, shown", [(0, True), (1, False)])
def test_quiet_workers_leaves_the_chief_alone_and_keeps_errors(index, shown):
    tf_config = {"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": index}}
    result = subprocess.run(
        [sys.executable, "-c", QUIET], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"TF_CONFIG": json.dumps(tf_config), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert ("printed" in result.stdout) is shown
    assert ("an info line" in result.stderr) is shown
    assert "an error line" in result.stderr

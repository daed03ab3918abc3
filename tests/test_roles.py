"""Server roles of a parameter-server cluster: a real server process, stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tfdist.cluster import parse_tf_config
from tfdist.roles import is_server_role, serve_if_needed

PS_CLUSTER = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}


@pytest.mark.parametrize(
    "cluster, task, serves",
    [
        (PS_CLUSTER, ("ps", 0), True),
        (PS_CLUSTER, ("worker", 0), True),
        (PS_CLUSTER, ("chief", 0), False),
        ({**PS_CLUSTER, "evaluator": ["127.0.0.1:4"]}, ("evaluator", 0), False),
        ({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, ("worker", 1), False),
    ],
)
def test_server_roles(cluster, task, serves):
    info = parse_tf_config({"cluster": cluster, "task": {"type": task[0], "index": task[1]}})
    assert is_server_role(info) is serves


def test_program_roles_return_at_once(no_tf_config):
    assert serve_if_needed() is False
    chief = parse_tf_config({"cluster": PS_CLUSTER, "task": {"type": "chief", "index": 0}})
    assert serve_if_needed(chief) is False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ps_task_serves_until_sigterm():
    port = free_port()
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": [f"127.0.0.1:{port}"]}
    env = {
        **os.environ,
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}}),
    }
    code = "import tfdist, sys; served = tfdist.serve_if_needed(); print('served', served)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the server accepts connections once it is up
            assert proc.poll() is None, proc.stdout.read()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail("the ps server never listened on its port")
        time.sleep(1.5)  # past the installation of the signal handlers
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert "served True" in output

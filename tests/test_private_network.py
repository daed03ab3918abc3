"""tfdist-launch --private_network: TensorFlow's task servers listen on every interface of the
host whatever TF_CONFIG names (its server has no bind address); in a job's own network
namespace they are out of every other process's reach. Read from the listening sockets of a
running 2-worker job, inside each task and outside it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.workers.listen_worker import listening_ports

pytestmark = pytest.mark.multiprocess
EVERY_INTERFACE = {"00000000", "00000000000000000000000000000000"}  # 0.0.0.0, [::]


def _namespaces_allowed() -> bool:
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--net", "true"], capture_output=True, check=False
    )
    return probe.returncode == 0


@pytest.mark.parametrize("private", [False, True], ids=["host network", "private network"])
def test_task_servers_are_out_of_reach_only_in_the_jobs_own_network(tmp_path, private):
    if private and not _namespaces_allowed():
        pytest.skip("this host does not allow unprivileged user and network namespaces")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tfdist.launch", *(["--private_network"] * private),
         "--workers", "2", "--", "python", "-m", "tests.workers.listen_worker", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        files = [tmp_path / f"listen_{i}.json" for i in range(2)]
        deadline = time.monotonic() + 180
        while not all(f.exists() for f in files):
            if launcher.poll() is not None or time.monotonic() > deadline:
                launcher.kill()
                pytest.fail(launcher.communicate()[0][-3000:])
            time.sleep(0.2)
        outside = listening_ports()
        records = [json.loads(f.read_text()) for f in files]
        for record in records:
            assert record["total"] == 2.0  # the two tasks reached each other
            port = str(int(record["address"].rsplit(":", 1)[1]))
            # Inside the task's own network: TensorFlow's server, on every interface.
            assert record["ports"].get(port) in EVERY_INTERFACE, record
            # Outside: the same port, reachable from the host's network, or not there at all.
            if private:
                assert int(port) not in outside, (port, outside.get(int(port)))
            else:
                assert outside.get(int(port)) in EVERY_INTERFACE, (port, outside)
    finally:
        (tmp_path / "done").touch()
        output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, output[-3000:]

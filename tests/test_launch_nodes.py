"""tfdist-launch across hosts: --nnodes / --node_rank / --master_addr, tried on loopback.

Two launchers stand for two hosts: each starts its own tasks, node 0 gathers both nodes'
addresses, and every task gets one TF_CONFIG naming the whole job.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.conftest import REPO, free_ports
from tfdist.launch.rendezvous import Master, Offer, RendezvousError, join

TIMEOUT = 300


def start_node(
    rank: int, port: int, *flags: str, command: list[str], nnodes: int = 2
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tfdist.launch", "--nnodes", str(nnodes), "--node_rank", str(rank),
         "--master_addr", f"127.0.0.1:{port}", *flags, "--", *command],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(*nodes: subprocess.Popen) -> list[tuple[int, str]]:
    """(exit code, output) of each node; none is left running, whatever happens."""
    results = []
    try:
        for node in nodes:
            output, _ = node.communicate(timeout=TIMEOUT)
            results.append((node.returncode, output))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    return results


def test_two_nodes_agree_on_one_cluster():
    """--dry_run on both nodes: the same cluster, node 0's workers first, global indices."""
    (port,) = free_ports(1)
    command = ["python", "train.py"]
    # The same flags on every node: --chief puts the chief on node 0.
    flags = ("--workers", "2", "--chief", "--dry_run", "--rdzv_timeout", "60")
    node1 = start_node(1, port, *flags, command=command)
    node0 = start_node(0, port, *flags, command=command)
    (code0, out0), (code1, out1) = finish(node0, node1)
    assert code0 == code1 == 0, out0 + out1
    configs = {}
    for output in (out0, out1):
        for line in output.splitlines():
            if line.startswith("TF_CONFIG="):
                config = json.loads(line.split("'")[1])
                configs[f"{config['task']['type']}:{config['task']['index']}"] = config
    assert sorted(configs) == ["chief:0", "worker:0", "worker:1", "worker:2", "worker:3"]
    clusters = {json.dumps(c["cluster"], sort_keys=True) for c in configs.values()}
    assert len(clusters) == 1  # every task sees the same cluster
    assert "node 0 of 2 joined the job: 1 chief, 4 workers" in out0
    assert "# worker:2" in out1 and "# worker:3" in out1 and "# chief:0" in out0


def test_nodes_started_differently_both_stop_within_seconds_with_one_line():
    """Node 1 offers --workers 3, node 0 has --workers 2: node 0's rendezvous refuses it and
    ends itself, long before the default --rdzv_timeout (600 s)."""
    (port,) = free_ports(1)
    command = ["python", "train.py"]
    start = time.monotonic()
    node1 = start_node(1, port, "--workers", "3", "--dry_run", command=command)
    node0 = start_node(0, port, "--workers", "2", "--dry_run", command=command)
    (code0, out0), (code1, out1) = finish(node0, node1)
    assert time.monotonic() - start < 10, out0 + out1
    mismatch = (
        "tfdist-launch: error: node 1 was started with --workers 3 --chief False --evaluator "
        "False, node 0 with --workers 2 --chief False --evaluator False: start every node "
        "with the same layout flags"
    )
    for code, output in ((code0, out0), (code1, out1)):
        assert code == 2, output
        assert output.strip().splitlines()[-1] == mismatch, output
    assert "[launch] node 1: waiting for node 0 at --master_addr 127.0.0.1:" in out1


@pytest.mark.parametrize("first", ["refused node", "node 0"])
def test_a_refusal_reaches_node_0_whichever_offer_comes_first(first):
    """The race the subprocess test above cannot steer: when the refused offer reaches the
    master before node 0's own, node 0 still hears the refusal at once (it waited out
    --rdzv_timeout before)."""
    (port,) = free_ports(1)
    flags = {"workers": 2, "chief": False, "evaluator": False}
    master = Master(("127.0.0.1", port), 2, flags)
    master.start()
    refused = Offer(1, 2, {**flags, "workers": 3}, {"worker": ["127.0.0.1:1"] * 3})
    mine = Offer(0, 2, flags, {"worker": ["127.0.0.1:4", "127.0.0.1:5"]})
    offers = [refused, mine] if first == "refused node" else [mine, refused]
    heard = {}
    start = time.monotonic()
    try:
        joins = [threading.Thread(target=_join_into, args=(heard, port, offer)) for offer in offers]
        for thread in joins:
            thread.start()
            time.sleep(0.2)  # the order the parameter names
        for thread in joins:
            thread.join(20)
    finally:
        master.close()
    assert time.monotonic() - start < 10
    assert heard.keys() == {0, 1}
    assert all("node 1 was started with --workers 3" in line for line in heard.values()), heard


def _join_into(heard: dict, port: int, offer: Offer) -> None:
    try:
        join(("127.0.0.1", port), offer, timeout=15, say=lambda line: None)
    except RendezvousError as error:
        heard[offer.node_rank] = str(error)


def test_a_waiting_node_names_the_nodes_it_waits_for():
    (port,) = free_ports(1)
    command = ["python", "train.py"]
    flags = ("--workers", "1", "--dry_run", "--rdzv_timeout", "4")
    nodes = [start_node(r, port, *flags, command=command, nnodes=3) for r in (0, 1)]
    for rank, (code, output) in enumerate(finish(*nodes)):
        assert code == 2, output
        assert f"[launch] node {rank}: joined node 0 at 127.0.0.1:{port}; waiting for node(s) 2 " \
            "of --nnodes 3" in output, output  # fmt: skip
        assert f"node {rank} found no complete job" in output, output


@pytest.mark.multiprocess
def test_two_launchers_train_the_weights_of_one_launcher_with_four_workers(tmp_path):
    """2 hosts x 2 workers (two launchers on loopback) against --workers 4 on one."""
    command = ["python", "-m", "tests.workers.fit_worker", "cnn"]
    one = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--workers", "4", "--",
         *command, str(tmp_path / "one")],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert one.returncode == 0, one.stdout[-3000:]
    (port,) = free_ports(1)
    nodes = [
        start_node(rank, port, "--workers", "2", command=[*command, str(tmp_path / "nodes")])
        for rank in (1, 0)
    ]
    for code, output in finish(*nodes):
        assert code == 0, output[-3000:]
    for index in range(4):
        got = np.load(tmp_path / "nodes" / f"worker_{index}" / "cnn.npz")
        want = np.load(tmp_path / "one" / f"worker_{index}" / "cnn.npz")
        for name in want.files:
            np.testing.assert_allclose(got[name], want[name], atol=1e-6)


def test_node_0_closing_at_once_still_answers_every_node():
    """Node 0's launcher closes the master as soon as its own answer comes, and may exit next
    (--dry_run does): close() returns only once node 1 has its answer too. A launcher that
    exited first left node 1 retrying until --rdzv_timeout."""
    (port,) = free_ports(1)
    flags = {"workers": 1, "chief": False, "evaluator": False}
    master = Master(("127.0.0.1", port), 2, flags)
    master.start()
    node1 = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        node1.sendall(Offer(1, 2, flags, {"worker": ["127.0.0.1:2"]}).to_json().encode() + b"\n")
        mine = Offer(0, 2, flags, {"worker": ["127.0.0.1:1"]})
        cluster = join(("127.0.0.1", port), mine, timeout=20, say=lambda line: None)
        master.close()
        assert not master._thread.is_alive()
        lines = node1.makefile()
        answer = json.loads(lines.readline())
        while "waiting" in answer:  # told node 0 was missing, before it joined
            answer = json.loads(lines.readline())
    finally:
        node1.close()
    assert answer == {"cluster": cluster} == {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}}

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
from tfdist.launch.rendezvous import Master, Offer, RendezvousError, join, sign, verified

TIMEOUT = 300
TOKEN = "the-jobs-token"


def start_node(
    rank: int, port: int, *flags: str, command: list[str], nnodes: int = 2, token: str = TOKEN
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tfdist.launch", "--nnodes", str(nnodes), "--node_rank", str(rank),
         "--master_addr", f"127.0.0.1:{port}", *(["--rdzv_token", token] if token else []),
         *flags, "--", *command],
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
    master = Master(("127.0.0.1", port), 2, flags, TOKEN, say=lambda line: None)
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
        join(("127.0.0.1", port), offer, token=TOKEN, timeout=15, say=lambda line: None)
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
    master = Master(("127.0.0.1", port), 2, flags, TOKEN, say=lambda line: None)
    master.start()
    node1 = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        lines = node1.makefile()
        nonce = offer_on(node1, lines, Offer(1, 2, flags, {"worker": ["127.0.0.1:2"]}))
        mine = Offer(0, 2, flags, {"worker": ["127.0.0.1:1"]})
        cluster = join(("127.0.0.1", port), mine, token=TOKEN, timeout=20, say=lambda line: None)
        master.close()
        assert not master._thread.is_alive()
        answer = json.loads(verified(TOKEN.encode(), nonce, lines.readline()))
        while "waiting" in answer:  # told node 0 was missing, before it joined
            answer = json.loads(verified(TOKEN.encode(), nonce, lines.readline()))
    finally:
        node1.close()
    assert answer == {"cluster": cluster} == {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}}


def offer_on(connection: socket.socket, lines, offer: Offer, token: str = TOKEN) -> str:
    """Answers node 0's challenge on `connection` with `offer` signed with `token`; returns
    the challenge (what node 0's answers are signed over)."""
    nonce = json.loads(lines.readline())["challenge"]
    message = sign(token.encode(), nonce, json.loads(offer.to_json()))
    connection.sendall(json.dumps(message).encode() + b"\n")
    return nonce


def test_strangers_can_neither_join_nor_end_nor_stall_the_job():
    """An unsigned offer in the old format (it used to end the job: 'workers: 3'), one
    signed with another token, and silent connections held open: none changes the cluster,
    ends the job or delays the genuine nodes, and the address is named once in the log."""
    (port,) = free_ports(1)
    flags = {"workers": 1, "chief": False, "evaluator": False}
    said = []
    master = Master(("127.0.0.1", port), 2, flags, TOKEN, say=said.append)
    master.start()
    strangers = []
    try:
        for _ in range(20):  # silent: they connect and send nothing, and stay
            strangers.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        forged = Offer(1, 2, {**flags, "workers": 3}, {"worker": ["127.0.0.1:40999"] * 3})
        unsigned = socket.create_connection(("127.0.0.1", port), timeout=10)
        unsigned.sendall(forged.to_json().encode() + b"\n")
        strangers.append(unsigned)
        wrong = socket.create_connection(("127.0.0.1", port), timeout=10)
        offer_on(wrong, wrong.makefile(), Offer(1, 2, flags, {"worker": ["127.0.0.1:40999"]}),
                 token="another-jobs-token")  # fmt: skip
        strangers.append(wrong)
        start = time.monotonic()
        results = {}

        def genuine(offer):
            results[offer.node_rank] = join(
                ("127.0.0.1", port), offer, token=TOKEN, timeout=20, say=lambda line: None
            )

        offers = [Offer(r, 2, flags, {"worker": [f"127.0.0.1:{2 + r}"]}) for r in (1, 0)]
        threads = [threading.Thread(target=genuine, args=(offer,)) for offer in offers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        took = time.monotonic() - start
    finally:
        for stranger in strangers:
            stranger.close()
        master.close()
    want = {"worker": ["127.0.0.1:2", "127.0.0.1:3"]}
    assert results == {0: want, 1: want}
    assert took < 3.0, took  # not the strangers' 5 s deadline, nor 20 of them in turn
    assert master.error is None
    assert len(said) == 1, said  # one line for the address, however many connections
    assert said[0].startswith("[launch] node 0: ignored a connection from 127.0.0.1")
    assert "--rdzv_token" in said[0]


def test_a_node_with_another_token_cannot_take_a_slot():
    (port,) = free_ports(1)
    flags = {"workers": 1, "chief": False, "evaluator": False}
    master = Master(("127.0.0.1", port), 2, flags, TOKEN, say=lambda line: None)
    master.start()
    results, errors = {}, {}

    def node(rank, token, timeout):
        offer = Offer(rank, 2, flags, {"worker": [f"127.0.0.1:{2 + rank}"]})
        try:
            results[(rank, token)] = join(
                ("127.0.0.1", port), offer, token=token, timeout=timeout, say=lambda line: None
            )
        except RendezvousError as error:
            errors[(rank, token)] = str(error)

    try:
        impostor = threading.Thread(target=node, args=(1, "guessed", 3))
        impostor.start()
        time.sleep(1.0)  # the impostor tries first, and keeps trying
        threads = [threading.Thread(target=node, args=(r, TOKEN, 20)) for r in (1, 0)]
        for thread in threads:
            thread.start()
        for thread in [impostor, *threads]:
            thread.join(25)
    finally:
        master.close()
    want = {"worker": ["127.0.0.1:2", "127.0.0.1:3"]}
    assert results == {(0, TOKEN): want, (1, TOKEN): want}
    assert "node 1 found no complete job" in errors[(1, "guessed")]
    assert "did not sign with this node's --rdzv_token" in errors[(1, "guessed")]


def test_node_0_makes_the_token_and_the_other_nodes_need_it():
    (port,) = free_ports(1)
    command = ["python", "train.py"]
    flags = ("--workers", "1", "--dry_run", "--rdzv_timeout", "30")
    alone = start_node(1, port, *flags, command=command, token="")
    ((code, output),) = finish(alone)
    assert code == 2, output
    assert output.strip().splitlines()[-1] == (
        "tfdist-launch: error: node 1 needs the job's token to join: pass node 0's "
        "--rdzv_token TOKEN (or set TFDIST_RDZV_TOKEN); node 0 prints it when it makes one. "
        "Received: no --rdzv_token and no TFDIST_RDZV_TOKEN"
    )
    node0 = start_node(0, port, *flags, command=command, token="")
    first = node0.stdout.readline()
    token = first.split("this job's token is ")[1].split(":")[0]
    assert f"--rdzv_token {token}" in first
    node1 = start_node(1, port, *flags, command=command, token=token)
    (code0, out0), (code1, out1) = finish(node0, node1)
    assert code0 == code1 == 0, out0 + out1
    assert "node 1 of 2 joined the job: 2 workers" in out1

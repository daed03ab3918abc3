"""Missing and lost peers: bounded start-up, errors naming the task, restarts to the same weights.

The multi-process tests start real training processes on loopback: a task whose peer never
starts, a peer killed (SIGKILL) or frozen (SIGSTOP) during training, and a worker killed at a
random step under `tools.launch --max_restarts`.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import REPO, free_ports, run_python, start_python, task_pid
from tfdist.app import TrainConfig, Trainer
from tfdist.cluster import parse_tf_config
from tfdist.peers import PeerError, explain_peer_error, wait_for_peers, wait_for_servers

TWO_WORKERS = {"cluster": {"worker": ["localhost:2001", "localhost:2002"]}}
WITH_CHIEF = {"cluster": {"chief": ["h0:2000"], "worker": ["h1:2001", "h2:2002"]}}
BARRIER = (
    "Barrier timed out. Id: [Init]Wait_for_all_tasks_to_register::0.\n"
    "# of tasks that reached the barrier: 1/2.\n"
    "The first task at the barrier: /job:worker/replica:0/task:0. Some timed out task names:\n"
    "/job:worker/replica:0/task:1\n"
)
HEARTBEAT = (
    "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks "
    "are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have "
    "crashed."
)
RESET = (
    "recvmsg:Connection reset by peer\nAdditional GRPC error information from remote target "
    "/job:worker/replica:0/task:1 while calling /tensorflow.WorkerService/RecvBuf:"
)


def cluster(spec, task_type="worker", index=0):
    return parse_tf_config({**spec, "task": {"type": task_type, "index": index}})


@pytest.mark.parametrize(
    "error, spec, task, starting, expected",
    [
        (
            tf.errors.DeadlineExceededError(None, None, BARRIER),
            TWO_WORKERS, ("worker", 0), True,
            r"^worker:1 \(localhost:2002\) did not join the job within 5 s \(worker:0 was waiting",
        ),
        (  # a task that cannot reach the leader hears only "Deadline Exceeded": name the leader
            tf.errors.DeadlineExceededError(None, None, "Deadline Exceeded"),
            WITH_CHIEF, ("worker", 1), True,
            r"^chief:0 \(h0:2000\) did not join the job within 5 s",
        ),
        (
            tf.errors.UnavailableError(None, None, HEARTBEAT),
            TWO_WORKERS, ("worker", 0), False,
            r"^Lost worker:1 \(localhost:2002\) during training: it stopped sending heartbeats",
        ),
        (
            tf.errors.UnavailableError(None, None, RESET),
            TWO_WORKERS, ("worker", 0), False,
            r"^Lost worker:1 \(localhost:2002\) during training: it closed its connection",
        ),
    ],
)  # fmt: skip
def test_errors_name_the_missing_task_and_its_address(error, spec, task, starting, expected):
    explained = explain_peer_error(
        error, cluster(spec, *task), starting=starting, startup_timeout=5.0
    )
    assert isinstance(explained, PeerError)
    assert re.search(expected, str(explained)), str(explained)


@pytest.mark.parametrize(
    "error, task",
    [
        (tf.errors.InvalidArgumentError(None, None, RESET), 0),  # not a peer-failure type
        (tf.errors.UnavailableError(None, None, "Socket closed"), 0),  # no task named
        (tf.errors.UnavailableError(None, None, RESET), 1),  # names only this task itself
    ],
)
def test_errors_that_are_not_about_a_peer_are_left_alone(error, task):
    assert explain_peer_error(error, cluster(TWO_WORKERS, "worker", task), starting=False) is None


@pytest.mark.parametrize(
    "options, message",
    [
        ({"startup_timeout": 0}, r"startup_timeout must be a positive number of seconds"),
        ({"heartbeat_timeout": -1.0}, r"heartbeat_timeout must be a positive number"),
    ],
)
def test_timeouts_are_validated(options, message):
    with pytest.raises(tfdist.StrategyError, match=message):
        tfdist.StrategyOptions(**options)


def test_timeouts_only_apply_to_multi_worker_mirrored():
    with pytest.raises(tfdist.StrategyError, match="Option startup_timeout does not apply"):
        tfdist.build_strategy("one_device", cluster=None, startup_timeout=5.0)


# --- real processes -----------------------------------------------------------------------


def test_a_parameter_server_chief_names_the_servers_that_do_not_answer():
    with socket.socket() as listening:
        listening.bind(("localhost", 0))
        listening.listen()
        (closed,) = free_ports(1)
        spec = {
            "cluster": {
                "chief": ["localhost:1"],
                "worker": [f"localhost:{listening.getsockname()[1]}"],
                "ps": [f"localhost:{closed}"],
            }
        }
        started = time.monotonic()
        with pytest.raises(PeerError) as error:
            wait_for_servers(cluster(spec, "chief"), timeout=1.0, poll_seconds=0.1)
    assert str(error.value).startswith(f"ps:0 (localhost:{closed}) did not start within 1 s")
    assert "worker:0" not in str(error.value)
    assert 1.0 <= time.monotonic() - started < 10


def listening_sockets(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
        s.listen()
    return sockets


def test_a_parameter_server_chief_starts_with_min_workers_and_names_the_missing(caplog):
    # Every ps and one of the two workers listen (a server's port is all the wait looks at).
    ps, worker1 = listening_sockets(2)
    (missing,) = free_ports(1)
    spec = {
        "cluster": {
            "chief": ["localhost:1"],
            "worker": [f"localhost:{missing}", f"localhost:{worker1.getsockname()[1]}"],
            "ps": [f"localhost:{ps.getsockname()[1]}"],
        }
    }
    with ps, worker1, caplog.at_level(logging.INFO, logger="tfdist"):
        started = time.monotonic()
        present = wait_for_servers(
            cluster(spec, "chief"), timeout=30, min_workers=1, last_call=1.0, poll_seconds=0.1
        )
        waited = time.monotonic() - started
        with pytest.raises(PeerError, match=r"waiting for every ps and 2 of 2 workers"):
            wait_for_servers(cluster(spec, "chief"), timeout=0.5, min_workers=None)
    assert present == [1] and 1.0 <= waited < 10
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0] == (
        f"1 of 2 workers and every ps are up; waiting up to 1 s more for worker:0 "
        f"(localhost:{missing})"
    )
    assert messages[1].startswith(
        f"Starting parameter-server training with 1 of 2 workers: worker:0 (localhost:{missing}) "
        "did not start"
    )


def test_synchronous_tasks_waiting_for_each_other_all_start():
    # Each task listens on its own port while it waits, so two waiting tasks see each other
    # (their gRPC servers start only after the wait); a third one's absence is named.
    ports = free_ports(3)
    spec = {"cluster": {"worker": [f"localhost:{port}" for port in ports[:2]]}}
    servers = {}

    def start(index):  # the wait, then the task's own server on its port, as TensorFlow's
        wait_for_peers(cluster(spec, "worker", index), timeout=20, poll_seconds=0.05)
        servers[index] = socket.create_server(("localhost", ports[index]), reuse_port=True)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waits = [pool.submit(start, i) for i in range(2)]
        assert [w.result(timeout=30) for w in waits] == [None, None]
    # worker:0 starts again (its server is gone, worker:1's still up) in a job of three.
    servers.pop(0).close()
    spec["cluster"]["worker"].append(f"localhost:{ports[2]}")
    with pytest.raises(PeerError, match=rf"^worker:2 \(localhost:{ports[2]}\) did not join"):
        wait_for_peers(cluster(spec, "worker", 0), timeout=0.3, poll_seconds=0.05)
    for server in servers.values():
        server.close()


def start_worker(index, ports, *flags, log, env=None):
    tf_config = {
        "cluster": {"worker": [f"localhost:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    }
    env = {
        **os.environ,
        "TF_CONFIG": json.dumps(tf_config),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        **(env or {}),
    }
    command = [sys.executable, "-m", "experiments.train", "--strategy=multi_worker_mirrored"]
    with open(log, "w") as out:  # the child keeps its own copy of the file descriptor
        return start_python([*command, "--model=mlp", *flags], env=env, output=out)


def error_line(log_path):
    lines = [line for line in Path(log_path).read_text().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, Path(log_path).read_text()[-3000:]
    return lines[0]


@pytest.mark.multiprocess
def test_a_task_whose_peer_never_starts_fails_within_the_startup_timeout(tmp_path):
    # Two one-task "jobs" at once: worker 0 (the coordination leader, which TensorFlow lets
    # wait forever) missing worker 1, and worker 1 missing its leader. The second runs as in a
    # Kubernetes pod under restartPolicy ExitCode, which retries only codes from 128 up.
    jobs = []
    for index, env, code in ((0, {}, 1), (1, {"TFDIST_RESTARTABLE_EXIT_CODE": "143"}, 143)):
        log, ports = tmp_path / f"worker{index}.log", free_ports(2)
        proc = start_worker(index, ports, "--startup_timeout=3", "--epochs=1", log=log, env=env)
        jobs.append((proc, log, ports[1 - index], code))
    # Each task's wait is timed from its first line ("Waiting for ... to start", logged when
    # the wait begins) to its exit: TensorFlow's start-up before it is the host's load.
    waiting: dict[int, float] = {}
    ended: dict[int, float] = {}
    started = time.monotonic()
    while len(ended) < len(jobs):
        now = time.monotonic()
        for index, (proc, log, _, _) in enumerate(jobs):
            if index not in waiting and "Waiting for " in log.read_text(errors="replace"):
                waiting[index] = now
            if index not in ended and proc.poll() is not None:
                ended[index] = now
            hung = index in waiting and index not in ended and now - waiting[index] > 60
            assert not hung, f"worker:{index} still waits 60 s after its wait began: a hang"
        # Reaching the wait is TensorFlow's start-up: minutes on a loaded host, not a hang.
        assert now - started < 300, "no task reached its wait and ended within 300 s"
        time.sleep(0.05)
    for index, (proc, log, missing_port, code) in enumerate(jobs):
        assert proc.returncode == code, log.read_text()[-3000:]
        assert error_line(log) == (
            f"error: worker:{1 - index} (localhost:{missing_port}) did not join the job within "
            f"3 s: nothing accepted a connection there (worker:{index} was waiting for every "
            "task in the TF_CONFIG environment variable). Start every task of the cluster, or "
            "fix the address in TF_CONFIG; if tasks start slowly (image pulls, scheduling), "
            "raise --startup_timeout. Received: startup_timeout=3.0"
        )
        # The 3 s bound + the error's report and shutdown, never a hang.
        assert index in waiting and ended[index] - waiting[index] < 30, (waiting, ended)


@pytest.mark.multiprocess
def test_a_peer_that_dies_or_freezes_in_training_is_named_within_the_heartbeat_timeout(
    tmp_path,
):
    jobs = {}
    for stop in (signal.SIGKILL, signal.SIGSTOP):
        ports = free_ports(2)
        logs = [tmp_path / f"{stop.name}-{i}.log" for i in range(2)]
        flags = ["--epochs=200", "--heartbeat_timeout=2", f"--model_dir={tmp_path / stop.name}"]
        procs = [start_worker(i, ports, *flags, log=logs[i]) for i in range(2)]
        jobs[stop] = procs, logs, ports
    try:
        for stop, (procs, logs, ports) in jobs.items():
            deadline = time.monotonic() + 300  # start-up and an epoch, on a loaded host
            while "epoch 2/200" not in logs[0].read_text():
                running = procs[0].poll() is None and time.monotonic() < deadline
                assert running, "\n".join(log.read_text()[-2000:] for log in logs)
                time.sleep(0.1)
            procs[1].send_signal(stop)
            killed = time.monotonic()
            assert procs[0].wait(timeout=60) == 1
            seconds = time.monotonic() - killed
            # A killed peer's connection drops at once, but a worker between collectives
            # may hear first from the heartbeat; a frozen one keeps its connection open.
            how = "closed its connection|stopped" if stop == signal.SIGKILL else "stopped"
            line = error_line(logs[0])
            assert re.match(
                rf"error: Lost worker:1 \(localhost:{ports[1]}\) during training: it ({how})", line
            ), line
            assert f"A restart resumes from {tmp_path / stop.name}/checkpoints/ckpt-" in line
            assert seconds < 30, f"{stop.name}: worker 0 took {seconds:.1f} s to stop"
    finally:
        for procs, _, _ in jobs.values():
            for proc in procs:
                proc.kill()
                proc.wait()


# --- restart after a kill at a random step ---------------------------------------------------

# Plain SGD, no shuffle: the same global batches on one device and on two workers.
EXACT = dict(
    model="mlp", optimizer="sgd", momentum=0.0, learning_rate=0.1, shuffle_buffer=0,
    global_batch_size=32, epochs=3, steps_per_epoch=30, eval_every=0, checkpoint_every=4,
)  # fmt: skip
STEPS = EXACT["epochs"] * EXACT["steps_per_epoch"]


def latest_checkpoint_step(model_dir) -> int:
    """The step of the newest checkpoint the run's manager lists (its number is the step)."""
    try:
        state = (model_dir / "checkpoints" / "checkpoint").read_text()
    except FileNotFoundError:
        return 0
    found = re.search(r'^model_checkpoint_path: ".*?ckpt-(\d+)"', state, re.M)
    return int(found.group(1)) if found else 0


@pytest.mark.multiprocess
def test_a_worker_killed_at_a_random_step_restarts_to_the_uninterrupted_weights(tmp_path):
    # A random victim, killed once a random checkpoint of the first two thirds is listed:
    # a third of the run is left, however fast this host trains (a delay in seconds
    # outran a 60-step run on a quiet host, and nothing was left to kill).
    rng = random.Random()
    victim = rng.randrange(2)
    after = rng.randrange(EXACT["checkpoint_every"], 2 * STEPS // 3, EXACT["checkpoint_every"])
    print(f"killing worker {victim} once the checkpoint of step {after} is listed")
    data_dir, model_dir = tmp_path / "data", tmp_path / "run"
    flags = [f"--{k}={v}" for k, v in EXACT.items()]
    launcher = subprocess.Popen(
        [
            sys.executable, "-m", "tools.launch", "--workers", "2", "--max_restarts", "1",
            "--timeout", "300", "--", sys.executable, "-m", "experiments.train",
            "--strategy=multi_worker_mirrored", f"--data_dir={data_dir}",
            f"--model_dir={model_dir}", f"--save_weights_to={tmp_path / 'weights'}", *flags,
        ],
        cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 200
        while latest_checkpoint_step(model_dir) < after:
            assert launcher.poll() is None, "the job ended before the kill"
            assert time.monotonic() < deadline, f"no checkpoint of step {after} within 200 s"
            time.sleep(0.01)
        while (pid := task_pid(launcher.pid, f"worker:{victim}")) is None:
            assert launcher.poll() is None, "the job ended before the kill"
            assert time.monotonic() < deadline, f"worker:{victim} of the launcher not found"
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=240)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output[-4000:]
    assert f"[launch] worker:{victim} killed by SIGKILL" in output, output[-4000:]
    assert "restarting the job (restart 1 of 1)" in output
    # The survivor ends on its one line within the launcher's grace, never by SIGKILL: held
    # by TensorFlow's shutdown or by a collective waiting for the peer it lost, it takes the
    # launcher's second SIGTERM as "stop now". The restarted job says how it ended.
    assert "killed (still running" not in output, output[-4000:]
    restarted = output.split("restarting the job (restart 1 of 1)", 1)[1]
    assert re.search(r"^\[worker:0\] final: multi_worker_mirrored, 2 replica", restarted, re.M)

    summary = json.loads((model_dir / "summary.json").read_text())
    assert summary["steps"] == summary["steps_trained"] == STEPS
    assert after <= summary["resumed_from_step"] < STEPS
    assert summary["resumed_from_step"] % EXACT["checkpoint_every"] == 0

    reference = Trainer(
        TrainConfig(data_dir=str(data_dir), **EXACT),
        strategy=tfdist.build_strategy("one_device", cluster=None),
    )
    assert reference.fit().steps == STEPS
    for index in range(2):
        saved = np.load(tmp_path / "weights" / f"worker_{index}.npz")
        weights = [saved[f"arr_{j}"] for j in range(len(saved.files))]
        for got, want in zip(weights, reference.model.get_weights(), strict=True):
            assert float(np.max(np.abs(got - want))) <= 1e-5


@pytest.mark.multiprocess
def test_a_port_another_process_holds_is_named_in_one_line(tmp_path):
    # A ps; multi_worker_mirrored's worker is the test below, whose one run checks this line.
    strategy, task = "parameter_server", "ps"
    # Another process (this test) listens on every address of the TF_CONFIG: the peers look
    # up, and the task's own server cannot start.
    holders = []
    for _ in range(3):
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        holders.append(holder)
    ports = [h.getsockname()[1] for h in holders]
    cluster = (
        {"worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"]}
        if task == "worker"
        else {"chief": [f"127.0.0.1:{ports[2]}"], "worker": [f"127.0.0.1:{ports[1]}"],
              "ps": [f"127.0.0.1:{ports[0]}"]}
    )  # fmt: skip
    tf_config = json.dumps({"cluster": cluster, "task": {"type": task, "index": 0}})
    try:
        result = run_python(
            [sys.executable, "-m", "experiments.train", f"--strategy={strategy}",
             "--epochs=1", "--steps_per_epoch=1", f"--data_dir={tmp_path}"],
            env={**os.environ, "TF_CONFIG": tf_config, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=120,
        )  # fmt: skip
    finally:
        for holder in holders:
            holder.close()
    assert result.returncode == 1, result.stderr[-2000:]  # a restart on a free port cures it
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {task}:0 cannot start its server on 127.0.0.1:{ports[0]}: port {ports[0]} is "
        "taken by another process (or cannot be bound here). Stop that process, or give the "
        "task a free port in TF_CONFIG (tfdist-launch picks free ports, and moves a task whose "
        "port was taken when it restarts the job)."
    ], result.stderr[-2000:]


@pytest.mark.multiprocess
def test_a_task_whose_own_port_is_taken_says_so_before_waiting_for_a_missing_peer(tmp_path):
    """worker:1 never starts and worker:0's port is held: worker:0 blames its own port at
    once (not worker:1 after the 600 s start-up timeout)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken, missing = holder.getsockname()[1], free_ports(1)[0]
    tf_config = json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{taken}", f"127.0.0.1:{missing}"]},
            "task": {"type": "worker", "index": 0},
        }
    )
    try:
        result = run_python(
            [sys.executable, "-m", "experiments.train", "--strategy=multi_worker_mirrored",
             "--epochs=1", "--steps_per_epoch=1", f"--data_dir={tmp_path}"],
            env={**os.environ, "TF_CONFIG": tf_config, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=90,
        )  # fmt: skip
    finally:
        holder.close()
    assert result.returncode == 1, result.stderr[-2000:]  # a restart on a free port cures it
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: worker:0 cannot start its server on 127.0.0.1:{taken}: port {taken} is "
        "taken by another process (or cannot be bound here). Stop that process, or give the "
        "task a free port in TF_CONFIG (tfdist-launch picks free ports, and moves a task whose "
        "port was taken when it restarts the job)."
    ], result.stderr[-2000:]
    assert "worker:1" not in result.stderr

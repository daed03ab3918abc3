"""Tests for tools/launch.py: cluster planning in-process, everything else through the real CLI.

The tasks are tiny Python programs (no TensorFlow), so each starts in well under a second.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import run_module, start_preload_server
from tfdist import exit_codes
from tfdist.cluster import parse_tf_config
from tfdist.launch.preload import SERVER_ENV
from tools import launch
from tools.chaos import running_tasks

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module", autouse=True)
def tasks_start_afresh():
    """The launcher's own tests start tasks as a user's launcher does: each a fresh
    interpreter (the suite's preload server is for the other modules' jobs), unless they
    ask for `starts`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(SERVER_ENV, raising=False)
        yield


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory):
    """A preload server that imports nothing (cheap): a launcher told of it forks its tasks
    there. Returns (its path, its pid)."""
    path, server = start_preload_server(tmp_path_factory.mktemp("preload"), [])
    yield path, server.pid
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture(params=["fresh", "forked"])
def starts(request, monkeypatch):
    """How the launcher starts the tasks: each a fresh interpreter, or forked by a preload
    server (tfdist/launch/preload.py); the launcher must tell and stop them alike."""
    if request.param == "forked":
        monkeypatch.setenv(SERVER_ENV, request.getfixturevalue("bare_server")[0])
    return request.param


REPO_ROOT = Path(__file__).resolve().parents[1]

# One program plays every task. It records its pid in "<task>.<attempt>.pid" (so a test can
# count the attempts and check that every process is gone afterwards), prints who it is on
# stdout and stderr and the restart count it reads the way a training binary would, then does
# what `actions` says for its task: "sleep" (60 s, i.e. until stopped), "ignore_term" (sleep,
# deaf to SIGTERM), "preempt_on_term" (sleep; on SIGTERM exit with the preempted code),
# "second_term" (sleep; exit 143 on the second SIGTERM only, as a trainer stuck in a step),
# "exit:N" or "kill:N", optionally with ":SECONDS" to wait first ("deaf_exit:N:SECONDS":
# the same, deaf to SIGTERM meanwhile). A list of actions gives one
# per attempt, the last repeating. Exits and kills wait until every task of the attempt has
# recorded its pid, so no task can be stopped before the test knows about it.
TASK_PROGRAM = textwrap.dedent(
    """
    import json, os, pathlib, signal, sys, time
    from tfdist.exit_codes import EXIT_PREEMPTED, restart_count
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    name = "{type}-{index}".format(**task)
    attempt = restart_count()
    pid_dir, total, actions = pathlib.Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    pid_file = pid_dir / "{}.{}.pid".format(name, attempt)
    pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
    pid_file.with_suffix(".tmp").rename(pid_file)
    print("I am", task["type"], task["index"])
    print("stderr of", name, file=sys.stderr)
    print("restart count", attempt)
    action = actions.get(name, actions.get("*", "sleep"))
    if isinstance(action, list):
        action = action[min(attempt, len(action) - 1)]
    if action == "ignore_term" or action.startswith("deaf_"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        action = action.removeprefix("deaf_")
    if action == "preempt_on_term":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_PREEMPTED))
    if action == "second_term":
        terms = []
        def on_term(*_):
            terms.append(1)
            if len(terms) == 2:
                print(name, "stops at the second SIGTERM", flush=True)
                sys.exit(143)
        signal.signal(signal.SIGTERM, on_term)
    if action in ("sleep", "ignore_term", "preempt_on_term", "second_term"):
        time.sleep(60)
        sys.exit(0)
    deadline = time.monotonic() + 10
    mine = "*.{}.pid".format(attempt)
    while len(list(pid_dir.glob(mine))) < total and time.monotonic() < deadline:
        time.sleep(0.02)
    kind, number, *wait = action.split(":")
    time.sleep(float(wait[0]) if wait else 0)
    if kind == "kill":
        os.kill(os.getpid(), int(number))
    sys.exit(int(number))
    """
)


def task_command(pid_dir: Path, total: int, actions: dict[str, str]) -> list[str]:
    return [sys.executable, "-c", TASK_PROGRAM, str(pid_dir), str(total), json.dumps(actions)]


def launch_argv(*flags: str, command: list[str]) -> list[str]:
    return [sys.executable, "-m", "tools.launch", *flags, "--", *command]


def run_launch(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    return result, time.monotonic() - start


def recorded_pids(pid_dir: Path) -> dict[str, int]:
    """Maps "<task>.<attempt>", e.g. "worker-1.0", to the pid of that process."""
    return {path.stem: int(path.read_text()) for path in pid_dir.glob("*.pid")}


def attempts(pid_dir: Path, task: str) -> int:
    """How many times `task` (e.g. "worker-1") was started."""
    return len(list(pid_dir.glob(f"{task}.*.pid")))


def launch_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("[launch] ")]


def addresses_started(stdout: str) -> list[str]:
    """The task addresses of every "starting" line, one string per attempt."""
    return [
        line.split(": ", 1)[1].split("; command: ")[0]
        for line in launch_lines(stdout)
        if line.startswith("[launch] starting ")
    ]


def wait_for_pids(pid_dir: Path, count: int) -> dict[str, int]:
    deadline = time.monotonic() + 10
    while len(recorded_pids(pid_dir)) < count:
        assert time.monotonic() < deadline, f"tasks did not start: {recorded_pids(pid_dir)}"
        time.sleep(0.05)
    return recorded_pids(pid_dir)


def wait_until_ended(pid: int) -> None:
    """Until the kernel has ended `pid` (a zombie its parent has not reaped yet): a signalled
    process on a loaded machine can take a while to be scheduled and exit."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still running 10 s after its signal")


def assert_all_gone(pids: dict[str, int]) -> None:
    alive = []
    for name, pid in pids.items():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(name)
    assert not alive, f"tasks left running after the launcher exited: {alive}"


# --- plan_cluster and friends, in-process -------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "names"),
    [
        (dict(workers=2), ["worker:0", "worker:1"]),
        (dict(workers=0, chief=True), ["chief:0"]),
        (
            dict(workers=2, chief=True, ps=2, evaluator=True),
            ["chief:0", "worker:0", "worker:1", "ps:0", "ps:1", "evaluator:0"],
        ),
    ],
)
def test_plan_cluster_gives_every_task_its_own_port_and_tf_config(layout, names):
    cluster, tasks = launch.plan_cluster(**layout)

    assert [task.name for task in tasks] == names
    addresses = [task.address for task in tasks]
    assert len(set(addresses)) == len(addresses)
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", address) for address in addresses)
    assert sum(len(members) for members in cluster.values()) == len(tasks)
    assert all(cluster.values()), f"empty task types must be left out: {cluster}"
    for task in tasks:
        config = json.loads(launch.tf_config_for(cluster, task))
        assert config == {"cluster": cluster, "task": {"type": task.type, "index": task.index}}
        assert config["cluster"][task.type][task.index] == task.address
        # What the launcher writes, tfdist must read back as the same task.
        info = parse_tf_config(launch.tf_config_for(cluster, task))
        assert (info.task_type, info.task_index, info.address) == (
            task.type,
            task.index,
            task.address,
        )


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_plan_cluster_brackets_ipv6_addresses(host):
    cluster, tasks = launch.plan_cluster(workers=2, host=host, ports=[5000, 5001])

    assert cluster == {"worker": ["[::1]:5000", "[::1]:5001"]}
    assert tasks[1] == launch.Task("worker", 1, "[::1]:5001")


def test_plan_cluster_binds_free_ipv6_ports():
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")

    _, tasks = launch.plan_cluster(workers=3, host="::1")

    assert all(re.fullmatch(r"\[::1\]:\d+", task.address) for task in tasks)
    assert len({task.address for task in tasks}) == 3


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (dict(workers=-1), "must be 0 or more"),
        (dict(workers=0), "no chief and no worker, so nothing would train.*--workers 2"),
        (dict(workers=0, evaluator=True), "nothing would train.*Received: 1 evaluator"),
        (dict(workers=2, ps=1), "needs a chief.* e.g. `--chief --workers 2 --ps 1`"),
        (dict(workers=0, chief=True, ps=1), "needs workers.*Received: 1 chief, 1 ps"),
        (dict(workers=2, ports=[5000]), "expected 2 ports, one per task"),
    ],
)
def test_plan_cluster_rejects_clusters_that_cannot_run(layout, message):
    with pytest.raises(launch.UsageError, match=message):
        launch.plan_cluster(**layout)


def test_only_workers_and_ps_serve_and_only_under_parameter_server_training():
    _, ps_tasks = launch.plan_cluster(workers=2, chief=True, ps=1, evaluator=True)
    _, mwms_tasks = launch.plan_cluster(workers=2, chief=True, evaluator=True)

    assert [task.name for task in launch.serving_tasks(ps_tasks)] == [
        "worker:0",
        "worker:1",
        "ps:0",
    ]
    assert launch.serving_tasks(mwms_tasks) == []


# --- the CLI ------------------------------------------------------------------------------


def test_dry_run_prints_a_runnable_line_per_task_and_starts_nothing(tmp_path):
    marker = tmp_path / "started"
    command = [
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w'); import os; print(os.environ['TF_CONFIG'])",
    ]

    result, _ = run_launch(
        launch_argv("--chief", "--workers", "2", "--ps", "1", "--dry_run", command=command)
    )

    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    lines = result.stdout.splitlines()
    headers = [line for line in lines if re.match(r"# \w+:\d+ \(", line)]
    commands = [line for line in lines if line.startswith("TF_CONFIG=")]
    assert [header.split()[1] for header in headers] == ["chief:0", "worker:0", "worker:1", "ps:0"]
    assert len(commands) == 4
    for header, line in zip(headers, commands, strict=True):
        assignment, *rest = shlex.split(line)
        config = json.loads(assignment.removeprefix("TF_CONFIG="))
        task_type, index = header.split()[1].split(":")
        assert config["task"] == {"type": task_type, "index": int(index)}
        assert f"({config['cluster'][task_type][int(index)]})" in header
        assert rest == command
    # The line really is a shell command that reproduces the task.
    shell = subprocess.run(["sh", "-c", commands[1]], capture_output=True, text=True, check=True)
    assert json.loads(shell.stdout)["task"] == {"type": "worker", "index": 0}


def test_output_of_every_task_is_prefixed_with_its_name(tmp_path):
    command = task_command(tmp_path, 3, {"*": "exit:0"})

    result, _ = run_launch(launch_argv("--chief", "--workers", "2", command=command))

    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert all(re.match(r"\[(launch|chief:0|worker:[01])\] ", line) for line in lines), lines
    for task_type, index in [("chief", 0), ("worker", 0), ("worker", 1)]:
        prefix = f"[{task_type}:{index}] "
        assert lines.count(f"{prefix}I am {task_type} {index}") == 1
        assert lines.count(f"{prefix}stderr of {task_type}-{index}") == 1
    assert lines[0].startswith("[launch] starting 3 tasks: chief:0 (127.0.0.1:")
    assert lines[-3:] == [
        "[launch] chief:0 exit 0",
        "[launch] worker:0 exit 0",
        "[launch] worker:1 exit 0",
    ]


@pytest.mark.parametrize(
    ("action", "exit_code", "message"),
    [
        ("exit:3", 3, "[launch] worker:1 failed with exit code 3; stopping the other tasks"),
        ("kill:9", 137, "[launch] worker:1 was killed by SIGKILL; stopping the other tasks"),
    ],
)
def test_a_failing_task_stops_the_others_and_sets_the_exit_code(
    tmp_path, starts, action, exit_code, message
):
    command = task_command(tmp_path, 4, {"worker-1": action})

    result, seconds = run_launch(launch_argv("--chief", "--workers", "3", command=command))

    assert result.returncode == exit_code, result.stdout + result.stderr
    assert seconds < 10
    assert message in result.stdout
    assert "[launch] worker:0 stopped" in result.stdout
    assert "[launch] chief:0 stopped" in result.stdout
    pids = recorded_pids(tmp_path)
    assert len(pids) == 4
    assert_all_gone(pids)


def test_parameter_server_run_ends_when_the_chief_finishes(tmp_path):
    command = task_command(tmp_path, 4, {"chief-0": "exit:0"})

    result, seconds = run_launch(
        launch_argv("--chief", "--workers", "2", "--ps", "1", command=command)
    )

    assert result.returncode == 0, result.stdout + result.stderr
    assert seconds < 10
    summary = [line for line in result.stdout.splitlines() if line.startswith("[launch] ")][-4:]
    assert summary == [
        "[launch] chief:0 exit 0",
        "[launch] worker:0 stopped",
        "[launch] worker:1 stopped",
        "[launch] ps:0 stopped",
    ]
    assert_all_gone(recorded_pids(tmp_path))


def test_a_worker_killed_as_its_peer_reports_it_is_named_as_the_cause(tmp_path):
    """worker:0 exits 1 (as a survivor reports its lost peer) and worker:1, killed first,
    is still exiting when the launcher looks: worker:1's SIGKILL is the cause, not worker:0's
    exit (a fault loop saw the killed worker's line missing, its exit coming from the
    preload server after the survivor's). Here worker:1 dies 0.3 s after the launcher looks."""
    command = task_command(tmp_path, 2, {"worker-0": "exit:1:1", "worker-1": "sleep"})
    launcher = subprocess.Popen(
        launch_argv("--workers", "2", "--grace", "1", command=command),
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pids = wait_for_pids(tmp_path, 2)
        os.kill(launcher.pid, signal.SIGSTOP)
        wait_until_ended(pids["worker-0.0"])  # the survivor's report ends it...
        os.kill(launcher.pid, signal.SIGCONT)
        time.sleep(0.3)
        os.kill(pids["worker-1.0"], signal.SIGKILL)  # ...before the killed peer's end is seen
        stdout, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert "[launch] worker:1 was killed by SIGKILL; stopping the other tasks" in stdout, (
        stdout + stderr
    )
    assert "worker:0 failed with exit code 1; stopping" not in stdout, stdout
    assert launcher.returncode == 137, stdout
    assert_all_gone(recorded_pids(tmp_path))


def test_a_dead_ps_seen_with_the_chief_s_exit_is_named_as_the_cause(tmp_path):
    """The chief reports a lost ps and exits; the ps is the cause, not the chief (the launcher
    had said the chief failed and the ps was 'stopped'), also when the killed ps is still
    exiting as the chief's exit is seen: a loaded machine schedules a killed process late (CI
    saw it). Here the ps ends 0.3 s after the launcher, frozen until the chief has ended,
    looks."""
    command = task_command(tmp_path, 4, {"chief-0": "sleep", "ps-0": "sleep"})
    launcher = subprocess.Popen(
        launch_argv("--chief", "--workers", "2", "--ps", "1", "--grace", "1", command=command),
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pids = wait_for_pids(tmp_path, 4)
        os.kill(launcher.pid, signal.SIGSTOP)
        os.kill(pids["chief-0.0"], signal.SIGTERM)  # the chief ends, reporting the lost ps...
        wait_until_ended(pids["chief-0.0"])
        os.kill(launcher.pid, signal.SIGCONT)
        time.sleep(0.3)
        os.kill(pids["ps-0.0"], signal.SIGKILL)  # ...whose end the launcher sees after
        stdout, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert (
        "[launch] ps:0 was killed by SIGKILL; parameter-server training cannot continue" in stdout
    ), stdout + stderr
    assert "[launch] ps:0 stopped" not in stdout
    assert launcher.returncode == 137, stdout
    assert_all_gone(recorded_pids(tmp_path))


def test_a_parameter_server_that_exits_by_itself_is_a_failure(tmp_path):
    command = task_command(tmp_path, 3, {"ps-0": "exit:0"})

    # --grace bounds the wait for the chief to report the lost ps (this chief never does).
    result, seconds = run_launch(
        launch_argv("--chief", "--workers", "1", "--ps", "1", "--grace", "1", command=command)
    )

    assert result.returncode == 1, result.stdout + result.stderr
    assert "[launch] ps:0 exited by itself, but under parameter-server training" in result.stdout
    assert "giving the chief up to 1 s to report" in result.stdout
    assert seconds < 10
    assert_all_gone(recorded_pids(tmp_path))


def test_a_dead_parameter_server_lets_the_chief_report_before_stopping_it(tmp_path):
    # The chief stands for a trainer that notices the lost ps and exits with its explanation.
    command = task_command(tmp_path, 3, {"ps-0": "kill:9", "chief-0": "exit:1:1"})

    result, seconds = run_launch(
        launch_argv("--chief", "--workers", "1", "--ps", "1", command=command)
    )

    assert result.returncode == 137, result.stdout + result.stderr
    assert seconds < 10
    lines = launch_lines(result.stdout)
    assert lines[1].startswith("[launch] ps:0 was killed by SIGKILL; parameter-server training")
    # It exited by itself within the grace period, not stopped by the launcher.
    assert "[launch] chief:0 exit 1" in lines
    assert "[launch] worker:0 stopped" in lines
    assert lines[-1] == (
        "[launch] ps:0 failed with exit code 137 (SIGKILL), which parameter-server training "
        "cannot survive; the job resumes from the chief's last checkpoint in its model_dir when "
        "run again, or when launched with --max_restarts N"
    )
    assert_all_gone(recorded_pids(tmp_path))


@pytest.mark.parametrize("how", ["kill:9", "exit:0"])
def test_a_parameter_server_job_survives_a_dead_worker(tmp_path, how):
    # The chief finishes a second after every task started, long after worker:1 has gone.
    command = task_command(tmp_path, 5, {"worker-1": how, "chief-0": "exit:0:1.5"})

    result, seconds = run_launch(
        launch_argv("--chief", "--workers", "2", "--ps", "2", "--grace", "30", command=command)
    )

    assert result.returncode == 0, result.stdout + result.stderr
    # The serving tasks are stopped at once, not after the 30 s grace (5 fresh interpreters
    # took 10.2 s in all under two fault loops).
    assert seconds < 25
    outcome = "was killed by SIGKILL" if how == "kill:9" else "exited by itself"
    [lost] = [line for line in launch_lines(result.stdout) if "worker:1 " + outcome in line]
    assert lost.endswith("parameter-server training continues on the other 1 worker (worker:0)")
    assert (
        "[launch] the program finished despite losing worker:1; stopping the serving tasks "
        "worker:0, ps:0, ps:1" in result.stdout
    )
    assert "[launch] chief:0 exit 0" in result.stdout
    assert_all_gone(recorded_pids(tmp_path))


def test_on_worker_failure_restart_restarts_a_dead_worker_in_place(tmp_path, starts):
    # worker:1 dies on every start: it is restarted 3 times, then the job goes on without it.
    command = task_command(tmp_path, 4, {"worker-1": "kill:9", "chief-0": "exit:0:3"})

    result, seconds = run_launch(
        launch_argv(
            "--chief",
            "--workers",
            "2",
            "--ps",
            "1",
            "--on_worker_failure",
            "restart",
            command=command,
        )  # fmt: skip
    )

    assert result.returncode == 0, result.stdout + result.stderr
    assert seconds < 15
    lines = launch_lines(result.stdout)
    restarts = [line for line in lines if "restarts in place" in line]
    assert restarts == [
        "[launch] worker:1 was killed by SIGKILL; parameter-server training continues on the "
        f"other workers, and worker:1 restarts in place ({n} of 3)"
        for n in (1, 2, 3)
    ]
    assert "[launch] worker:1 has been restarted 3 times; not again" in lines
    assert "the program finished despite losing worker:1" in result.stdout
    # Every start said it was worker 1, with the job's TF_CONFIG.
    assert result.stdout.count("[worker:1] I am worker 1") == 4
    assert_all_gone(recorded_pids(tmp_path))


def test_a_parameter_server_job_fails_when_its_last_worker_dies(tmp_path):
    command = task_command(tmp_path, 4, {"worker-0": "kill:9", "worker-1": "exit:3:0.5"})

    result, seconds = run_launch(
        launch_argv("--chief", "--workers", "2", "--ps", "1", command=command)
    )

    assert result.returncode == 3, result.stdout + result.stderr
    assert seconds < 10
    assert "[launch] worker:0 was killed by SIGKILL; parameter-server training continues" in (
        result.stdout
    )
    assert (
        "[launch] worker:1 failed with exit code 3, and it was the last worker: "
        "parameter-server training cannot go on; stopping the other tasks" in result.stdout
    )
    assert "[launch] chief:0 stopped" in result.stdout
    assert_all_gone(recorded_pids(tmp_path))


def test_on_worker_failure_stop_ends_a_parameter_server_job(tmp_path):
    command = task_command(tmp_path, 4, {"worker-1": "kill:9"})

    result, seconds = run_launch(
        launch_argv(
            "--chief", "--workers", "2", "--ps", "1", "--on_worker_failure", "stop", command=command
        )
    )

    assert result.returncode == 137, result.stdout + result.stderr
    assert seconds < 10
    assert "[launch] worker:1 was killed by SIGKILL; stopping the other tasks" in result.stdout
    assert_all_gone(recorded_pids(tmp_path))


def test_on_worker_failure_continue_needs_parameter_servers():
    result, _ = run_launch(
        launch_argv("--workers", "2", "--on_worker_failure", "continue", command=["true"])
    )

    assert result.returncode == launch.EXIT_USAGE
    assert re.search(
        r"--on_worker_failure continue needs parameter-server training.*"
        r"Received: --on_worker_failure=continue without --ps",
        result.stderr,
    )


def test_timeout_stops_everything_even_a_task_that_ignores_sigterm(tmp_path, starts):
    command = task_command(tmp_path, 2, {"worker-1": "ignore_term"})

    result, seconds = run_launch(
        launch_argv("--workers", "2", "--timeout", "2", "--grace", "0.5", command=command)
    )

    assert result.returncode == 124, result.stdout + result.stderr
    assert 2 <= seconds < 10
    assert "[launch] timed out after 2 s; still running: worker:0, worker:1" in result.stdout
    assert "[launch] worker:0 stopped" in result.stdout
    assert "[launch] worker:1 killed (still running 0.5 s after SIGTERM)" in result.stdout
    assert_all_gone(recorded_pids(tmp_path))


def test_a_survivor_stuck_after_a_peer_failed_gets_a_second_sigterm_before_sigkill(
    tmp_path, starts
):
    # A trainer takes the first SIGTERM as "save at the next step boundary", which a survivor
    # waiting in a collective for its dead peer never reaches; the second means "now".
    command = task_command(tmp_path, 3, {"worker-0": "exit:1", "*": "second_term"})

    result, seconds = run_launch(launch_argv("--workers", "3", "--grace", "4", command=command))

    assert result.returncode == 1, result.stdout + result.stderr
    assert seconds < 10
    assert (
        "[launch] worker:1, worker:2 did not stop within 2 s of SIGTERM, most likely "
        "waiting in a collective for the task that failed; SIGTERM again: stop now"
    ) in result.stdout
    for index in (1, 2):
        assert f"worker-{index} stops at the second SIGTERM" in result.stdout
        assert f"[launch] worker:{index} stopped" in result.stdout
    assert "still running 4 s" not in result.stdout
    assert_all_gone(recorded_pids(tmp_path))


def test_a_signalled_launcher_gives_its_tasks_the_whole_grace_after_one_sigterm(tmp_path, starts):
    # A preemption's SIGTERM lets every task save at its step boundary: no second SIGTERM.
    command = task_command(tmp_path, 2, {"*": "second_term"})
    launcher = subprocess.Popen(
        launch_argv("--workers", "2", "--grace", "1", command=command),
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for_pids(tmp_path, 2)
    launcher.send_signal(signal.SIGTERM)
    stdout, _ = launcher.communicate(timeout=30)

    assert launcher.returncode == 143
    assert "SIGTERM again" not in stdout
    assert "[launch] worker:0 killed (still running 1 s after SIGTERM)" in stdout


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_stops_every_task(tmp_path, starts, signum, exit_code):
    command = task_command(tmp_path, 3, {})
    launcher = subprocess.Popen(
        launch_argv("--workers", "3", command=command),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A test run started in the background inherits an ignored SIGINT, which the launcher
        # (rightly) leaves ignored; this test needs it delivered. (preexec_fn is not safe with
        # threads, which TensorFlow starts in this process, so only use it when needed.)
        preexec_fn=_default_sigint if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else None,
    )
    try:
        pids = wait_for_pids(tmp_path, 3)
        launcher.send_signal(signum)
        output, _ = launcher.communicate(timeout=10)
    finally:
        launcher.kill()

    assert launcher.returncode == exit_code, output
    assert f"[launch] received {signal.Signals(signum).name}; stopping all tasks" in output
    assert "[launch] worker:2 stopped" in output
    assert_all_gone(pids)


def _parent_and_session(pid: int) -> tuple[int, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[1]), int(fields[3])  # ppid, session


def test_tasks_forked_by_a_preload_server_are_its_children_each_in_a_session_of_its_own(
    tmp_path, bare_server, monkeypatch
):
    path, server_pid = bare_server
    monkeypatch.setenv(SERVER_ENV, path)
    command = task_command(tmp_path, 3, {})
    launcher = subprocess.Popen(
        launch_argv("--chief", "--workers", "2", command=command), cwd=REPO_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        pids = wait_for_pids(tmp_path, 3)
        # A forked task runs (and records its pid) before the launcher lists it.
        deadline = time.monotonic() + 10
        while len(listed := running_tasks(launcher.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        lineage = {name: _parent_and_session(pid) for name, pid in pids.items()}
        launcher.send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=10)
    finally:
        launcher.kill()
    assert listed == {"chief:0": pids["chief-0.0"], "worker:0": pids["worker-0.0"],
                      "worker:1": pids["worker-1.0"]}, output  # fmt: skip
    for name, (parent, session) in lineage.items():
        assert parent == server_pid and session == pids[name], (name, parent, session)
    assert "[chief:0] I am chief 0" in output and "[worker:1] stderr of worker-1" in output
    assert launcher.returncode == 143, output
    assert_all_gone(pids)
    assert running_tasks(launcher.pid) == {}  # the launcher's list went with it


def test_a_forked_program_gets_its_own_folder_search_path_and_streams(tmp_path, bare_server):
    """As a fresh interpreter would: the task's working folder, its PYTHONPATH's modules,
    stderr apart from stdout when asked, and its exit code."""
    from tfdist.launch.preload import Preloader

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "only_here.py").write_text("WHERE = 'lib'\n")
    code = (
        "import os, sys, only_here; print(os.getcwd(), only_here.WHERE); "
        "print('to stderr', file=sys.stderr); sys.exit(3)"
    )
    preloader = Preloader([], env=dict(os.environ), say=print, relay=print)
    assert preloader.connect(bare_server[0])
    try:
        env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
        task = preloader.spawn([sys.executable, "-c", code], env=env, cwd=str(tmp_path),
                               stderr_apart=True)  # fmt: skip
        with task.stdout, task.stderr:
            out, err = task.stdout.read().decode(), task.stderr.read().decode()
        assert task.wait(30) == 3, (out, err)
    finally:
        preloader.close()
    assert out == f"{tmp_path} lib\n" and err == "to stderr\n", (out, err)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--preload", "no_such_module_here"],
         "[launch] the preload server of no_such_module_here cannot serve (ModuleNotFoundError: "
         "No module named 'no_such_module_here'); each task starts afresh"),
        (["--preload", "json"], None),
    ],
)  # fmt: skip
def test_a_preload_that_cannot_import_says_so_and_the_job_runs_afresh(tmp_path, flags, said):
    command = task_command(tmp_path, 2, {"*": "exit:0"})
    result, _ = run_launch(launch_argv("--workers", "2", *flags, command=command))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("cannot serve") == (1 if said else 0), result.stdout
    if said:
        assert said in result.stdout
    assert "[worker:1] I am worker 1" in result.stdout


def test_a_preload_for_a_command_that_is_not_python_says_it_starts_afresh():
    result, _ = run_launch(launch_argv("--workers", "2", "--preload", "json", command=["true"]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[launch] --preload json forks `python -m MODULE`, `python FILE` and `python -c " \
        "CODE` commands of the launcher's Python; this command starts afresh in each task" \
        in result.stdout  # fmt: skip


PRELOADED_JOB = textwrap.dedent(
    """
    import os, sys
    preloaded = "tensorflow" in sys.modules  # before this script imports it
    import tensorflow as tf
    from tfdist.exit_codes import restart_count
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = strategy.cluster_resolver.task_id
    total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(float(index + 1))), None)
    print("preloaded", preloaded, "parent", os.getppid(), "sum", float(total), flush=True)
    if index == 1 and restart_count() == 0:
        os.kill(os.getpid(), 9)
    """
)


@pytest.mark.multiprocess
def test_preloaded_tensorflow_tasks_train_together_and_restart_forked_again(tmp_path):
    """--preload tensorflow: each task (a real collective across 2 processes), and the
    restart after a SIGKILL, forked from one server that imported TensorFlow once."""
    script = tmp_path / "job.py"
    script.write_text(PRELOADED_JOB)
    result = subprocess.run(
        launch_argv("--workers", "2", "--max_restarts", "1", "--preload", "tensorflow",
                    command=["python", str(script)]),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    said = re.findall(r"^\[(worker:\d)\] preloaded (\w+) parent (\d+) sum (\S+)$",
                      result.stdout, re.M)  # fmt: skip
    assert len(said) == 4, result.stdout[-3000:]  # 2 tasks x 2 attempts
    assert {(preloaded, total) for _, preloaded, _, total in said} == {("True", "3.0")}
    assert len({parent for _, _, parent, _ in said}) == 1  # one server, kept across restarts
    assert "worker:1 failed with exit code 137 (SIGKILL); restarting the job" in result.stdout


def test_a_command_that_does_not_exist_exits_127(tmp_path):
    result, _ = run_launch(
        launch_argv("--workers", "2", command=[str(tmp_path / "no-such-program")])
    )

    assert result.returncode == 127
    assert "[launch] cannot start worker:0: [Errno 2] No such file or directory" in result.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "2"], r"no command to run: put it after `--`"),
        (["--workers", "2", "python", "train.py"], r"'python train.py'.*command goes after `--`"),
        (["--ps", "1", "--", "python"], r"^tfdist-launch: error: .*needs a chief.*--chief"),
        (["--workers", "-1", "--", "python"], r"must be 0 or more.*workers=-1"),
        (["--workers", "0", "--", "python"], r"nothing would train"),
        (["--timeout", "0", "--", "python"], r"--timeout must be more than 0.*--timeout=0"),
        (["--max_restarts", "-1", "--", "python"], r"must be 0 or more.*--max_restarts=-1"),
        (
            ["--workers", "2", "--", "python", "-m", "experiments.train", "--strategy=mirrored"],
            r"'mirrored' trains within one process, but this layout starts several",
        ),
    ],
)
def test_bad_usage_exits_2_with_a_one_line_message(flags, message):
    result, _ = run_launch([sys.executable, "-m", "tools.launch", *flags])

    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert re.search(message, result.stderr), result.stderr


# --- restarts -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "outcome", "cause"),
    [
        ("exit:3", "exit 3", "failed with exit code 3"),
        ("kill:9", "killed by SIGKILL", "failed with exit code 137 (SIGKILL)"),
    ],
)
def test_a_job_whose_task_fails_once_is_restarted_and_succeeds(
    tmp_path, starts, action, outcome, cause
):
    # worker:0 runs until stopped the first time, and finishes the second time.
    command = task_command(tmp_path, 2, {"worker-1": [action, "exit:0"], "*": ["sleep", "exit:0"]})

    result, seconds = run_launch(
        launch_argv("--workers", "2", "--max_restarts", "1", command=command)
    )

    assert result.returncode == 0, result.stdout + result.stderr
    assert seconds < 10
    lines = launch_lines(result.stdout)
    assert lines[2:5] == [
        "[launch] worker:0 stopped",
        f"[launch] worker:1 {outcome}",
        f"[launch] worker:1 {cause}; restarting the job (restart 1 of 1)",
    ]
    assert lines[5].startswith("[launch] starting 2 tasks (restart 1 of 1): worker:0 (")
    assert lines[6:] == ["[launch] worker:0 exit 0", "[launch] worker:1 exit 0"]
    # The ports were still free, so the restarted job has the TF_CONFIG it had.
    first, second = addresses_started(result.stdout)
    assert first == second
    # Every task of every attempt read its restart count from the environment.
    for name in ("worker:0", "worker:1"):
        assert f"[{name}] restart count 0" in result.stdout
        assert f"[{name}] restart count 1" in result.stdout
    assert attempts(tmp_path, "worker-0") == attempts(tmp_path, "worker-1") == 2
    assert_all_gone(recorded_pids(tmp_path))


@pytest.mark.parametrize("flags", [[], ["--max_restarts", "0"]])
def test_without_restarts_the_same_job_exits_with_the_tasks_code(tmp_path, flags):
    command = task_command(
        tmp_path, 2, {"worker-1": ["exit:3", "exit:0"], "*": ["sleep", "exit:0"]}
    )

    result, _ = run_launch(launch_argv("--workers", "2", *flags, command=command))

    assert result.returncode == 3, result.stdout + result.stderr
    assert launch_lines(result.stdout)[1:] == [
        "[launch] worker:1 failed with exit code 3; stopping the other tasks",
        "[launch] worker:0 stopped",
        "[launch] worker:1 exit 3",
    ]
    assert "[worker:1] restart count 0" in result.stdout
    assert attempts(tmp_path, "worker-0") == attempts(tmp_path, "worker-1") == 1
    assert_all_gone(recorded_pids(tmp_path))


def test_a_task_that_always_fails_uses_up_the_restarts_and_sets_the_exit_code(tmp_path):
    command = task_command(tmp_path, 2, {"worker-1": "exit:5"})

    result, seconds = run_launch(
        launch_argv("--workers", "2", "--max_restarts", "2", command=command)
    )

    assert result.returncode == 5, result.stdout + result.stderr
    assert seconds < 10
    lines = launch_lines(result.stdout)
    cause = "[launch] worker:1 failed with exit code 5"
    assert [line for line in lines if line.startswith(cause)] == [
        f"{cause}; stopping the other tasks",
        f"{cause}; restarting the job (restart 1 of 2)",
        f"{cause}; stopping the other tasks",
        f"{cause}; restarting the job (restart 2 of 2)",
        f"{cause}; stopping the other tasks",
        f"{cause}; no restarts left (--max_restarts 2)",
    ]
    assert lines[-1] == f"{cause}; no restarts left (--max_restarts 2)"
    assert attempts(tmp_path, "worker-0") == attempts(tmp_path, "worker-1") == 3
    assert_all_gone(recorded_pids(tmp_path))


def test_a_task_that_exits_with_a_usage_error_is_never_restarted(tmp_path):
    command = task_command(tmp_path, 2, {"worker-1": "exit:2", "*": ["sleep", "exit:0"]})

    result, _ = run_launch(launch_argv("--workers", "2", "--max_restarts", "2", command=command))

    assert result.returncode == exit_codes.EXIT_USAGE, result.stdout + result.stderr
    lines = launch_lines(result.stdout)
    cause = "[launch] worker:1 stopped on a usage error (exit code 2: see its error line)"
    assert [line for line in lines if "usage error" in line] == [
        f"{cause}; stopping the other tasks",
        "[launch] not restarting: worker:1's usage error would come back every time",
    ], lines  # the cause once, then the decision
    assert attempts(tmp_path, "worker-1") == 1


def test_a_usage_error_that_its_peer_reports_first_as_a_loss_is_not_restarted(tmp_path):
    """worker:0 exits restartably first (it lost its peer) and worker:1 exits with its data
    mistake (exit 2) while the launcher stops the job (deaf to the SIGTERM, as a process
    busy in C++ is): the usage error still decides."""
    command = task_command(tmp_path, 2, {"worker-0": "exit:1", "worker-1": "deaf_exit:2:0.5"})

    result, _ = run_launch(launch_argv("--workers", "2", "--max_restarts", "2", command=command))

    assert result.returncode == exit_codes.EXIT_USAGE, result.stdout + result.stderr
    lines = launch_lines(result.stdout)
    assert lines[-1] == "[launch] not restarting: worker:1's usage error would come back " \
        "every time", lines  # fmt: skip
    assert attempts(tmp_path, "worker-0") == attempts(tmp_path, "worker-1") == 1


@pytest.mark.multiprocess
def test_the_binarys_flag_error_ends_a_parameter_server_job_without_restarts():
    result = run_module(
        "tools.launch", "--chief", "--workers", "1", "--ps", "1", "--max_restarts", "2",
        "--", sys.executable, "-m", "experiments.train", "--strategy=parameter_server",
        "--epochs=0", timeout=120,
    )  # fmt: skip
    assert result.returncode == exit_codes.EXIT_USAGE, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if "error:" in line]
    assert errors and all(
        line.endswith("error: flag --epochs=0: 0 is not a positive integer. Run with --help to "
                      "see the flags.") for line in errors
    ), errors  # fmt: skip
    assert "not restarting: " in result.stdout and "usage error would come back" in result.stdout
    assert "restarting the job" not in result.stdout and "cannot survive" not in result.stdout
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize(("max_restarts", "exit_code"), [(1, 0), (0, exit_codes.EXIT_PREEMPTED)])
def test_a_preempted_task_is_logged_as_preempted_and_restarted_if_restarts_remain(
    tmp_path, max_restarts, exit_code
):
    preempted = f"exit:{exit_codes.EXIT_PREEMPTED}"
    command = task_command(
        tmp_path, 2, {"worker-1": [preempted, "exit:0"], "*": ["sleep", "exit:0"]}
    )

    result, _ = run_launch(
        launch_argv("--workers", "2", "--max_restarts", str(max_restarts), command=command)
    )

    assert result.returncode == exit_code, result.stdout + result.stderr
    cause = f"[launch] worker:1 was preempted (state saved, exit code {exit_codes.EXIT_PREEMPTED})"
    assert f"{cause}; stopping the other tasks" in result.stdout
    restarting = f"{cause}; restarting the job (restart 1 of 1)"
    assert (restarting in result.stdout) == (max_restarts == 1)
    assert attempts(tmp_path, "worker-1") == max_restarts + 1
    assert_all_gone(recorded_pids(tmp_path))


def test_the_timeout_covers_every_attempt(tmp_path):
    # worker-1 fails 0.3 s into each attempt; a fresh interpreter's start takes up to a
    # second or two on a loaded machine, so 4 s leave room for a restart (a fault loop saw
    # a 2 s timeout end within the second attempt's start).
    command = task_command(tmp_path, 2, {"worker-1": "exit:3:0.3"})

    result, seconds = run_launch(
        launch_argv("--workers", "2", "--max_restarts", "100", "--timeout", "4", command=command)
    )

    assert result.returncode == 124, result.stdout + result.stderr
    assert 4 <= seconds < 12
    assert "timed out after 4 s" in result.stdout
    assert 2 <= attempts(tmp_path, "worker-1") < 40
    assert_all_gone(recorded_pids(tmp_path))


def test_a_restarted_job_moves_a_task_whose_port_was_taken(tmp_path):
    # On its first attempt the task has another process, outside the task's process group (so
    # that stopping the task leaves it alone), listen on the task's own port, then fails.
    holder_pid = tmp_path / "holder.pid"
    program = textwrap.dedent(
        f"""
        import json, os, subprocess, sys, time
        from tfdist.exit_codes import restart_count
        address = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][0]
        print("listening on", address)
        if restart_count() == 0:
            host, port = address.rsplit(":", 1)
            hold = (
                "import socket, sys, time; s = socket.socket(); "
                f"s.bind(({{host!r}}, {{port}})); s.listen(); print('held', flush=True); "
                "time.sleep(20)"
            )
            # Not on the task's stderr: the launcher would wait for that pipe to close.
            holder = subprocess.Popen(
                [sys.executable, "-c", hold],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            open({str(holder_pid)!r}, "w").write(str(holder.pid))
            holder.stdout.readline()
            sys.exit(3)
        """
    )
    try:
        result, _ = run_launch(
            launch_argv(
                "--workers", "1", "--max_restarts", "1", command=[sys.executable, "-c", program]
            )
        )
    finally:
        if holder_pid.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(holder_pid.read_text()), signal.SIGKILL)

    assert result.returncode == 0, result.stdout + result.stderr
    first, second = addresses_started(result.stdout)
    old, new = first.split(" ")[1].strip("()"), second.split(" ")[1].strip("()")
    assert old != new
    assert f"[launch] worker:0's port {old} is taken; it moves to {new}" in result.stdout
    # The task's TF_CONFIG followed.
    assert f"[worker:0] listening on {old}" in result.stdout
    assert f"[worker:0] listening on {new}" in result.stdout


def test_a_signal_to_the_launcher_never_restarts_even_if_the_tasks_exit_preempted(tmp_path):
    # As under a real preemption: the tasks save and exit with the preempted code on SIGTERM.
    command = task_command(tmp_path, 2, {"*": "preempt_on_term"})
    launcher = subprocess.Popen(
        launch_argv("--workers", "2", "--max_restarts", "3", command=command),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        pids = wait_for_pids(tmp_path, 2)
        launcher.send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=10)
    finally:
        launcher.kill()

    assert launcher.returncode == 143, output
    assert launch_lines(output)[1:] == [
        "[launch] received SIGTERM; stopping all tasks",
        "[launch] worker:0 stopped",
        "[launch] worker:1 stopped",
    ]
    assert attempts(tmp_path, "worker-0") == attempts(tmp_path, "worker-1") == 1
    assert_all_gone(pids)


def test_reclaim_ports_keeps_free_ports_and_replaces_taken_ones():
    _, tasks = launch.plan_cluster(workers=3)
    assert launch.reclaim_ports(tasks) == tasks

    host, port = tasks[1].address.rsplit(":", 1)
    with socket.socket() as squatter:
        squatter.bind((host, int(port)))
        squatter.listen()
        reclaimed = launch.reclaim_ports(tasks)

    assert [reclaimed[0], reclaimed[2]] == [tasks[0], tasks[2]]
    assert reclaimed[1].name == "worker:1"
    assert reclaimed[1].address != tasks[1].address
    assert reclaimed[1].address.startswith(f"{host}:")
    assert len({task.address for task in reclaimed}) == 3


def test_help_documents_restarts():
    result, _ = run_launch([sys.executable, "-m", "tools.launch", "--help"])

    assert result.returncode == 0
    assert "--max_restarts N" in result.stdout
    assert exit_codes.RESTART_COUNT_ENV in result.stdout
    assert f"exits {exit_codes.EXIT_PREEMPTED}" in result.stdout


@pytest.mark.parametrize(("environ", "count"), [({}, 0), ({"TFDIST_RESTART_COUNT": "2"}, 2)])
def test_restart_count_reads_the_launchers_variable(environ, count):
    assert exit_codes.restart_count(environ) == count


@pytest.mark.parametrize("value", ["", "-1", "two", "1.5"])
def test_restart_count_rejects_what_is_not_a_count(value):
    with pytest.raises(
        exit_codes.RestartCountError,
        match=rf"whole number 0 or more.*Received: TFDIST_RESTART_COUNT='{re.escape(value)}'",
    ):
        exit_codes.restart_count({"TFDIST_RESTART_COUNT": value})


@pytest.mark.parametrize(
    ("environ", "code"), [({}, 42), ({"TFDIST_RESTARTABLE_EXIT_CODE": "143"}, 143)]
)
def test_restartable_exits_use_the_code_the_launcher_names(environ, code):
    assert exit_codes.restartable_exit_code(exit_codes.EXIT_PREEMPTED, environ) == code


@pytest.mark.parametrize("value", ["", "0", "256", "soon"])
def test_a_restartable_exit_code_outside_1_to_255_is_refused(value):
    with pytest.raises(exit_codes.RestartCountError, match=r"exit code from 1 to 255"):
        exit_codes.restartable_exit_code(1, {"TFDIST_RESTARTABLE_EXIT_CODE": value})


def test_the_preempted_code_is_what_tensorflows_preemption_handler_exits_with():
    # The default TerminationConfig of PreemptionCheckpointHandler off GCE (private API: if
    # TensorFlow moves it, check that its default exit code is still the one tfdist uses).
    from tensorflow.python.distribute.failure_handling import failure_handling

    with pytest.raises(SystemExit) as exit_info:
        failure_handling.BorgTerminationConfig().exit_fn()

    assert exit_info.value.code == exit_codes.EXIT_PREEMPTED


def test_the_launcher_and_tfjob_accept_the_same_layouts():
    from tfdist.k8s.job import ManifestError, TrainingJob
    from tfdist.k8s.tfjob import tfjob_manifest
    from tfdist.launch.plan import UsageError, plan_cluster
    from tfdist.layout import Layout, LayoutError

    def launches(layout, strategy):
        try:
            plan_cluster(workers=layout.workers, chief=bool(layout.chief), ps=layout.ps,
                         evaluator=bool(layout.evaluator), strategy=strategy)  # fmt: skip
        except UsageError:
            return False
        return True

    def writes_tfjob(layout, strategy):
        command = ("python", "-m", "experiments.train", f"--strategy={strategy}")
        try:
            tfjob_manifest(TrainingJob(name="j", image="i", command=command, layout=layout))
        except (ManifestError, LayoutError):
            return False
        return True

    strategies = ["auto", "one_device", "mirrored", "central_storage",
                  "multi_worker_mirrored", "parameter_server"]  # fmt: skip
    differ = []
    for chief, workers, ps, evaluator in itertools.product((0, 1), (0, 1, 2, 3), (0, 2), (0, 1)):
        layout = Layout(chief=chief, workers=workers, ps=ps, evaluator=evaluator)
        for strategy in strategies:
            one_replica = sum(layout.counts().values()) == 1
            if one_replica and strategy in ("multi_worker_mirrored", "parameter_server"):
                continue  # the TFJob operator gives one replica no TF_CONFIG: it must refuse
            if launches(layout, strategy) != writes_tfjob(layout, strategy):
                differ.append((layout.describe(), strategy))
    assert not differ, differ
    # The layouts the issue tried: an evaluator beside multi_worker_mirrored, and a
    # single-host strategy started as two workers (refused by both).
    assert launches(Layout(workers=2, evaluator=1), "multi_worker_mirrored")
    assert not launches(Layout(workers=2), "mirrored")

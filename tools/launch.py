"""Run a TensorFlow cluster as local processes, one per task, each with its own TF_CONFIG.

Every task runs COMMAND; its TF_CONFIG names its role and lists every task's address (free
ports on --host). Output lines are prefixed with their task, e.g. "[worker:1] ". The run ends
when the program finishes, when a task fails (the others are then stopped; with --max_restarts
the job then starts again), at --timeout, or on Ctrl-C. A COMMAND that starts with `python`
or `python3` runs under the launcher's own interpreter, as torchrun does, so the tasks see the
same virtualenv. The launcher does not import TensorFlow, so it starts instantly.

examples:
  # MultiWorkerMirroredStrategy on two workers
  python -m tools.launch --workers 2 -- python train.py
  # parameter-server training: the chief coordinates, the workers and ps serve
  python -m tools.launch --chief --workers 2 --ps 1 -- python train.py
  # restart the whole job up to 3 times if a task fails, is killed or is preempted
  # (a parameter-server worker that dies is survived without a restart)
  python -m tools.launch --workers 2 --max_restarts 3 -- python train.py
  # print each task's TF_CONFIG and command line instead of starting anything
  python -m tools.launch --chief --workers 2 --ps 1 --dry_run -- python train.py

roles:
  Without --ps every task runs COMMAND to completion. With --ps only the chief (and the
  evaluator) run the training program; COMMAND should make workers and ps start a
  tf.distribute.Server and wait, and the launcher stops them once the chief exits 0.

failures in parameter-server training (--ps M):
  A worker that dies does not end the job (--on_worker_failure continue, the default with
  --ps): the chief's ClusterCoordinator re-runs the steps the worker was running on the
  other workers, and the launcher logs the loss and carries on; only when every worker is
  gone does the job fail. --on_worker_failure restart also starts the dead worker again
  with its TF_CONFIG (--worker_restarts times at most, 3 by default), as Kubernetes restarts
  a pod; the coordinator then gives it work again. --on_worker_failure stop ends the job
  instead, as a failure of any task does without --ps (synchronous training cannot lose a
  worker). A dead ps or chief ends the job: the variables live on the ps and the chief
  coordinates. A worker missing when the job starts is left out after a grace period (the
  chief starts with --min_workers of them, tfdist.peers.wait_for_servers). After a ps
  dies the chief gets --grace seconds to report where training stopped and which checkpoint
  a restart resumes from; --max_restarts N then restarts the job from that checkpoint.

restarts (--max_restarts N):
  When a task fails (a non-zero exit, or death by a signal) the launcher stops every task, as
  without restarts, then starts the whole job again, at most N times, with the same command
  and TF_CONFIG (a port another program took meanwhile is replaced, and the log says so).
  Every task sees the attempt in TFDIST_RESTART_COUNT: 0 at first, 1 after the first restart,
  and so on, so the program can resume from its checkpoint. A task that exits 42 was
  preempted with its state saved (42 is what TensorFlow's PreemptionCheckpointHandler exits
  with by default off GCE; see tfdist/exit_codes.py): it is restarted like a failure, and
  logged as "preempted (state saved)". --timeout covers all attempts together. A signal to
  the launcher (Ctrl-C, SIGTERM) never restarts anything.

exit status:
  0        every program task exited 0
  N        the first task to fail exited with N (128+S if signal S killed it) and no
           restarts were left; 42 means it was preempted with its state saved
  1        a worker or ps server exited by itself while the program ran, or every worker
           of a parameter-server job died
  2        bad usage
  124      --timeout passed
  126/127  COMMAND cannot be run / was not found
  128+S    the launcher received signal S (130 for Ctrl-C, 143 for SIGTERM)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from tfdist.exit_codes import EXIT_PREEMPTED, RESTART_COUNT_ENV

# The order TensorFlow's launchers list task types in; ports are handed out in this order too.
TASK_TYPES = ("chief", "worker", "ps", "evaluator")
EXIT_USAGE = 2
EXIT_TIMEOUT = 124  # what coreutils `timeout` returns, so scripts can tell the two apart
EXIT_NO_EXEC, EXIT_NOT_FOUND = 126, 127  # the shell's codes for a command it cannot run / find
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL_SECONDS = 0.1
# A task may leave a daemon holding its output pipe open; wait this long for it, not forever.
_DRAIN_SECONDS = 5.0
_EXAMPLE = "python -m tools.launch --workers 2 -- python train.py"
# What a worker's death does to a parameter-server job (without ps, any failure ends the job).
WORKER_FAILURE_CHOICES = ("continue", "restart", "stop")
# --on_worker_failure restart: how often one worker is restarted in place before the job
# goes on without it (a worker that keeps dying at once has a problem a restart won't fix).
WORKER_RESTARTS = 3


class UsageError(ValueError):
    """A launch request that cannot work as given; the CLI prints it and exits with 2."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One process of the cluster.

    Args:
      type: the TF_CONFIG task type: "chief", "worker", "ps" or "evaluator".
      index: the task's index among the tasks of its type.
      address: "host:port" on which the task's tf.distribute.Server listens.
    """

    type: str
    index: int
    address: str

    @property
    def name(self) -> str:
        """The task as logs and messages write it, e.g. "worker:1"."""
        return f"{self.type}:{self.index}"


def plan_cluster(
    *,
    workers: int,
    chief: bool = False,
    ps: int = 0,
    evaluator: bool = False,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
) -> tuple[dict[str, list[str]], list[Task]]:
    """Lays out a cluster on one host and gives every task its own port.

    Args:
      workers: number of worker tasks.
      chief: whether to add a chief (required with `ps`, where it coordinates).
      ps: number of parameter-server tasks.
      evaluator: whether to add an evaluator (listed in the cluster, as Kubeflow does).
      host: address every task listens on; "::1" and "[::1]" both mean IPv6 loopback.
      ports: one port per task in task order; by default the OS picks free ones.

    Returns:
      `(cluster, tasks)`: the TF_CONFIG "cluster" dict holding only the task types present,
      and the tasks in order: chief, workers, ps, evaluator.

    Raises:
      UsageError: if the counts describe no cluster TensorFlow can run, `ports` has the wrong
        length, or no port can be bound on `host`.
    """
    if workers < 0 or ps < 0:
        raise UsageError(f"task counts must be 0 or more. Received: workers={workers}, ps={ps}")
    if workers == 0 and not chief:
        raise UsageError(
            f"no tasks to start: pass --workers N or --chief, e.g. `{_EXAMPLE}`. "
            "Received: workers=0 and no chief"
        )
    if ps and not chief:
        raise UsageError(
            "parameter-server training needs a chief as coordinator: add --chief, e.g. "
            f"`--chief --workers 2 --ps {ps}`. Received: ps={ps} without chief"
        )
    if ps and not workers:
        raise UsageError(
            "parameter-server training needs workers to run the steps the chief schedules: "
            f"add --workers N, e.g. `--chief --workers 2 --ps {ps}`. Received: workers=0"
        )
    counts = {"chief": int(chief), "worker": workers, "ps": ps, "evaluator": int(evaluator)}
    slots = [(task_type, i) for task_type in TASK_TYPES for i in range(counts[task_type])]
    host = host.strip("[]")
    if ports is None:
        ports = _free_ports(host, len(slots))
    elif len(ports) != len(slots):
        raise UsageError(f"expected {len(slots)} ports, one per task. Received: ports={ports}")
    tasks = [Task(t, i, _address(host, port)) for (t, i), port in zip(slots, ports, strict=True)]
    return _cluster_of(tasks), tasks


def tf_config_for(cluster: dict[str, list[str]], task: Task) -> str:
    """Returns the TF_CONFIG value (a JSON string) that makes a process play `task` in `cluster`."""
    return json.dumps({"cluster": cluster, "task": {"type": task.type, "index": task.index}})


def serving_tasks(tasks: Sequence[Task]) -> list[Task]:
    """Returns the tasks that only serve (run a tf.distribute.Server) and never exit by themselves.

    Under parameter-server training these are the workers and parameter servers: they wait for
    the chief to send them work. Without parameter servers every task runs the program to its end.
    """
    if not any(task.type == "ps" for task in tasks):
        return []
    return [task for task in tasks if task.type in ("worker", "ps")]


def _free_ports(host: str, count: int) -> list[int]:
    # Every socket stays bound until all ports are chosen, so the OS cannot hand out a port twice.
    # They close on return because the tasks must bind the ports themselves; the tasks start right
    # after, and take far longer than that to import TensorFlow and bind, so holding the sockets
    # any longer would not make the ports safer.
    with contextlib.ExitStack() as sockets:
        try:
            return [_bind(sockets, host, 0) for _ in range(count)]
        except OSError as error:
            raise UsageError(
                f"cannot bind a port on --host ({error}): expected an address of this "
                f"machine such as 127.0.0.1 or ::1. Received: --host={host}"
            ) from error


def reclaim_ports(tasks: Sequence[Task]) -> list[Task]:
    """Keeps every task's address whose port is still free and gives the others free ports.

    A restarted job should get the TF_CONFIG it had, but another program may have taken one
    of its ports since the first start.

    Args:
      tasks: the tasks of the job that is about to be restarted.

    Returns:
      The tasks in the same order, each with its old address or, if its port was taken, the
      same host with a port the OS picked.
    """
    with contextlib.ExitStack() as sockets:
        taken = []
        for task in tasks:
            try:
                _bind(sockets, *_split_address(task.address))
            except OSError:
                taken.append(task)
        # The free ports stay bound while new ones are picked, so none is handed out twice.
        moved = {}
        for task in taken:
            host, _ = _split_address(task.address)
            address = _address(host, _bind(sockets, host, 0))
            moved[task] = dataclasses.replace(task, address=address)
    return [moved.get(task, task) for task in tasks]


def _bind(sockets: contextlib.ExitStack, host: str, port: int) -> int:
    # Binds a socket that stays bound until `sockets` closes and returns its port.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = sockets.enter_context(socket.socket(family, socket.SOCK_STREAM))
    if port:
        # gRPC servers bind with SO_REUSEADDR, so a port whose closed connections linger in
        # TIME_WAIT after a run is free for them; it must count as free here too.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock.getsockname()[1]


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _address(host: str, port: int) -> str:
    # An IPv6 address contains colons, so it needs brackets to be told apart from the port.
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _with_own_python(command: Sequence[str]) -> list[str]:
    # `python` on PATH is often not the interpreter the launcher runs under (an unactivated
    # virtualenv); the tasks should get the one whose packages the user just installed.
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


def _cluster_of(tasks: Sequence[Task]) -> dict[str, list[str]]:
    cluster: dict[str, list[str]] = {}
    for task in tasks:
        cluster.setdefault(task.type, []).append(task.address)
    return cluster


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _exit_code(returncode: int) -> int:
    # Popen reports death by signal S as -S; shells report it as 128 + S.
    return returncode if returncode >= 0 else 128 - returncode


def _failure(returncode: int, *, with_code: bool = False) -> str:
    # `with_code` also names the exit code a shell would report for a death by signal.
    if returncode == EXIT_PREEMPTED:
        return f"was preempted (state saved, exit code {returncode})"
    if returncode < 0 and with_code:
        return f"failed with exit code {_exit_code(returncode)} ({_signal_name(-returncode)})"
    if returncode < 0:
        return f"was killed by {_signal_name(-returncode)}"
    if returncode > 0:
        return f"failed with exit code {returncode}"
    return "exited by itself, but under parameter-server training it must serve until stopped"


def _worker_failure_mode(choice: str | None, parameter_server: bool) -> str:
    # Synchronous training cannot lose a worker: its collectives need every one of them.
    if choice is None:
        return "continue" if parameter_server else "stop"
    if choice not in WORKER_FAILURE_CHOICES:
        raise UsageError(
            f"--on_worker_failure must be one of {', '.join(WORKER_FAILURE_CHOICES)}. "
            f"Received: --on_worker_failure={choice}"
        )
    if choice != "stop" and not parameter_server:
        raise UsageError(
            f"--on_worker_failure {choice} needs parameter-server training (--ps M): without ps "
            "tasks every worker takes part in every step, so the job cannot go on without one; "
            f"use --max_restarts N to restart the whole job instead. Received: "
            f"--on_worker_failure={choice} without --ps"
        )
    return choice


def _plural(items: Sequence[object], noun: str) -> str:
    return f"{len(items)} {noun}" + ("" if len(items) == 1 else "s")


class Launcher:
    """Starts one process per task, relays their output and stops them all together.

    Example:
        _, tasks = plan_cluster(workers=2)
        exit_code = Launcher(["python", "train.py"], tasks=tasks, max_restarts=3).run()

    Args:
      command: program and arguments every task runs (without a shell).
      tasks: the tasks from `plan_cluster`.
      timeout: seconds the whole run, every attempt included, may take before every task is
        stopped.
      grace: seconds a task gets to exit after SIGTERM before it is killed with SIGKILL.
      max_restarts: how many times the whole job may be started again after a task fails.
      on_worker_failure: with ps tasks, "continue" (the default) survives a worker's death,
        since the chief reschedules its steps on the others; "restart" also restarts the
        worker in place (up to `worker_restarts` times); "stop" ends the job. Without ps
        tasks only "stop" (the default) is possible.
      worker_restarts: with on_worker_failure="restart", how many times one worker is
        restarted in place before its death is left as it is.

    Raises:
      UsageError: if `command` or `tasks` is empty, `timeout` <= 0, `grace` < 0,
        `max_restarts` or `worker_restarts` < 0, or `on_worker_failure` is unknown, or
        other than "stop" without ps.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        tasks: Sequence[Task],
        timeout: float = 3600.0,
        grace: float = 10.0,
        max_restarts: int = 0,
        on_worker_failure: str | None = None,
        worker_restarts: int = WORKER_RESTARTS,
    ) -> None:
        if not command:
            raise UsageError(f"no command to run: put it after `--`, e.g. `{_EXAMPLE}`")
        if not tasks:
            raise UsageError("no tasks to start: build them with plan_cluster(workers=...)")
        if timeout <= 0:
            raise UsageError(f"--timeout must be more than 0 s. Received: --timeout={timeout:g}")
        if grace < 0:
            raise UsageError(f"--grace must be 0 s or more. Received: --grace={grace:g}")
        if max_restarts < 0:
            raise UsageError(
                f"--max_restarts must be 0 or more. Received: --max_restarts={max_restarts}"
            )
        if worker_restarts < 0:
            raise UsageError(
                "--worker_restarts must be 0 or more. Received: "
                f"--worker_restarts={worker_restarts}"
            )
        self._worker_restarts_allowed = worker_restarts
        self._command, self._tasks = list(command), list(tasks)
        self._serving = serving_tasks(self._tasks)
        self._worker_failure = _worker_failure_mode(on_worker_failure, bool(self._serving))
        self._timeout, self._grace = timeout, grace
        self._max_restarts, self._restarts = max_restarts, 0
        self._lock = threading.Lock()
        self._procs: dict[Task, subprocess.Popen[bytes]] = {}
        self._readers: dict[Task, threading.Thread] = {}
        self._stopped: dict[Task, str] = {}  # tasks the launcher ended -> how
        self._signals: list[int] = []

    def run(self) -> int:
        """Starts the tasks, supervises them until the run ends, and stops whatever is left.

        When a task fails and restarts remain, everything is stopped and the job starts again.

        Returns:
          The exit code, as the module docstring (and --help) lists them.
        """
        sys.stdout.flush()  # text printed earlier must come out before the bytes written here
        previous_handlers = self._install_signal_handlers()
        deadline = time.monotonic() + self._timeout  # one budget for all attempts together
        try:
            while True:
                code, failed = self._attempt(deadline)
                if failed is not None:
                    code = self._exit_or_restart(code, failed, deadline)
                if code is not None:
                    return code
                self._move_taken_ports()
        finally:
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _attempt(self, deadline: float) -> tuple[int, tuple[Task, int] | None]:
        # Runs the job once. Returns its exit code and, if a task's failure ended it, that
        # task with its Popen return code: the one kind of ending a restart may cure.
        self._procs, self._readers, self._stopped = {}, {}, {}
        self._worker_restarts: dict[Task, int] = {}
        failed = None
        try:
            code = self._start_all()
            if code is None:
                code, failed = self._supervise(deadline)
        finally:
            self._stop_all()
            for reader in self._readers.values():
                reader.join(_DRAIN_SECONDS)
        for task in self._tasks:
            self._say(f"{task.name} {self._outcome(task)}")
        return code, failed

    def _exit_or_restart(self, code: int, failed: tuple[Task, int], deadline: float) -> int | None:
        # After a task failed: returns the launcher's exit code, or None to restart the job.
        task, returncode = failed
        cause = f"{task.name} {_failure(returncode, with_code=True)}"
        if self._signals:  # it came while the tasks were being stopped
            self._say(f"received {_signal_name(self._signals[0])}; not restarting")
            return code
        if self._restarts == self._max_restarts:
            if self._max_restarts:
                self._say(f"{cause}; no restarts left (--max_restarts {self._max_restarts})")
            elif self._serving and task.type in ("chief", "ps"):
                self._say(
                    f"{cause}, which parameter-server training cannot survive; the job resumes "
                    "from the chief's last checkpoint in its model_dir when run again, or when "
                    "launched with --max_restarts N"
                )
            return code
        if time.monotonic() > deadline:
            # With restarts left, only success, a signal or the timeout end the run.
            self._say(f"{cause}; timed out after {self._timeout:g} s, so not restarting")
            return EXIT_TIMEOUT
        self._restarts += 1
        self._say(f"{cause}; restarting the job (restart {self._restarts} of {self._max_restarts})")
        return None

    def _move_taken_ports(self) -> None:
        # A task whose port another program took since the last start gets a new one, and the
        # log says so: the restarted job's TF_CONFIG then differs from the last one's.
        tasks = reclaim_ports(self._tasks)
        for old, new in zip(self._tasks, tasks, strict=True):
            if new != old:
                self._say(f"{old.name}'s port {old.address} is taken; it moves to {new.address}")
        self._tasks, self._serving = tasks, serving_tasks(tasks)

    def _start_all(self) -> int | None:
        where = ", ".join(f"{task.name} ({task.address})" for task in self._tasks)
        # One line even for `python -c` programs, so that every line of the log has a prefix.
        command = shlex.join(self._command).replace("\n", "\\n")
        serving = "; workers and ps serve until the chief finishes" if self._serving else ""
        again = f" (restart {self._restarts} of {self._max_restarts})" if self._restarts else ""
        self._say(
            f"starting {_plural(self._tasks, 'task')}{again}: {where}; command: {command}{serving}"
        )
        for task in self._tasks:
            try:
                self._start(task)
            except OSError as error:
                stopping = "; stopping the tasks already started" if self._procs else ""
                self._say(f"cannot start {task.name}: {error}{stopping}")
                return EXIT_NOT_FOUND if isinstance(error, FileNotFoundError) else EXIT_NO_EXEC
        return None

    def _start(self, task: Task) -> None:
        # Starts (or restarts in place) one task with its TF_CONFIG; raises OSError if it cannot.
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # lines should arrive as they are printed
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # N copies of TF's C++ INFO logs bury the rest
        env[RESTART_COUNT_ENV] = str(self._restarts)  # so the program can say it is resuming
        env["TF_CONFIG"] = tf_config_for(_cluster_of(self._tasks), task)
        proc = subprocess.Popen(
            _with_own_python(self._command),
            env=env,
            stdin=subprocess.DEVNULL,  # several tasks cannot share one terminal's input
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a group of its own: stopping it reaches its children
        )
        self._procs[task] = proc
        self._readers[task] = threading.Thread(
            target=self._relay, args=(task, proc.stdout), daemon=True
        )
        self._readers[task].start()

    def _supervise(self, deadline: float) -> tuple[int, tuple[Task, int] | None]:
        programs = [task for task in self._tasks if task not in self._serving]
        workers = [task for task in self._serving if task.type == "worker"]
        exited: set[Task] = set()
        while not self._signals:
            for task, proc in self._procs.items():
                if task in exited or proc.poll() is None:
                    continue
                exited.add(task)
                if proc.returncode == 0 and task not in self._serving:
                    continue
                self._readers[task].join(1.0)  # its last lines (a traceback?) come first
                restart = task in workers and self._worker_failure == "restart"
                if restart and self._restart_in_place(task, proc.returncode):
                    exited.discard(task)
                    continue
                if task in workers and self._worker_failure in ("continue", "restart"):
                    left = [w for w in workers if w not in exited]
                    if left:
                        self._say(
                            f"{task.name} {_failure(proc.returncode)}; parameter-server training "
                            f"continues on the other {_plural(left, 'worker')} "
                            f"({', '.join(w.name for w in left)})"
                        )
                        continue
                    self._say(
                        f"{task.name} {_failure(proc.returncode)}, and it was the last worker: "
                        "parameter-server training cannot go on; stopping the other tasks"
                    )
                    return _exit_code(proc.returncode) or 1, (task, proc.returncode)
                if task.type == "ps" and self._serving:
                    self._let_chief_report(task, proc.returncode)
                else:
                    self._say(f"{task.name} {_failure(proc.returncode)}; stopping the other tasks")
                # A server that exits 0 failed too.
                return _exit_code(proc.returncode) or 1, (task, proc.returncode)
            if exited.issuperset(programs):
                lost = [task for task in workers if task in exited]
                if self._serving:
                    names = ", ".join(task.name for task in self._serving if task not in lost)
                    despite = f" despite losing {', '.join(t.name for t in lost)}" if lost else ""
                    self._say(f"the program finished{despite}; stopping the serving tasks {names}")
                return 0, None
            if time.monotonic() > deadline:
                running = ", ".join(task.name for task in self._tasks if task not in exited)
                self._say(f"timed out after {self._timeout:g} s; still running: {running}")
                return EXIT_TIMEOUT, None
            time.sleep(_POLL_SECONDS)
        self._say(f"received {_signal_name(self._signals[0])}; stopping all tasks")
        return 128 + self._signals[0], None

    def _restart_in_place(self, task: Task, returncode: int) -> bool:
        # What Kubernetes does with a worker pod: the chief's coordinator waits for the
        # worker at its old address, rebuilds its datasets and sends it closures again.
        count = self._worker_restarts.get(task, 0) + 1
        allowed = self._worker_restarts_allowed
        if count > allowed:
            self._say(f"{task.name} has been restarted {allowed} times; not again")
            return False
        self._say(
            f"{task.name} {_failure(returncode)}; parameter-server training continues on the "
            f"other workers, and {task.name} restarts in place ({count} of {allowed})"
        )
        self._worker_restarts[task] = count
        try:
            self._start(task)
        except OSError as error:
            self._say(f"cannot restart {task.name}: {error}")
            return False
        return True

    def _let_chief_report(self, ps: Task, returncode: int) -> None:
        # The chief notices a dead ps within seconds and explains where training stopped
        # and where a restart resumes; stopping it at once would cut that message off.
        chief = next(task for task in self._tasks if task.type == "chief")
        proc = self._procs[chief]
        self._say(
            f"{ps.name} {_failure(returncode)}; parameter-server training cannot continue "
            f"without it; giving the chief up to {self._grace:g} s to report, then stopping "
            "the other tasks"
        )
        deadline = time.monotonic() + self._grace
        while proc.poll() is None and time.monotonic() < deadline and not self._signals:
            time.sleep(_POLL_SECONDS)
        self._readers[chief].join(1.0 if proc.poll() is not None else 0)

    def _stop_all(self) -> None:
        running = [task for task, proc in self._procs.items() if proc.poll() is None]
        self._stopped.update(dict.fromkeys(running, "stopped"))
        # Every group, not only those of running tasks: a task that exited may have left children
        # behind. (An empty group's id is reused only after the pid counter wraps around.)
        self._signal_groups(signal.SIGTERM)
        deadline = time.monotonic() + self._grace
        signals_so_far = len(self._signals)  # one more Ctrl-C while waiting means "now"
        while any(self._procs[task].poll() is None for task in running) and (
            time.monotonic() < deadline and len(self._signals) == signals_so_far
        ):
            time.sleep(0.05)
        for task in running:
            if self._procs[task].poll() is None:
                self._stopped[task] = f"killed (still running {self._grace:g} s after SIGTERM)"
        self._signal_groups(signal.SIGKILL)
        for proc in self._procs.values():
            proc.wait()

    def _signal_groups(self, signum: int) -> None:
        for proc in self._procs.values():
            # start_new_session made each task the leader of a group whose id is its pid.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)

    def _outcome(self, task: Task) -> str:
        if task in self._stopped:
            return self._stopped[task]
        if task not in self._procs:
            return "not started"
        code = self._procs[task].returncode
        return f"exit {code}" if code >= 0 else f"killed by {_signal_name(-code)}"

    def _install_signal_handlers(self) -> dict[int, object]:
        # The tasks run in sessions of their own, so a Ctrl-C in the terminal reaches only the
        # launcher, which passes it on as SIGTERM. Only the main thread may set handlers, and an
        # ignored signal stays ignored (under `nohup`, a hang-up must not stop the run).
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {
            signum: signal.signal(signum, lambda signum, _: self._signals.append(signum))
            for signum in _FORWARDED_SIGNALS
            if signal.getsignal(signum) is not signal.SIG_IGN
        }

    def _relay(self, task: Task, pipe: BinaryIO) -> None:
        prefix = f"[{task.name}] ".encode()
        with pipe:
            for line in pipe:
                self._write(prefix + (line if line.endswith(b"\n") else line + b"\n"))

    def _say(self, message: str) -> None:
        self._write(f"[launch] {message}\n".encode())

    def _write(self, data: bytes) -> None:
        # Bytes, not text: a task's output passes through whatever its encoding. If our reader
        # went away (`| head`), keep draining the tasks so that they do not block on a full pipe.
        with self._lock, contextlib.suppress(OSError, ValueError):
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()


def _dry_run_lines(command: Sequence[str], tasks: Sequence[Task]) -> Iterator[str]:
    yield f"# {_plural(tasks, 'task')}; run each line in a shell of its own"
    cluster = _cluster_of(tasks)
    for task in tasks:
        yield f"# {task.name} ({task.address})"
        yield f"TF_CONFIG={shlex.quote(tf_config_for(cluster, task))} {shlex.join(command)}"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.launch",
        usage="%(prog)s [--workers N] [--chief] [--ps M] [--evaluator] [options] -- COMMAND ...",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation could silently take a flag meant for COMMAND
    )
    add = parser.add_argument
    add("--workers", type=int, default=1, metavar="N", help="number of worker tasks (default: 1)")
    add("--chief", action="store_true", help="add a chief task; required with --ps")
    add(
        "--ps",
        type=int,
        default=0,
        metavar="M",
        help="number of parameter-server tasks (default: 0)",
    )
    add("--evaluator", action="store_true", help="add an evaluator task (side-car evaluation)")
    add(
        "--host",
        default="127.0.0.1",
        help="address the tasks listen on, e.g. ::1 (default: 127.0.0.1)",
    )
    add(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="stop every task and exit 124 after this long, all restarts included (default: 3600)",
    )
    add(
        "--grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="time a stopped task gets between SIGTERM and SIGKILL (default: 10)",
    )
    add(
        "--max_restarts",
        type=int,
        default=0,
        metavar="N",
        help=f"when a task fails, is killed or is preempted (exits {EXIT_PREEMPTED}), stop every "
        "task and start the whole job again, up to N times; the tasks find the attempt in "
        f"{RESTART_COUNT_ENV} (default: 0)",
    )
    add(
        "--on_worker_failure",
        choices=WORKER_FAILURE_CHOICES,
        default=None,
        help="with --ps: 'continue' (the default) keeps parameter-server training going when a "
        "worker dies, its steps rescheduled on the others; 'restart' also starts the worker "
        "again in place, up to --worker_restarts times, and the chief gives it work again; "
        "'stop' ends the job. Without --ps a failed task always ends the job (default: "
        "continue with --ps, else stop)",
    )
    add(
        "--worker_restarts",
        type=int,
        default=WORKER_RESTARTS,
        metavar="N",
        help="with --on_worker_failure restart: how many times one worker is restarted in "
        f"place (default: {WORKER_RESTARTS})",
    )
    add(
        "--dry_run",
        action="store_true",
        help="print each task's TF_CONFIG and command line, to run by hand or on other hosts, "
        "and start nothing",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line, then launches the cluster (or prints it with --dry_run).

    Args:
      argv: the arguments after the program name; `sys.argv[1:]` by default.

    Returns:
      The exit code, as the module docstring (and --help) lists them.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` belongs to the command, even flags the launcher also has.
    split = argv.index("--") if "--" in argv else len(argv)
    command = argv[split + 1 :]
    args, unknown = _build_parser().parse_known_args(argv[:split])
    try:
        if unknown:
            raise UsageError(
                f"unrecognised arguments {shlex.join(unknown)!r}: the launcher's flags are listed "
                f"by --help, and the command goes after `--`, e.g. `{_EXAMPLE}`"
            )
        _, tasks = plan_cluster(
            workers=args.workers,
            chief=args.chief,
            ps=args.ps,
            evaluator=args.evaluator,
            host=args.host,
        )
        launcher = Launcher(
            command,
            tasks=tasks,
            timeout=args.timeout,
            grace=args.grace,
            max_restarts=args.max_restarts,
            on_worker_failure=args.on_worker_failure,
            worker_restarts=args.worker_restarts,
        )
    except UsageError as error:
        print(f"launch: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        print("\n".join(_dry_run_lines(command, tasks)), flush=True)
        return 0
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())

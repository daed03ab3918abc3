"""The supervisor: starts one process per task, relays their output, stops and restarts them."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tfdist.exit_codes import (
    EXIT_PREEMPTED,
    EXIT_STORAGE,
    EXIT_USAGE,
    NOT_RESTARTABLE,
    RESTART_COUNT_ENV,
)
from tfdist.launch.output import NATIVE_LOGS_ENV, OncePerProcess, RuntimeLines
from tfdist.launch.plan import (
    Task,
    UsageError,
    cluster_of,
    reclaim_ports,
    serving_tasks,
    tf_config_for,
)
from tfdist.launch.preload import SERVER_ENV, Preloader, python_program
from tfdist.launch.straggler import Straggle, Straggler

EXIT_TIMEOUT = 124  # what coreutils `timeout` returns, so scripts can tell the two apart
EXIT_NO_EXEC, EXIT_NOT_FOUND = 126, 127  # the shell's codes for a command it cannot run / find
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL_SECONDS = 0.1
# A chief or worker failed by itself, the launcher watches the other tasks this long before
# naming the cause: a ps or peer killed first can still be exiting (a loaded machine
# schedules it late) when the report of it has already ended the reporter.
_SETTLE_SECONDS = 1.0
# A task may leave a daemon holding its output pipe open; wait this long for it, not forever.
_DRAIN_SECONDS = 5.0
EXAMPLE = "tfdist-launch --workers 2 -- python train.py"
# What a worker's death does to a parameter-server job (without ps, any failure ends the job).
WORKER_FAILURE_CHOICES = ("continue", "restart", "stop")
# --on_worker_failure restart: how often one worker is restarted in place before the job
# goes on without it (a worker that keeps dying at once has a problem a restart won't fix).
WORKER_RESTARTS = 3


def tasks_file(launcher_pid: int) -> Path:
    """Where a running launcher lists its tasks' pids, {"worker:1": pid, ...}, for tools that
    signal them (tools/chaos.py): a task forked by a preload server is not the launcher's
    child, and its /proc environ is the server's."""
    return Path(tempfile.gettempdir(), f"tfdist-launch-{launcher_pid}.json")


def _with_own_python(command: Sequence[str]) -> list[str]:
    # `python` on PATH is often not the interpreter the launcher runs under (an unactivated
    # virtualenv); the tasks should get the one whose packages the user just installed.
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


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
    if returncode == EXIT_USAGE:
        return f"stopped on a usage error (exit code {returncode}: see its error line)"
    if returncode == EXIT_STORAGE:
        return f"stopped on a storage fault (exit code {returncode}: see its error line)"
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
      cluster: the whole job's cluster, when `tasks` are only this host's share of it
        (tfdist-launch --nnodes); by default the cluster of `tasks`.
      stragglers: tasks to slow down or pause on purpose, for benchmarks (straggler.py).
      preload: modules (e.g. tensorflow, keras) to import once, in a server that then forks
        every task of a `python ...` command, restarts included (preload.py).

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
        cluster: dict[str, list[str]] | None = None,
        stragglers: Sequence[Straggle] = (),
        preload: Sequence[str] = (),
    ) -> None:
        if not command:
            raise UsageError(f"no command to run: put it after `--`, e.g. `{EXAMPLE}`")
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
        names = {task.name for task in tasks}
        for straggle in stragglers:
            if straggle.task not in names:
                raise UsageError(
                    f"--slow and --pause name a task of this job ({', '.join(sorted(names))}). "
                    f"Received: {straggle.task}"
                )
        self._straggles = list(stragglers)
        self._stragglers: list[Straggler] = []
        self._command, self._tasks = list(command), list(tasks)
        # The whole job's cluster when this host runs only some of its tasks (--nnodes).
        self._cluster = cluster
        self._serving = serving_tasks(self._tasks)
        self._worker_failure = _worker_failure_mode(on_worker_failure, bool(self._serving))
        self._timeout, self._grace = timeout, grace
        self._max_restarts, self._restarts = max_restarts, 0
        self._lock = threading.Lock()
        self._procs: dict[Task, subprocess.Popen[bytes]] = {}
        self._readers: dict[Task, threading.Thread] = {}
        self._stopped: dict[Task, str] = {}  # tasks the launcher ended -> how
        self._signals: list[int] = []
        self._preload = list(preload)
        self._preloader: Preloader | None = None

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
            self._start_preloader()
            while True:
                code, failed = self._attempt(deadline)
                if failed is not None:
                    code = self._exit_or_restart(code, failed, deadline)
                if code is not None:
                    return code
                self._move_taken_ports()
        finally:
            if self._preloader is not None:
                self._preloader.close()
            tasks_file(os.getpid()).unlink(missing_ok=True)
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
                self._hold_up()
                code, failed = self._supervise(deadline)
        finally:
            for straggler in self._stragglers:
                straggler.stop()  # before SIGTERM: a stopped task could not take it
            self._stragglers = []
            self._stop_all(peer_lost=failed is not None)
            for reader in self._readers.values():
                reader.join(_DRAIN_SECONDS)
        for task in self._tasks:
            self._say(f"{task.name} {self._outcome(task)}")
        if failed is not None and failed[1] not in NOT_RESTARTABLE:
            # A task's usage error or storage fault can end its peers first (they lose it,
            # a restartable failure): it decides, so that no restart meets it again.
            final = [
                (t, proc.returncode)
                for t, proc in self._procs.items()
                if proc.returncode in NOT_RESTARTABLE
            ]
            if final:
                failed = final[0]
                code = failed[1]
        return code, failed

    def _exit_or_restart(self, code: int, failed: tuple[Task, int], deadline: float) -> int | None:
        # After a task failed: returns the launcher's exit code, or None to restart the job.
        task, returncode = failed
        cause = f"{task.name} {_failure(returncode, with_code=True)}"
        if self._signals:  # it came while the tasks were being stopped
            self._say(f"received {_signal_name(self._signals[0])}; not restarting")
            return code
        if returncode == EXIT_USAGE:  # the command is wrong: every restart would fail alike
            # Its failure was said when it happened; say only the decision.
            self._say(f"not restarting: {task.name}'s usage error would come back every time")
            return code
        if returncode == EXIT_STORAGE:
            self._say(
                f"not restarting: {task.name}'s storage fault would come back until it is "
                "fixed; then run the same command again, which resumes from the last checkpoint"
            )
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

    def _start_preloader(self) -> None:
        server = os.environ.get(SERVER_ENV)
        if not (self._preload or server):
            return
        if python_program(_with_own_python(self._command)) is None:
            if not self._preload:
                return
            self._say(
                f"--preload {','.join(self._preload)} forks `python -m MODULE`, `python FILE` "
                "and `python -c CODE` commands of the launcher's Python; this command starts "
                "afresh in each task"
            )
            return
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        said_once = OncePerProcess()

        def relay(line: bytes) -> None:
            if not said_once.repeats(line):
                self._write(b"[preload] " + (line if line.endswith(b"\n") else line + b"\n"))

        preloader = Preloader(self._preload, env=env, say=self._say, relay=relay)
        if preloader.connect(server) if server else preloader.start():
            self._preloader = preloader

    def _hold_up(self) -> None:
        # The stragglers asked for (--slow, --pause), each on its task's current process.
        by_name = {task.name: task for task in self._tasks}
        for straggle in self._straggles:
            task = by_name[straggle.task]
            straggler = Straggler(
                straggle, pid=lambda task=task: self._procs[task].pid, say=self._say
            )
            straggler.start()
            self._stragglers.append(straggler)

    def _start(self, task: Task) -> None:
        # Starts (or restarts in place) one task with its TF_CONFIG; raises OSError if it cannot.
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # lines should arrive as they are printed
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # N copies of TF's C++ INFO logs bury the rest
        env[RESTART_COUNT_ENV] = str(self._restarts)  # so the program can say it is resuming
        env["TF_CONFIG"] = tf_config_for(self._cluster or cluster_of(self._tasks), task)
        command = _with_own_python(self._command)
        if self._preloader is not None:
            proc = self._preloader.spawn(command, env=env)
        else:
            proc = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,  # several tasks cannot share one terminal's input
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a group of its own: stopping it reaches its children
            )
        self._procs[task] = proc
        self._readers[task] = threading.Thread(target=self._relay, args=(task, proc), daemon=True)
        self._readers[task].start()
        self._list_tasks()

    def _list_tasks(self) -> None:
        # Written whole, then renamed over the last list: a reader never sees half of one.
        path = tasks_file(os.getpid())
        listing = path.with_suffix(".new")
        listing.write_text(json.dumps({t.name: p.pid for t, p in self._procs.items()}))
        listing.replace(path)

    def _supervise(self, deadline: float) -> tuple[int, tuple[Task, int] | None]:
        programs = [task for task in self._tasks if task not in self._serving]
        workers = [task for task in self._serving if task.type == "worker"]
        exited: set[Task] = set()
        while not self._signals:
            ended = self._ended(exited)
            if any(self._failed_by_itself(t) for t in ended):
                ended = self._settled(exited, ended)
            # A dead ps, or a task killed by a signal, is the cause of what ends with it (the
            # chief reports the lost ps, a worker its lost peer, and exits): seen in the same
            # round, it is told first, or the reporter's exit would be blamed and the killed
            # task said to be stopped.
            ended.sort(key=lambda t: (t.type != "ps", self._procs[t].returncode >= 0))
            for task in ended:
                proc = self._procs[task]
                exited.add(task)
                if proc.returncode == 0 and task not in self._serving:
                    continue
                self._readers[task].join(1.0)  # its last lines (a traceback?) come first
                restart = (
                    task in workers
                    and self._worker_failure == "restart"
                    and proc.returncode not in NOT_RESTARTABLE
                )
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

    def _ended(self, exited: set[Task]) -> list[Task]:
        return [t for t, p in self._procs.items() if t not in exited and p.poll() is not None]

    def _failed_by_itself(self, task: Task) -> bool:
        """A chief that failed, or a worker that exited with an error of its own (not a
        signal): it may be reporting a peer that died first (a lost ps or worker)."""
        code = self._procs[task].returncode or 0
        return (task.type == "chief" and code != 0) or (task.type == "worker" and code > 0)

    def _settled(self, exited: set[Task], ended: list[Task]) -> list[Task]:
        """`ended` and whatever other task ends within the settle time: a ps or a peer that
        was killed first is the cause of the failure seen with it, even when it is still
        exiting (or its exit has not reached the launcher yet: a forked task's comes from
        the preload server)."""
        deadline = time.monotonic() + _SETTLE_SECONDS
        while time.monotonic() < deadline and not self._signals:
            others = [t for t in self._procs if t not in ended and t not in exited]
            if not others or any(self._procs[t].poll() is not None for t in others):
                break
            time.sleep(_POLL_SECONDS)
        return self._ended(exited)

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

    def _stop_all(self, *, peer_lost: bool = False) -> None:
        """SIGTERM to every task, SIGKILL to those still running after the grace period.

        A SIGTERM asks a training task to save at its next step boundary. After a peer's
        failure (`peer_lost`) a survivor may never reach one: its collective waits for the
        peer that is gone. Halfway through the grace such a task gets a second SIGTERM, which
        tfdist's trainer takes as "stop now", so it exits on its own line, not by SIGKILL.
        """
        running = [task for task, proc in self._procs.items() if proc.poll() is None]
        self._stopped.update(dict.fromkeys(running, "stopped"))
        # Every group, not only those of running tasks: a task that exited may have left children
        # behind. (An empty group's id is reused only after the pid counter wraps around.)
        self._signal_groups(signal.SIGTERM)
        start = time.monotonic()
        signals_so_far = len(self._signals)  # one more Ctrl-C while waiting means "now"

        def wait(until: float) -> list[Task]:
            while any(self._procs[task].poll() is None for task in running) and (
                time.monotonic() < until and len(self._signals) == signals_so_far
            ):
                time.sleep(0.05)
            return [task for task in running if self._procs[task].poll() is None]

        left = wait(start + (self._grace / 2 if peer_lost else self._grace))
        if peer_lost and left and len(self._signals) == signals_so_far:
            self._say(
                f"{', '.join(t.name for t in left)} did not stop within {self._grace / 2:g} s of "
                "SIGTERM, most likely waiting in a collective for "
                "the task that failed; SIGTERM again: stop now"
            )
            for task in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._procs[task].pid, signal.SIGTERM)
            left = wait(start + self._grace)
        for task in left:
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

    def _relay(self, task: Task, proc: subprocess.Popen) -> None:
        prefix = f"[{task.name}] ".encode()
        said_once = OncePerProcess()
        runtime = RuntimeLines(show_all=os.environ.get(NATIVE_LOGS_ENV, "") == "all")

        def write(line: bytes) -> None:
            self._write(prefix + (line if line.endswith(b"\n") else line + b"\n"))

        with proc.stdout as pipe:
            for line in pipe:
                if said_once.repeats(line):
                    continue
                for out in runtime.passed(line):
                    write(out)
        try:
            returncode = proc.wait(timeout=_DRAIN_SECONDS)
        except subprocess.TimeoutExpired:  # its output closed early: show what was held
            returncode = None
        for out in runtime.at_exit(returncode):
            write(out)
        if runtime.dropped and returncode != 0:  # a clean finish's are nobody's business
            self._say(
                f"{task.name}: {runtime.dropped} line(s) of TensorFlow's runtime log held back "
                f"(they only repeat its own error line or a lost peer's; {NATIVE_LOGS_ENV}=all "
                "shows them)"
            )

    def _say(self, message: str) -> None:
        self._write(f"[launch] {message}\n".encode())

    def _write(self, data: bytes) -> None:
        # Bytes, not text: a task's output passes through whatever its encoding. If our reader
        # went away (`| head`), keep draining the tasks so that they do not block on a full pipe.
        with self._lock, contextlib.suppress(OSError, ValueError):
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

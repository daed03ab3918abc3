"""Tasks forked from one interpreter that has imported TensorFlow already (--preload).

Each task of a Python command spends its first seconds importing TensorFlow and Keras (about
6 s of CPU on a 2-core host) before its first line runs, and a restart pays it again. With
`tfdist-launch --preload tensorflow,keras` the launcher starts one preload server, which
imports those modules once; every task is then forked from it, so it starts in a fraction of
a second, restarts too, and shares the imported pages with its peers. gunicorn's --preload
and the forkserver of Python's multiprocessing do the same.

A forked task is still a process of its own: its own pid, session and process group (the
launcher's signals reach it as before), its own TF_CONFIG and environment, its output on its
own pipe. Only a command of the launcher's own Python in one of three forms is forked:
`python -m MODULE ...`, `python FILE ...` and `python -c CODE ...`; any other command (other
interpreter options, another program) is started afresh, as without --preload. The server
runs no TensorFlow op, so no runtime thread exists when it forks.

What differs from a fresh interpreter: the preloaded modules were imported with the
launcher's environment, not the task's (TF_CONFIG is read later, when a strategy is made,
so it is the task's; the task's PYTHONPATH is added to the search path); the modules the
server imported, tfdist.launch among them, are imported already; and the server's
standard stream objects (their buffering) and hash seed are shared. The `random` module
and NumPy's global generator are seeded afresh in each task. The imports' objects are
frozen out of the garbage collector (gc.freeze), as they live as long as a task.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import traceback
import types
from collections.abc import Callable, Sequence
from typing import NoReturn

PRELOAD_ENV = "TFDIST_PRELOAD"  # the default of --preload: modules, comma-separated
# A running server (server_command) that every launcher which sees this uses for its tasks:
# a test suite or a sweep of many short jobs imports TensorFlow once in all.
SERVER_ENV = "TFDIST_PRELOAD_SERVER"
READY_SECONDS = 300.0  # the longest a launcher waits for a server's imports
_MESSAGE_BYTES = 1 << 22  # a task's command and environment travel in one message
_SERVER = "import sys; from tfdist.launch.preload import main; main(sys.argv[1:])"


def python_program(command: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """What a command of this interpreter runs: ("module", NAME, args) for `python -m NAME`,
    ("script", PATH, args) for `python PATH`, ("code", TEXT, args) for `python -c TEXT`;
    None for any other command (it is not forked)."""
    if len(command) < 2 or command[0] != sys.executable:
        return None
    first = command[1]
    if first in ("-m", "-c"):
        if len(command) < 3:
            return None
        return ("module" if first == "-m" else "code", command[2], list(command[3:]))
    if first.startswith("-"):  # an interpreter option: only a fresh interpreter honours it
        return None
    return ("script", first, list(command[2:]))


class Forked:
    """A task forked by the preload server, read as the supervisor reads a subprocess.Popen:
    `pid`, `stdout` (and `stderr` where it was asked for apart), `returncode`, `poll()` and
    `wait()`."""

    def __init__(self, args: Sequence[str], pid: int, stdout, preloader: Preloader, stderr=None):
        self.args, self.pid, self.stdout, self.stderr = list(args), pid, stdout, stderr
        self._codes, self._ended = preloader._codes, preloader._ended  # noqa: SLF001

    @property
    def returncode(self) -> int | None:
        return self._codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._ended:
            if not self._ended.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


class Preloader:
    """The launcher's side of the preload server: starts it, has it fork tasks, learns their
    exits.

    Example:
        preloader = Preloader(["tensorflow", "keras"], env=env, say=print)
        if preloader.start():
            proc = preloader.spawn([sys.executable, "train.py"], env=task_env)
        preloader.close()
    """

    def __init__(
        self,
        modules: Sequence[str],
        *,
        env: dict[str, str],
        say: Callable[[str], None],
        relay: Callable[[bytes], None],
    ):
        self.modules, self._env, self._say, self._relay = list(modules), env, say, relay
        self._server: subprocess.Popen[bytes] | None = None
        self._channel: socket.socket | None = None
        self._replies: list[dict] = []
        self._lock = threading.Lock()  # one fork request at a time
        self._ended = threading.Condition()
        self._codes: dict[int, int] = {}  # pid -> exit code, as Popen's returncode
        self._pids: list[int] = []  # every task forked
        self._lost = False

    def start(self) -> bool:
        """Starts the server and waits for its imports. False (said in one line) if it
        cannot import them: the tasks then start afresh."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._server = subprocess.Popen(
                [sys.executable, "-c", _SERVER, str(theirs.fileno()), ",".join(self.modules)],
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=[theirs.fileno()],
                start_new_session=True,  # the terminal's Ctrl-C is the launcher's to pass on
            )  # fmt: skip
        threading.Thread(target=self._relay_output, daemon=True).start()
        return self._begin(ours, f"the preload server of {', '.join(self.modules)}")

    def _begin(self, channel: socket.socket, server: str) -> bool:
        # The server's first message says whether its imports succeeded; a server that says
        # nothing in time is not waited for longer (a launcher never hangs on it).
        self._channel = channel
        channel.settimeout(READY_SECONDS)
        first = _receive(channel)[0]
        channel.settimeout(None)
        if first is None or "ready" not in first:
            why = first["error"] if first else f"no answer within {READY_SECONDS:g} s"
            self._say(f"{server} cannot serve ({why}); each task starts afresh")
            self.close()
            return False
        self._server_pid = first["ready"]
        threading.Thread(target=self._learn_exits, daemon=True).start()
        return True

    def connect(self, path: str) -> bool:
        """Uses the running server listening at `path`, waiting for its imports. False (said
        in one line) if there is none: the tasks then start afresh."""
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            channel.connect(path)
        except OSError as error:
            channel.close()
            self._say(f"no preload server at {path} ({error}); each task starts afresh")
            return False
        if not self._begin(channel, f"the preload server at {path}"):
            return False
        apart = _namespaces_apart(self._server_pid)
        if apart:
            self._say(
                f"the preload server at {path} runs in another {' and '.join(apart)} namespace "
                "than this launcher (--private_network, unshare): its tasks would not share "
                "this launcher's view; each task starts afresh"
            )
            self.close()
            return False
        return True

    def spawn(
        self,
        command: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str | None = None,
        stderr_apart: bool = False,
        output: int | None = None,
    ) -> Forked:
        """Forks `command` (python_program(command) must not be None) with `env`, in `cwd`
        (this process's by default). Its output (stdout and stderr) comes on the returned
        process's `stdout`; with `stderr_apart`, stderr comes on its `stderr`; with `output`
        (an open file descriptor), both are written there instead."""
        pipes = [] if output is not None else [os.pipe() for _ in range(1 + stderr_apart)]
        reads, writes = [read for read, _ in pipes], [write for _, write in pipes]
        with open(os.devnull, "rb") as null, self._lock:
            try:
                if self._lost:
                    raise OSError("the preload server is gone")
                request = {
                    "program": python_program(command), "env": env, "cwd": cwd or os.getcwd(),
                }  # fmt: skip
                sent = writes if output is None else [output]
                _send(self._channel, request, fds=[null.fileno(), *sent])
                for write in writes:
                    os.close(write)
                writes = []
                with self._ended:
                    self._ended.wait_for(lambda: self._replies or self._lost)
                    if not self._replies:
                        raise OSError("the preload server is gone")
                    reply = self._replies.pop(0)
                if "error" in reply:
                    raise OSError(reply["error"])
            except BaseException:
                for fd in reads + writes:
                    os.close(fd)
                raise
            self._pids.append(reply["pid"])
        streams = [open(read, "rb") for read in reads]  # noqa: SIM115 - the caller's to close
        return Forked(command, reply["pid"], *(streams[:1] or [None]), self, *streams[1:])

    def close(self) -> None:
        """Ends the server (the tasks it forked are the supervisor's to stop)."""
        if self._channel is not None:
            with contextlib.suppress(OSError):
                self._channel.shutdown(socket.SHUT_RDWR)
        if self._server is not None:
            try:
                self._server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()

    def _learn_exits(self) -> None:
        while True:
            message = _receive(self._channel)[0]
            with self._ended:
                if message is None:  # the server died: its orphans' exits cannot be learned
                    self._lost = True
                    for pid in self._pids:
                        if pid not in self._codes:
                            with contextlib.suppress(OSError):
                                os.killpg(pid, signal.SIGKILL)
                            self._codes[pid] = -signal.SIGKILL
                    self._ended.notify_all()
                    return
                if "exit" in message:
                    self._codes[message["exit"]] = message["returncode"]
                else:
                    # The server reports in order: a reused pid's last exit came before.
                    self._codes.pop(message.get("pid"), None)
                    self._replies.append(message)
                self._ended.notify_all()

    def _relay_output(self) -> None:
        with self._server.stdout as pipe:
            for line in pipe:
                self._relay(line)


def _namespaces_apart(pid: int) -> list[str]:
    """The Linux namespaces that process `pid` does not share with this one (all of them when
    they cannot be read: a process of another user namespace)."""
    apart = []
    for kind in ("mnt", "net", "pid", "user"):
        try:
            if os.readlink(f"/proc/{pid}/ns/{kind}") != os.readlink(f"/proc/self/ns/{kind}"):
                apart.append(kind)
        except OSError:
            apart.append(kind)
    return apart


# --- the server ----------------------------------------------------------------------------


def _send(channel: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    socket.send_fds(channel, [json.dumps(message).encode()], list(fds))


def _receive(channel: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and the descriptors that came with it (stdin, stdout, and stderr
    where it is apart); (None, []) at the end."""
    try:
        data, fds, flags, _ = socket.recv_fds(channel, _MESSAGE_BYTES, 3)
    except OSError:
        return None, []
    if not data:
        return None, []
    if flags & socket.MSG_TRUNC:
        raise OSError(f"a message over {_MESSAGE_BYTES} bytes")
    if flags & socket.MSG_CTRUNC:
        raise OSError("a message with more descriptors than stdin, stdout and stderr")
    return json.loads(data), fds


def serve(
    modules: Sequence[str], *, channel_fd: int | None = None, path: str | None = None
) -> None:
    """The preload server: imports `modules`, then forks a task for each request and reports
    each task's exit to the launcher that asked for it.

    With `channel_fd` it serves the one launcher that started it, and ends with it. With
    `path` it listens there for any number of launchers (TFDIST_PRELOAD_SERVER), and ends
    when the process that started it does.
    """
    launchers = [socket.socket(fileno=channel_fd)] if channel_fd is not None else []
    listener = None
    if path is not None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path)  # before the imports: a launcher may connect and wait meanwhile
        listener.listen(64)
    parent = os.getppid()
    try:
        for name in modules:
            importlib.import_module(name)
    except BaseException as error:  # noqa: BLE001 - any failure only means "start afresh"
        for launcher in launchers:
            _send(launcher, {"error": f"{type(error).__name__}: {error}"})
        return
    sys.stdout.flush(), sys.stderr.flush()  # nothing of ours may be written again by a task
    # What the imports made lives as long as a task does: out of the collector's walks, so a
    # task's full collections walk only its own objects (TensorFlow's are some 400,000), and
    # out of its copy-on-write (as Python's gc.freeze documentation advises before a fork).
    gc.collect()
    gc.freeze()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)  # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for launcher in launchers:
        _send(launcher, {"ready": os.getpid()})
    owners: dict[int, socket.socket] = {}  # a forked task's pid -> the launcher that asked
    while launchers or (listener is not None and os.getppid() == parent):
        waiting = [*launchers, wake_read, *([listener] if listener is not None else [])]
        readable = select.select(waiting, [], [], 1.0)[0]
        if wake_read in readable:
            os.read(wake_read, 4096)
        _report_exits(owners)
        if listener is not None and listener in readable:
            launcher = listener.accept()[0]
            launchers.append(launcher)
            _send(launcher, {"ready": os.getpid()})
        for launcher in [one for one in launchers if one in readable]:
            request, fds = _receive(launcher)
            if request is None:  # that launcher has ended
                launchers.remove(launcher)
                launcher.close()
                continue
            own = [*launchers, *([listener] if listener is not None else []), wake_read, wake_write]
            try:
                pid = os.fork()
            except OSError as error:
                _send(launcher, {"error": f"cannot fork: {error}"})
                pid = None
            if pid == 0:
                _run_task(request, fds, own)  # never returns
            for fd in fds:
                os.close(fd)
            if pid is not None:
                owners[pid] = launcher
                _send(launcher, {"pid": pid})
                if listener is not None:  # a shared server's log: one line per task
                    print(f"forked {pid}: {shlex.join(_command_line(request['program']))}",
                          flush=True)  # fmt: skip


def _command_line(program: Sequence) -> list[str]:
    kind, target, args = program
    return {"module": ["python", "-m"], "code": ["python", "-c"]}.get(kind, ["python"]) + [
        target,
        *args,
    ]


def _report_exits(owners: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        launcher = owners.pop(pid, None)
        if launcher is not None and launcher.fileno() != -1:
            with contextlib.suppress(OSError):
                _send(launcher, {"exit": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _run_task(request: dict, fds: Sequence[int], own: Sequence[socket.socket | int]) -> NoReturn:
    """In the forked child: becomes the task, runs its program, and exits as Python would:
    through the interpreter's own shutdown (its threads, exit handlers and TensorFlow's
    teardown, where a multi-worker job's tasks wait for each other before they go: a task
    that left at once could break a peer still reading its part of the last collective)."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stdin, output, *error = fds  # stderr on a pipe of its own, or with stdout
        os.dup2(stdin, 0)
        os.dup2(output, 1)
        os.dup2(error[0] if error else output, 2)
        for fd in fds:
            os.close(fd)
        for one in own:  # a socket forgets its descriptor, or it would close a reused one
            os.close(one.detach() if isinstance(one, socket.socket) else one)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _add_python_path(request["env"].get("PYTHONPATH", ""))
        _reseed()
    except BaseException:  # noqa: BLE001 - it must not return into the server's loop
        with contextlib.suppress(BaseException):
            traceback.print_exc()
            sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)
    # Up through the server's frames, which catch nothing, to the interpreter's exit.
    raise SystemExit(_run_program(*request["program"]))


def _add_python_path(value: str) -> None:
    # A fresh interpreter puts PYTHONPATH's folders after the program's own; the server's
    # search path was made from the server's environment.
    folders = [os.path.abspath(folder) for folder in value.split(os.pathsep) if folder]
    sys.path[1:1] = [folder for folder in folders if folder not in sys.path]


def _reseed() -> None:
    # `random` reseeds itself after a fork; NumPy's global generator does not.
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _run_program(kind: str, target: str, args: list[str]) -> int:
    """Runs the program as `python -m`, `python FILE` or `python -c` would; its exit code."""
    interrupted = False
    try:
        if kind == "module":
            sys.argv, sys.path[0] = [target, *args], os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "script":
            sys.argv, sys.path[0] = [target, *args], os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv, sys.path[0] = ["-c", *args], ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)  # noqa: S102 - python -c
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:  # noqa: BLE001 - printed and exit 1, as the interpreter does
        code = _uncaught(*sys.exc_info())
    if interrupted:  # Python dies of the SIGINT it was interrupted by, once shut down
        _shut_down()
        sys.stdout.flush(), sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _uncaught(kind, error, trace) -> int:
    # The interpreter hands an uncaught exception to sys.excepthook, and a hook may end the
    # process itself (tfdist's does: one line and exit 2 for a mistake it explains).
    try:
        sys.excepthook(kind, error, trace)
    except SystemExit as exit_:
        return _exit_code(exit_.code)
    return 1


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _shut_down() -> None:
    # What the interpreter does before it exits: wait for the threads that are not daemons,
    # then run the exit handlers.
    with contextlib.suppress(Exception):
        threading._shutdown()  # noqa: SLF001 - the interpreter's own step, not public
    atexit._run_exitfuncs()  # noqa: SLF001


def main(argv: Sequence[str]) -> None:
    """The server's entry point: `CHANNEL_FD MODULES` or `--listen PATH MODULES` (modules
    comma-separated)."""
    *where, modules = argv
    names = [name for name in modules.split(",") if name]
    if where[0] == "--listen":
        serve(names, path=where[1])
    else:
        serve(names, channel_fd=int(where[0]))


def server_command(path: str, modules: Sequence[str]) -> list[str]:
    """The command line of a preload server that listens at `path` for any number of
    launchers (set TFDIST_PRELOAD_SERVER=path for them); it ends with its parent process."""
    return [sys.executable, "-c", _SERVER, "--listen", path, ",".join(modules)]

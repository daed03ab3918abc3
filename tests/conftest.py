"""Shared test set-up: quiet TensorFlow, four logical CPUs, helpers to run binaries, and the
fast tier.

The fast tier (`pytest --fast`, about a minute on 2 cores) runs the tests of modules marked
`pytestmark = pytest.mark.fast` (the logic, cluster, launcher, Kubernetes, schedule, registry
and error-message tests), less those marked `multiprocess` (they start processes) or `slow`
(they train in this process): no TensorFlow process is launched, no wheel built, no model
trained. A fast-tier test that starts a training binary or a test worker fails
(pytest_runtest_call). A test in an unmarked module runs in the whole
suite (`pytest`) only; a new test in a fast module is in the fast tier unless marked
`multiprocess`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import linecache
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tools.chaos import running_tasks

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parents[1]
NUM_CPU_DEVICES = 4


def pytest_addoption(parser):
    parser.addoption(
        "--fast",
        action="store_true",
        help="the fast tier: tests of modules marked fast, less those marked multiprocess",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    _check_groups(config, items)
    if not config.getoption("--fast"):
        return
    kept, left = [], []
    for item in items:
        (kept if _in_fast_tier(item) else left).append(item)
    config.hook.pytest_deselected(items=left)
    items[:] = kept


def _in_fast_tier(item) -> bool:
    return bool(item.get_closest_marker("fast")) and not any(
        item.get_closest_marker(name) for name in ("multiprocess", "slow")
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Markers that tell the truth, checked as each test runs:

    - a test of the fast tier that runs a training binary or a test worker itself (`python
      -m experiments...`) fails: mark it multiprocess; so does one that trains more than a
      step or two in this process: mark it slow;
    - a test marked multiprocess that started no process, in its own set-up or call, in a
      shared fixture it uses, or in an earlier test of its module whose job it reads (a
      cached one), fails: it runs in this process (mark it slow, or nothing).
    """
    before = _LAUNCHES["tensorflow"]
    fast = _in_fast_tier(item)
    with _counting_training_steps() if fast else contextlib.nullcontext() as steps:
        result = yield
    if fast and _LAUNCHES["tensorflow"] > before:
        raise AssertionError(
            f"{item.nodeid} is in the fast tier but started a TensorFlow process: mark it "
            "pytest.mark.multiprocess (or move the process into a fixture of a slower test)"
        )
    if fast and steps["steps"] > _FAST_TIER_STEPS:
        raise AssertionError(
            f"{item.nodeid} is in the fast tier but trained {steps['steps']} steps (at most "
            f"{_FAST_TIER_STEPS}): mark it pytest.mark.slow"
        )
    started = _tests_processes() > item.stash.get(_PROCESSES_BEFORE, 0)
    module = item.nodeid.split("::")[0]
    if started:
        _MODULES_THAT_LAUNCHED.add(module)  # a job it caches (functools.cache) serves later tests
    shared = _FIXTURES_THAT_LAUNCH.intersection(item.fixturenames)
    earlier = module in _MODULES_THAT_LAUNCHED
    if item.get_closest_marker("multiprocess") and not (started or shared or earlier):
        raise AssertionError(
            f"{item.nodeid} is marked multiprocess but started no process (nor did a shared "
            "fixture it uses): it runs in this process; mark it slow if it trains, or nothing"
        )
    return result


# A fast-tier test may take a step or two (a refusal on the first step, say), not train.
_FAST_TIER_STEPS = 2


@contextlib.contextmanager
def _counting_training_steps():
    """Counts the training steps of every fit in this process (Keras's own and tfdist's,
    which both end their batches through Keras's CallbackList: the last batch index an epoch
    reports is its count, whatever the steps per call)."""
    from keras.callbacks import CallbackList

    counted = {"steps": 0}
    originals = {name: getattr(CallbackList, name) for name in _COUNTED_CALLBACKS}

    def batch_end(self, batch, logs=None):
        self.__dict__["_steps_in_epoch"] = max(self.__dict__.get("_steps_in_epoch", 0), batch + 1)
        return originals["on_train_batch_end"](self, batch, logs)

    def epoch_done(name):
        def done(self, *args, **keywords):
            counted["steps"] += self.__dict__.pop("_steps_in_epoch", 0)
            return originals[name](self, *args, **keywords)

        return done

    CallbackList.on_train_batch_end = batch_end
    CallbackList.on_epoch_end = epoch_done("on_epoch_end")
    CallbackList.on_train_end = epoch_done("on_train_end")
    try:
        yield counted
    finally:
        for name, original in originals.items():
            setattr(CallbackList, name, original)


_COUNTED_CALLBACKS = ("on_train_batch_end", "on_epoch_end", "on_train_end")
_PROCESSES_BEFORE = pytest.StashKey[int]()
# Shared (module or session) fixtures that started processes: a test that uses one is
# multi-process although the fixture ran in an earlier test's set-up. The suite's preload
# server is a process of the harness, not of any test.
_FIXTURES_THAT_LAUNCH: set[str] = set()
_MODULES_THAT_LAUNCHED: set[str] = set()
_HARNESS_FIXTURES = {"preload_server"}
_HARNESS = {"processes": 0}


def _tests_processes() -> int:
    return _LAUNCHES["processes"] - _HARNESS["processes"]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_PROCESSES_BEFORE] = _tests_processes()


class _FixtureLaunches:
    """Notes the shared fixtures that start processes. A plugin of its own, registered in
    pytest_configure: a conftest's hooks do not see the set-up of session fixtures."""

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        before = _LAUNCHES["processes"]
        result = yield
        launched = _LAUNCHES["processes"] - before
        if fixturedef.argname in _HARNESS_FIXTURES:
            _HARNESS["processes"] += launched
        elif launched and fixturedef.scope != "function":
            _FIXTURES_THAT_LAUNCH.add(fixturedef.argname)
        return result


def _check_groups(config, items) -> None:
    """Under --dist loadgroup, each test marked xdist_group must carry its group in its id
    (pytest-xdist's way of sending a group to one worker); a pytest that ignores the
    rename would run each shared multi-process fixture once per worker, silently."""
    if not getattr(config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist could not group {len(lost)} test(s) marked xdist_group (e.g. "
            f"{lost[0]}): this pytest does not keep the group in the test's id. Install the "
            "versions setup.cfg's test extra names (pip install -e '.[test]')."
        )


def pytest_configure(config):
    # Logical devices can only be set before TensorFlow initialises its runtime, so the whole
    # session gets its four CPUs here, before any test touches TensorFlow.
    from tfdist.devices import configure_cpu_devices

    configure_cpu_devices(NUM_CPU_DEVICES)
    if not hasattr(config, "workerinput"):  # once, before the pytest-xdist workers start
        _compile_the_checkout()
    _count_launches(config)
    _time_the_collector()
    config.pluginmanager.register(_FixtureLaunches(), "tfdist-fixture-launches")


def _compile_the_checkout() -> None:
    """Writes the bytecode of the checkout's own modules, as the install writes the
    installed packages' (--compile-bytecode). Where PYTHONDONTWRITEBYTECODE is set, Python
    never writes it on import, so every process the suite starts would compile tfdist and
    the test helpers it imports from source: 0.2-0.4 s of CPU a process, some 600 of them."""
    import compileall

    for package in ("tfdist", "tests", "tools", "experiments"):
        compileall.compile_dir(REPO / package, quiet=1)


# --- the suite reports the processes it launched -------------------------------------------------
#
# Starting processes (TensorFlow's start-up above all) is where the suite's time goes, so the
# run ends with how many it started. Every process a test starts goes through
# subprocess.Popen in a pytest process; a launcher's tasks are counted from its flags. Each
# pytest-xdist worker writes its counts to a folder the controller names, which sums them.

_LAUNCHES = {
    "launches": 0, "processes": 0, "tensorflow": 0, "forked": 0, "by_test": {},
    "gc_seconds": 0.0, "gc_full": 0, "gc_full_seconds": 0.0, "gc_full_by_site": {}, "first_start": None, "last_end": None,
    "cpu_by_test": {}, "cpu_self": 0.0, "cpu_started": 0.0, "cpu_forked": 0.0,
}  # fmt: skip
# Modules whose processes run TensorFlow: the training binaries and the tests' worker scripts
# (the launcher's own tests start plain Python tasks, which the fast tier may).
_TENSORFLOW_MODULES = ("experiments.", "tests.workers.")
_LAUNCH_DIR = "TFDIST_TEST_LAUNCH_COUNTS"
_MOST_LAUNCHING = 15


def _tasks_of(args) -> int:
    """How many processes a command starts: a launcher's tasks, or itself."""
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    if not any(a in ("tools.launch", "tfdist.launch") or a.endswith("tfdist-launch") for a in argv):
        return 1
    tasks, flags = 0, dict(zip(argv[:-1], argv[1:], strict=True))
    for flag in ("--workers", "--ps", "--nproc_per_node"):
        if flags.get(flag, "").isdigit():
            tasks += int(flags[flag])
    return 1 + max(tasks, 1) + ("--chief" in argv)


def _count_launches(config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        import tempfile

        os.environ.setdefault(_LAUNCH_DIR, tempfile.mkdtemp(prefix="tfdist-launches-"))
        os.makedirs(os.environ[_LAUNCH_DIR], exist_ok=True)  # a folder named that is not there yet
        if getattr(config.option, "numprocesses", None):
            return  # it starts the xdist workers only: they count what the tests start
    original = subprocess.Popen.__init__

    def counted(self, args, *rest, **keywords):
        _count_process(args)
        original(self, args, *rest, **keywords)

    subprocess.Popen.__init__ = counted


def _count_process(args) -> None:
    """Counts a process a test starts (through subprocess.Popen, or forked: run_python)."""
    _LAUNCHES["launches"] += 1
    _LAUNCHES["processes"] += _tasks_of(args)
    # "tests/test_x.py::test_y (setup)": a module fixture's launches count for the test that
    # set it up
    test = os.environ.get("PYTEST_CURRENT_TEST", "outside a test").rsplit(" (", 1)[0]
    _LAUNCHES["by_test"][test] = _LAUNCHES["by_test"].get(test, 0) + _tasks_of(args)
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    # `python -m <module>` itself (through a launcher the tasks may never start: a refused
    # layout starts none).
    if argv[1:2] == ["-m"] and argv[2:3] and argv[2].startswith(_TENSORFLOW_MODULES):
        _LAUNCHES["tensorflow"] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Notes when this pytest process ran its first test and ended its last (wall clock): a
    worker that ends long before the other idles, and the report says for how long."""
    now = time.time()
    if _LAUNCHES["first_start"] is None:
        _LAUNCHES["first_start"] = now
    _freeze_survivors()
    before = sum(_cpu_seconds())
    yield
    _LAUNCHES["last_end"] = time.time()
    _LAUNCHES["cpu_by_test"][item.nodeid] = sum(_cpu_seconds()) - before


_SERVER_PID: list[int] = []  # this pytest process's preload server, once started


def _cpu_seconds() -> tuple[float, float, float]:
    """CPU seconds so far: this pytest process's own, the processes it started and waited
    for (a launcher's tasks included), and the tasks its preload server forked and reaped."""
    import resource

    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    forked = 0.0
    if _SERVER_PID:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{_SERVER_PID[0]}/stat").read_text().rsplit(")", 1)[1].split()
            cutime, cstime = int(fields[13]), int(fields[14])  # its reaped children's
            forked = (cutime + cstime) / os.sysconf("SC_CLK_TCK")
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime, forked


def _time_the_collector() -> None:
    """Sums the time Python's garbage collector takes in this pytest process: a full
    collection walks every object the session holds (TensorFlow's alone are 400,000)."""
    started = [0.0]
    site = [""]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            if info["generation"] == 2:
                site[0] = _collecting_site()
            return
        took = time.perf_counter() - started[0]
        _LAUNCHES["gc_seconds"] += took
        if info["generation"] == 2:
            _LAUNCHES["gc_full"] += 1
            _LAUNCHES["gc_full_seconds"] += took
            by_site = _LAUNCHES["gc_full_by_site"]
            by_site[site[0]] = by_site.get(site[0], 0.0) + took

    gc.callbacks.append(timed)
    # A pytest process holds every test's traced functions and models until they go, millions
    # of objects: Python's default full collection after 10 of the middle generation's walks
    # them all once a few seconds (a third of the collector's time over the in-process tests). Once
    # after 100 leaves each test's own cycles to the young generations, where they are freed.
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 100)


# A full collection walks every object the collector tracks: in a pytest process late in a
# run, millions (the traced functions and models of module fixtures, Keras's and TensorFlow's
# caches), a second or more each, and the layouts make one wherever a dropped copy may sit in
# a cycle (host.Dropped). So between tests, at most once this often, everything alive is
# collected once and frozen out of the collector (gc.freeze, as Python's documentation
# advises before a fork): the collections a test makes walk only what it made since. What
# was frozen and dies in a cycle later waits for the next refreeze. A refreeze late in a
# whole run costs 3-6 s itself (135 s over a run at 120 s apart, 84 s at 300: hence 600).
# It also keeps Python's automatic full collections away: after a full collection they
# wait until a quarter as many objects as survived it have aged, and millions survived. (A
# cheaper refreeze that collected only what was not frozen yet reset that count to the
# few it found: automatic full collections then took 246 s of a run, the refreezes 200.)
_REFREEZE_SECONDS = 600.0
_FROZEN_AT = [float("-inf")]


def _freeze_survivors() -> None:
    if time.monotonic() - _FROZEN_AT[0] >= _REFREEZE_SECONDS:
        collect_everything()


def collect_everything() -> None:
    """A full collection of everything, frozen objects too, the survivors frozen again: for
    a test that counts what is alive (tests/test_memory.py)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _FROZEN_AT[0] = time.monotonic()


def _collecting_site() -> str:
    """Where a full collection was asked for: the file and line of the gc.collect() call, or
    'automatic' when an allocation set it off."""
    frame = sys._getframe(1).f_back  # past the callback: who was running (if anyone was)
    if frame is None:
        return "automatic"
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    if "collect(" in line:
        return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
    return "automatic"


def pytest_sessionfinish(session):
    folder = os.environ.get(_LAUNCH_DIR)
    if folder and os.path.isdir(folder):
        name = getattr(session.config, "workerinput", {}).get("workerid", "main")
        controller = name == "main" and getattr(session.config.option, "numprocesses", None)
        if not controller:  # pytest-xdist's controller has waited for its workers: their sum
            _LAUNCHES["cpu_self"], _LAUNCHES["cpu_started"], _ = _cpu_seconds()
        Path(folder, f"{name}.json").write_text(json.dumps(_LAUNCHES))


def pytest_terminal_summary(terminalreporter, config):
    folder = os.environ.get(_LAUNCH_DIR)
    if hasattr(config, "workerinput") or not folder or not os.path.isdir(folder):
        return
    counts = [json.loads(p.read_text()) for p in Path(folder).glob("*.json")]
    launches = sum(c["launches"] for c in counts)
    processes = sum(c["processes"] for c in counts)
    forked = sum(c.get("forked", 0) for c in counts)
    terminalreporter.write_line(
        f"processes launched by the tests: {processes} ({launches} launches; a launcher's "
        f"tasks counted from its flags); {forked} tasks forked by the preload servers"
    )
    terminalreporter.write_line(
        "Python's garbage collector in the pytest processes: "
        f"{sum(c.get('gc_seconds', 0.0) for c in counts):.0f} s, "
        f"{sum(c.get('gc_full', 0) for c in counts)} full collections "
        f"({sum(c.get('gc_full_seconds', 0.0) for c in counts):.0f} s of it)"
    )
    sites: dict[str, float] = {}
    for count in counts:
        for where, seconds in count.get("gc_full_by_site", {}).items():
            sites[where] = sites.get(where, 0.0) + seconds
    if sites:
        terminalreporter.write_line(
            "  full collections by where they were asked for: "
            + ", ".join(f"{w} {t:.0f} s" for w, t in sorted(sites.items(), key=lambda x: -x[1])[:6])
        )
    ends = sorted(c["last_end"] for c in counts if c.get("last_end"))
    if len(ends) > 1:
        terminalreporter.write_line(
            f"the pytest workers ran out of tests {ends[-1] - ends[0]:.0f} s apart "
            f"(their first: {ends[0] - min(c['first_start'] for c in counts if c.get('first_start')):.0f} s "
            "after the first test began)"
        )
    own, started, forked = (
        sum(c.get(k, 0.0) for c in counts) for k in ("cpu_self", "cpu_started", "cpu_forked")
    )
    # A preload server is waited for at the session's end: its tasks are among the started.
    terminalreporter.write_line(
        f"CPU: {own + started:.0f} s in all: {own:.0f} s in the pytest processes, "
        f"{started:.0f} s in the processes they started ({forked:.0f} s of it in tasks "
        "forked by the preload servers; Ray's own processes are not counted)"
    )
    cpu: dict[str, float] = {}
    for count in counts:
        cpu.update(count.get("cpu_by_test", {}))
    terminalreporter.write_line(
        f"the {_MOST_LAUNCHING} tests that took the most CPU (set-up of shared fixtures included):"
    )
    for test, seconds in sorted(cpu.items(), key=lambda item: -item[1])[:_MOST_LAUNCHING]:
        terminalreporter.write_line(f"{seconds:7.1f} s  {test}")
    by_test: dict[str, int] = {}
    for count in counts:
        for test, started in count.get("by_test", {}).items():
            by_test[test] = by_test.get(test, 0) + started
    most = sorted(by_test.items(), key=lambda item: -item[1])[:_MOST_LAUNCHING]
    if most:
        terminalreporter.write_line("the tests that started the most processes:")
        for test, started in most:
            terminalreporter.write_line(f"{started:5d}  {test}")


def run_module(
    module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Runs `python -m module args...` from the repository root and captures its output."""
    full_env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    full_env.update(env or {})
    return run_python([sys.executable, "-m", module, *args], env=full_env, timeout=timeout)


# Launchers start afresh (they import no TensorFlow, and their own tests signal them): their
# tasks are forked by the preload server through TFDIST_PRELOAD_SERVER.
_STARTED_AFRESH = ("tools.launch", "tfdist.launch")


def run_python(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | str = REPO,
    timeout: float = 300,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Runs a command of this interpreter (`python -m ...`, `python FILE`, `python -c ...`)
    as subprocess.run(..., capture_output=True, text=True) does. In the whole suite the
    preload server forks it with TensorFlow and Keras imported (about 6 s of CPU saved a
    run; tfdist/launch/preload.py says what differs from a fresh interpreter). A launcher,
    a run without the server, and a `fresh` one start afresh: `fresh` for a program that
    checks what a new interpreter imports (the server has imported tfdist.launch)."""
    env = dict(os.environ) if env is None else env
    preloader = None if fresh else _preloader_for(argv)
    if preloader is None:
        return subprocess.run(
            argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    _count_process(argv)
    task = preloader.spawn(argv, env=env, cwd=str(cwd), stderr_apart=True)
    read: dict[str, str] = {}

    def drain(name: str, stream) -> None:
        with stream:
            text = stream.read().decode(errors="replace")  # as text=True reads it:
            read[name] = text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines

    readers = [
        threading.Thread(target=drain, args=(name, getattr(task, name)), daemon=True)
        for name in ("stdout", "stderr")
    ]
    for reader in readers:
        reader.start()
    try:
        task.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(task.pid, signal.SIGKILL)
        task.wait()
        for reader in readers:
            reader.join(10)
        raise subprocess.TimeoutExpired(
            argv, timeout, read.get("stdout"), read.get("stderr")
        ) from None
    for reader in readers:
        reader.join()
    return subprocess.CompletedProcess(argv, task.returncode, read["stdout"], read["stderr"])


def start_python(
    argv: list[str], *, output, env: dict[str, str] | None = None, cwd: Path | str = REPO
):
    """Starts a command of this interpreter, as subprocess.Popen(argv, stdout=output,
    stderr=subprocess.STDOUT) would, with SIGINT delivered (a suite run in the background
    hands its children SIGINT ignored). Forked by the preload server where run_python would
    fork it; the returned process answers pid, returncode, poll, wait, send_signal,
    terminate and kill as a Popen does."""
    env = dict(os.environ) if env is None else env
    preloader = _preloader_for(argv)
    if preloader is None:
        return subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT,
            preexec_fn=_default_sigint if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else None,
        )  # fmt: skip
    _count_process(argv)
    return _Forked(preloader.spawn(argv, env=env, cwd=str(cwd), output=output.fileno()))


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Forked:
    """A task the preload server forked, with subprocess.Popen's ways to wait and signal."""

    def __init__(self, task):
        self._task, self.pid, self.args = task, task.pid, task.args

    @property
    def returncode(self) -> int | None:
        return self._task.returncode

    def poll(self) -> int | None:
        return self._task.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._task.wait(timeout)

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # as Popen: no signal to a pid that may be reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_PRELOADERS: dict[str, object] = {}


def _preloader_for(argv: list[str]):
    """This pytest process's connection to its preload server, to fork `argv` with; None
    where it starts afresh: no server (the fast tier), a command the server does
    not fork, or a launcher."""
    from tfdist.launch.preload import SERVER_ENV, Preloader, python_program

    path, program = os.environ.get(SERVER_ENV), python_program(argv)
    if not path or program is None or (program[0] == "module" and program[1] in _STARTED_AFRESH):
        return None
    if path not in _PRELOADERS:
        preloader = Preloader(["tensorflow", "keras"], env=dict(os.environ), say=print, relay=print)
        assert preloader.connect(path), f"no preload server at {path}"
        _PRELOADERS[path] = preloader
    return _PRELOADERS[path]


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> str:
    """scikit-learn's digits as TFRecords (the binary's default data), written once a session
    (once per pytest-xdist worker) and only read after: by the tests and the jobs they start."""
    from tfdist.data import prepare_dataset

    here = str(tmp_path_factory.mktemp("digits"))
    prepare_dataset("digits", data_dir=here)
    return here


def launch_downpour(out, workers: int, what: str) -> None:
    """tests/workers/downpour_worker.py run by a chief, `workers` workers and 2 ps tasks."""
    result = run_module(
        "tools.launch", "--chief", "--workers", str(workers), "--ps", "2", "--timeout", "280",
        "--", sys.executable, "-m", "tests.workers.downpour_worker", str(out), what,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]


@pytest.fixture(scope="session")
def downpour_one_worker(tmp_path_factory):
    """One parameter-server job (a chief, 1 worker, 2 ps) of downpour_worker's `one` cases,
    shared by tests/test_downpour.py and tests/test_sparse_rows.py (both in xdist_group
    'downpour', so the job runs once). Returns where it wrote."""
    out = tmp_path_factory.mktemp("downpour-one")
    launch_downpour(out, 1, "one")
    return out


@pytest.fixture(scope="session")
def sparse_rows_job(tmp_path_factory):
    """One job of 2 worker processes training tests/workers/sparse_rows_worker.py's runs,
    shared by tests/test_sparse_rows.py and tests/test_saves.py (both in xdist_group
    'sparse_rows'). Returns (where it wrote, the launcher's output)."""
    out = tmp_path_factory.mktemp("sparse_rows")
    result = run_module(
        "tools.launch", "--workers", "2", "--timeout", "400", "--",
        sys.executable, "-m", "tests.workers.sparse_rows_worker", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return out, result.stdout


def start_preload_server(folder: Path, modules: list[str]) -> tuple[str, subprocess.Popen]:
    """A shared preload server listening in `folder` (its output in server.log there), once
    it listens (it listens before it imports; launchers that connect meanwhile wait).
    Returns (its path, its process)."""
    from tfdist.launch.preload import server_command

    path = str(folder / "server")
    with open(folder / "server.log", "wb") as log:
        server = subprocess.Popen(
            server_command(path, modules), stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert server.poll() is None and time.monotonic() < deadline, folder / "server.log"
        time.sleep(0.02)
    return path, server


@pytest.fixture(scope="session", autouse=True)
def preload_server(request, tmp_path_factory):
    """One preload server per pytest process, which every launcher the tests start forks its
    `python ...` tasks from (tfdist/launch/preload.py): TensorFlow and Keras are imported
    once, not in every task (about 6 s of CPU each, the most of what a small job costs).
    The launcher's own tests (tests/test_launch.py) run without it, as users start tasks."""
    if request.config.getoption("--fast"):
        yield None  # the fast tier launches no TensorFlow task
        return
    from tfdist.launch.preload import SERVER_ENV

    folder = tmp_path_factory.mktemp("preload")
    path, server = start_preload_server(folder, ["tensorflow", "keras"])
    os.environ[SERVER_ENV] = path
    _SERVER_PID.append(server.pid)
    yield path
    os.environ.pop(SERVER_ENV, None)
    _LAUNCHES["cpu_forked"] = _cpu_seconds()[2]
    _SERVER_PID.clear()
    server.terminate()
    server.wait(timeout=30)
    log = (folder / "server.log").read_text(errors="replace").splitlines()
    _LAUNCHES["forked"] = sum(line.startswith("forked ") for line in log)


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


@pytest.fixture(scope="session", autouse=True)
def records_are_strict_json(tmp_path_factory):
    """After the session: every summary.json and .jsonl file a test wrote is strict JSON."""
    yield
    problems = []
    for path in sorted(tmp_path_factory.getbasetemp().rglob("*")):
        if path.name != "summary.json" and path.suffix != ".jsonl":
            continue
        lines = path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]
        for line in lines:
            try:
                json.loads(line, parse_constant=_not_json)
            except ValueError as error:
                problems.append(f"{path}: {error}")
    assert not problems, "\n".join(problems[:20])


@pytest.fixture
def train_flags():
    """Parses experiments.train's flags from a command line (the binary's first argument is
    its name), unparsing them afterwards."""
    from experiments import train as train_binary

    def parse(*args: str):
        train_binary.FLAGS(["train", *args])

    yield parse
    train_binary.FLAGS.unparse_flags()


@pytest.fixture
def no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def task_pid(launcher_pid: int, task: str) -> int | None:
    """The pid of the launcher's child that plays `task` ("worker:1"), from its TF_CONFIG.

    Fault tests kill that real process; None while the launcher has not started it.
    """
    return running_tasks(launcher_pid).get(task)


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that were free a moment ago."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports

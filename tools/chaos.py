"""Chaos soak: random SIGKILLs and SIGTERMs against real training jobs, and what they cost.

Two jobs run on loopback through tfdist-launch and the training binary, one after the other:

- multi_worker_mirrored, 3 workers under --max_restarts: any fault restarts the whole job,
  which resumes from its last checkpoint. At the end its weights must equal those of the same
  job run without faults (a reference run made first), and every step must be counted.
- parameter_server, a chief, 3 workers and 1 ps: a killed worker restarts in place while the
  others go on; a killed chief or ps restarts the job from its last checkpoint. At the end
  every requested step must be counted (summary.json) and every update applied.

Each job takes --faults kills, at random moments (start-up included: each pause counts from
the launch or the last restart, so many land while the tasks connect), of a random task,
with SIGKILL or SIGTERM. The soak prints one row per fault (what was killed, when, in which
phase, how the job reacted, where it resumed, the steps redone) and a final table per job,
and writes both under --out/<time>/ (faults.csv, summary.json, each run's log; a new
directory per run: nothing earlier is overwritten). It exits 0 only if every fault landed
and both jobs ended with nothing lost.

  python -m tools.chaos --faults 20           # the soak of issue 13: ~20 min on 2 cores
  python -m tools.chaos --faults 3 --jobs sync --seed 7

It is a soak, not a test: its run time depends on the machine, and its faults on --seed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tfdist.launch.supervisor import tasks_file

REPO = Path(__file__).resolve().parents[1]
STEPS_PER_EPOCH = 10
CHECKPOINT_EVERY = 5
TOLERANCE = 1e-5

# The same deterministic run for both jobs' binaries: plain SGD, no shuffle.
_TRAIN = [
    "--model=mlp", "--optimizer=sgd", "--momentum=0", "--learning_rate=0.1", "--shuffle_buffer=0",
    "--global_batch_size=48", "--eval_every=0", f"--steps_per_epoch={STEPS_PER_EPOCH}",
    f"--checkpoint_every={CHECKPOINT_EVERY}",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class JobSpec:
    name: str
    launch: tuple[str, ...]
    train: tuple[str, ...]
    # Enough training for every fault to land before it ends: a fault and the recovery from
    # it take ~20 s; the parameter-server job trains ~2.5x as many steps in that time.
    epochs_per_fault: int


def job_specs(faults: int) -> dict[str, JobSpec]:
    # Every fault may cost a restart; a worker of the ps job may be hit every time.
    return {
        "sync": JobSpec(
            "multi_worker_mirrored",
            ("--workers", "3", "--max_restarts", str(2 * faults + 5)),
            ("--strategy=multi_worker_mirrored",),
            epochs_per_fault=15,
        ),
        "ps": JobSpec(
            "parameter_server",
            (
                "--chief",
                "--workers",
                "3",
                "--ps",
                "1",
                "--max_restarts",
                str(2 * faults + 5),
                "--on_worker_failure",
                "restart",
                "--worker_restarts",
                str(faults + 1),
            ),
            ("--strategy=parameter_server",),
            epochs_per_fault=40,
        ),  # fmt: skip
    }


@dataclasses.dataclass
class Fault:
    job: str
    number: int
    at_seconds: float  # since the job's launch
    task: str
    signal: str
    phase: str  # "start-up" or "training"
    # The newest step the job had logged (its checkpoints, every CHECKPOINT_EVERY steps): the
    # job was at most CHECKPOINT_EVERY - 1 steps further when the fault came.
    step_reached: int | None
    reaction: str = ""
    resumed_at: int | None = None  # where the next attempt went on (None: no restart)
    # Steps trained again: at least step_reached - resumed_at, at most CHECKPOINT_EVERY - 1 more.
    redone: int | None = None


def running_tasks(launcher_pid: int) -> dict[str, int]:
    """{"worker:1": pid, ...}: the tasks the launcher `launcher_pid` runs now (it lists them in
    tasks_file; none while it starts or after it has ended)."""
    try:
        listed = json.loads(tasks_file(launcher_pid).read_text())
    except (OSError, ValueError):
        return {}
    return {task: pid for task, pid in listed.items() if _alive(pid)}


def _alive(pid: int) -> bool:
    try:  # the state field, after the command name in parentheses; Z: exited, not yet reaped
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Job:
    """One launcher run whose output lines are kept with the time they arrived."""

    def __init__(self, spec: JobSpec, *, epochs: int, root: Path, data_dir: Path, tag: str):
        self.spec, self.tag = spec, tag
        self.model_dir, self.weights = root / f"{tag}-run", root / f"{tag}-weights"
        self.log_path = root / f"{tag}.log"
        self.steps = epochs * STEPS_PER_EPOCH
        self.argv = [
            sys.executable, "-m", "tfdist.launch", *spec.launch, "--timeout", "3000", "--",
            "python", "-m", "experiments.train", *spec.train, *_TRAIN, f"--epochs={epochs}",
            f"--data_dir={data_dir}", f"--model_dir={self.model_dir}",
            f"--save_weights_to={self.weights}",
        ]  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        self.proc = subprocess.Popen(
            self.argv, cwd=REPO, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.started = time.monotonic()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                with self._lock:
                    self.lines.append((time.monotonic(), line.rstrip("\n")))

    def since(self, moment: float) -> list[str]:
        with self._lock:
            return [line for at, line in self.lines if at >= moment]

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self) -> int:
        code = self.proc.wait()
        self._reader.join()
        return code

    def summary(self) -> dict:
        return json.loads((self.model_dir / "summary.json").read_text())


_STEP_LINE = re.compile(r"Saved checkpoint \S*ckpt-(\d+)|\] epoch \d+/\d+\s+step (\d+)")
_RESUMED = re.compile(r"(?:Restored|Resuming from) \S*ckpt-(\d+)|No complete checkpoint")
_ATTEMPT = "[launch] starting "


def newest_step(lines: list[str]) -> int | None:
    steps = [int(m.group(1) or m.group(2)) for line in lines if (m := _STEP_LINE.search(line))]
    return max(steps) if steps else None


def inject(job: Job, faults: int, rng: random.Random, max_delay: float) -> list[Fault]:
    """Kills random tasks of `job` until `faults` kills landed or the job ended.

    Each pause counts from the last time the job was (re)started whole, so kills land in
    start-up (TensorFlow's connections, restoring the checkpoint) as often as in training.
    """
    done: list[Fault] = []
    whole = job.started
    while len(done) < faults and job.running():
        deadline = whole + rng.uniform(0.5, max_delay)
        while time.monotonic() < deadline and job.running():
            time.sleep(0.05)
        tasks = running_tasks(job.proc.pid)
        if not tasks or not job.running():
            continue
        task = rng.choice(sorted(tasks))
        signum = rng.choice([signal.SIGKILL, signal.SIGTERM])
        lines = job.since(job.started)
        starts = [i for i, line in enumerate(lines) if line.startswith(_ATTEMPT)]
        attempt = lines[starts[-1] :] if starts else lines
        training = newest_step(attempt) is not None or any(_RESUMED.search(x) for x in attempt)
        try:
            os.kill(tasks[task], signum)
        except ProcessLookupError:
            continue  # it exited by itself meanwhile: not a fault of ours
        killed = time.monotonic()
        fault = Fault(
            job=job.tag, number=len(done) + 1, at_seconds=round(killed - job.started, 1),
            task=task, signal=signal.Signals(signum).name,
            phase="training" if training else "start-up", step_reached=newest_step(lines),
        )  # fmt: skip
        done.append(fault)
        whole = _await_recovery(job, fault, killed)
        print(_row(fault), flush=True)
    return done


def _await_recovery(job: Job, fault: Fault, killed: float) -> float:
    """Waits until the job started again whole (or ended); fills in how it reacted.

    Returns when that was. The job has resumed once its new attempt restored a checkpoint or
    (with none saved yet) logged its first step; a worker restarted in place once it serves.
    """
    deadline = killed + 300
    while time.monotonic() < deadline and job.running():
        lines = job.since(killed)
        said = [line[len("[launch] ") :] for line in lines if line.startswith("[launch] ")]
        # The launcher's first word on it, then how it went on.
        fault.reaction = next((line for line in said if not _OUTCOME.match(line)), "")
        restart = next((line for line in said if "restarting the job" in line), None)
        if restart and restart != fault.reaction:
            fault.reaction += "; " + restart.rsplit("; ", 1)[-1]
        starts = [i for i, line in enumerate(lines) if line.startswith(_ATTEMPT)]
        if starts:
            attempt = lines[starts[-1] :]
            resumed = [m for line in attempt if (m := _RESUMED.search(line))]
            if resumed or newest_step(attempt) is not None:
                fault.resumed_at = int(resumed[0].group(1) or 0) if resumed else 0
                break
        if any("restarts in place" in x for x in said) and any(
            f"[{fault.task}]" in x and "Serving as" in x for x in lines
        ):
            break
        time.sleep(0.1)
    if fault.resumed_at is not None and fault.step_reached is not None:
        fault.redone = max(0, fault.step_reached - fault.resumed_at)
    return time.monotonic()


# The launcher's per-task outcome lines at the end of an attempt ("worker:1 exit 0").
_OUTCOME = re.compile(r"^\w+:\d+ (exit \d+|stopped|killed|not started)")


_COLUMNS = ("job", "number", "at_seconds", "task", "signal", "phase", "step_reached",
            "resumed_at", "redone", "reaction")  # fmt: skip


def _row(fault: Fault) -> str:
    value = dataclasses.asdict(fault)
    cells = ["-" if value[c] is None else str(value[c]) for c in _COLUMNS]
    return "{:<5} {:>3} {:>7} {:<9} {:<8} {:<9} {:>8} {:>8} {:>6}  {}".format(*cells)


def _header() -> str:
    return "{:<5} {:>3} {:>7} {:<9} {:<8} {:<9} {:>8} {:>8} {:>6}  {}".format(
        "job", "#", "at (s)", "killed", "signal", "phase", "reached", "resumed", "redone≥",
        "how the job reacted (launcher)",
    )  # fmt: skip


def final_weights(directory: Path, task: str) -> list[np.ndarray]:
    saved = np.load(directory / f"{task.replace(':', '_')}.npz")
    return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def soak(tag: str, spec: JobSpec, args, root: Path, rng: random.Random) -> dict:
    """Runs the job under faults (after a reference run for the synchronous one)."""
    data_dir = root / "data"
    epochs = args.epochs or spec.epochs_per_fault * args.faults
    reference = None
    if tag == "sync":
        print(f"[chaos] {spec.name}: a reference run without faults", flush=True)
        clean = Job(spec, epochs=epochs, root=root, data_dir=data_dir, tag=f"{tag}-reference")
        clean.start()
        if clean.wait() != 0:
            raise SystemExit(f"the reference run failed; see {clean.log_path}")
        reference = final_weights(clean.weights, "worker:0")
    job = Job(spec, epochs=epochs, root=root, data_dir=data_dir, tag=tag)
    print(f"[chaos] {spec.name}: {args.faults} faults; log in {job.log_path}", flush=True)
    job.start()
    faults = inject(job, args.faults, rng, args.max_delay)
    code = job.wait()
    result = {
        "job": spec.name, "faults": len(faults), "exit status": code,
        "steps requested": job.steps, "wall seconds": round(time.monotonic() - job.started),
        "restarts": sum("restarting the job" in line for _, line in job.lines),
        "in-place worker restarts": sum("restarts in place" in line for _, line in job.lines),
    }  # fmt: skip
    summary = job.summary() if (job.model_dir / "summary.json").exists() else {}
    result["steps completed"] = summary.get("steps")
    if tag == "sync":
        result["max |w - uninterrupted w|"] = max_difference(
            final_weights(job.weights, "worker:0"), reference
        )
        result["ok"] = (
            code == 0
            and len(faults) == args.faults
            and result["steps completed"] == job.steps
            and result["max |w - uninterrupted w|"] <= TOLERANCE
        )
    else:
        result["updates applied"] = summary.get("applied_updates")
        result["ok"] = (
            code == 0
            and len(faults) == args.faults
            and result["steps completed"] == job.steps
            and (result["updates applied"] or 0) >= job.steps
        )
    result["fault rows"] = faults
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--faults", type=int, default=20, help="kills per job (default 20)")
    parser.add_argument("--jobs", choices=["both", "sync", "ps"], default="both")
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"epochs of {STEPS_PER_EPOCH} steps per job; enough for the faults "
                        "to land before training ends (default: 15 per fault for the synchronous job, 40 for "
                        "the parameter-server job)")  # fmt: skip
    parser.add_argument("--max_delay", type=float, default=10.0,
                        help="the longest pause in seconds before a fault, counted from the "
                        "launch or the job's recovery from the last fault (default 10)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument("--out", default=None, help="where results go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.faults < 1 or (args.epochs is not None and args.epochs < 1) or args.max_delay < 0.5:
        parser.error("--faults and --epochs must be 1 or more, --max_delay 0.5 or more")
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    root = Path(args.out or tempfile.mkdtemp(prefix="tfdist-chaos-")) / stamp
    root.mkdir(parents=True)
    print(f"[chaos] seed {seed}; results and logs in {root}", flush=True)
    print(_header(), flush=True)
    specs = job_specs(args.faults)
    tags = ["sync", "ps"] if args.jobs == "both" else [args.jobs]
    results = [soak(tag, specs[tag], args, root, rng) for tag in tags]

    with open(root / "faults.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_COLUMNS)
        writer.writeheader()
        for result in results:
            for fault in result["fault rows"]:
                writer.writerow(dataclasses.asdict(fault))
    print()
    keys = [k for k in results[0] if k not in ("job", "fault rows")]
    print("{:<28}".format("") + "".join(f"{r['job']:>24}" for r in results))
    for key in keys:
        cells = "".join(f"{_cell(r.get(key)):>24}" for r in results)
        print(f"{key:<28}{cells}")
    (root / "summary.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k != "fault rows"} for r in results], indent=2)
    )
    return 0 if all(r["ok"] for r in results) else 1


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.1e}" if value < 0.01 else f"{value:g}"
    return "-" if value is None else str(value)


if __name__ == "__main__":
    sys.exit(main())

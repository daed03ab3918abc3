"""Run a few real training steps under every strategy this host can run, and compare them.

Each strategy runs in its own processes (a strategy's devices and collectives are fixed at
program start): one_device, mirrored and central_storage over 2 logical CPUs, then
multi_worker_mirrored with 2 worker processes and parameter_server with a chief, 2 workers
and a ps, both through tfdist-launch. Synchronous data parallelism must reproduce
one_device's weights, so the table's last columns are a correctness check, not decoration.

  python -m tools.smoke              # all of them, about a minute on 2 cores
  python -m tools.smoke --only mirrored --only parameter_server

Exit code 0 when every strategy ran and matched one_device within --tolerance.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass

RESULT_MARKER = "SMOKE_RESULT "


@dataclass(frozen=True)
class Job:
    strategy: str
    launch: tuple[str, ...]  # tfdist-launch flags; empty: one plain process
    flags: tuple[str, ...] = ()

    @property
    def layout(self) -> str:
        if not self.launch:
            return "1 process" + (", 2 logical CPUs" if "--num_cpu_devices=2" in self.flags else "")
        return "launch " + " ".join(self.launch)


JOBS = (
    Job("one_device", ()),
    Job("mirrored", (), ("--num_cpu_devices=2",)),
    Job("central_storage", (), ("--num_cpu_devices=2",)),
    Job("multi_worker_mirrored", ("--workers", "2"), ("--collective_timeout=120",)),
    Job("parameter_server", ("--chief", "--workers", "2", "--ps", "1")),
)


def parse_results(output: str, marker: str = RESULT_MARKER) -> dict[str, dict]:
    """The JSON results after `marker` in a job's output, keyed by task ('' when not launched)."""
    results = {}
    for line in output.splitlines():
        prefix, found, payload = line.partition(marker)
        if found:
            results[prefix.strip().strip("[]")] = json.loads(payload)
    return results


def run_job(job: Job, *, steps: int, timeout: float) -> tuple[dict[str, dict], str, float]:
    smoke = [sys.executable, "-m", "experiments.smoke", f"--strategy={job.strategy}",
             f"--steps={steps}", *job.flags]  # fmt: skip
    if job.launch:
        command = [sys.executable, "-m", "tfdist.launch", *job.launch,
                   "--timeout", str(int(timeout)), "--", *smoke]  # fmt: skip
    else:
        command = smoke
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout + 30, check=False
        )
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        output = f"{e.stdout or ''}\n(timed out after {timeout:.0f} s)"
    return parse_results(output), output, time.perf_counter() - start


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.smoke", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--only", action="append", choices=[j.strategy for j in JOBS],
                        help="run only this strategy (repeatable); one_device always runs")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3, help="training steps per strategy")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest weight difference from one_device that still passes")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300, help="seconds per strategy")
    args = parser.parse_args(argv)
    jobs = [j for j in JOBS if not args.only or j.strategy in {"one_device", *args.only}]

    header = f"{'strategy':<22} {'layout':<38} {'replicas':>8} {'loss first -> last':>19} " \
             f"{'max |w - w_1dev|':>17} {'seconds':>8}  status"  # fmt: skip
    print(header, flush=True)
    print("-" * len(header), flush=True)
    reference = None
    failures = 0
    for job in jobs:
        results, output, seconds = run_job(job, steps=args.steps, timeout=args.timeout)
        task_results = list(results.values())
        status, diff_text, loss_text, replicas = "ok", "-", "-", "-"
        if not task_results:
            status = "FAILED (no result)"
        else:
            first = task_results[0]
            replicas = str(first["replicas"])
            loss_text = f"{first['losses'][0]:.4f} -> {first['losses'][-1]:.4f}"
            if reference is None:
                reference, diff_text = first, "(reference)"
            else:
                diff = max(max_abs_diff(r["weights"], reference["weights"]) for r in task_results)
                diff_text = f"{diff:.1e}"
                if diff > args.tolerance:
                    status = f"MISMATCH (> {args.tolerance:g})"
        print(f"{job.strategy:<22} {job.layout:<38} {replicas:>8} {loss_text:>19} "
              f"{diff_text:>17} {seconds:>8.1f}  {status}", flush=True)  # fmt: skip
        if status != "ok":
            failures += 1
            print("    last output lines:\n    " + "\n    ".join(output.splitlines()[-15:]))
    print(f"\n{len(jobs) - failures} of {len(jobs)} strategies trained and matched one_device.")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

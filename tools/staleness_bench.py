"""Benchmark: staleness of parameter-server updates, with and without the staleness-aware rate.

Each run is a real parameter-server job through tfdist-launch (a chief, --workers workers and
--ps parameter servers, all on this host) training the digits cnn with the same seed; the
two variants (the plain learning rate, and the rate divided by max(1, staleness), Zhang et
al. 2016) take turns, A B A B ..., so the machine's drift hits both alike. For every run
the table gives the staleness the chief measured (mean and max over all updates), the
final test accuracy and loss, and the updates applied; then the medians per variant and
the median of the per-repeat differences (aware - plain).

  python -m tools.staleness_bench                          # ~6 minutes on 2 cores
  python -m tools.staleness_bench --optimizers sgd --repeats 3 --out_csv /tmp/stale.csv

Measured on 2 shared CPU cores (4 workers, 1 ps, cnn, 220 steps of 64, 3 repeats, medians),
while every worker still read the data in the same order (since fixed; the exchange_bench
table in the README has the figures after the fix):
staleness mean ~0.9-1.0, max 5-11, for both variants. Adam: test accuracy 0.886 plain vs
0.866 staleness-aware (median paired difference -0.003, test loss -0.05): no clear effect.
SGD with momentum 0.9: neither variant learns much in 220 steps (0.16 vs 0.23; median paired
difference +0.12), while the same SGD reaches 0.90 on one device and with a single
parameter-server worker (staleness 0): asynchrony, not the loop, costs the accuracy. With
mean staleness ~1 the rate changes only for the minority of updates with staleness >= 2.

This is a benchmark, not a test: it reports figures and never fails on them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from tools import harness

# (learning rate, momentum): the digits_cnn recipe's Adam, and an SGD that reaches ~0.90 on
# one device in the same 220 steps (without momentum, 0.05 does not learn at all in them).
OPTIMIZERS = {"adam": (0.003, 0.0), "sgd": (0.05, 0.9)}
COLUMNS = [
    "optimizer", "staleness_aware_lr", "repeat", "workers", "ps", "steps", "applied_updates",
    "staleness_mean", "staleness_max", "eval_accuracy", "eval_loss", "train_loss",
    "job_seconds",
]  # fmt: skip


def run_job(args, *, optimizer: str, aware: bool, data_dir: str, model_dir: str) -> dict:
    """Trains once through the launcher; returns summary.json plus the job's wall time."""
    flags = [
        "--strategy=parameter_server", f"--model={args.model}", f"--epochs={args.epochs}",
        f"--seed={args.seed}", f"--optimizer={optimizer}",
        f"--learning_rate={OPTIMIZERS[optimizer][0]}", f"--momentum={OPTIMIZERS[optimizer][1]}",
        f"--steps_per_execution={args.steps_per_execution}", "--eval_every=0",
        f"--data_dir={data_dir}", f"--staleness_aware_lr={str(aware).lower()}",
    ]  # fmt: skip
    layout = ["--chief", f"--workers={args.workers}", f"--ps={args.ps}"]
    return harness.train(flags, layout=layout, model_dir=model_dir, timeout=args.timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.staleness_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of 22 steps of 64")
    parser.add_argument("--steps_per_execution", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--optimizers", default="adam,sgd", help="comma-separated: adam, sgd (default: both)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--out_csv", default="staleness_bench.csv")
    args = parser.parse_args(argv)
    optimizers = [name.strip() for name in args.optimizers.split(",") if name.strip()]
    unknown = [name for name in optimizers if name not in OPTIMIZERS]
    if unknown:
        parser.error(f"--optimizers takes {', '.join(OPTIMIZERS)}. Received: {unknown}")

    rows = []
    with tempfile.TemporaryDirectory(prefix="staleness-bench-") as scratch:
        data_dir = os.path.join(scratch, "data")
        for optimizer in optimizers:
            for repeat in range(args.repeats):
                for aware in (False, True):
                    model_dir = os.path.join(scratch, f"{optimizer}-{repeat}-{int(aware)}")
                    summary = run_job(
                        args, optimizer=optimizer, aware=aware, data_dir=data_dir,
                        model_dir=model_dir,
                    )  # fmt: skip
                    row = {
                        "optimizer": optimizer,
                        "staleness_aware_lr": aware,
                        "repeat": repeat,
                        "workers": args.workers,
                        "ps": args.ps,
                        **{k: summary[k] for k in COLUMNS if k in summary},
                    }
                    rows.append(row)
                    print(_format_row(row), flush=True)

    harness.write_csv(args.out_csv, rows, COLUMNS)
    print()
    print(_table(rows))
    print(f"\nwrote {args.out_csv}")
    return 0


def _format_row(row: dict) -> str:
    return (
        f"{row['optimizer']:5s} aware={str(row['staleness_aware_lr']):5s} #{row['repeat']}  "
        f"staleness mean {row['staleness_mean']:.2f} max {row['staleness_max']:2d}  "
        f"test acc {row['eval_accuracy']:.4f} loss {row['eval_loss']:.4f}  "
        f"updates {row['applied_updates']}/{row['steps']}  {row['job_seconds']:.0f} s"
    )


def _table(rows: list[dict]) -> str:
    header = (
        f"{'optimizer':9s} {'lr':15s} {'runs':>4s} {'stale mean':>10s} {'stale max':>9s} "
        f"{'test acc':>8s} {'test loss':>9s}   (medians)"
    )
    lines = [header, "-" * len(header)]
    for optimizer in dict.fromkeys(row["optimizer"] for row in rows):
        for aware in (False, True):
            mine = [
                r for r in rows if r["optimizer"] == optimizer and r["staleness_aware_lr"] == aware
            ]
            lines.append(
                f"{optimizer:9s} {'staleness-aware' if aware else 'plain':15s} {len(mine):4d} "
                f"{harness.median(mine, 'staleness_mean'):10.2f} {harness.median(mine, 'staleness_max'):9.0f} "
                f"{harness.median(mine, 'eval_accuracy'):8.4f} {harness.median(mine, 'eval_loss'):9.4f}"
            )
        pairs = {}
        for r in rows:
            if r["optimizer"] == optimizer:
                pairs.setdefault(r["repeat"], {})[r["staleness_aware_lr"]] = r
        deltas = [p[True]["eval_accuracy"] - p[False]["eval_accuracy"] for p in pairs.values()]
        loss = [p[True]["eval_loss"] - p[False]["eval_loss"] for p in pairs.values()]
        lines.append(
            f"{optimizer:9s} {'aware - plain':15s} {len(deltas):4d} {'':10s} {'':9s} "
            f"{statistics.median(deltas):+8.4f} {statistics.median(loss):+9.4f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: how much the workers exchange and wait, against what they learn, on one table.

Synchronous training (multi_worker_mirrored: an all-reduce every step, every worker waits for
the slowest) against its alternatives, each a real job through tfdist-launch and the training
binary on the digits cnn, with the same examples (--epochs of 22 steps of 64), seed and data:

  sync           multi_worker_mirrored
  ps             parameter_server, plain asynchronous updates (--max_staleness=none)
  ps_aware       + the staleness-aware learning rate (Zhang et al., 2016)
  ps_dc          + delay compensation (--async_correction=dc; Zheng et al., 2017)
  ps_momentum    + momentum lowered by asynchrony's own (SGD only; Mitliagkas et al., 2016)
  ps_stale0/1/4  + --max_staleness=0 / 1 / 4 (bounded delay; 0: the workers take turns)
  ps_warmup      + --async_warmup=110: the first half of the steps take turns, then unbounded
  ps_warmup_mom  + --async_warmup=110 and the momentum correction after it (SGD only)
  local4/16      local SGD, weights averaged every 4 / 16 steps (--average_every)
  gossip_ring    gossip SGD on a ring of the workers (--gossip=ring)
  gossip_exp     gossip SGD on the one-peer exponential graph (--gossip=exponential)
  admm4          consensus ADMM, rho 0.1, a consensus step every 4 steps (--admm; Boyd et
                 al., 2011): each worker on its own data, joined by z and the duals

Every variant runs with no straggler and with one worker slowed 2x (tfdist-launch --slow
worker:1=2), for each optimizer (Adam 0.003; SGD 0.05 with momentum 0.9), --repeats times,
interleaved (repeat 1 of every variant, then repeat 2, ...) so the machine's drift hits
all alike. Repeat r trains with --seed + r (the initial weights and the data's order), sync
included, so each median is over distinct runs. Reported, medians over the repeats:

  test acc       test accuracy after the same number of examples
  spread         the repeats' lowest and highest test accuracy
  ex/s           training examples per second (the binary's own figure, over the run)
  train s        training seconds (the sum of the epochs' times, without evaluation; the
                 first epoch at the second's rate, leaving out the one-off tracing)
  KiB/step       bytes one worker sends per step: measured (local SGD, gossip: tfdist counts
                 its sends) or by formula (sync: a ring all-reduce, 2 (N-1)/N of the
                 weights; ps: the weights read and the gradients sent, 2x the weights)
  acc@sync s     test accuracy when the sync run of the same setting had finished training
                 (interpolated along the epochs' curve): accuracy per wall-clock second
  s to 95%       training seconds until the test accuracy first reached 95% of sync's
                 final one (nan: never), the time-to-accuracy of DAWNBench

  python -m tools.exchange_bench --quick            # 1 repeat, 4 epochs, fewer variants
  python -m tools.exchange_bench                    # the full table (~2 h on 2 cores)
  python -m tools.exchange_bench --variants sync,local4 --optimizers sgd --stragglers 1
  python -m tools.exchange_bench --table A/results.csv B/results.csv   # one table of runs

Each invocation writes into a new directory under --out (results.csv, table.txt,
accuracy_vs_time.png): nothing an earlier run wrote is replaced. It is a benchmark, not a
test: it reports figures and never fails on them.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from tools import harness

# (learning rate, momentum): the digits_cnn recipe's Adam, and an SGD that reaches ~0.90 on
# one device in the same 220 steps.
OPTIMIZERS = {"adam": (0.003, 0.0), "sgd": (0.05, 0.9)}
# name -> (strategy, binary flags)
# Parameter-server variants name their bound: the binary's default bounds the staleness.
UNBOUNDED = "--max_staleness=none"
VARIANTS = {
    "sync": ("multi_worker_mirrored", []),
    "ps": ("parameter_server", [UNBOUNDED]),
    "ps_aware": ("parameter_server", [UNBOUNDED, "--staleness_aware_lr"]),
    "ps_dc": ("parameter_server", [UNBOUNDED, "--async_correction=dc"]),
    "ps_momentum": ("parameter_server", [UNBOUNDED, "--async_correction=momentum"]),
    "ps_stale0": ("parameter_server", ["--max_staleness=0"]),
    "ps_stale1": ("parameter_server", ["--max_staleness=1"]),
    "ps_stale4": ("parameter_server", ["--max_staleness=4"]),
    "ps_warmup": ("parameter_server", ["--async_warmup=110"]),
    "ps_warmup_mom": ("parameter_server", ["--async_warmup=110", "--async_correction=momentum"]),
    "local4": ("multi_worker_mirrored", ["--average_every=4"]),
    "local16": ("multi_worker_mirrored", ["--average_every=16"]),
    "gossip_ring": ("multi_worker_mirrored", ["--gossip=ring"]),
    "gossip_exp": ("multi_worker_mirrored", ["--gossip=exponential"]),
    "admm4": ("multi_worker_mirrored", ["--admm=rho=0.1,every=4"]),
}
# Variants that lower SGD's momentum: Adam has none to lower.
MOMENTUM_ONLY = ("ps_momentum", "ps_warmup_mom")
QUICK_VARIANTS = ["sync", "ps", "ps_dc", "ps_stale1", "local4", "gossip_ring"]
COLUMNS = [
    "optimizer", "straggler", "variant", "repeat", "eval_accuracy", "eval_loss",
    "examples_per_second", "train_seconds", "bytes_per_step", "bytes_how", "staleness_mean",
    "staleness_max", "replica_distance_relative", "curve", "job_seconds",
]  # fmt: skip


def run_job(
    args, *, variant: str, optimizer: str, slow: float, scratch: str, repeat: int = 0
) -> dict:
    """Trains once through the launcher; returns summary.json with the job's wall time."""
    strategy, extra = VARIANTS[variant]
    rate, momentum = OPTIMIZERS[optimizer]
    flags = [
        f"--strategy={strategy}", "--model=cnn", f"--epochs={args.epochs}",
        f"--seed={args.seed + repeat}",
        f"--optimizer={optimizer}", f"--learning_rate={rate}", f"--momentum={momentum}",
        "--eval_every=1", f"--data_dir={os.path.join(scratch, 'data')}", *extra,
    ]  # fmt: skip
    layout = ["--workers", str(args.workers)]
    if strategy == "parameter_server":
        layout = ["--chief", *layout, "--ps", str(args.ps)]
    if slow > 1:
        layout += ["--slow", f"worker:1={slow:g}"]
    return harness.train(
        flags, layout=layout, model_dir=tempfile.mkdtemp(prefix=f"{variant}-", dir=scratch),
        timeout=args.timeout, what=variant,
    )  # fmt: skip


def row_of(args, summary: dict, *, variant: str, optimizer: str, slow: float, repeat: int):
    """The table's row for one job: its figures, and its learning curve (seconds, accuracy)."""
    elapsed, curve = 0.0, []
    history = summary["history"]
    for i, epoch in enumerate(history):
        steps = epoch["step"] - (curve[-1][2] if curve else 0)
        # The first epoch is timed at the second's rate: the tracing and compiling every
        # job does once would otherwise weigh on a short run's figures.
        rate = history[min(i if i else 1, len(history) - 1)]["examples_per_second"]
        elapsed += steps * summary["global_batch_size"] / rate
        curve.append((elapsed, epoch.get("eval_accuracy"), epoch["step"]))
    exchange = summary.get("exchange") or {}
    weights = summary["exchange_weights"]
    if "bytes_sent" in exchange:
        sent, how = exchange["bytes_sent"] / summary["steps"], "measured"
    elif VARIANTS[variant][0] == "parameter_server":
        sent, how = 2 * 4 * weights, "formula"
    else:
        sent, how = 2 * (args.workers - 1) / args.workers * 4 * weights, "formula"
    return {
        "optimizer": optimizer, "straggler": f"{slow:g}x", "variant": variant,
        "repeat": repeat, "eval_accuracy": summary["eval_accuracy"],
        "eval_loss": summary["eval_loss"], "examples_per_second": summary["examples_per_second"],
        "train_seconds": elapsed, "bytes_per_step": sent, "bytes_how": how,
        "staleness_mean": summary.get("staleness_mean"),
        "staleness_max": summary.get("staleness_max"),
        "replica_distance_relative": exchange.get("replica_distance_relative"),
        "curve": json.dumps([(round(t, 3), a) for t, a, _ in curve]),
        "job_seconds": summary["job_seconds"],
    }  # fmt: skip


def accuracy_at(curve: list, seconds: float) -> float:
    """The accuracy a run's curve had reached at `seconds` of training (linear between
    epochs; before its first evaluation, that first figure)."""
    points = [(t, a) for t, a in curve if a is not None]
    if seconds <= points[0][0]:
        return points[0][1]
    for (t0, a0), (t1, a1) in zip(points, points[1:], strict=False):
        if t0 <= seconds <= t1:
            return a0 + (a1 - a0) * (seconds - t0) / (t1 - t0)
    return points[-1][1]


def seconds_to(curve: list, accuracy: float) -> float:
    """When a run's curve first reached `accuracy` (linear between epochs; nan: never)."""
    points = [(t, a) for t, a in curve if a is not None]
    previous = (0.0, 0.0)
    for t, a in points:
        if a >= accuracy:
            t0, a0 = previous
            return t0 + (t - t0) * (accuracy - a0) / (a - a0) if a > a0 else t
        previous = (t, a)
    return float("nan")


def table(rows: list[dict]) -> str:
    header = (
        f"{'optimizer':9s} {'straggler':9s} {'variant':12s} {'runs':>4s} {'test acc':>8s} "
        f"{'spread':>13s} {'vs sync':>7s} {'ex/s':>6s} {'train s':>7s} {'KiB/step':>8s} {'how':8s} "
        f"{'stale':>5s} {'acc@sync s':>10s} {'s to 95%':>8s}"
    )
    lines = [header + "   (medians)", "-" * len(header)]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["optimizer"], row["straggler"], row["variant"]), []).append(row)
    for (optimizer, straggler, variant), mine in groups.items():
        sync = groups.get((optimizer, straggler, "sync"), [])
        accuracy = harness.median(mine, "eval_accuracy")
        versus = accuracy - harness.median(sync, "eval_accuracy") if sync else float("nan")
        at_sync = to_target = float("nan")
        if sync:
            sync_seconds = harness.median(sync, "train_seconds")
            at_sync = statistics.median(
                accuracy_at(json.loads(r["curve"]), sync_seconds) for r in mine
            )
            target = 0.95 * harness.median(sync, "eval_accuracy")
            to_target = statistics.median(seconds_to(json.loads(r["curve"]), target) for r in mine)
        stale = [r["staleness_mean"] for r in mine if r["staleness_mean"] is not None]
        accuracies = [float(r["eval_accuracy"]) for r in mine]
        spread = f"{min(accuracies):.3f}-{max(accuracies):.3f}"
        lines.append(
            f"{optimizer:9s} {straggler:9s} {variant:12s} {len(mine):4d} {accuracy:8.4f} "
            f"{spread:>13s} {versus:+7.4f} {harness.median(mine, 'examples_per_second'):6.0f} "
            f"{harness.median(mine, 'train_seconds'):7.1f} {harness.median(mine, 'bytes_per_step') / 1024:8.1f} "
            f"{mine[0]['bytes_how']:8s} "
            f"{(statistics.median(stale) if stale else float('nan')):5.2f} {at_sync:10.4f} "
            f"{to_target:8.1f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'); no plot written")
        return False
    panels = sorted({(r["optimizer"], r["straggler"]) for r in rows})
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for axis, (optimizer, straggler) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if (r["optimizer"], r["straggler"]) == (optimizer, straggler)]
        for variant in dict.fromkeys(r["variant"] for r in mine):
            runs = [r for r in mine if r["variant"] == variant]
            middle = sorted(runs, key=lambda r: r["eval_accuracy"])[len(runs) // 2]
            curve = [(t, a) for t, a in json.loads(middle["curve"]) if a is not None]
            style = "-" if variant == "sync" else ("--" if variant.startswith("ps") else ":")
            width = 2.5 if variant == "sync" else 1.2
            axis.plot(*zip(*curve, strict=True), style, linewidth=width, label=variant)
        axis.set_title(f"{optimizer}, straggler {straggler}")
        axis.set_xlabel("training seconds")
        axis.set_ylabel("test accuracy")
        axis.set_ylim(0, 1)
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    figure.suptitle("Test accuracy vs wall time, 4 workers, digits cnn (median run per variant)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.exchange_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=10, help="epochs of 22 steps of 64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--optimizers", default="adam,sgd", help="comma-separated: adam, sgd")
    parser.add_argument("--variants", default=None, help="comma-separated (default: all)")
    parser.add_argument(
        "--stragglers", default="1,2", help="comma-separated slowdowns of worker:1 (1: none)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--out", default="exchange_bench", help="a new directory goes in here")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 4 epochs, 6 variants")
    parser.add_argument(
        "--table", nargs="+", metavar="CSV", help="print the table of earlier runs' results.csv"
    )
    args = parser.parse_args(argv)
    if args.table:
        print(table([row for path in args.table for row in read_rows(path)]))
        return 0
    if args.quick:
        args.repeats, args.epochs = 1, 4
        args.variants = args.variants or ",".join(QUICK_VARIANTS)
    optimizers = _listed(parser, "--optimizers", args.optimizers, OPTIMIZERS)
    variants = _listed(parser, "--variants", args.variants or ",".join(VARIANTS), VARIANTS)
    try:
        stragglers = [float(s) for s in args.stragglers.split(",")]
    except ValueError:
        parser.error(f"--stragglers takes numbers >= 1. Received: {args.stragglers}")
    if any(s < 1 for s in stragglers):
        parser.error(f"--stragglers takes numbers >= 1. Received: {args.stragglers}")
    out = Path(args.out) / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=False)
    weights = _cnn_weights()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="exchange-bench-") as scratch:
        for repeat in range(args.repeats):
            for slow in stragglers:
                for optimizer in optimizers:
                    for variant in variants:
                        if variant in MOMENTUM_ONLY and not OPTIMIZERS[optimizer][1]:
                            continue  # it lowers SGD's momentum; Adam has none to lower
                        summary = run_job(
                            args, variant=variant, optimizer=optimizer, slow=slow,
                            scratch=scratch, repeat=repeat,
                        )  # fmt: skip
                        summary["exchange_weights"] = weights
                        row = row_of(
                            args, summary, variant=variant, optimizer=optimizer, slow=slow,
                            repeat=repeat,
                        )  # fmt: skip
                        rows.append(row)
                        # Rewritten after every job: a stopped run keeps what it measured.
                        harness.write_csv(out / "results.csv", rows, COLUMNS)
                        print(
                            f"#{repeat} {optimizer:4s} {slow:g}x {variant:12s} "
                            f"acc {row['eval_accuracy']:.4f} {row['examples_per_second']:6.0f} ex/s "
                            f"{row['train_seconds']:5.1f} s  job {row['job_seconds']:.0f} s",
                            flush=True,
                        )
    text = table(rows)
    (out / "table.txt").write_text(text + "\n")
    print()
    print(text)
    if plot(rows, out / "accuracy_vs_time.png"):
        print(f"\nwrote {out / 'accuracy_vs_time.png'}")
    print(f"wrote {out / 'results.csv'} and {out / 'table.txt'}")
    return 0


def read_rows(path: str) -> list[dict]:
    """The rows of a results.csv, their figures as numbers."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key in ("eval_accuracy", "eval_loss", "examples_per_second", "train_seconds",
                        "bytes_per_step", "job_seconds"):  # fmt: skip
                row[key] = float(row[key])
            for key in ("staleness_mean", "replica_distance_relative"):
                row[key] = float(row[key]) if row[key] else None
            rows.append(row)
    return rows


def _listed(parser, flag: str, text: str, known) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        parser.error(f"{flag} takes {', '.join(known)}. Received: {text}")
    return names


def _cnn_weights() -> int:
    """The digits cnn's number of trainable weights (what an exchange of the model moves)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfdist.models import build_model

    model = build_model("cnn", input_shape=(8, 8, 1), num_classes=10)
    return sum(int(v.numpy().size) for v in model.trainable_variables)


if __name__ == "__main__":
    sys.exit(main())

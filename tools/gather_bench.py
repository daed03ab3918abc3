"""Benchmark: an all-gather inside a step among the replicas of one process, TensorFlow's
(`ReplicaContext.all_gather`: two collective gathers a call) against tfdist's
(`tfdist.collective.replicas.all_gather`: the parts read where they lie, one merge_call).

Each row is a fresh process (nothing traced before it) over --devices logical CPUs: one
tf.function whose step makes --gathers gathers in a chain, each differentiated. Reported:

  trace s    tracing the step (every replica's program)
  first s    its first call: the program made ready (placement, optimisation, collectives
             resolved) and run once
  step ms    the median of --iters calls after it

  python -m tools.gather_bench                   # 10 and 40 gathers over 4 devices
  python -m tools.gather_bench --gathers 10,40,80 --devices 2

Rows go to --out_csv (an earlier file there is moved aside, not replaced). A benchmark, not a
test: it reports figures and checks only that the two gathers agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from tools import harness

RESULT = "BENCH_ROW "
KINDS = ("tensorflow", "tfdist")


def one(kind: str, gathers: int, devices: int, iters: int) -> dict:
    """Times one step of `gathers` gathers in this process."""
    import tfdist

    tfdist.configure_cpu_devices(devices)
    import numpy as np
    import tensorflow as tf

    from tfdist.collective import replicas

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(devices)])

    def gather(x):
        if kind == "tfdist":
            return replicas.all_gather(x)
        return tf.distribute.get_replica_context().all_gather(x, axis=0)

    def replica():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        x = tf.fill([2, 64], tf.cast(r, tf.float32))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x
            for _ in range(gathers):
                y = gather(y[:2] * 1.01)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, x)

    step = tf.function(lambda: strategy.run(replica), autograph=False)
    start = time.perf_counter()
    step.get_concrete_function()
    traced = time.perf_counter() - start
    start = time.perf_counter()
    grads = step()
    first = time.perf_counter() - start
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    checksum = float(np.sum([g.numpy() for g in strategy.experimental_local_results(grads)]))
    return {
        "gather": kind,
        "gathers": gathers,
        "devices": devices,
        "trace s": round(traced, 3),
        "first s": round(first, 3),
        "step ms": round(1e3 * statistics.median(times), 3),
        "checksum": checksum,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.gather_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--gathers", default="10,40", help="gathers per step, comma-separated")
    parser.add_argument("--devices", type=int, default=4, help="logical CPUs (replicas)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls after the first")
    parser.add_argument("--out_csv", default="gather_bench.csv", help="where the rows go")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a row in this process: KIND:GATHERS
    args = parser.parse_args(argv)
    try:
        counts = [int(g) for g in args.gathers.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        parser.error(
            f"--gathers takes positive whole numbers, e.g. 10,40. Received: {args.gathers!r}"
        )
    if args.devices < 2 or args.iters < 1:
        parser.error(
            "--devices must be at least 2 (a gather needs replicas) and --iters at least 1. "
            f"Received: --devices={args.devices} --iters={args.iters}"
        )
    if args.one:
        kind, gathers = args.one.split(":")
        row = one(kind, int(gathers), args.devices, args.iters)
        print(RESULT + json.dumps(row), flush=True)
        return 0
    rows = []
    for gathers in counts:
        for kind in KINDS:
            command = [sys.executable, "-m", "tools.gather_bench", f"--one={kind}:{gathers}",
                       f"--devices={args.devices}", f"--iters={args.iters}"]  # fmt: skip
            job = harness.run(command, timeout=900, what=f"{kind} x{gathers}")
            line = next(x for x in job.output.splitlines() if x.startswith(RESULT))
            rows.append(json.loads(line[len(RESULT) :]))
        pair = rows[-2:]
        if abs(pair[0]["checksum"] - pair[1]["checksum"]) > 1e-3 * max(
            1.0, abs(pair[0]["checksum"])
        ):
            raise SystemExit(f"The two gathers disagree: {pair}")
    columns = ["gather", "gathers", "devices", "trace s", "first s", "step ms"]
    print("  ".join(f"{c:>10}" for c in columns))
    for row in rows:
        print("  ".join(f"{row[c]!s:>10}" for c in columns))
    for gathers in sorted({r["gathers"] for r in rows}):
        tf_row, mine = (
            next(r for r in rows if r["gathers"] == gathers and r["gather"] == k) for k in KINDS
        )
        print(
            f"{gathers} gathers: tfdist / TensorFlow  trace {mine['trace s'] / tf_row['trace s']:.2f}, "
            f"first call {mine['first s'] / tf_row['first s']:.2f}, "
            f"step {mine['step ms'] / tf_row['step ms']:.2f}"
        )
    harness.keep_earlier(args.out_csv)
    harness.write_csv(args.out_csv, rows, columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())

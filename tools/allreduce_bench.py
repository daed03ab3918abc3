"""All-reduce benchmark across worker processes, in the style of nccl-tests.

Starts W local worker processes through tools.launch; each builds a MultiWorkerMirrored
runtime and times, per size, tfdist's ring (ProcessRing) and TensorFlow's built-in
all-reduce (CollectiveReduceV2 with the ring hint), taking turns. Rank 0 prints, per size
and implementation, the median time of --iters calls, algbw = S / t and
busbw = algbw x 2(W-1)/W (the bytes each rank moves, so rings of any size compare), and
writes the table as CSV.

  python -m tools.allreduce_bench --workers 3                 # 4 KiB .. 64 MiB
  python -m tools.allreduce_bench --workers 3 --max_bytes 16M --iters 5

A benchmark, not a test: it reports figures and checks only that both agree on the sum.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

RESULT = "BENCH_ROW "
BUILTIN_GROUP_KEY = 2_000_000


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return (
        int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)
    )


def sizes_between(low: int, high: int) -> list[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= 4
    return sizes


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import tfdist
    from tfdist.collective import ProcessRing

    cluster = tfdist.parse_tf_config()
    tfdist.build_strategy("multi_worker_mirrored", cluster=cluster, collective_timeout=300)
    rank, ranks = cluster.task_index, cluster.num_workers
    ring = ProcessRing(rank=rank, ranks=ranks, timeout_seconds=300)
    builtin_keys = iter(range(1, 1 << 20))

    def builtin_for(length: int):
        key = next(builtin_keys)

        @tf.function(input_signature=[tf.TensorSpec([length], tf.float32)])
        def builtin(x):
            return tf.raw_ops.CollectiveReduceV2(
                input=x, group_size=ranks, group_key=BUILTIN_GROUP_KEY, instance_key=key,
                ordering_token=[], merge_op="Add", final_op="Id", communication_hint="ring",
                timeout_seconds=300.0,
            )  # fmt: skip

        return builtin

    for size in sizes_between(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)):
        length = size // 4
        x = tf.random.stateless_uniform([length], seed=[rank, size])
        implementations = {"tfdist ring": ring.all_reduce, "tf builtin ring": builtin_for(length)}
        outputs = {name: fn(x).numpy() for name, fn in implementations.items()}  # warm-up
        agree = bool(abs(outputs["tfdist ring"] - outputs["tf builtin ring"]).max() <= 1e-4 * ranks)
        times = {name: [] for name in implementations}
        for _ in range(args.iters):
            for name, fn in implementations.items():
                start = time.perf_counter()
                fn(x).numpy()
                times[name].append(time.perf_counter() - start)
        if rank == 0:
            for name, samples in times.items():
                seconds = statistics.median(samples)
                algbw = size / seconds / 1e9
                row = {
                    "workers": ranks, "bytes": size, "implementation": name, "seconds": seconds,
                    "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (ranks - 1) / ranks, "agree": agree,
                }  # fmt: skip
                print(RESULT + json.dumps(row), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.allreduce_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    parser.add_argument("--min_bytes", default="4K", help="smallest buffer (default 4K)")
    parser.add_argument("--max_bytes", default="64M", help="largest buffer (default 64M)")
    parser.add_argument(
        "--iters", type=int, default=5, help="timed calls per size and implementation"
    )
    parser.add_argument("--out_csv", default="allreduce_bench.csv")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    command = [sys.executable, "-m", "tools.launch", "--workers", str(args.workers), "--", sys.executable, "-m",
               "tools.allreduce_bench", "--worker", f"--min_bytes={args.min_bytes}", f"--max_bytes={args.max_bytes}",
               f"--iters={args.iters}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    rows = [
        json.loads(line.split(RESULT, 1)[1]) for line in done.stdout.splitlines() if RESULT in line
    ]
    if done.returncode or not rows:
        print(done.stdout[-4000:], file=sys.stderr)
        return done.returncode or 1
    print(
        f"{'bytes':>10} {'implementation':<16} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11} {'agree':>6}"
    )
    for row in rows:
        print(f"{row['bytes']:>10} {row['implementation']:<16} {row['seconds'] * 1e3:9.2f} "
              f"{row['algbw_GBps']:11.3f} {row['busbw_GBps']:11.3f} {str(row['agree']):>6}")  # fmt: skip
    with open(args.out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{args.workers} workers on loopback; wrote {args.out_csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

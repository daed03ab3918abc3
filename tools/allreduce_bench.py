"""All-reduce benchmark, in the style of nccl-tests.

Mode `process` (the default) starts W local worker processes through tfdist-launch. Each
builds a MultiWorkerMirrored runtime and times, per buffer size, taking turns:

  tfdist ring      ProcessRing: tfdist's ring over point-to-point collective transfers
  naive            GatherBroadcast: everything to rank 0, summed there, broadcast back
  tf builtin ring  TensorFlow's CollectiveReduceV2 with the ring hint
  (tfdist ring bf16  the ring with bfloat16 wire compression, with --compression)

Rank 0 prints the median time of --iters calls, algbw = S / t and busbw = algbw x 2(W-1)/W
(the bytes each rank of a ring moves, so any number of ranks compares), and the ratio of
each busbw to the built-in one's; the table goes to CSV and, with matplotlib, a PNG.

Mode `local` runs in one process over W logical CPUs: a ResNet-20-sized list of gradients is
all-reduced through MirroredStrategy with each CrossDeviceOps — tfdist's RingAllReduce (fused
and unfused), ReductionToOneDevice and HierarchicalCopyAllReduce — the way Keras' model.fit
reduces its gradients (replica context all_reduce).

  python -m tools.allreduce_bench --workers 3                  # 4 KiB .. 64 MiB
  python -m tools.allreduce_bench --workers 3 --min_bytes 1M --max_bytes 64M --iters 7
  python -m tools.allreduce_bench --mode local --workers 4

A benchmark, not a test: it reports figures, and checks only that implementations agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from tools import harness

RESULT = "BENCH_ROW "
BASELINE = {"process": "tf builtin ring", "local": "ReductionToOneDevice"}


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    suffix = text[-1].upper()
    return int(float(text[:-1]) * units[suffix]) if suffix in units else int(text)


def sizes_between(low: int, high: int) -> list[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= 4
    return sizes


def time_calls(implementations: dict, iters: int) -> dict[str, list[float]]:
    """Seconds per call of each implementation, taking turns so load drifts hit all alike."""
    times = {name: [] for name in implementations}
    for _ in range(iters):
        for name, call in implementations.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def process_worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.collective import GatherBroadcast, ProcessRing, group_key_base

    cluster = tfdist.parse_tf_config()
    tfdist.build_strategy("multi_worker_mirrored", cluster=cluster, collective_timeout=300)
    rank, ranks = cluster.task_index, cluster.num_workers
    ring = ProcessRing(
        rank=rank, ranks=ranks, timeout_seconds=300, max_pieces=args.max_pieces,
        min_piece_bytes=parse_bytes(args.min_piece_bytes),
    )  # fmt: skip
    naive = GatherBroadcast(rank=rank, ranks=ranks, timeout_seconds=300)
    builtin_keys = iter(range(1, 1 << 20))

    def builtin_for(length: int):
        key = next(builtin_keys)

        @tf.function(input_signature=[tf.TensorSpec([length], tf.float32)])
        def builtin(x):
            return tf.raw_ops.CollectiveReduceV2(
                input=x, group_size=ranks, group_key=group_key_base("benchmarks"), instance_key=key,
                ordering_token=[], merge_op="Add", final_op="Id", communication_hint="ring",
                timeout_seconds=300.0,
            )  # fmt: skip

        return builtin

    for size in sizes_between(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)):
        x = tf.random.stateless_uniform([size // 4], seed=[rank, size])
        functions = {
            "tfdist ring": ring.all_reduce,
            "naive": naive.all_reduce,
            "tf builtin ring": builtin_for(size // 4),
        }
        if args.compression:
            functions["tfdist ring bf16"] = lambda t: ring.all_reduce_many(
                [t], compression="bfloat16"
            )[0]
        outputs = {name: fn(x).numpy() for name, fn in functions.items()}  # warm-up, and check
        reference = outputs["tf builtin ring"]
        agree = {
            name: bool(np.abs(out - reference).max() <= (1e-2 if "bf16" in name else 1e-4) * ranks)
            for name, out in outputs.items()
        }
        times = time_calls(
            {n: (lambda fn=fn, x=x: fn(x).numpy()) for n, fn in functions.items()}, args.iters
        )
        if rank == 0:
            for name, samples in times.items():
                seconds = statistics.median(samples)
                algbw = size / seconds / 1e9
                row = {"mode": "process", "workers": ranks, "bytes": size, "implementation": name,
                       "seconds": seconds, "algbw_GBps": algbw,
                       "busbw_GBps": algbw * 2 * (ranks - 1) / ranks, "agree": agree[name]}  # fmt: skip
                print(RESULT + json.dumps(row), flush=True)


def resnet20_gradient_shapes() -> list[list[int]]:
    from tfdist.models import build_model

    model = build_model("resnet", input_shape=(32, 32, 3), num_classes=10, depth=20)
    return [
        v.shape.as_list() if hasattr(v.shape, "as_list") else list(v.shape)
        for v in model.trainable_variables
    ]


def local_mode(args: argparse.Namespace) -> list[dict]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tfdist

    tfdist.configure_cpu_devices(args.workers)
    import numpy as np
    import tensorflow as tf

    from tfdist.collective import RingAllReduce

    shapes = resnet20_gradient_shapes()
    nbytes = sum(int(np.prod(s)) for s in shapes) * 4
    devices = [f"/cpu:{i}" for i in range(args.workers)]
    implementations = {
        "tfdist RingAllReduce": RingAllReduce(),
        "tfdist RingAllReduce (no fusion)": RingAllReduce(bucket_bytes=0),
        "ReductionToOneDevice": tf.distribute.ReductionToOneDevice(),
        "HierarchicalCopyAllReduce": tf.distribute.HierarchicalCopyAllReduce(num_packs=1),
    }
    steps, outputs = {}, {}
    for name, ops in implementations.items():
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)

        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            grads = [
                tf.random.stateless_normal(shape, seed=[ctx.replica_id_in_sync_group, i])
                for i, shape in enumerate(shapes)
            ]
            summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, grads)
            return tf.add_n([tf.reduce_sum(g) for g in summed])

        step = tf.function(lambda strategy=strategy, fn=replica_fn: strategy.run(fn))
        outputs[name] = float(strategy.experimental_local_results(step())[0])  # warm-up
        steps[name] = step
    reference = outputs[BASELINE["local"]]
    times = time_calls(steps, args.iters)
    rows = []
    for name, samples in times.items():
        seconds = statistics.median(samples)
        algbw = nbytes / seconds / 1e9
        rows.append({"mode": "local", "workers": args.workers, "bytes": nbytes, "implementation": name,
                     "seconds": seconds, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * 2 * (args.workers - 1) / args.workers,
                     "agree": abs(outputs[name] - reference) <= 1e-3 * max(1.0, abs(reference)),
                     "tensors": len(shapes)})  # fmt: skip
    return rows


def print_table(rows: list[dict], mode: str) -> None:
    baseline = {r["bytes"]: r["busbw_GBps"] for r in rows if r["implementation"] == BASELINE[mode]}
    width = max(len(r["implementation"]) for r in rows)
    print(f"{'bytes':>10}  {'implementation':<{width}} {'time ms':>9} {'algbw GB/s':>11} "
          f"{'busbw GB/s':>11} {'vs ' + BASELINE[mode]:>{len(BASELINE[mode]) + 3}}  agree")  # fmt: skip
    for r in rows:
        ratio = r["busbw_GBps"] / baseline[r["bytes"]] if baseline.get(r["bytes"]) else float("nan")
        print(f"{r['bytes']:>10}  {r['implementation']:<{width}} {r['seconds'] * 1e3:9.2f} "
              f"{r['algbw_GBps']:11.3f} {r['busbw_GBps']:11.3f} "
              f"{ratio:>{len(BASELINE[mode]) + 3}.2f}  {r['agree']}")  # fmt: skip


def plot(rows: list[dict], mode: str, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'); no plot written")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = list(dict.fromkeys(r["implementation"] for r in rows))
    if mode == "process":
        for name in names:
            mine = [r for r in rows if r["implementation"] == name]
            ax.plot(
                [r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], marker="o", label=name
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("buffer size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"All-reduce across {rows[0]['workers']} worker processes on loopback")
        ax.legend()
    else:
        ax.barh(names, [r["seconds"] * 1e3 for r in rows])
        ax.set_xlabel("ms per all-reduce (median)")
        ax.set_title(f"ResNet-20 gradients ({rows[0]['tensors']} tensors, {rows[0]['bytes'] / 2**20:.2f} MiB) "
                     f"over {rows[0]['workers']} logical CPUs")  # fmt: skip
        ax.invert_yaxis()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.allreduce_bench",
        description=__doc__.split("\n\n")[0],
        epilog="Output: a table on stdout, --out_csv, and --plot (PNG, needs matplotlib).",
    )
    parser.add_argument("--mode", choices=("process", "local"), default="process")
    parser.add_argument("--workers", type=int, default=3,
                        help="worker processes (process) or logical CPUs (local); default 3")  # fmt: skip
    parser.add_argument("--min_bytes", default="4K", help="smallest buffer (default 4K)")
    parser.add_argument("--max_bytes", default="64M", help="largest buffer (default 64M)")
    parser.add_argument(
        "--iters", type=int, default=5, help="timed calls per size and implementation"
    )
    parser.add_argument(
        "--max_pieces", type=int, default=4, help="ProcessRing: concurrent rings per buffer"
    )
    parser.add_argument(
        "--min_piece_bytes", default="1M", help="ProcessRing: smallest slice per ring"
    )
    parser.add_argument(
        "--compression", action="store_true", help="also time the ring with bfloat16 on the wire"
    )
    parser.add_argument("--out_csv", default=None, help="default allreduce_<mode>.csv")
    parser.add_argument("--plot", default=None, help="PNG path; default allreduce_<mode>.png")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error(f"--workers must be at least 2. Received: {args.workers}")
    if args.worker:
        process_worker(args)
        return 0
    if args.mode == "local":
        rows = local_mode(args)
    else:
        forwarded = [
            f"--{k}={getattr(args, k)}"
            for k in ("min_bytes", "max_bytes", "iters", "max_pieces", "min_piece_bytes")
        ]
        task = [sys.executable, "-m", "tools.allreduce_bench", "--worker", *forwarded,
                *(["--compression"] if args.compression else [])]  # fmt: skip
        job = harness.launch(task, layout=["--workers", str(args.workers)])
        rows = [
            json.loads(line.split(RESULT, 1)[1])
            for line in job.output.splitlines()
            if RESULT in line
        ]
        if not rows:
            print(job.output[-4000:], file=sys.stderr)
            return 1
    print_table(rows, args.mode)
    out_csv = args.out_csv or f"allreduce_{args.mode}.csv"
    harness.write_csv(out_csv, rows)
    where = (
        "worker processes on loopback" if args.mode == "process" else "logical CPUs in one process"
    )
    png = args.plot or f"allreduce_{args.mode}.png"
    wrote = [out_csv] + ([png] if plot(rows, args.mode, png) else [])
    print(f"\n{args.workers} {where}; median of {args.iters} calls; wrote {', '.join(wrote)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

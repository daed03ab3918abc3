"""Benchmark: an embedding table split across ps tasks, against the same table kept whole.

Each job is a real parameter-server job through tfdist-launch (a chief, one worker and --ps
parameter servers, all on this host). The model: ids (--ids_per_example per example) ->
Embedding(rows x 64) -> mean -> Dense(64, relu) -> Dense(1), trained by `tfdist.fit` with
SGD. The table is held and looked up three ways:

  split   tfdist's partitioner splits it into one block of rows per ps (ps_min_shard_bytes
          of 1 MiB); a lookup gathers the batch's rows on the ps tasks holding them
  whole   one variable on one ps (ps_min_shard_bytes above its size); the lookup gathers
          the batch's rows on that ps
  keras   whole, looked up as Keras 3 does on its own (without tfdist's lookups): the worker
          reads the whole table every step and gathers the rows itself
  empty   a 1000-row table: what a ps holds for the job besides a large table (baseline)

With one ps, split and whole are the same job. The chief times the second of two epochs (the
first traces and warms up) and measures, over those steps, the bytes the worker process
received on its TCP sockets (`ss -ti`: in all, and from the ps tasks), and each ps
process's resident memory before the model is built and at its peak (VmHWM in
/proc/PID/status). "ps MB" is the largest growth of a ps's peak over what it held before the
model; "table on ps" the largest growth beyond the empty-table job's, ps by ps.

  python -m tools.ps_bench                                  # ~3 minutes a repeat, 2 cores
  python -m tools.ps_bench --ps 1 2 --rows 1000000 250000 --repeats 3 --out_csv /tmp/ps.csv

A benchmark, not a test: it reports figures and never fails on them. Linux only (ss, /proc).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools import harness

WIDTH = 64
MEDIAN_COLUMNS = [
    "examples_per_s", "worker_rx_kb_per_step", "from_ps_kb_per_step", "ps_peak_mb",
    "ps_net_mb", "table_on_ps_mb",
]  # fmt: skip
COLUMNS = ["layout", "ps", "rows", "table_mb", "repeat", *MEDIAN_COLUMNS, "ps_net_mb_each",
           "job_seconds"]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The job: what every task of one run executes (`--task`).


def _listening_pid(port: int) -> int:
    """The pid of the process that listens on 127.0.0.1:port (a task's gRPC server)."""
    out = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    found = re.search(r"pid=(\d+)", out)
    if not found:
        raise RuntimeError(f"no process listens on port {port}: {out!r}")
    return int(found[1])


def _received(pid: int, ps_ports: set[int]) -> tuple[int, int]:
    """Bytes that pid's established TCP sockets received: in all, and from the ps ports."""
    out = subprocess.run(
        ["ss", "-tinpH", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    total = from_ps = 0
    lines = out.splitlines()
    for socket_line, info in zip(lines[::2], lines[1::2], strict=False):
        if f"pid={pid}," not in socket_line:
            continue
        received = re.search(r"bytes_received:(\d+)", info)
        count = int(received[1]) if received else 0
        peer = socket_line.split()[3]  # Recv-Q Send-Q Local Peer (state filtered away)
        total += count
        if int(peer.rsplit(":", 1)[1]) in ps_ports:
            from_ps += count
    return total, from_ps


def _memory_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.M)[1])


def run_task(args) -> None:
    """One task of the job; the chief trains and writes the figures to --result."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    class ReadWholeEmbedding(keras.layers.Embedding):
        """Keras 3's lookup as it is without tfdist: read the table, gather on the worker."""

        def call(self, inputs):
            table = tf.convert_to_tensor(self.embeddings.value)  # a ReadVariableOp
            return keras.ops.take(table, keras.ops.cast(inputs, "int32"), axis=0)

    cluster = tfdist.cluster_from_environment()
    if tfdist.serve_if_needed(cluster):
        return
    table_bytes = args.rows * WIDTH * 4
    strategy = tfdist.build_strategy(  # waits for every ps and worker to be up
        "parameter_server",
        cluster=cluster,
        ps_min_shard_bytes=1 << 20 if args.layout in ("split", "empty") else table_bytes * 2,
    )
    config = json.loads(os.environ["TF_CONFIG"])["cluster"]
    port = lambda address: int(address.rsplit(":", 1)[1])  # noqa: E731
    ps_pids = [_listening_pid(port(a)) for a in config["ps"]]
    worker_pid = _listening_pid(port(config["worker"][0]))
    ps_ports = {port(a) for a in config["ps"]}
    before = [_memory_kb(pid, "VmRSS") for pid in ps_pids]
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((args.ids_per_example,), dtype="int32"),
            (ReadWholeEmbedding if args.layout == "keras" else keras.layers.Embedding)(
                args.rows, WIDTH, name="table"
            ),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ])  # fmt: skip
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.rows, (args.steps * args.batch, args.ids_per_example), "int32")
    labels = (ids[:, 0] % 2).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(args.batch).repeat()

    class Measure(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.start = (time.perf_counter(), _received(worker_pid, ps_ports))

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.end = (time.perf_counter(), _received(worker_pid, ps_ports))

    measure = Measure()
    # Unbounded asynchronous updates, as the figures in the README were measured (fit's
    # default under parameter_server is max_staleness=0: the workers take turns).
    tfdist.fit(
        model, data, epochs=2, steps_per_epoch=args.steps, callbacks=[measure], verbose=0,
        max_staleness=None,
    )  # fmt: skip
    seconds = measure.end[0] - measure.start[0]
    received = [(e - s) / args.steps for s, e in zip(measure.start[1], measure.end[1], strict=True)]
    peaks = [_memory_kb(pid, "VmHWM") for pid in ps_pids]
    result = {
        "examples_per_s": args.steps * args.batch / seconds,
        "worker_rx_kb_per_step": received[0] / 1024,
        "from_ps_kb_per_step": received[1] / 1024,
        "ps_peak_mb": max(peaks) / 1024,
        "ps_net_mb_each": [(p - b) / 1024 for p, b in zip(peaks, before, strict=True)],
        "shards": [
            list(s.shape) for s in getattr(model.layers[0].embeddings.value, "variables", [])
        ],
    }
    result["ps_net_mb"] = max(result["ps_net_mb_each"])
    Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# The benchmark: one job per (layout, ps, rows, repeat).


def run_job(args, layout: str, ps: int, rows: int, result: str) -> dict:
    task = [
        sys.executable, "-m", "tools.ps_bench", "--task", f"--layout={layout}", f"--rows={rows}",
        f"--steps={args.steps}", f"--batch={args.batch}",
        f"--ids_per_example={args.ids_per_example}", f"--result={result}",
    ]  # fmt: skip
    job = harness.launch(
        task, layout=["--chief", "--workers=1", f"--ps={ps}"], timeout=args.timeout,
        what=f"{layout} over {ps} ps",
    )  # fmt: skip
    return {**json.loads(Path(result).read_text()), "job_seconds": job.seconds}


EMPTY_ROWS = 1000  # a 250 KB table: what a ps holds for the job besides a large table


def plan(args) -> list[tuple[str, int, int]]:
    """(layout, ps, rows): per ps count, an empty-table baseline, the split and the whole
    table at the first --rows; Keras's own lookup on the fewest ps; split tables on the most
    ps at the other --rows."""
    runs = [("keras", min(args.ps), args.rows[0])]
    for ps in args.ps:
        runs.append(("empty", ps, EMPTY_ROWS))
        runs.append(("split", ps, args.rows[0]))
        if ps > 1:
            runs.append(("whole", ps, args.rows[0]))
    runs += [("split", max(args.ps), rows) for rows in args.rows[1:]]
    return runs


def subtract_empty(rows: list[dict]) -> None:
    """Sets each row's table_on_ps_mb: the most any ps took beyond the empty-table run's."""
    for row in rows:
        empty = [
            r["ps_net_mb_each"] for r in rows
            if r["layout"] == "empty" and r["ps"] == row["ps"] and r["repeat"] == row["repeat"]
        ]  # fmt: skip
        base = empty[0] if empty else [0.0] * row["ps"]
        row["table_on_ps_mb"] = max(m - b for m, b in zip(row["ps_net_mb_each"], base, strict=True))


def _table(rows: list[dict]) -> str:
    header = (
        f"{'layout':6s} {'ps':>3s} {'rows':>9s} {'table MB':>8s} {'examples/s':>10s} "
        f"{'worker KB/step':>14s} {'from ps':>8s} {'ps MB':>6s} {'table on ps':>11s} "
        f"{'x 1 ps':>6s}"
    )
    lines = [header, "-" * len(header)]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["layout"], row["ps"], row["rows"]), []).append(row)
    medians = {
        key: {k: statistics.median(r[k] for r in group) for k in MEDIAN_COLUMNS}
        for key, group in groups.items()
    }
    one_ps = {n: m["table_on_ps_mb"] for (layout, ps, n), m in medians.items() if ps == 1}
    for (layout, ps, n), med in medians.items():
        ratio = med["table_on_ps_mb"] / one_ps[n] if n in one_ps and layout != "empty" else None
        lines.append(
            f"{layout:6s} {ps:3d} {n:9d} {n * WIDTH * 4 / 2**20:8.0f} {med['examples_per_s']:10.0f} "
            f"{med['worker_rx_kb_per_step']:14.0f} {med['from_ps_kb_per_step']:8.0f} "
            f"{med['ps_net_mb']:6.0f} {med['table_on_ps_mb']:11.0f} "
            + (f"{ratio:6.2f}" if ratio is not None else "")
        )
    lines.append(
        "(medians of --repeats; MB per ps: the largest ps's peak resident memory beyond what it "
        "held before the model; table on ps: beyond the empty-table job's)"
    )
    return "\n".join(lines)


def _series(rows: list[dict], layout: str, n: int) -> tuple[list[int], dict[str, list]]:
    """ps counts and per-ps medians of a layout at n rows (split and whole share 1 ps)."""
    mine = [
        r for r in rows
        if r["rows"] == n and (r["layout"] == layout or (layout == "whole" and r["layout"] == "split" and r["ps"] == 1))
    ]  # fmt: skip
    ps = sorted({r["ps"] for r in mine})
    keys = ("table_on_ps_mb", "worker_rx_kb_per_step", "examples_per_s")
    return ps, {
        key: [statistics.median(r[key] for r in mine if r["ps"] == p) for p in ps] for key in keys
    }


def _plot(rows: list[dict], largest: int, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'); no plot written")
        return False
    fig, (memory, traffic, speed) = plt.subplots(1, 3, figsize=(13, 4))
    for layout, marker in (("split", "o"), ("whole", "s"), ("keras", "x")):
        ps, med = _series(rows, layout, largest)
        memory.plot(ps, med["table_on_ps_mb"], marker=marker, label=layout)
        traffic.plot(
            ps, [kb / 1024 for kb in med["worker_rx_kb_per_step"]], marker=marker, label=layout
        )
        speed.plot(ps, med["examples_per_s"], marker=marker, label=layout)
    for n in sorted({r["rows"] for r in rows if r["rows"] not in (largest, EMPTY_ROWS)}):
        ps, med = _series(rows, "split", n)
        traffic.plot(ps, [kb / 1024 for kb in med["worker_rx_kb_per_step"]], "^",
                     label=f"split, {n:,} rows")  # fmt: skip
    ps, med = _series(rows, "split", largest)
    if ps and ps[0] == 1:
        ideal = [med["table_on_ps_mb"][0] / p for p in ps]
        memory.plot(ps, ideal, "k:", label="1 ps / number of ps")
    memory.set(title="peak memory the table took on the largest ps", xlabel="ps tasks", ylabel="MB")
    traffic.set(
        title="worker receives per step", xlabel="ps tasks", ylabel="MB (log)", yscale="log"
    )
    speed.set(title="throughput", xlabel="ps tasks", ylabel="examples/s")
    for ax in (memory, traffic, speed):
        ax.set_xticks(sorted({r["ps"] for r in rows}))
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"Embedding {largest:,} x {WIDTH} float32 on ps tasks, 1 worker (tools/ps_bench.py)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.ps_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Output: a table on stdout, rows appended to --out_csv, and --plot (PNG, needs "
        "matplotlib).",
    )
    parser.add_argument("--ps", type=int, nargs="+", default=[1, 2, 4], help="ps task counts")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1_000_000, 250_000],
        help="table rows: both layouts at the first; the split one on the most ps at the rest",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch (2 epochs)")
    parser.add_argument("--batch", type=int, default=512, help="examples per step")
    parser.add_argument("--ids_per_example", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per job")
    parser.add_argument("--out_csv", default="ps_bench.csv")
    parser.add_argument("--plot", default="ps_bench.png")
    # One task of a job (the launcher starts these).
    parser.add_argument("--task", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--layout", choices=("split", "whole", "keras", "empty"), help=argparse.SUPPRESS
    )
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.task:
        args.rows = args.rows[0]
        run_task(args)
        return 0
    for flag, values in (("--ps", args.ps), ("--rows", args.rows)):
        if min(values) < 1:
            parser.error(f"{flag} takes positive numbers. Received: {values}")

    run = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ps_bench_") as scratch:
        for repeat in range(args.repeats):
            for i, (layout, ps, n) in enumerate(plan(args)):
                result = run_job(args, layout, ps, n, os.path.join(scratch, f"{repeat}-{i}.json"))
                row = {"run": run, "layout": layout, "ps": ps, "rows": n, "repeat": repeat,
                       "table_mb": n * WIDTH * 4 / 2**20, **result}  # fmt: skip
                rows.append(row)
                print(
                    f"{layout:5s} ps={ps} rows={n:,} #{repeat}: {row['examples_per_s']:.0f} "
                    f"examples/s, worker {row['worker_rx_kb_per_step']:.0f} KB/step, ps net "
                    f"{' / '.join(f'{m:.0f}' for m in row['ps_net_mb_each'])} MB "
                    f"({row['job_seconds']:.0f} s)",
                    flush=True,
                )
    subtract_empty(rows)
    print()
    print(_table(rows))
    # Appended: a re-run adds its rows (a "run" time apiece) and keeps the earlier ones.
    new_file = not os.path.exists(args.out_csv) or os.path.getsize(args.out_csv) == 0
    with open(args.out_csv, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["run", *COLUMNS], extrasaction="ignore")
        if new_file:
            writer.writeheader()
        for row in rows:
            writer.writerow(
                {**row, "ps_net_mb_each": " ".join(f"{m:.1f}" for m in row["ps_net_mb_each"])}
            )
    print(
        f"\nwrote {args.out_csv}"
        + (f" and {args.plot}" if _plot(rows, args.rows[0], args.plot) else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

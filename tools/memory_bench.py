"""Benchmark: memory and speed of sharded optimizer state (ZeRO) against plain data parallelism.

For MLPs of about 10M and 50M parameters trained with Adam on synthetic data, by N = 1, 2
and 4 worker processes (multi_worker_mirrored, one CPU replica each, started by tools.launch),
it measures per process, for plain training and for shard_optimizer zero1 and zero2:

- bytes of optimizer state (Adam's slots) this process holds, reduced-gradient bytes
  (plain and zero1 form the whole all-reduced gradient; zero2 only its slice's sum), and
  parameter bytes (every stage built keeps the whole model on each process);
- peak resident memory (VmHWM) and the memory training added on top of the built model;
- the median step time, and the bytes each process sends per step over the ring, counted
  from the ring's schedule for the buffers the step exchanges (plain runs the same ring,
  all_reduce='ring', so every mode uses one transport).

Output: a table, memory_bench.csv and memory_bench.png. Then, from the two sizes, the largest
model each mode fits in a per-process memory budget (a straight line through the measured
peaks against parameters, per mode and N).

Then, in this process over 5 logical CPUs (CPU:0 the host, CPU:1-4 the replicas' devices),
the bytes of the variables on each device during fit (tfdist.DeviceBytes) for every layout:
plain, zero1/2/3, a pipeline of 2 and 4 stages and tensor parallelism of degree 2 and 4, N =
2 and 4, as a multiple of the model's weight bytes; and from it the largest MLP of that shape
whose variables fit a per-device budget (--device_budget_mib; activations and TensorFlow's
own buffers come on top). --device_model adds a functional CNN and keras-hub's Gemma causal
LM (tied embeddings: a pipeline's first and last stages each hold them). zero3 and the
pipeline are built in tfdist.host_scope: the host column is what stays in host memory after
fit (nothing: they drop the host's copy as the replicas take it over).

  python -m tools.memory_bench                         # about 12 minutes on 2 cores
  python -m tools.memory_bench --sizes 10 --workers 1 2 --steps 3
  python -m tools.memory_bench --devices_only          # the per-device table alone
  python -m tools.memory_bench --devices_only --device_model mlp cnn gemma

This is a benchmark, not a test: it reports figures and never fails on them. In the worker
processes the host and the replica's device are one CPU, so what is built in host memory
counts in their RSS until fit drops it; the per-device table separates them.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from tools import harness  # noqa: E402

MODES = ("plain", "zero1", "zero2", "zero3")
# Hidden layers (width, count) of the MLPs, 512 inputs and 10 outputs: ~10M and ~50M weights.
SIZES = {10: (2048, 3), 50: (4000, 4)}
INPUTS, CLASSES = 512, 10


def parameter_count(size: int) -> int:
    width, layers = SIZES[size]
    dims = [INPUTS, *[width] * layers, CLASSES]
    return sum(a * b + b for a, b in zip(dims, dims[1:], strict=False))


def ring_bytes(length: int, ranks: int, itemsize: int, phases: tuple[str, ...]) -> int:
    """Bytes rank 0 sends over tfdist's ring for `phases` ('reduce_scatter', 'all_gather')
    of a buffer of `length` elements, chunk by chunk as the ring's schedule sends them (the
    gradient ring cuts its buffer into fusion buckets first: the same bytes to a chunk's
    rounding)."""
    from tfdist.collective.ring import (
        all_gather_schedule,
        chunk_bounds,
        reduce_scatter_schedule,
    )

    if ranks == 1:
        return 0
    sizes = [end - start for start, end in chunk_bounds(length, ranks)]
    schedules = {"reduce_scatter": reduce_scatter_schedule, "all_gather": all_gather_schedule}
    sent = sum(sizes[chunk] for phase in phases for chunk, _ in schedules[phase](0, ranks))
    return sent * itemsize


# --- one worker process -------------------------------------------------------------------------


def worker(args) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.parallel import ShardedParameters, ShardedUpdate
    from tfdist.parallel.zero.partition import slot_bytes

    workers = args.workers
    if workers > 1:
        strategy = tfdist.build_strategy("multi_worker_mirrored", all_reduce="ring")
    else:
        strategy = tfdist.build_strategy("one_device", cluster=None)
    width, layers = SIZES[args.size]
    with tfdist.host_scope(strategy) if args.mode == "zero3" else strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((INPUTS,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(layers)]
            + [keras.layers.Dense(CLASSES)]
        )
        model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(True))
    rng = np.random.default_rng(0)
    batch = args.global_batch_size
    x = rng.normal(size=(batch * 4, INPUTS)).astype("float32")
    y = rng.integers(0, CLASSES, size=(batch * 4,)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
    hooks = {
        "plain": [], "zero1": [ShardedUpdate(1)], "zero2": [ShardedUpdate(2)],
        "zero3": [ShardedParameters()],
    }[args.mode]  # fmt: skip
    built_rss = harness.resident("VmRSS")
    ends: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    warmup = 2
    tfdist.fit(
        model, data, epochs=1, steps_per_epoch=warmup + args.steps, verbose=0,
        callbacks=[Clock()], step_hooks=hooks,
    )  # fmt: skip
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    state = hooks[0].state_bytes()["optimizer_state"] if hooks else slot_bytes(model.optimizer)
    length, ranks = params, workers
    all_reduce = ("reduce_scatter", "all_gather")
    phases = {
        "plain": all_reduce,
        "zero1": (*all_reduce, "all_gather"),  # the gradients whole, then the weights
        "zero2": all_reduce,  # the gradients' slices, then the weights
        # every weight gathered in the forward pass and again in the backward (its N-1
        # other slices received; sent: as an all-gather), and the gradients all-reduced
        # (the strategy's collectives, not tfdist's ring)
        "zero3": ("all_gather", "all_gather", *all_reduce),
    }[args.mode]
    sent = ring_bytes(length, ranks, 4, phases)
    # zero2 forms only its slice's sum; zero3 all-reduces the whole gradients, then slices.
    gradient = params * 4 if args.mode != "zero2" else -(-params // ranks) * 4
    steps = [b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:], strict=False)]
    task = json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]
    record = {
        "size": args.size, "workers": workers, "mode": args.mode, "task": task,
        "parameters": params, "parameter_bytes": params * 4, "optimizer_state_bytes": state,
        "reduced_gradient_bytes": gradient, "peak_rss_bytes": harness.resident("VmHWM"),
        "training_rss_bytes": harness.resident("VmHWM") - built_rss,
        "step_seconds": statistics.median(steps), "bytes_sent_per_step": sent,
    }  # fmt: skip
    with open(os.path.join(args.out_dir, f"task{task}.json"), "w") as f:
        json.dump(record, f)


# --- the benchmark ------------------------------------------------------------------------------


def run(size: int, workers: int, mode: str, steps: int, batch: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        task = [
            sys.executable, "-m", "tools.memory_bench", "--worker", "--size", str(size),
            "--mode", mode, "--workers", str(workers), "--steps", str(steps),
            "--global_batch_size", str(batch), "--out_dir", out,
        ]  # fmt: skip
        what = f"{size}M {mode} x{workers}"
        if workers > 1:
            harness.launch(task, layout=["--workers", str(workers)], what=what)
        else:
            harness.run(task, what=what)
        return harness.task_records(out, workers)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.memory_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 50], choices=sorted(SIZES))
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after 2 warm-up)")
    parser.add_argument("--global_batch_size", type=int, default=32)
    parser.add_argument(
        "--budget_gib", type=float, default=2.0, help="per-process memory budget for the "
        "largest-model estimate (default 2 GiB)",
    )  # fmt: skip
    parser.add_argument(
        "--device_budget_mib", type=float, default=64.0, help="per-device budget for the "
        "largest model whose variables fit (default 64 MiB)",
    )  # fmt: skip
    parser.add_argument("--devices_only", action="store_true", help="only the per-device table")
    parser.add_argument("--device_layout", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument(
        "--device_model", choices=DEVICE_MODELS, nargs="+", default=["mlp"],
        help="the model(s) of the per-device table (default mlp)",
    )  # fmt: skip
    parser.add_argument("--out_csv", default="memory_bench.csv")
    parser.add_argument("--out_png", default="memory_bench.png")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out_dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.workers) < 1 or args.steps < 1:
        parser.error("--workers and --steps take whole numbers >= 1")
    if args.worker:
        args.workers = args.workers[0]
        worker(args)
        return 0

    if args.device_layout:
        layout, n = args.device_layout
        print(json.dumps(device_layout(layout, int(n), args.device_model[0])))
        return 0
    if args.devices_only:
        for model in args.device_model:
            print_devices(device_rows(model), args.device_budget_mib)
        return 0
    rows = []
    for size in args.sizes:
        for workers in args.workers:
            for mode in MODES if workers > 1 else ("plain",):
                tasks = run(size, workers, mode, args.steps, args.global_batch_size)
                row = dict(tasks[0])
                row["peak_rss_bytes"] = max(t["peak_rss_bytes"] for t in tasks)
                row["training_rss_bytes"] = max(t["training_rss_bytes"] for t in tasks)
                row["step_seconds"] = statistics.median(t["step_seconds"] for t in tasks)
                row["optimizer_state_bytes"] = max(t["optimizer_state_bytes"] for t in tasks)
                del row["task"]
                rows.append(row)
                print(
                    f"  {size}M x{workers} {mode:<5}  state {row['optimizer_state_bytes'] / 2**20:7.1f}"
                    f" MiB  peak {row['peak_rss_bytes'] / 2**20:7.0f} MiB"
                    f"  step {row['step_seconds'] * 1e3:7.0f} ms",
                    flush=True,
                )
    harness.write_csv(args.out_csv, rows)
    print_table(rows)
    print_budget(rows, args.budget_gib)
    plot(rows, args.out_png)
    print(f"\nwrote {args.out_csv} and {args.out_png}")
    for model in args.device_model:
        print_devices(device_rows(model), args.device_budget_mib)
    return 0


def _plain(rows, row):
    return next(
        r for r in rows
        if r["size"] == row["size"] and r["workers"] == row["workers"] and r["mode"] == "plain"
    )  # fmt: skip


def print_table(rows) -> None:
    mib = 2**20
    print(
        f"\n{'model':>6} {'N':>2} {'mode':<6} {'params MiB':>10} {'opt state MiB':>13} "
        f"{'/plain':>7} {'grad MiB':>8} {'peak RSS MiB':>12} {'train +MiB':>10} "
        f"{'step ms':>8} {'/plain':>7} {'sent MiB/step':>13}"
    )
    for r in rows:
        plain = _plain(rows, r)
        print(
            f"{r['size']:>5}M {r['workers']:>2} {r['mode']:<6} {r['parameter_bytes'] / mib:10.1f} "
            f"{r['optimizer_state_bytes'] / mib:13.1f} "
            f"{r['optimizer_state_bytes'] / plain['optimizer_state_bytes']:7.3f} "
            f"{r['reduced_gradient_bytes'] / mib:8.1f} {r['peak_rss_bytes'] / mib:12.0f} "
            f"{r['training_rss_bytes'] / mib:10.0f} {r['step_seconds'] * 1e3:8.0f} "
            f"{r['step_seconds'] / plain['step_seconds']:7.2f} "
            f"{r['bytes_sent_per_step'] / mib:13.1f}"
        )


def print_budget(rows, budget_gib: float) -> None:
    """The largest model under `budget_gib` per process: peak RSS = a + b * parameters,
    fitted through the two sizes measured for each (N, mode)."""
    sizes = sorted({r["size"] for r in rows})
    if len(sizes) < 2:
        return
    print(f"\nLargest MLP that trains with Adam in {budget_gib:g} GiB per process (fitted):")
    budget = budget_gib * 2**30
    for workers in sorted({r["workers"] for r in rows}):
        for mode in MODES:
            points = [
                (r["parameters"], r["peak_rss_bytes"]) for r in rows
                if r["workers"] == workers and r["mode"] == mode
            ]  # fmt: skip
            if len(points) < 2:
                continue
            (p0, m0), (p1, m1) = points[0], points[-1]
            per_parameter = (m1 - m0) / (p1 - p0)
            largest = p0 + (budget - m0) / per_parameter
            print(
                f"  N={workers} {mode:<6} {per_parameter:5.1f} bytes/parameter -> "
                f"{largest / 1e6:6.0f}M parameters"
            )


def plot(rows, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'); no plot written")
        return
    sizes = sorted({r["size"] for r in rows})
    fig, axes = plt.subplots(2, len(sizes), figsize=(5.5 * len(sizes), 7), squeeze=False)
    for col, size in enumerate(sizes):
        mine = [r for r in rows if r["size"] == size]
        labels = [f"N={r['workers']}\n{r['mode']}" for r in mine]
        state = [r["optimizer_state_bytes"] / 2**20 for r in mine]
        peak = [r["peak_rss_bytes"] / 2**20 for r in mine]
        colors = [
            {
                "plain": "tab:gray",
                "zero1": "tab:blue",
                "zero2": "tab:green",
                "zero3": "tab:red",
            }[r["mode"]]  # fmt: skip
            for r in mine
        ]
        axes[0][col].bar(labels, state, color=colors)
        axes[0][col].set_title(f"{size}M parameters, Adam: optimizer state per process")
        axes[0][col].set_ylabel("MiB")
        axes[1][col].bar(labels, peak, color=colors)
        axes[1][col].set_title("peak resident memory per process (max over processes)")
        axes[1][col].set_ylabel("MiB")
        for ax in axes[:, col]:
            ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- the variables on each device, in this process -------------------------------------------

# The per-device table's MLP: 512 inputs, 4 hidden layers of 1024 (the pipeline's cuts), 10
# outputs: 3.7M weights.
DEVICE_WIDTH, DEVICE_LAYERS = 1024, 4
LAYOUTS = (
    ("plain", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2), ("pipeline", 2), ("tensor", 2),
    ("plain", 4), ("zero1", 4), ("zero2", 4), ("zero3", 4), ("pipeline", 4), ("tensor", 4),
)  # fmt: skip
# The models of the per-device table: the MLP above; a functional CNN; keras-hub's Gemma
# causal LM (random weights, tied embeddings; 4 decoder blocks). Tensor parallelism splits
# the MLP's Dense pairs (degree=) and Gemma as GemmaBackbone.get_layout_map says (its one
# key/value head held whole by every replica); the CNN's convolutions it does not split.
DEVICE_MODELS = ("mlp", "cnn", "gemma")


def _device_model(name: str, n: int):
    """(the model builder, the batch's x and y, the pipeline's cuts over n stages)."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "mlp":

        def build():
            keras.utils.set_random_seed(0)
            hidden = [
                keras.layers.Dense(DEVICE_WIDTH, activation="relu", name=f"block_{i + 1}")
                for i in range(DEVICE_LAYERS)
            ]
            return keras.Sequential([keras.Input((INPUTS,)), *hidden, keras.layers.Dense(CLASSES)])

        x = rng.normal(size=(64, INPUTS)).astype("float32")
        cuts = ["block_3"] if n == 2 else ["block_2", "block_3", "block_4"]
    elif name == "cnn":

        def build():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((16, 16, 3))
            h = keras.layers.Conv2D(64, 3, padding="same", activation="relu", name="conv_1")(inputs)
            h = keras.layers.Conv2D(128, 3, padding="same", activation="relu", name="conv_2")(h)
            h = keras.layers.MaxPooling2D(name="pool")(h)
            h = keras.layers.Conv2D(128, 3, padding="same", activation="relu", name="conv_3")(h)
            h = keras.layers.GlobalAveragePooling2D(name="global_pool")(h)
            h = keras.layers.Dense(512, activation="relu", name="fc")(h)
            return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(h))

        x = rng.normal(size=(64, 16, 16, 3)).astype("float32")
        cuts = ["conv_3"] if n == 2 else ["conv_2", "conv_3", "fc"]
    else:
        import keras_hub

        def build():
            keras.utils.set_random_seed(0)
            backbone = keras_hub.models.GemmaBackbone(
                vocabulary_size=4096, num_layers=4, num_query_heads=4, num_key_value_heads=1,
                hidden_dim=256, intermediate_dim=1024, head_dim=64, name="gemma_backbone",
            )  # fmt: skip
            return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)

        tokens = rng.integers(1, 4096, size=(64, 17)).astype("int32")
        x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((64, 16), "int32")}
        blocks = [2] if n == 2 else [1, 2, 3]
        cuts = [f"gemma_backbone/decoder_block_{b}" for b in blocks]
        return build, x, tokens[:, 1:], cuts  # next-token labels
    y = rng.integers(0, CLASSES, size=64).astype("int32")
    return build, x, y, cuts


def device_rows(model: str = "mlp") -> list[dict]:
    """Per layout, each in a process of its own (nothing of another layout alive): the
    variables' bytes on the host (CPU:0) and on each replica's device (CPU:1-N) at the peak
    of fit, as multiples of the weights' bytes (Adam)."""
    import subprocess

    rows = []
    for layout, n in LAYOUTS:
        if layout == "tensor" and model == "cnn":
            continue  # convolutions: tensor_parallel splits Dense, Embedding and attention
        command = [sys.executable, "-m", "tools.memory_bench", "--device_layout", layout, str(n),
                   f"--device_model={model}"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"{layout} x{n} failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"  {model} {layout} x{n}: " + " ".join(f"{s:.2f}" for s in row["shares"]), flush=True
        )
    return rows


def device_layout(layout: str, n: int, model_name: str = "mlp") -> dict:
    """One layout's row of the per-device table, in this process (5 logical CPUs)."""
    import keras

    import tfdist
    from tfdist.training.memory import variable_bytes

    tfdist.configure_cpu_devices(5)
    build, x, y, cuts = _device_model(model_name, n)
    devices = [f"/cpu:{i}" for i in range(1, n + 1)]
    strategy = tfdist.build_strategy("mirrored", cluster=None, devices=devices)
    # The model once, outside any strategy (on CPU:0): its weights' bytes are the unit, and
    # it is what tensor_parallel converts. Made before the count begins, it counts nowhere.
    dense = build()
    weights = sum(int(w.nbytes) for w in dense.get_weights())
    before = variable_bytes()

    def compiled(model):
        model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(True))
        return model

    if layout == "tensor" and model_name == "gemma":  # keras-hub's own split of Gemma
        import keras_hub

        with tfdist.host_scope(strategy):
            model = compiled(build())
        mesh = keras.distribution.DeviceMesh((1, n), ["batch", "model"], devices)
        layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
        tfdist.parallel.tensor_parallel(model, layout_map=layout_map)
    elif layout == "tensor":
        with strategy.scope():
            model = compiled(tfdist.parallel.tensor_parallel(dense, degree=n))
    else:
        with tfdist.host_scope(strategy) if layout in ("zero3", "pipeline") else strategy.scope():
            model = compiled(build())
    keywords: dict = {}
    if layout.startswith("zero"):
        keywords["shard_optimizer"] = layout
    if layout == "pipeline":
        keywords["pipeline"] = tfdist.parallel.Pipeline(cut_before=cuts, micro_batches=2)
    record = tfdist.DeviceBytes()
    tfdist.fit(model, x, y, batch_size=16 * n, verbose=0, callbacks=[record], **keywords)
    shares = [
        (record.peak.get(f"CPU:{i}", 0) - before.get(f"CPU:{i}", 0)) / weights
        for i in range(1, n + 1)
    ]
    host = (record.peak.get("CPU:0", 0) - before.get("CPU:0", 0)) / weights
    return {
        "model": model_name, "layout": layout, "devices": n, "weights": weights, "host": host,
        "shares": shares,
    }  # fmt: skip


def print_devices(rows, budget_mib: float) -> None:
    described = {
        "mlp": f"MLP 512 -> {DEVICE_LAYERS} x {DEVICE_WIDTH} -> {CLASSES}",
        "cnn": "functional CNN, 3 convolutions and 2 Dense",
        "gemma": "keras-hub Gemma causal LM, 4 blocks, tied embeddings",
    }[rows[0]["model"]]
    print(
        f"\nVariables on each device during fit, x the weights' bytes (Adam; {described}, "
        f"{rows[0]['weights'] / 2**20:.1f} MiB of weights; 5 logical CPUs, CPU:0 the host):"
    )
    print(f"{'layout':<9} {'N':>2} {'largest device':>14} {'host':>5}  each device")
    for r in rows:
        shares = " ".join(f"{s:.2f}" for s in r["shares"])
        print(
            f"{r['layout']:<9} {r['devices']:>2} {max(r['shares']):14.2f} {r['host']:5.2f}  {shares}"
        )
    print(
        f"\nLargest model of this shape whose variables fit {budget_mib:g} MiB per device "
        "(weights x its largest device's multiple; activations come on top):"
    )
    for r in rows:
        largest = budget_mib * 2**20 / (4 * max(r["shares"]))
        print(f"  {r['layout']:<9} N={r['devices']}  {largest / 1e6:6.1f}M parameters")


if __name__ == "__main__":
    raise SystemExit(main())

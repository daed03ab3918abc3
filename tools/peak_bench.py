"""Benchmark: each process's memory PEAK, by phase, as TensorFlow's allocator and the OS count it.

A device runs out of memory at its peak, not at rest. This runs one device per worker
process (tfdist-launch, multi_worker_mirrored) so that the allocator's figures are that
device's, on issue 51's model: 256 -> Dense(1024) -> 8 x Dense(1024) -> Dense(10) with Adam
(8.7M parameters; W = its weight bytes, 34.7 MB), global batch 16, and reports per process
the allocator's peak in each phase, as a multiple of W:

  construction   building and compiling the model under the layout's scope
  first step     fit's start through its first batch (placement, tracing, the slots)
  steps          the batches after it
  epoch end      the last batch's end to fit's return (what the runner writes back)
  save           model.save
  at rest        what is allocated after fit, before the save

and with `--restore_workers N`, two more: the job saves a tfdist.StepCheckpoint at its
epoch's end, and a job of N processes of the same layout resumes from it (a sharded
checkpoint read back as N processes' slices: 4 -> 2 under zero3) and trains a second epoch:

  checkpoint     the StepCheckpoint's save at the epoch's end
  restore        the resuming job's fit start through the checkpoint read back (its
                 placement included); its other phases are not reported

and, in a second table, the OS's count of the same phases: the resident high-water mark
(VmHWM of /proc/self/status, reset at each phase's start by writing 5 to
/proc/self/clear_refs) over the process's resident memory once its strategy is built.
What the allocator never sees shows there: Python's and Keras's own buffers (model.save
writes the .keras file's weights into one in memory), the gRPC transport's buffers of the
collectives, the copies NumPy makes.

Layouts: plain data parallelism, zero1 and zero2 (strategy.scope()), zero3 and the pipeline
(built in tfdist.host_scope, as the README says), zero3 x tensor (`zero3_tensor`: a model
of blocks, hybrid_model, split by a layout map over 2-way tensor groups, one a process of
2 logical CPUs, each part sliced over the processes) and all three together (`all_three`:
hybrid_model cut into stages over the processes, each stage split over 2-way tensor groups
and sharded over 2 pipelines, each process given 4 logical CPUs and holding one stage of
both pipelines); the pipeline one stage per process: over 2 processes
cut before the fifth of the ten Dense layers (the larger stage holds 0.61 W), over 4 before
the fourth, sixth and eighth (CUTS). The CPU allocator keeps these statistics only when
TensorFlow runs its BFC allocator on the CPU (TF_CPU_ALLOCATOR_USE_BFC=true, set here for
the workers). On this machine host and device are one allocator: a copy "in host memory"
counts here, as it would count against a GPU host's RAM.

  python -m tools.peak_bench                          # every layout over 2, about 2 minutes
  python -m tools.peak_bench --layouts zero3 pipeline --workers 2 4
  python -m tools.peak_bench --layouts plain zero3 --workers 4 --budget_mb 200
  python -m tools.peak_bench --layouts plain zero3 --activations 64 1024 4096
  python -m tools.peak_bench --layouts zero3 --workers 4 --restore_workers 2 --width 4096

`--activations` reports instead each step's peak against the global batch, on a model of
transformer-like MLP blocks (256 -> Dense(512) -> 4 x [Dense(2048, relu) -> Dense(512),
added to its input] -> Dense(10)), with each block's activations kept from the forward
pass or recomputed in the backward pass (tfdist.parallel.recompute_activations with the
blocks as units): how much of the peak the activations are, and how much recomputation
takes off. (A unit keeps its input either way, so recomputing single layers of an MLP
saves nothing; a block's inner activations are what it saves.)

This is a benchmark, not a test: it reports figures and never fails on them.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from tools import harness  # noqa: E402

LAYOUTS = ("plain", "zero1", "zero2", "zero3", "pipeline", "zero3_tensor", "all_three")
# all_three: hybrid_model's stages split over 2-way tensor groups (Megatron's pairs: each
# block's first layer by its outputs, its second by its inputs) and sharded over 2
# pipelines (zero3), each process of DEVICES logical CPUs holding one stage of both
# pipelines. Its processes' figures cover their DEVICES devices (one allocator a process).
# zero3_tensor: hybrid_model split so over TENSOR logical CPUs a process (a tensor group),
# each part sliced over the processes by zero3 (FSDP x TP); a process's figure covers its
# TENSOR devices.
DEVICES, TENSOR = 4, 2
SPLIT = ("zero3_tensor", "all_three")  # the layouts of hybrid_model, split by a layout map
HYBRID_CUTS = {2: ["b2_up"], 4: ["b1_up", "b2_up", "b3_up"]}
PHASES = ("construction", "first step", "steps", "epoch end", "save")
RESUMING = ("checkpoint", "restore")  # with --restore_workers
INPUTS, WIDTH, HIDDEN, CLASSES = 256, 1024, 8, 10
STEPS, BATCH = 4, 16
# Where the pipeline is cut, by processes: over 2 before the fifth Dense layer (issue 51's
# cut: the larger stage holds 0.61 W); over 4 where tfdist-plan cuts it, into stages of
# about equal work (the largest holds 0.28 W).
CUTS = {2: ["d4"], 4: ["d3", "d5", "d7"]}


def worker(args) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.parallel import Pipeline

    hybrid = args.layout in SPLIT
    if hybrid:  # before the strategy (it starts TensorFlow's runtime)
        tfdist.configure_cpu_devices(DEVICES if args.layout == "all_three" else TENSOR)
    strategy = tfdist.build_strategy("multi_worker_mirrored")
    peaks: dict[str, float] = {}
    resident: dict[str, float] = {}
    baseline = harness.resident("VmRSS")

    def reset() -> None:
        tf.config.experimental.reset_memory_stats("CPU:0")
        _reset_high_water_mark()

    def peak(phase: str) -> None:
        peaks[phase] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        resident[phase] = harness.resident("VmHWM") - baseline

    reset()
    hosted = args.layout in ("zero3", "pipeline", *SPLIT)
    scope = tfdist.host_scope(strategy) if hosted else strategy.scope()
    with scope:
        keras.utils.set_random_seed(0)
        if hybrid:
            model = hybrid_model(args.width)
        else:
            model = blocks_model() if args.blocks else dense_model(args.width)
        model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(True))
    if hybrid:
        count = DEVICES if args.layout == "all_three" else TENSOR * strategy.num_replicas_in_sync
        devices = [f"cpu:{k}" for k in range(count)]  # the mesh's names: its model axis counts
        mesh = keras.distribution.DeviceMesh((count // TENSOR, TENSOR), ["batch", "model"], devices)
        layout = keras.distribution.LayoutMap(mesh)
        layout[".*_up/kernel"] = (None, "model")  # a Sequential's paths: sequential/b0_up/...
        layout[".*_down/kernel"] = ("model", None)
        tfdist.parallel.tensor_parallel(model, layout_map=layout)
    if args.recompute:
        tfdist.parallel.recompute_activations(model, units=BLOCKS if args.blocks else None)
    peak("construction")
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)

    class Phases(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                peak("first step")
                reset()
            elif batch == STEPS - 1:
                peak("steps")
                reset()

    class AfterCheckpoint(keras.callbacks.Callback):
        """Listed after the StepCheckpoint: its restore and save are measured alone."""

        def on_train_begin(self, logs=None):
            if args.resume:  # the saving job's first step keeps fit's start
                peak("restore")
                reset()

        def on_epoch_end(self, epoch, logs=None):
            peak("checkpoint")
            reset()

    class BeforeCheckpoint(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            peak("epoch end")  # the write-back; what follows the save is added below
            reset()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * STEPS, INPUTS)).astype("float32")
    y = rng.integers(0, CLASSES, size=(args.batch * STEPS,)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
    workers = strategy.num_replicas_in_sync
    if args.layout == "all_three":
        keywords = {
            "pipeline": Pipeline(cut_before=HYBRID_CUTS[workers], micro_batches=2),
            "shard_optimizer": "zero3",
        }
    elif args.layout == "zero3_tensor":  # tfdist.fit makes it a pipeline of one stage
        keywords = {"shard_optimizer": "zero3"}
    elif args.layout == "pipeline":
        keywords = {"pipeline": Pipeline(cut_before=CUTS[workers], micro_batches=2)}
    else:
        keywords = {} if args.layout == "plain" else {"shard_optimizer": args.layout}
    callbacks = [Phases()]
    epochs = 1
    if args.checkpoint_dir:
        checkpoint = tfdist.StepCheckpoint(args.checkpoint_dir, max_to_keep=1)
        callbacks += [BeforeCheckpoint(), checkpoint, AfterCheckpoint()]
        epochs = 2 if args.resume else 1
    reset()
    tfdist.fit(model, data, epochs=epochs, verbose=0, callbacks=callbacks, **keywords)
    before = peaks.get("epoch end", 0), resident.get("epoch end", 0)
    peak("epoch end")
    peaks["epoch end"] = max(peaks["epoch end"], before[0])
    resident["epoch end"] = max(resident["epoch end"], before[1])
    rest = tf.config.experimental.get_memory_info("CPU:0")["current"]
    reset()
    task = json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]
    model.save(os.path.join(args.out_dir, f"model{task}.keras"))
    peak("save")
    record = {"weights": weights, "rest": rest, **peaks, "resident": resident}
    with open(os.path.join(args.out_dir, f"task{task}.json"), "w") as f:
        json.dump(record, f)


def _reset_high_water_mark() -> None:
    # Linux: writing 5 resets VmHWM to the resident memory now (proc(5), clear_refs).
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


BLOCKS = [f"block{i}" for i in range(4)]


def dense_model(width: int):
    import keras

    layers = [keras.layers.Dense(width, activation="relu", name=f"d{i}") for i in range(9)]
    return keras.Sequential(
        [keras.Input((INPUTS,)), *layers, keras.layers.Dense(CLASSES, name="d9")]
    )


def hybrid_model(width: int):
    """256 -> Dense(width) -> 4 x [Dense(width, relu) -> Dense(width)] -> Dense(10): blocks
    whose pairs tensor parallelism splits (8.7M parameters at 1024, as dense_model's)."""
    import keras

    layers = [keras.Input((INPUTS,)), keras.layers.Dense(width, name="stem")]
    for i in range(4):
        layers += [
            keras.layers.Dense(width, activation="relu", name=f"b{i}_up"),
            keras.layers.Dense(width, name=f"b{i}_down"),
        ]
    return keras.Sequential([*layers, keras.layers.Dense(CLASSES, name="head")])


def blocks_model():
    import keras

    class MLPBlock(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(2048, activation="relu")
            self.out = keras.layers.Dense(512)

        def call(self, x):
            return x + self.out(self.hidden(x))

    inputs = keras.Input((INPUTS,))
    x = keras.layers.Dense(512, name="stem")(inputs)
    for name in BLOCKS:
        x = MLPBlock(name=name)(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(x))


def run(
    layout: str,
    workers: int,
    width: int = WIDTH,
    *,
    batch: int = BATCH,
    recompute: bool = False,
    blocks: bool = False,
    restore_workers: int | None = None,
) -> list[dict]:
    """Each process's record of one job (and with `restore_workers`, its `restore` phase
    that of the job resuming from its checkpoint with that many processes)."""
    with tempfile.TemporaryDirectory() as out:

        def job(n: int, *flags: str) -> list[dict]:
            task = [
                sys.executable, "-m", "tools.peak_bench", "--worker", "--layout", layout,
                "--out_dir", out, "--width", str(width), "--batch", str(batch),
                *(["--recompute"] if recompute else []), *(["--blocks"] if blocks else []),
                *flags,
            ]  # fmt: skip
            harness.launch(task, layout=["--workers", str(n)], what=f"{layout} x{n}")
            return harness.task_records(out, n)

        if restore_workers is None:
            return job(workers)
        model_dir = os.path.join(out, "run")
        records = job(workers, "--checkpoint_dir", model_dir)
        resumed = job(restore_workers, "--checkpoint_dir", model_dir, "--resume")
        restore = max(r["restore"] for r in resumed)
        resident = max(r["resident"]["restore"] for r in resumed)
        for r in records:
            r["restore"], r["resident"]["restore"] = restore, resident
        return records


def whole_run(records: list[dict]) -> int:
    """The whole run's peak bytes of the job's largest process."""
    return max(r[p] for r in records for p in PHASES)


def parameters(width: int) -> int:
    return INPUTS * width + width + HIDDEN * (width * width + width) + width * CLASSES + CLASSES


def largest(layout: str, workers: int, budget: int) -> tuple[int, int]:
    """The widest model (in steps of 64) whose whole-run peak per process, measured, fits
    `budget` bytes, and that peak. The peak grows with the weights, so a first run at the
    default width predicts the width; runs 5% narrower follow until one fits."""
    ratio = whole_run(run(layout, workers)) / (4 * parameters(WIDTH))
    target = budget / ratio / 4  # parameters
    width = int((-(INPUTS + 1 + CLASSES + HIDDEN) + ((INPUTS + 1 + CLASSES + HIDDEN) ** 2
                 + 4 * HIDDEN * target) ** 0.5) / (2 * HIDDEN))  # fmt: skip
    for _ in range(6):
        width = max(64, width // 64 * 64)
        peak = whole_run(run(layout, workers, width))
        if peak <= budget or width == 64:
            return width, peak
        width = int(width * 0.95)
    return width, peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.peak_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--out_dir", help=argparse.SUPPRESS)
    parser.add_argument(
        "--width", type=int, default=WIDTH,
        help=f"the Dense layers' width (default {WIDTH}: 34.7 MB of weights; 4096: 541 MB)",
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    parser.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint_dir", help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--restore_workers", type=int, metavar="N",
        help="also save a StepCheckpoint at the epoch's end and resume it with N processes: "
        "the phases 'checkpoint' and 'restore' (the restore's is the resuming job's)",
    )  # fmt: skip
    parser.add_argument(
        "--activations", type=int, nargs="+", metavar="BATCH",
        help="instead: each step's peak at these global batch sizes, with each layer's "
        "activations kept and recomputed (tfdist.parallel.recompute_activations)",
    )  # fmt: skip
    parser.add_argument(
        "--budget_mb", type=float,
        help="instead: the largest model each layout trains with every process's whole-run "
        "peak within this many MB (measured; about 3 runs a layout)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if min(args.workers) < 2:
        parser.error("--workers: 2 or more processes (one device each)")
    pipelines = {n for n in [*args.workers, args.restore_workers or 2]} - set(CUTS)
    if {"pipeline", "all_three"} & set(args.layouts) and pipelines:
        parser.error(
            f"the pipeline layout is cut for {sorted(CUTS)} processes (CUTS). Received: "
            f"{sorted(pipelines)}"
        )
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # the workers' allocator statistics
    if args.budget_mb:
        return budget_table(args.layouts, args.workers, int(args.budget_mb * 2**20))
    if args.activations:
        return activations_table(args.layouts, args.workers, args.activations)
    restoring = args.restore_workers
    phases = PHASES + (RESUMING if restoring else ())
    runs = {
        (layout, n): run(layout, n, args.width, restore_workers=restoring)
        for layout in args.layouts
        for n in args.workers
    }
    moved = f" -> {restoring}" if restoring else ""
    width = f"; {runs[next(iter(runs))][0]['weights'] / 1e6:.1f} MB of weights" if runs else ""
    print("allocator peak per process (the largest over the processes), in W = weight bytes"
          + width)  # fmt: skip
    if "all_three" in args.layouts:
        print(f"(all_three: 2 stages x {TENSOR}-way tensor x 2 pipelines under zero3, each "
              f"process {DEVICES} devices holding one stage: a device's figure is about "
              f"1/{DEVICES} of its process's)")  # fmt: skip
    if "zero3_tensor" in args.layouts:
        print(f"(zero3_tensor: {TENSOR}-way tensor x zero3 over the processes, each process "
              f"{TENSOR} devices, one tensor group: a device's figure is about 1/{TENSOR} of "
              "its process's)")  # fmt: skip
    print("| layout | processes | " + " | ".join(phases) + " | whole run | at rest |")
    print("|---" * (len(phases) + 4) + "|")
    for (layout, workers), records in runs.items():
        w = records[0]["weights"]
        cells = [max(r[p] for r in records) / w for p in phases]
        rest = max(r["rest"] for r in records) / w
        print(
            f"| {layout} | {workers}{moved} | " + " | ".join(f"{c:.2f}" for c in cells)
            + f" | {max(cells):.2f} | {rest:.2f} |",
            flush=True,
        )  # fmt: skip
    print()
    print("resident high-water mark per process (VmHWM, reset each phase) over its resident "
          "memory once the strategy was built, in W")  # fmt: skip
    print("| layout | processes | " + " | ".join(phases) + " | whole run |")
    print("|---" * (len(phases) + 3) + "|")
    for (layout, workers), records in runs.items():
        w = records[0]["weights"]
        cells = [max(r["resident"][p] for r in records) / w for p in phases]
        print(f"| {layout} | {workers}{moved} | " + " | ".join(f"{c:.2f}" for c in cells)
              + f" | {max(cells):.2f} |", flush=True)  # fmt: skip
    return 0


def activations_table(layouts, workers_list, batches) -> int:
    print("a step's allocator peak per process in W (the block model's weight bytes), against "
          "the global batch: each block's activations kept, or recomputed in its backward "
          "pass")  # fmt: skip
    print("| layout | processes | global batch | kept | recomputed | recomputed / kept |")
    print("|---|---|---|---|---|---|")
    for layout in layouts:
        for workers in workers_list:
            for batch in batches:
                step = []
                for recompute in (False, True):
                    records = run(layout, workers, batch=batch, recompute=recompute, blocks=True)
                    step.append(max(r["steps"] / r["weights"] for r in records))
                print(f"| {layout} | {workers} | {batch} | {step[0]:.2f} | {step[1]:.2f} | "
                      f"{step[1] / step[0]:.2f} |", flush=True)  # fmt: skip
    return 0


def budget_table(layouts, workers_list, budget: int) -> int:
    print(f"the largest model each layout trains in {budget / 2**20:.0f} MB per process "
          "(whole-run allocator peak, measured)")  # fmt: skip
    print("| layout | processes | width | parameters | peak MB | x plain |")
    print("|---|---|---|---|---|---|")
    plain = None
    for layout in layouts:
        for workers in workers_list:
            width, peak = largest(layout, workers, budget)
            n = parameters(width)
            if layout == "plain" and plain is None:
                plain = n
            ratio = f"{n / plain:.2f}" if plain else "-"
            print(f"| {layout} | {workers} | {width} | {n / 1e6:.1f}M | {peak / 2**20:.0f} | "
                  f"{ratio} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

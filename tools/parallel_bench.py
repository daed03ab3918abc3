"""Benchmark: tfdist's pipeline and tensor parallelism on logical CPU devices, measured and
against the planner (tfdist.plan, tfdist-plan) calibrated on this machine.

It prints four tables (every figure is labelled measured, formula, or model/planner = the
planner applied to measured inputs):

1. Pipeline bubble (an MLP of 4 equal blocks, two Dense layers each, cut into S = 2 and 4
   stages; M = 1..16 micro-batches; GPipe, 1F1B, and interleaved 1F1B with the 4 blocks as
   v = 2 chunks on each of S = 2 devices, M a multiple of S): the median measured idle share
   of a step, from the pass timestamps the runner records in the graph, beside the formula,
   (S-1)/(vM+S-1) (v = 1 but interleaved), and the bubble `schedules.simulate` predicts from
   the measured median pass times per stage.
2. Activations held per stage, GPipe vs 1F1B (S=4, M=8): the most micro-batches a stage
   held at once in the executed order (forward ended, backward not yet), times one
   micro-batch's boundary activation, beside simulate's peak_activations.
3. Parameter bytes per device under tensor parallelism (a small transformer block converted
   with tensor_parallel(degree=N) over N = 1, 2, 4 devices): bytes on device 0, split and
   replicated, and the ratio to N = 1.
4. The planner: this machine calibrated (tfdist.plan.calibrate: one device's speed alone
   and the devices' combined throughput, each model's forward/backward efficiency and its
   optimizer's update bandwidth, the link fitted to the strategy's all-reduce and
   all-gather), then its predicted step of 4-device layouts (data x4, pipeline 4 x M=4
   and 8, pipeline 2 x data 2, tensor 2 x data 2, tensor 4) next to each layout's
   measured median step under tfdist.fit, and its prediction for the same devices on a
   cluster's links given by flags.

Output: the tables, parallel_bench.csv (a `table` column says which) and parallel_bench.png
in --out; an earlier run's files there are kept as parallel_bench.N.csv and .png.

  python -m tools.parallel_bench            # about 3-4 minutes on 2 cores
  python -m tools.parallel_bench --quick    # a smoke run, under a minute
  python -m tools.parallel_bench --cluster_bandwidth_gbps 25 --cluster_latency_us 30

On a machine with fewer cores than logical devices (2 cores, 4 devices here) passes that
run at once on different devices share the cores and slow each other: a pass is slower in
a pipeline's steady state (every stage busy) than while it fills and drains, so pass times
are not constant as the formula assumes, and an idle stage's core goes to the busy ones.
Table 1 also gives the most passes measured running at once; where that is 1, the stages
took turns and the measured bubble is (S-1)/S whatever M (its footnote says which held).
The planner takes that sharing from its calibration (a step takes at least the devices'
busy seconds over their combined throughput). This is a benchmark, not a test: it reports
figures and never fails on them.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from tools import harness  # noqa: E402

DEVICES = 4
BLOCKS = 4  # the MLP's blocks: S = 2 puts two in a stage, S = 4 one
CLASSES = 10
WARMUP = 2
HELD_MICRO_BATCHES = 8  # table 2's M (S = 4)
# Table 4's timed steps per layout (8x table 1's): this shared machine's step times wander,
# and the planner is held to their median.
LAYOUT_STEPS_FACTOR = 8


@dataclasses.dataclass(frozen=True)
class Sizes:
    width: int  # the MLP's layers
    batch: int  # global batch of the MLP runs
    vocab: int  # the transformer's
    model_dim: int
    heads: int
    ff: int
    seq: int
    tp_batch: int  # global batch of the transformer runs
    steps: int  # timed steps after WARMUP
    micro_batches: tuple[int, ...]
    repeats: int  # timed calls per calibration figure


FULL = Sizes(512, 128, 2048, 128, 4, 512, 32, 64, 5, (1, 2, 4, 8, 16), 10)
# Both lists keep M = 8: table 2 is read from those runs.
QUICK = Sizes(128, 64, 256, 32, 4, 64, 8, 32, 2, (1, 8), 4)


def cuts(stages: int) -> list[str]:
    return [f"b{k * BLOCKS // stages}_1" for k in range(1, stages)]


def cpu(index: int) -> str:
    return f"/cpu:{index}"


# --- models and data ----------------------------------------------------------------------------


def mlp(sizes: Sizes, *, compile_it: bool = True):
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((sizes.width,))]
    for block in range(BLOCKS):
        layers += [
            keras.layers.Dense(sizes.width, activation="relu", name=f"b{block}_{i}") for i in (1, 2)
        ]
    model = keras.Sequential([*layers, keras.layers.Dense(CLASSES, name="head")])
    if compile_it:
        model.compile(keras.optimizers.Adam(1e-4), _loss())
    return model


def transformer(sizes: Sizes, *, compile_it: bool = True):
    """Embedding -> attention -> LayerNorm -> Dense(ff) -> Dense(d) -> pooling -> head, as a
    chain (no residual), so each layer can be timed on its predecessor's output."""
    import keras

    keras.utils.set_random_seed(0)
    d = sizes.model_dim
    ids = keras.Input((sizes.seq,), dtype="int32")
    x = keras.layers.Embedding(sizes.vocab, d, name="embed")(ids)
    x = keras.layers.MultiHeadAttention(sizes.heads, d // sizes.heads, name="attention")(x, x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Dense(sizes.ff, activation="relu", name="ff_in")(x)
    x = keras.layers.Dense(d, name="ff_out")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    model = keras.Model(ids, keras.layers.Dense(CLASSES, name="head")(x))
    if compile_it:
        model.compile(keras.optimizers.Adam(1e-4), _loss())
    return model


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp_data(sizes: Sizes):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(sizes.batch * 4, sizes.width)).astype("float32")
    y = rng.integers(0, CLASSES, sizes.batch * 4).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(sizes.batch, True)


def transformer_data(sizes: Sizes):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.integers(0, sizes.vocab, (sizes.tp_batch * 4, sizes.seq)).astype("int32")
    y = rng.integers(0, CLASSES, sizes.tp_batch * 4).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(sizes.tp_batch, True)


def strategy_over(devices: int):
    import tfdist

    return tfdist.build_strategy("mirrored", cluster=None, devices=[cpu(i) for i in range(devices)])


def parameter_count(variables) -> int:
    return sum(int(v.numpy().size) for v in variables)


# --- 1 and 2: pipeline bubble and activations held --------------------------------------------


def drive_pipeline(
    model,
    strategy,
    dataset,
    *,
    stages: int,
    micro_batches: int,
    schedule: str,
    steps: int,
    chunks: int = 1,
) -> list[dict]:
    """`runner.last_passes` of each timed step; fit hides its runner, so this drives one."""
    from tfdist.parallel import Pipeline
    from tfdist.training.fit_data import make_fit_data

    pipeline = Pipeline(
        cut_before=cuts(stages * chunks), micro_batches=micro_batches, schedule=schedule,
        chunks_per_device=chunks,
    )  # fmt: skip
    runner = pipeline.runner(model, strategy)
    data = make_fit_data(dataset, strategy=strategy, for_training=True)
    runner.build(data.sample_batch)
    runner.begin(0)
    iterator = runner.job.iterator(data)
    timed = []
    for step in range(WARMUP + steps):
        runner.train(iterator, 1, bounded=True, logs=None)
        if step >= WARMUP:
            timed.append(dict(runner.last_passes))
    return timed


def measured_bubble(passes: dict, devices: int) -> float:
    """1 - time in passes / (devices x the step's span), over every (pipeline, stage)."""
    spans = [p for ps in passes.values() for p in ps]
    busy = sum(end - start for _, start, end in spans)
    length = max(end for *_, end in spans) - min(start for _, start, _ in spans)
    return 1.0 - busy / (devices * length)


def median_pass_times(steps: list[dict], stages: int) -> tuple[list[float], list[float]]:
    """Each stage's median forward and backward pass, over pipelines, passes and steps."""
    forward, backward = [], []
    for stage in range(stages):
        mine = [p for step in steps for (_, s), ps in step.items() if s == stage for p in ps]
        forward.append(statistics.median(e - b for n, b, e in mine if n[0] == "F"))
        backward.append(statistics.median(e - b for n, b, e in mine if n[0] == "B"))
    return forward, backward


def most_at_once(passes: dict) -> int:
    """The most passes in flight at once over all devices, by their timestamps."""
    events = sorted(
        (t, change) for ps in passes.values() for _, start, end in ps
        for t, change in ((start, 1), (end, -1))
    )  # fmt: skip
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


def held_at_most(passes: list[tuple[str, float, float]]) -> int:
    """Micro-batches held at once: forward ended and its backward not yet, by the clock."""
    events = sorted(
        [(end, 1) for name, _, end in passes if name[0] == "F"]
        + [(end, -1) for name, _, end in passes if name[0] == "B"]
    )  # a tie puts the release first: it ends the backward that frees the slot
    held = peak = 0
    for _, change in events:
        held += change
        peak = max(peak, held)
    return peak


def bench_pipeline(sizes: Sizes, schedules: list[str]) -> tuple[list[dict], list[dict]]:
    from tfdist.parallel.pipeline.schedules import bubble_formula, schedule, simulate

    bubble_rows, held_rows = [], []
    dataset = mlp_data(sizes)
    for stages in (2, 4):
        strategy = strategy_over(stages)
        with strategy.scope():
            model = mlp(sizes)
        for name in schedules:
            chunks = BLOCKS // stages if name == "interleaved" else 1
            if name == "interleaved" and chunks < 2:
                continue  # S = 4 devices would need 8 blocks for 2 chunks each
            for m in sizes.micro_batches:
                if name == "interleaved" and m % stages:
                    continue  # its micro-batches go in groups of the S devices
                steps = drive_pipeline(
                    model, strategy, dataset, stages=stages, micro_batches=m, schedule=name,
                    steps=sizes.steps, chunks=chunks,
                )  # fmt: skip
                forward, backward = median_pass_times(steps, stages * chunks)
                plan = schedule(name, stages, m, chunks=chunks)
                timeline = simulate(plan, lambda s, f=forward: f[s], lambda s, b=backward: b[s])
                row = {
                    "table": "bubble", "stages": stages, "micro_batches": m, "schedule": name,
                    "chunks": chunks,
                    "bubble_measured": statistics.median(
                        measured_bubble(p, stages) for p in steps
                    ),
                    "bubble_formula": bubble_formula(stages, m, chunks),
                    "bubble_simulated": timeline.bubble,
                    "passes_at_once_measured": max(most_at_once(p) for p in steps),
                    "forward_ms_measured": 1e3 * statistics.mean(forward),
                    "backward_ms_measured": 1e3 * statistics.mean(backward),
                }  # fmt: skip
                bubble_rows.append(row)
                print(
                    f"  S={stages} M={m:<2} {name:<11} bubble measured "
                    f"{row['bubble_measured']:.3f}"
                    f" formula {row['bubble_formula']:.3f}",
                    flush=True,
                )
                if stages == 4 and m == HELD_MICRO_BATCHES:
                    micro = sizes.batch // m
                    for stage in range(stages):
                        width = CLASSES if stage == stages - 1 else sizes.width
                        held = max(held_at_most(p[0, stage]) for p in steps)
                        held_rows.append(
                            {
                                "table": "activations",
                                "stages": stages,
                                "micro_batches": m,
                                "schedule": name,
                                "stage": stage,
                                "held_measured": held,
                                "held_simulated": timeline.peak_activations[stage],
                                "boundary_bytes": width * micro * 4,
                                "held_bytes_measured": held * width * micro * 4,
                            }  # fmt: skip
                        )
    return bubble_rows, held_rows


# --- 3: parameter bytes per device under tensor parallelism ----------------------------------


def bytes_on_device(model, device: int) -> tuple[int, int]:
    """(split bytes, replicated bytes) that device `device` holds of `model`'s weights."""
    import tensorflow as tf

    from tfdist.parallel import split_layers

    parts = {id(v) for layer in split_layers(model) for ps in layer._parts.values() for v in ps}
    split = replicated = 0
    for v in model.weights:
        size = int(v.numpy().size) * v.value.dtype.size
        if id(v) not in parts:  # mirrored: whole on every device
            replicated += size
        elif tf.DeviceSpec.from_string(v.value.device).device_index == device:
            split += size
    return split, replicated


def bench_tensor_bytes(sizes: Sizes) -> list[dict]:
    import tfdist

    rows = []
    for n in (1, 2, 4):
        strategy = strategy_over(n)
        with strategy.scope():
            model = transformer(sizes, compile_it=False)
            if n > 1:
                model = tfdist.parallel.tensor_parallel(model, degree=n)
        split, replicated = bytes_on_device(model, 0)
        rows.append(
            {"table": "tensor_bytes", "devices": n, "split_bytes": split,
             "replicated_bytes": replicated, "device0_bytes": split + replicated}
        )  # fmt: skip
    for row in rows:
        row["ratio_to_1"] = row["device0_bytes"] / rows[0]["device0_bytes"]
    return rows


# --- 4: calibration -----------------------------------------------------------------------------


# --- 4: the planner against tfdist.fit -------------------------------------------------------

# parallel_bench's layouts as the planner's.
LAYOUTS = {
    "mlp data x4": dict(data=4),
    "mlp pipeline 4 M=4": dict(stages=4, micro_batches=4),
    "mlp pipeline 4 M=8": dict(stages=4, micro_batches=8),
    "mlp pipeline 2 x data 2 M=4": dict(data=2, stages=2, micro_batches=4),
    "tf data x4": dict(data=4),
    "tf tensor 2 x data 2": dict(tensor=2, data=2),
    "tf tensor 4": dict(tensor=4),
}


def calibrate_models(sizes: Sizes, repeats: int) -> tuple[object, dict]:
    """This machine (tfdist.plan.calibrate) and, per model, its cost, batch, efficiency and
    update bandwidth (its passes measured on one device's share of the batch)."""
    import numpy as np
    import tensorflow as tf

    from tfdist.plan import ModelCost, calibrate

    strategy = strategy_over(DEVICES)
    machine = calibrate.machine(strategy, repeats=repeats)
    peak = machine.device.peak("float32")
    rng = np.random.default_rng(0)
    models = {}
    for kind, build, batch in (("mlp", mlp, sizes.batch), ("tf", transformer, sizes.tp_batch)):
        model = build(sizes)
        local = batch // DEVICES
        if kind == "mlp":
            x = tf.constant(rng.normal(size=(local, sizes.width)).astype("float32"))
        else:
            x = tf.constant(rng.integers(0, sizes.vocab, (local, sizes.seq)).astype("int32"))
        y = tf.constant(rng.integers(0, CLASSES, local).astype("int32"))
        cost = ModelCost.of(model)
        models[kind] = {
            "cost": cost,
            "batch": batch,
            "efficiency": calibrate.efficiency(
                model, x, y, peak=peak, flops_per_example=cost.forward_flops, repeats=repeats
            ),
            "bandwidth": calibrate.update_bandwidth(
                lambda build=build: build(sizes), strategy, repeats=repeats
            ),
            "shared": calibrate.shared(
                lambda build=build: build(sizes), x, y, strategy, repeats=repeats
            ),
        }
    return machine, models


def predicted(layout: str, machine, models: dict):
    """The planner's estimate of `layout` on `machine` (a Cluster) for its model."""
    from tfdist.plan import ParallelLayout, Training, estimate

    figures = models[layout.split()[0]]
    cluster = dataclasses.replace(
        machine,
        efficiency=figures["efficiency"],
        shared=figures["shared"] if machine.shared else None,
        device=dataclasses.replace(machine.device, memory_bandwidth=figures["bandwidth"]),
    )
    training = Training(figures["cost"], batch=figures["batch"])
    return estimate(ParallelLayout(**LAYOUTS[layout]), training, cluster)


def measure_layout(layout: str, sizes: Sizes, steps: int) -> float:
    """The median step time of `layout` under tfdist.fit on this machine (seconds)."""
    import keras

    import tfdist
    from tfdist.parallel import Pipeline

    ends: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    strategy = strategy_over(DEVICES)
    pipeline = None
    with strategy.scope():
        if layout == "tiny":  # the step's own cost: one weight, one example per replica
            import numpy as np
            import tensorflow as tf

            model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.Adam(1e-4), "mse")
            ones = np.ones((DEVICES, 1), "float32")
            data = tf.data.Dataset.from_tensors((ones, ones)).repeat()
        elif layout.startswith("mlp"):
            model, data = mlp(sizes), mlp_data(sizes)
            if "pipeline" in layout:
                stages = 4 if "pipeline 4" in layout else 2
                m = int(layout.split("M=")[1])
                pipeline = Pipeline(cut_before=cuts(stages), micro_batches=m, schedule="1f1b")
        else:
            # Converted before it is compiled: the copy would rebuild a compiled optimizer
            # on its split parts, which live outside the strategy's variables.
            model, data = transformer(sizes, compile_it=False), transformer_data(sizes)
            if "tensor" in layout:
                degree = 4 if layout.endswith("tensor 4") else 2
                model = tfdist.parallel.tensor_parallel(model, degree=degree)
            model.compile(keras.optimizers.Adam(1e-4), _loss())
    tfdist.fit(
        model, data, epochs=1, steps_per_epoch=WARMUP + steps, verbose=0, callbacks=[Clock()],
        pipeline=pipeline,
    )  # fmt: skip
    return statistics.median(b - a for a, b in zip(ends[WARMUP - 1 :], ends[WARMUP:], strict=False))


def bench_cost_model(sizes: Sizes, args) -> tuple[list[dict], list[dict], object]:
    from tfdist.plan import Link

    machine, models = calibrate_models(sizes, sizes.repeats)
    # Each step's own cost under tfdist.fit (the replicas' launch, Keras's bookkeeping):
    # a model of one weight, stepped as the layouts are.
    steps = LAYOUT_STEPS_FACTOR * sizes.steps
    machine = dataclasses.replace(machine, step_overhead=measure_layout("tiny", sizes, steps))
    if args.latency_us is not None or args.bandwidth_gbps is not None:
        link = Link(
            args.latency_us * 1e-6 if args.latency_us is not None else machine.intra.latency,
            args.bandwidth_gbps * 1e9 / 8
            if args.bandwidth_gbps is not None
            else machine.intra.bandwidth,
        )
        machine = dataclasses.replace(machine, intra=link, inter=link)
    # The same devices as independent accelerators on a cluster's links.
    remote = Link(args.cluster_latency_us * 1e-6, args.cluster_bandwidth_gbps * 1e9 / 8)
    cluster = dataclasses.replace(machine, intra=remote, inter=remote, shared=None)
    calibration = [
        {"table": "calibration", "what": "device GFLOP/s alone",
         "value_measured": machine.device.peak("float32") / 1e9},
        {"table": "calibration", "what": "matmuls: combined throughput / one alone",
         "value_measured": machine.shared},
        {"table": "calibration", "what": "a step's own cost ms (one weight)",
         "value_measured": 1e3 * machine.step_overhead},
        {"table": "calibration", "what": "all-reduce latency us (fit)",
         "value_measured": 1e6 * machine.intra.latency},
        {"table": "calibration", "what": "all-reduce bandwidth Gb/s (fit)",
         "value_measured": machine.intra.bandwidth * 8 / 1e9},
        {"table": "calibration", "what": "all-gather latency us (fit)",
         "value_measured": 1e6 * machine.intra.for_gather.latency},
        {"table": "calibration", "what": "all-gather bandwidth Gb/s (fit)",
         "value_measured": machine.intra.for_gather.bandwidth * 8 / 1e9},
        *({"table": "calibration", "what": f"{kind} efficiency (forward + backward)",
           "value_measured": f["efficiency"]} for kind, f in models.items()),
        *({"table": "calibration", "what": f"{kind} update GB/s (each, all at once)",
           "value_measured": f["bandwidth"] / 1e9} for kind, f in models.items()),
        *({"table": "calibration", "what": f"{kind} devices' combined throughput / one alone",
           "value_measured": f["shared"]} for kind, f in models.items()),
    ]  # fmt: skip
    rows = []
    for layout in LAYOUTS:
        measured = measure_layout(layout, sizes, steps)
        local = predicted(layout, machine, models)
        rows.append(
            {
                "table": "layouts",
                "layout": layout,
                "step_ms_model_local": 1e3 * local.step,
                "compute_ms_model": 1e3 * local.compute,
                "exchange_ms_model": 1e3 * local.exchange,
                "bubble_ms_model": 1e3 * local.bubble,
                "step_ms_measured": 1e3 * measured,
                "measured_over_model": measured / local.step,
                "step_ms_model_cluster": 1e3 * predicted(layout, cluster, models).step,
            }  # fmt: skip
        )
        print(f"  {layout:<28} measured {1e3 * measured:7.1f} ms", flush=True)
    return calibration, rows, machine


# --- output -------------------------------------------------------------------------------------


def print_bubble(rows: list[dict]) -> None:
    print("\n1. Pipeline bubble (idle share of a step): measured, formula, model")
    print(
        f"{'S':>2} {'M':>3} {'schedule':<16} {'measured':>9} {'formula':>8} {'simulated':>10} "
        f"{'F ms':>6} {'B ms':>6} {'at once':>7}"
    )
    for r in rows:
        name = r["schedule"] + (f" v={r['chunks']}" if r.get("chunks", 1) > 1 else "")
        print(
            f"{r['stages']:>2} {r['micro_batches']:>3} {name:<16} "
            f"{r['bubble_measured']:9.3f} {r['bubble_formula']:8.3f} {r['bubble_simulated']:10.3f} "
            f"{r['forward_ms_measured']:6.2f} {r['backward_ms_measured']:6.2f} "
            f"{r['passes_at_once_measured']:>7}"
        )
    print(
        "  measured: median over the timed steps of 1 - sum(pass times) / (devices x step span),\n"
        "  from the runner's in-graph timestamps; formula: (S-1)/(vM+S-1), v the chunks per\n"
        "  device (1 but interleaved; S counts devices); simulated: simulate()\n"
        "  on each stage's measured median F and B (F ms, B ms: their mean over the stages);\n"
        "  at once: the most passes measured in flight together, over all devices.\n"
        f"  Note: the {DEVICES} logical devices share this machine's {os.cpu_count()} cores. "
        "Passes running at once\n"
        "  slow each other, so a pass is slower while every stage is busy than while the pipe\n"
        "  fills and drains (the measured F and B mix both), and an idle device's core goes\n"
        "  to the busy ones: on few cores a bubble is not all lost CPU."
    )
    if max(r["passes_at_once_measured"] for r in rows) == 1:
        print(
            "  In this run no two passes overlapped (at once = 1): the step's program ran one\n"
            "  pass at a time, so the measured bubble is (S-1)/S for every M, and neither the\n"
            "  formula nor the simulated bubble (which lets stages run concurrently) was reached."
        )


def print_held(rows: list[dict]) -> None:
    if not rows:
        return
    m = rows[0]["micro_batches"]
    print(f"\n2. Activations held per stage (S=4, M={m}): measured order vs simulate")
    print(
        f"{'schedule':<8} {'stage':>5} {'held (measured)':>15} {'held (simulate)':>15} "
        f"{'boundary KiB':>12} {'held KiB':>9}"
    )
    for r in rows:
        print(
            f"{r['schedule']:<8} {r['stage']:>5} {r['held_measured']:>15} "
            f"{r['held_simulated']:>15} {r['boundary_bytes'] / 1024:12.1f} "
            f"{r['held_bytes_measured'] / 1024:9.1f}"
        )
    print(
        "  held: the most micro-batches whose forward had ended and backward had not, by the\n"
        "  pass timestamps; KiB: held x one micro-batch's stage output (micro batch x width x 4\n"
        "  bytes). The layers' inner activations the tape also keeps are not counted."
    )


def print_tensor_bytes(rows: list[dict]) -> None:
    print("\n3. Parameter bytes on device 0, transformer block, tensor_parallel(degree=N)")
    print(f"{'N':>2} {'split KiB':>10} {'replicated KiB':>14} {'device 0 KiB':>12} {'/N=1':>6}")
    for r in rows:
        print(
            f"{r['devices']:>2} {r['split_bytes'] / 1024:10.1f} "
            f"{r['replicated_bytes'] / 1024:14.1f} {r['device0_bytes'] / 1024:12.1f} "
            f"{r['ratio_to_1']:6.3f}"
        )
    print(
        "  measured from the variables: split parts on device 0 (their device), replicated\n"
        "  (mirrored) weights counted whole; N=1 is the unconverted model on one device."
    )


def print_cost_model(calibration: list[dict], rows: list[dict], machine, args) -> None:
    print("\n4. The planner (tfdist.plan) against tfdist.fit. Calibration, measured here:")
    for r in calibration:
        print(f"  {r['what']:<44} {r['value_measured']:10.3f}")
    print(
        f"\nStep time, {DEVICES} devices: planner (local: the calibration above; cluster: the "
        f"same devices, independent, on {args.cluster_latency_us:g} us, "
        f"{args.cluster_bandwidth_gbps:g} Gb/s links) vs measured (tfdist.fit, median)"
    )
    print(
        f"{'layout':<28} {'planner ms':>10} {'compute':>8} {'exchange':>8} {'bubble':>7} "
        f"{'measured ms':>11} {'meas/plan':>9} {'cluster ms':>10}"
    )
    for r in rows:
        print(
            f"{r['layout']:<28} {r['step_ms_model_local']:10.1f} {r['compute_ms_model']:8.1f} "
            f"{r['exchange_ms_model']:8.1f} {r['bubble_ms_model']:7.1f} "
            f"{r['step_ms_measured']:11.1f} {r['measured_over_model']:9.2f} "
            f"{r['step_ms_model_cluster']:10.1f}"
        )
    print(
        "  planner: a step's own cost, then FLOPs counted from the models' layers at the\n"
        "  calibrated speed and efficiency (the devices share the cores: a step takes at\n"
        "  least their busy seconds over their combined throughput), the optimizer's update\n"
        "  at its measured bandwidth,"
        " and tfdist's collectives on the fitted link (tfdist.plan.costs)."
    )


def plot(bubble: list[dict], layouts: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'); no plot written")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for stages, color in ((2, "tab:blue"), (4, "tab:green")):
        mine = [
            r for r in bubble if r["stages"] == stages and r["schedule"] == bubble[0]["schedule"]
        ]
        ms = [r["micro_batches"] for r in mine]
        for column, style in (("measured", "o-"), ("formula", "--"), ("simulated", ":")):
            values = [r[f"bubble_{column}"] for r in mine]
            left.plot(ms, values, style, color=color, label=f"S={stages} {column}")
    left.set_xscale("log", base=2)
    left.set_xlabel("micro-batches M")
    left.set_ylabel("bubble")
    left.set_title(f"pipeline bubble ({bubble[0]['schedule']})")
    left.legend(fontsize=7)
    labels = [
        r["layout"].replace(" x ", "x\n").replace(" M=", "\nM=").replace(" pipeline", "\npipeline")
        for r in layouts
    ]
    at = range(len(layouts))
    right.bar(
        [i - 0.27 for i in at],
        [r["step_ms_model_local"] for r in layouts],
        0.27,
        label="planner (local)",
    )
    right.bar(list(at), [r["step_ms_measured"] for r in layouts], 0.27, label="measured")
    right.bar(
        [i + 0.27 for i in at],
        [r["step_ms_model_cluster"] for r in layouts],
        0.27,
        label="planner (cluster)",
    )
    right.set_xticks(list(at), labels, fontsize=7)
    right.set_ylabel("step ms")
    right.set_title(f"step time on {DEVICES} devices")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.parallel_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smaller everything: a smoke run")
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=["gpipe", "1f1b", "interleaved"],
        choices=["gpipe", "1f1b", "interleaved"],
    )
    parser.add_argument("--latency_us", type=float, help="replace the measured link latency")
    parser.add_argument("--bandwidth_gbps", type=float, help="replace the measured bandwidth")
    parser.add_argument("--cluster_latency_us", type=float, default=10.0)
    parser.add_argument("--cluster_bandwidth_gbps", type=float, default=100.0)
    parser.add_argument("--out", default=".", help="folder for the CSV and the plot")
    args = parser.parse_args(argv)
    if args.cluster_bandwidth_gbps <= 0:
        parser.error("--cluster_bandwidth_gbps must be positive")
    sizes = QUICK if args.quick else FULL

    import tfdist

    tfdist.configure_cpu_devices(DEVICES)  # before any TensorFlow op
    began = time.perf_counter()
    print("pipeline runs:", flush=True)
    bubble, held = bench_pipeline(sizes, args.schedules)
    tensor_bytes = bench_tensor_bytes(sizes)
    print("cost model: calibrating, then each layout under tfdist.fit", flush=True)
    calibration, layouts, machine = bench_cost_model(sizes, args)

    print_bubble(bubble)
    print_held(held)
    print_tensor_bytes(tensor_bytes)
    print_cost_model(calibration, layouts, machine, args)
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "parallel_bench.csv")
    png_path = os.path.join(args.out, "parallel_bench.png")
    kept = [k for k in map(harness.keep_earlier, (csv_path, png_path)) if k is not None]
    harness.write_csv(csv_path, [*bubble, *held, *tensor_bytes, *calibration, *layouts])
    plot(bubble, layouts, png_path)
    print(f"\nwrote {csv_path} and {png_path} ({time.perf_counter() - began:.0f} s)")
    if kept:
        print(f"kept the earlier run's files as {' and '.join(map(str, kept))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

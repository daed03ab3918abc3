"""Benchmark: tfdist.fit against Keras's model.fit and against a compiled loop, same model,
data and batch, at 1 and 16 steps per call (and tfdist's 'auto').

The model is a 64 -> 256 -> 256 -> 10 MLP with Adam, on 8,192 random examples (cached and
prefetched, 128 batches of 64 an epoch): small steps, where the fixed cost of each call shows.
Three trainers train it from the same seed:

- `keras fit`: Keras's own model.fit (compile's steps_per_execution);
- `tfdist.fit`: tfdist's (its steps_per_execution, or 'auto');
- `compiled loop`: the limit, no framework around it: one tf.function over the iterator runs
  steps_per_execution steps of strategy.run(GradientTape, apply_gradients), no metrics, no
  callbacks.

Under one_device and mirrored over 2 logical CPUs (in this process), and multi_worker_mirrored
over 2 processes (tfdist-launch; Keras's fit cannot train there). The variants take turns
(A B C ... A B C ...) so the machine's drift hits them alike. Throughput is measured after a
warm-up epoch (tracing excluded) as examples per second; the table gives the medians over the
repeats and the medians of the per-repeat ratios.

  python -m tools.train_bench                      # about 12 minutes on 2 cores
  python -m tools.train_bench --repeats 3 --no-multi_worker
  python -m tools.train_bench --only_repeated_fits  # the repeated short fits alone
  python -m tools.train_bench --only_first_step     # the time to the first step alone

First, repeated short fits: 6 one-epoch calls of 32 steps on the same model after a warm-up
call (a notebook's loop, Keras Tuner), Keras's seconds over tfdist's: where tfdist traced its
step at every call, this row showed it.

Then the time to the first step: a keras-hub Gemma causal LM of a small random config (no
download; keras-hub is a test extra) in a fresh process per run, from `fit(data, epochs=1)`
called to its first step done (a batch-end callback), Keras's fit against tfdist.fit under one_device and
mirrored over 2 logical CPUs, and tfdist's zero3 over the same 2 against Keras on one device.
What is left is tracing: the step's program built and made ready.

This is a benchmark, not a test: it reports figures and never fails on them.
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

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.errors import first_line  # noqa: E402
from tools import harness  # noqa: E402

EXAMPLES, BATCH, FEATURES, CLASSES = 8192, 64, 64, 10
STEPS = EXAMPLES // BATCH
TRAINERS = ("keras fit", "tfdist.fit", "compiled loop")
# (trainer, steps per call) in the order they take turns.
VARIANTS = (
    ("keras fit", 1), ("tfdist.fit", 1), ("compiled loop", 1),
    ("keras fit", 16), ("tfdist.fit", 16), ("compiled loop", 16),
    ("tfdist.fit", "auto"),
)  # fmt: skip
# Keras's fit cannot train across worker processes.
MULTI_WORKER_VARIANTS = tuple(v for v in VARIANTS if v[0] != "keras fit")


def _data() -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((EXAMPLES, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, EXAMPLES)
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(BATCH, drop_remainder=True)
        .cache()
        .repeat()
        .prefetch(tf.data.AUTOTUNE)
    )


def _model(strategy, steps_per_execution: int) -> keras.Model:
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(CLASSES),
            ]
        )
        model.compile(
            keras.optimizers.Adam(1e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
        )
    return model


class _EpochClock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        self.ends.append(time.perf_counter())


def _compiled_loop(model, strategy, data, *, per_call: int, epochs: int) -> list[float]:
    """The limit: epochs of STEPS steps, `per_call` a call; returns each epoch's end time."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    optimizer = model.optimizer
    with strategy.scope():
        optimizer.build(model.trainable_variables)

    def step(x, y):
        with tf.GradientTape() as tape:
            per_example = loss(y, model(x, training=True))
            mean = tf.nn.compute_average_loss(per_example, global_batch_size=BATCH)
        gradients = tape.gradient(mean, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))

    @tf.function
    def run(iterator, n):
        for _ in tf.range(n):
            x, y = next(iterator)
            strategy.run(step, args=(x, y))

    iterator = iter(strategy.experimental_distribute_dataset(data))
    count = tf.constant(per_call)
    ends = []
    for _ in range(epochs):
        for _ in range(STEPS // per_call):
            run(iterator, count)
        ends.append(time.perf_counter())
    return ends


def throughput(trainer: str, per_call, strategy, *, epochs: int) -> float | None:
    """Examples/s of one run after its first epoch; None where the trainer fails."""
    model = _model(strategy, per_call if isinstance(per_call, int) else 1)
    data = _data()
    clock = _EpochClock()
    if trainer == "compiled loop":
        ends = _compiled_loop(model, strategy, data, per_call=per_call, epochs=epochs)
    else:
        options = dict(epochs=epochs, steps_per_epoch=STEPS, verbose=0, callbacks=[clock])
        try:
            if trainer == "keras fit":
                model.fit(data, **options)
            else:
                tfdist.fit(model, data, steps_per_execution=per_call, **options)
        except tf.errors.OpError as error:  # Keras's fit under mirrored, > 1 step a call
            print(f"  {trainer} failed: {first_line(error)[:120]}", flush=True)
            return None
        ends = clock.ends
    # Epoch 1 traces the step: it is the warm-up, left out.
    return (epochs - 1) * STEPS * BATCH / (ends[-1] - ends[0])


# Repeated short fits (a notebook's loop, Keras Tuner): calls of one epoch of this many steps
# after a warm-up call, the model's traced step kept across them (or not).
SHORT_STEPS, SHORT_CALLS = 32, 6


def repeated_fits(trainer: str, per_call: int, strategy) -> float | None:
    """Seconds of SHORT_CALLS one-epoch fits of SHORT_STEPS steps after a warm-up fit (its
    tracing left out); None where the trainer fails."""
    model = _model(strategy, per_call)
    data = _data().take(SHORT_STEPS)
    if trainer == "keras fit":

        def call():
            model.fit(data, epochs=1, verbose=0)
    else:

        def call():
            tfdist.fit(model, data, epochs=1, verbose=0)

    try:
        call()  # the warm-up: traces the step
        started = time.perf_counter()
        for _ in range(SHORT_CALLS):
            call()
        return time.perf_counter() - started
    except tf.errors.OpError as error:  # Keras's fit under mirrored, > 1 step a call
        print(f"  {trainer} failed: {first_line(error)[:120]}", flush=True)
        return None


def _repeated_fits_table(strategies: dict, repeats: int) -> list[dict]:
    rows = []
    for repeat in range(repeats):
        for name, make in strategies.items():
            for per_call in (1, 16):
                for trainer in ("keras fit", "tfdist.fit"):
                    seconds = repeated_fits(trainer, per_call, make())
                    rows.append({"repeat": repeat, "strategy": name, "trainer": trainer,
                                 "steps_per_execution": per_call, "seconds": seconds})  # fmt: skip
    print(
        f"\nrepeated short fits: {SHORT_CALLS} calls of one epoch of {SHORT_STEPS} steps after "
        "a warm-up call (seconds, medians)"
    )
    print(f"{'strategy':<15} {'steps/call':>10} {'keras fit':>10} {'tfdist.fit':>10} "
          f"{'keras/tfdist':>12}")  # fmt: skip
    for name in strategies:
        for per_call in (1, 16):

            def seconds(trainer, name=name, per_call=per_call):
                return [r["seconds"] for r in rows if r["strategy"] == name
                        and r["steps_per_execution"] == per_call and r["trainer"] == trainer]  # fmt: skip

            keras_s, tfdist_s = seconds("keras fit"), seconds("tfdist.fit")
            if None in keras_s or None in tfdist_s:
                shown = ["fails" if None in keras_s else f"{statistics.median(keras_s):.3f}",
                         "fails" if None in tfdist_s else f"{statistics.median(tfdist_s):.3f}",
                         "-"]  # fmt: skip
            else:
                ratios = [k / t for k, t in zip(keras_s, tfdist_s, strict=True)]
                shown = [f"{statistics.median(keras_s):.3f}", f"{statistics.median(tfdist_s):.3f}",
                         f"{statistics.median(ratios):.3f}"]  # fmt: skip
            print(f"{name:<15} {per_call:>10} {shown[0]:>10} {shown[1]:>10} {shown[2]:>12}")
    return rows


# The time to the first step: (strategy, tfdist's shard_optimizer, whether Keras's fit runs
# there too).
FIRST_STEP = "FIRST_STEP "  # a task's line of output that holds its figure
FIRST_STEP_LAYOUTS = (("one_device", None, True), ("mirrored x2", None, True),
                      ("mirrored x2", "zero3", False))  # fmt: skip


def _causal_lm(strategy, shard: str | None) -> tuple[keras.Model, tf.data.Dataset]:
    """keras-hub's Gemma of 2 small decoder blocks, random weights, compiled as keras-hub's
    examples compile it, and 32 padded token sequences in batches of 8 (the tests' model:
    tools/keras_hub_models.py)."""
    from tools import keras_hub_models

    scope = tfdist.host_scope(strategy) if shard == "zero3" else strategy.scope()
    with scope:
        model = keras_hub_models.gemma_causal_lm()
    return model, keras_hub_models.token_data()


class _FirstStep(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.done = None

    def on_train_batch_end(self, batch, logs=None):
        if self.done is None:
            self.done = time.perf_counter()


def _first_step_task(argv: list[str]) -> int:
    """One fresh process: seconds from fit called to its first step done, printed."""
    trainer, strategy_name, shard = argv
    shard = None if shard == "-" else shard
    tfdist.configure_cpu_devices(2)
    if strategy_name == "one_device":
        strategy = tfdist.build_strategy("one_device", cluster=None)
    else:
        strategy = tfdist.build_strategy("mirrored", cluster=None, devices=("/cpu:0", "/cpu:1"))
    model, data = _causal_lm(strategy, shard)
    clock = _FirstStep()
    started = time.perf_counter()
    if trainer == "keras fit":
        try:
            model.fit(data, epochs=1, verbose=0, callbacks=[clock])
        except tf.errors.OpError as error:  # Keras's fit under mirrored, keras-hub's mask
            print(FIRST_STEP + json.dumps({"seconds": None, "error": first_line(error)[:120]}))
            return 0
    else:
        tfdist.fit(model, data, epochs=1, verbose=0, callbacks=[clock],
                   shard_optimizer=shard)  # fmt: skip
    print(FIRST_STEP + json.dumps({"seconds": clock.done - started}), flush=True)
    return 0


def _first_step_table(repeats: int) -> list[dict]:
    rows = []
    for repeat in range(repeats):
        for name, shard, keras_too in FIRST_STEP_LAYOUTS:
            for trainer in ("keras fit", "tfdist.fit"):
                if trainer == "keras fit" and not keras_too:
                    continue
                task = [sys.executable, "-m", "tools.train_bench", "--_first_step", trainer,
                        name, shard or "-"]  # fmt: skip
                job = harness.run(task, timeout=600, what=f"{trainer} first step")
                line = next(x for x in job.output.splitlines() if x.startswith(FIRST_STEP))
                seconds = json.loads(line[len(FIRST_STEP) :])["seconds"]
                rows.append({"repeat": repeat, "strategy": name, "shard_optimizer": shard,
                             "trainer": trainer, "seconds": seconds})  # fmt: skip
                shown = "fails" if seconds is None else f"{seconds:6.2f} s"
                print(f"  repeat {repeat}  {name:<12} {shard or '':<6} {trainer:<11} {shown}",
                      flush=True)  # fmt: skip

    def seconds(trainer, name, shard=None):
        return [r["seconds"] for r in rows if r["trainer"] == trainer and r["strategy"] == name
                and r["shard_optimizer"] == shard]  # fmt: skip

    print("\ntime to the first step: keras-hub Gemma (2 blocks, random weights), a fresh "
          f"process per run, medians of {repeats} (seconds)")  # fmt: skip
    print(f"{'layout':<22} {'keras fit':>10} {'tfdist.fit':>10} {'tfdist/keras':>12}")
    for name, shard, keras_too in FIRST_STEP_LAYOUTS:
        keras_s = seconds("keras fit", name if keras_too else "one_device")
        tfdist_s = seconds("tfdist.fit", name, shard)
        label = name + (f", {shard}" if shard else "") + ("" if keras_too else " *")
        if None in keras_s:
            print(f"{label:<22} {'fails':>10} {statistics.median(tfdist_s):>10.2f} {'-':>12}")
            continue
        ratios = [t / k for t, k in zip(tfdist_s, keras_s, strict=True)]
        print(f"{label:<22} {statistics.median(keras_s):>10.2f} {statistics.median(tfdist_s):>10.2f} "
              f"{statistics.median(ratios):>12.2f}")  # fmt: skip
    print("* against Keras's fit on one device (Keras has no zero3)")
    return rows


def _task(argv: list[str]) -> int:
    """One task of the multi-worker job: trains one variant, the chief writes its rate."""
    trainer, per_call, epochs, out = argv
    per_call = per_call if per_call == "auto" else int(per_call)
    strategy = tfdist.build_strategy("multi_worker_mirrored")
    rate = throughput(trainer, per_call, strategy, epochs=int(epochs))
    if tfdist.cluster_from_environment().is_chief:
        with open(out, "w") as f:
            json.dump({"examples_per_s": rate}, f)
    return 0


def _multi_worker(trainer: str, per_call, *, epochs: int) -> float | None:
    with tempfile.TemporaryDirectory() as here:
        out = os.path.join(here, "rate.json")
        task = [sys.executable, "-m", "tools.train_bench", "--_task", trainer, str(per_call),
                str(epochs), out]  # fmt: skip
        harness.launch(task, layout=["--workers=2"], timeout=600, what=f"{trainer} x2")
        with open(out) as f:
            return json.load(f)["examples_per_s"]


def _ratio(rows, strategy: str, a: tuple, b: tuple) -> str:
    pairs = []
    for repeat in sorted({r["repeat"] for r in rows}):
        rate = {
            (r["trainer"], r["steps_per_execution"]): r["examples_per_s"]
            for r in rows
            if r["repeat"] == repeat and r["strategy"] == strategy
        }
        if rate.get(a) and rate.get(b):
            pairs.append(rate[a] / rate[b])
    return f"{statistics.median(pairs):.3f}" if pairs else "-"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_task"]:
        return _task(argv[1:])
    if argv[:1] == ["--_first_step"]:
        return _first_step_task(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m tools.train_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant (default 5)")
    parser.add_argument(
        "--epochs", type=int, default=4, help="epochs of 128 steps per run; the first is warm-up"
    )
    parser.add_argument(
        "--multi_worker",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the multi_worker_mirrored rows (2 processes; default: yes)",
    )
    parser.add_argument(
        "--out_csv", default="train_bench.csv", help="where to write every measurement"
    )
    parser.add_argument(
        "--only_repeated_fits",
        action="store_true",
        help="only the repeated short fits (6 one-epoch calls of 32 steps after a warm-up)",
    )
    parser.add_argument(
        "--only_first_step",
        action="store_true",
        help="only the time to the first step (a keras-hub causal LM, a fresh process per run)",
    )
    args = parser.parse_args(argv)
    if args.only_first_step:
        first = _first_step_table(args.repeats)
        harness.write_csv(args.out_csv.replace(".csv", "_first_step.csv"), first)
        return 0

    tfdist.configure_cpu_devices(2)
    strategies = {
        "one_device": lambda: tfdist.build_strategy("one_device", cluster=None),
        "mirrored x2": lambda: tfdist.build_strategy(
            "mirrored", cluster=None, devices=("/cpu:0", "/cpu:1")
        ),
    }
    short = _repeated_fits_table(strategies, args.repeats)
    harness.write_csv(args.out_csv.replace(".csv", "_repeated_fits.csv"), short)
    if args.only_repeated_fits:
        return 0
    first = _first_step_table(args.repeats)
    harness.write_csv(args.out_csv.replace(".csv", "_first_step.csv"), first)
    names = [*strategies, *(["multi_worker x2"] if args.multi_worker else [])]
    rows = []
    for repeat in range(args.repeats):
        for name in names:
            for trainer, per_call in VARIANTS if name in strategies else MULTI_WORKER_VARIANTS:
                if name in strategies:
                    rate = throughput(trainer, per_call, strategies[name](), epochs=args.epochs)
                else:
                    rate = _multi_worker(trainer, per_call, epochs=args.epochs)
                rows.append({"repeat": repeat, "strategy": name, "trainer": trainer,
                             "steps_per_execution": per_call, "examples_per_s": rate})  # fmt: skip
                shown = "fails" if rate is None else f"{rate:8.0f} examples/s"
                print(f"  repeat {repeat}  {name:<15} {trainer:<13} {per_call!s:>4}  {shown}",
                      flush=True)  # fmt: skip
    harness.write_csv(args.out_csv, rows)

    print(
        f"\n{'strategy':<15} {'steps/call':>10} {'keras fit':>10} {'tfdist.fit':>10} "
        f"{'compiled loop':>13} {'tfdist/keras':>12} {'tfdist/loop':>11}"
    )
    for name in names:
        for per_call in (1, 16, "auto"):

            def median(trainer, per_call=per_call, name=name):
                rates = [r["examples_per_s"] for r in rows if r["strategy"] == name
                         and r["trainer"] == trainer and r["steps_per_execution"] == per_call]  # fmt: skip
                if not rates:
                    return "-"
                if any(rate is None for rate in rates):
                    return "fails"
                return f"{statistics.median(rates):.0f}"

            loop = ("compiled loop", 16 if per_call == "auto" else per_call)
            print(
                f"{name:<15} {per_call!s:>10} {median('keras fit'):>10} {median('tfdist.fit'):>10} "
                f"{median(*loop):>13} "
                f"{_ratio(rows, name, ('tfdist.fit', per_call), ('keras fit', per_call)):>12} "
                f"{_ratio(rows, name, ('tfdist.fit', per_call), loop):>11}"
            )
    print(
        f"\nwrote {args.out_csv}; {args.repeats} repeats, {args.epochs - 1} timed epochs of "
        f"{STEPS} steps, global batch {BATCH}; 'auto' is held to the loop at 16 steps a call"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

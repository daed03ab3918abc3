"""Benchmark: tfdist.fit against Keras's model.fit, same compiled model, data and batch.

For one_device and for mirrored over 2 logical CPUs, each trainer trains the same compiled cnn
on the same digits TFRecord pipeline (batched with the global batch); the trainers take turns
(A B A B ...) so the machine's drift hits them alike. Throughput is measured after a warm-up
epoch (tracing excluded) over the remaining epochs, as examples per second; the table gives
medians, min and max over the repeats and the median of the per-repeat ratios tfdist / Keras.

  python -m tools.train_bench                      # about 3 minutes on 2 cores
  python -m tools.train_bench --repeats 7 --out_csv /tmp/train_bench.csv

This is a benchmark, not a test: it reports figures and never fails on them. Measured on 2
shared cores (TensorFlow 2.21, Keras 3.15), median ratio tfdist.fit / keras fit: 1.013 on
one_device and 1.067 on mirrored x2 (an earlier run, before a one-step call stopped taking a
step count: 0.966 and 1.021).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402

import tfdist  # noqa: E402
from tfdist.data import PipelineOptions, prepare_digits  # noqa: E402
from tfdist.models import build_model  # noqa: E402
from tools import harness  # noqa: E402


class _EpochClock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        self.ends.append(time.perf_counter())


def throughput(
    trainer: str, strategy, *, data_dir: str, batch: int, epochs: int, steps: int
) -> float:
    """Examples/s of one run: the same compiled model and pipeline, trained by `trainer`."""
    digits = prepare_digits(data_dir)
    options = PipelineOptions(shuffle_buffer=1024, seed=0, deterministic=True)
    # A dataset batched with the global batch: both split each batch over the replicas.
    dataset = digits.dataset("train", batch_size=batch, options=options)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = build_model(
            "cnn", input_shape=digits.info.image_shape, num_classes=digits.info.num_classes
        )
        model.compile(
            keras.optimizers.Adam(0.003),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    clock = _EpochClock()
    fit = {
        "tfdist.fit": lambda **kw: tfdist.fit(model, dataset, **kw),
        "keras fit": lambda **kw: model.fit(dataset, **kw),
    }
    fit[trainer](epochs=epochs, steps_per_epoch=steps, verbose=0, callbacks=[clock])
    # Epoch 1 traces the step: it is the warm-up, left out.
    return (epochs - 1) * steps * batch / (clock.ends[-1] - clock.ends[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.train_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant (default 5)")
    parser.add_argument(
        "--epochs", type=int, default=4, help="epochs per run; the first is warm-up"
    )
    parser.add_argument(
        "--steps", type=int, default=100, help="steps per epoch (short windows are noisy)"
    )
    parser.add_argument("--global_batch_size", type=int, default=64)
    parser.add_argument(
        "--out_csv", default="train_bench.csv", help="where to write every measurement"
    )
    args = parser.parse_args(argv)

    tfdist.configure_cpu_devices(2)
    strategies = {
        "one_device": lambda: tfdist.build_strategy("one_device", cluster=None),
        "mirrored x2": lambda: tfdist.build_strategy(
            "mirrored", cluster=None, devices=("/cpu:0", "/cpu:1")
        ),
    }
    trainers = ("tfdist.fit", "keras fit")
    rows = []
    with tempfile.TemporaryDirectory() as data_dir:
        prepare_digits(data_dir)
        for repeat in range(args.repeats):
            for strategy_name, make in strategies.items():
                for loop_name in trainers:
                    rate = throughput(
                        loop_name,
                        make(),
                        data_dir=data_dir,
                        batch=args.global_batch_size,
                        epochs=args.epochs,
                        steps=args.steps,
                    )
                    rows.append(
                        {
                            "repeat": repeat,
                            "strategy": strategy_name,
                            "loop": loop_name,
                            "examples_per_s": rate,
                        }
                    )
                    print(
                        f"  repeat {repeat}  {strategy_name:<12} {loop_name:<10} {rate:8.0f} examples/s",
                        flush=True,
                    )
    harness.write_csv(args.out_csv, rows)

    print(
        f"\n{'strategy':<12} {'loop':<10} {'median ex/s':>12} {'min':>8} {'max':>8} {'ratio tfdist.fit/keras (median of pairs)':>38}"
    )
    for strategy_name in strategies:
        pairs = []
        for repeat in range(args.repeats):
            by_loop = {
                r["loop"]: r["examples_per_s"]
                for r in rows
                if r["repeat"] == repeat and r["strategy"] == strategy_name
            }
            pairs.append(by_loop["tfdist.fit"] / by_loop["keras fit"])
        for loop_name in trainers:
            rates = [
                r["examples_per_s"]
                for r in rows
                if r["strategy"] == strategy_name and r["loop"] == loop_name
            ]
            ratio = f"{statistics.median(pairs):.3f}" if loop_name == "tfdist.fit" else ""
            print(
                f"{strategy_name:<12} {loop_name:<10} {statistics.median(rates):12.0f} {min(rates):8.0f} {max(rates):8.0f} {ratio:>38}"
            )
    print(
        f"\nwrote {args.out_csv}; {args.repeats} repeats, {args.epochs - 1} timed epochs of {args.steps} steps, global batch {args.global_batch_size}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

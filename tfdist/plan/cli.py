"""tfdist-plan: the layouts of a Keras model on a cluster, ranked.

    tfdist-plan --model my_project.models:build --batch 512 --precision bfloat16 \\
        --hosts 2 --devices_per_host 8 --device h100 --intra_gbps 3600 --inter_gbps 400
    tfdist-plan --model model.keras --batch 256 --cluster cluster.toml

--model names a function that returns a Keras model (compiled, or --optimizer says which
optimizer's state to count), or a saved .keras file. Nothing is trained: the model is built
and its forward pass traced on one example. (This machine's own figures are measured by
python -m tools.parallel_bench, which holds the planner to tfdist.fit here.)
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything loads TensorFlow

from tfdist.plan.cluster import DEVICES, GIB, Cluster, PlanError, device_of

# Optimizers by the number of copies of each weight they keep.
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2, "rmsprop": 1, "adagrad": 1}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfdist-plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", required=True, help="module:function returning a Keras model, or a .keras file"
    )
    p.add_argument("--batch", type=int, required=True, help="the global batch (examples per step)")
    p.add_argument(
        "--example", action="append", default=None, metavar="SHAPE",
        help="an input's shape without the batch, e.g. 1024 or 224,224,3, where the model "
        "leaves it unknown (once per input, in the model's input order)",
    )  # fmt: skip
    p.add_argument(
        "--optimizer", choices=sorted(OPTIMIZER_SLOTS), default=None,
        help="the optimizer whose state to count (default: the compiled model's)",
    )  # fmt: skip
    p.add_argument("--precision", default="float32", help="float32, bfloat16 or float16 compute")
    p.add_argument(
        "--recompute", action="store_true", help="activations recomputed in the backward pass"
    )
    p.add_argument("--cluster", help="a TOML or JSON file with the cluster's fields")
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--devices_per_host", type=int, default=8)
    p.add_argument(
        "--device",
        default="h100",
        help=f"one of {', '.join(DEVICES)} (or --flops and --memory_gib)",
    )
    p.add_argument("--flops", type=float, help="the device's peak FLOP/s at --precision")
    p.add_argument("--memory_gib", type=float, help="the device's memory")
    p.add_argument("--intra_gbps", type=float, default=3600.0, help="link within a host, Gbit/s")
    p.add_argument("--intra_latency_us", type=float, default=3.0)
    p.add_argument("--inter_gbps", type=float, default=400.0, help="link between hosts, Gbit/s")
    p.add_argument("--inter_latency_us", type=float, default=10.0)
    p.add_argument(
        "--efficiency", type=float, default=0.4, help="share of peak FLOP/s a step reaches"
    )
    p.add_argument(
        "--hybrid", action="store_true",
        help="rank the layouts that combine pipeline, tensor and ZeRO too (those tfdist does "
        "not train yet are marked *)",
    )  # fmt: skip
    p.add_argument("--top", type=int, default=0, help="print only the first N layouts (0: all)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cluster = cluster_of(args)
        model = load_model(args.model)
        training = training_of(model, args)
        from tfdist.plan.costs import plan

        estimates = plan(training, cluster, hybrid=args.hybrid)
    except PlanError as e:
        print(f"tfdist-plan: error: {e}", file=sys.stderr)
        return 2
    print(report(training, cluster, estimates, top=args.top))
    return 0


def cluster_of(args) -> Cluster:
    if args.cluster:
        return Cluster.from_file(args.cluster)
    fields = {
        "hosts": args.hosts, "devices_per_host": args.devices_per_host, "device": args.device,
        "intra_gbps": args.intra_gbps, "intra_latency_us": args.intra_latency_us,
        "inter_gbps": args.inter_gbps, "inter_latency_us": args.inter_latency_us,
        "efficiency": args.efficiency,
        "name": "the cluster",
    }  # fmt: skip
    if args.flops is not None:
        fields[f"flops_{args.precision}"] = args.flops
    if args.memory_gib is not None:
        fields["memory_gib"] = args.memory_gib
    device_of(fields)  # a clear error for an unknown device before the model is built
    return Cluster.from_mapping(fields)


def load_model(spec: str):
    """The model `spec` names: a .keras file, or module:function (called with no arguments)."""
    if spec.endswith(".keras"):
        import keras

        if not Path(spec).exists():
            raise PlanError(f"--model {spec}: no such file")
        return keras.saving.load_model(spec, compile=True)
    module, _, name = spec.partition(":")
    if not module or not name:
        raise PlanError(f"--model takes module:function or a .keras file. Received: {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        target = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise PlanError(f"--model {spec}: {e}") from None
    return target()


def training_of(model, args):
    from tfdist.plan.costs import Training
    from tfdist.plan.model import ModelCost

    example = None
    if args.example:
        try:
            example = [tuple(int(d) for d in s.split(",")) for s in args.example]
        except ValueError:
            raise PlanError(
                f"--example takes shapes like 1024 or 224,224,3. Received: {args.example}"
            ) from None
    if args.optimizer is None and getattr(model, "optimizer", None) is None:
        raise PlanError(
            f"--model {args.model} is not compiled, so its optimizer's state is unknown: "
            f"compile it, or give --optimizer ({', '.join(sorted(OPTIMIZER_SLOTS))})"
        )
    cost = ModelCost.of(model, example)
    if args.optimizer is not None:
        cost.slots_per_param = OPTIMIZER_SLOTS[args.optimizer]
    half = args.precision in ("bfloat16", "float16")
    return Training(
        cost, batch=args.batch, precision=args.precision, activation_bytes=2 if half else 4,
        recompute=args.recompute,
    )  # fmt: skip


def report(training, cluster: Cluster, estimates, *, top: int = 0) -> str:
    from tfdist.plan.costs import best_choice, recipe

    model = training.model
    width = max([28, *(len(_name(e.layout, cluster)) for e in estimates[: top or None])])
    lines = [
        cluster.describe(),
        f"model {model.name}: {_parameters(model.params)}, "
        f"{model.forward_flops / 1e9:.{2 if model.forward_flops >= 1e7 else 6}f} GFLOP forward "
        "per example, "
        f"{model.activation_bytes * training.activation_scale() / 2**20:.1f} MiB of activations per "
        f"example; global batch {training.batch}, {training.precision}, optimizer state "
        f"{model.slots_per_param} x the weights",
        "",
        f"{'rank':>4s}  {'layout':{width}s} {'weights':>8s} {'grads':>8s} {'optim':>8s} {'activ':>8s} "
        f"{'buffers':>8s} {'total':>8s} {'fits':>4s} {'step ms':>8s} {'compute':>8s} "
        f"{'exchange':>8s} {'bubble':>8s} {'speedup':>7s} {'effic':>6s}",
    ]
    n = cluster.devices
    shown = estimates[: top or None]
    for i, e in enumerate(shown, 1):
        gib = lambda b: f"{b / GIB:8.2f}"  # noqa: E731
        fits = e.fits(cluster)
        lines.append(
            f"{(str(i) if fits else '-'):>4s}  {_name(e.layout, cluster):{width}s} {gib(e.weights)} {gib(e.gradients)} "
            f"{gib(e.optimizer)} {gib(e.activations)} {gib(e.buffers)} {gib(e.memory)} "
            f"{('yes' if fits else 'no'):>4s} {_ms(e.step)} {_ms(e.compute)} "
            f"{_ms(e.exchange)} {_ms(e.bubble)} {_times(e.speedup)} "
            f"{e.efficiency(e.layout.devices):6.1%}"
        )
    lines.append("\n" + best_choice(estimates, cluster))
    trained = [e for e in estimates if e.fits(cluster) and e.layout.built(cluster.hosts)]
    if trained and trained[0].layout.devices > 1:
        best = trained[0].layout
        lines.append(
            (
                "To train it:"
                if trained[0] is estimates[0]
                else f"The fastest layout tfdist trains today, {best.name}:"
            )  # fmt: skip
            + "\n"
            + textwrap.indent(recipe(best, model), "    ")
        )
    if any(not e.layout.built(cluster.hosts) for e in shown):
        lines.append(
            "* not trained by tfdist yet: in a job of several hosts, the interleaved "
            "schedule, or tensor groups other than one a host (of a model not cut) or whole "
            "stages a host (docs/guides/combining-layouts.md)."
        )
    lines.append(
        "\nBytes per device in GiB; step = compute + exchange + bubble; speedup against one "
        f"device training the whole batch (efficiency: speedup / {n}). Layouts that do not fit "
        "are listed last, unranked."
        + (
            " Over several hosts a tensor group stays within one: each host one tensor "
            "group (of a model not cut) or whole stages."
            if cluster.hosts > 1 and all(e.layout.built(cluster.hosts) for e in estimates)
            else ""
        )
    )
    return "\n".join(lines)


def _name(layout, cluster: Cluster) -> str:
    return layout.name + ("" if layout.built(cluster.hosts) else " *")


def _ms(seconds: float) -> str:
    """Milliseconds, to three significant digits below 1 ms: a small model's step is
    microseconds, and a column of 0.0 would hide which layout is fastest."""
    ms = seconds * 1e3
    if ms >= 1 or ms == 0:
        return f"{ms:8.1f}"
    decimals = min(6, max(3, 2 - math.floor(math.log10(ms))))
    return f"{ms:8.{decimals}f}"


def _times(speedup: float) -> str:
    return f"{speedup:7.1f}" if speedup >= 1 else f"{speedup:7.3f}"


def _parameters(count: int) -> str:
    return f"{count / 1e6:.1f} M parameters" if count >= 100_000 else f"{count:,} parameters"


if __name__ == "__main__":
    sys.exit(main())

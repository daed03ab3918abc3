"""The planner (tfdist.plan) against published scaling tables: each table's model, batch and
hardware entered, the predicted scaling efficiency printed beside the published one.

1. Horovod (Sergeev and Del Balso, 2018; the Horovod repository's docs/benchmarks): data
   parallel, tf_cnn_benchmarks with 64 images per GPU, servers of 4 Pascal (P100) GPUs
   linked by 25 Gbit/s RoCE. Published scaling efficiency: Inception V3 and ResNet-101 90%,
   VGG-16 79% on 32 servers (128 GPUs, the README of early 2018) and 68% on 128 servers
   (512 GPUs, the README and docs since).
2. Megatron-LM weak model-parallel scaling (NVIDIA ADLR, "MegatronLM's Supercharged V1.0",
   Table 1): GPT-2 models of 1.2, 2.0, 4.2 and 8.7 B parameters over 1, 2, 4 and 8 V100s
   of a DGX-2H (NVSwitch), batch 8, sequence 1024, fp16 with activation checkpointing;
   100%, 90.7%, 86.5% and 79.6% of linear scaling. The post gives sizes, not shapes: the
   hidden size is that of the nearest size in the Megatron-LM paper's Table 1 (Shoeybi et
   al., 2019: 1536, 1920, 2304, 3072 with 16, 20, 24, 32 heads) and the layers make up
   the parameter count (40, 43, 64, 76).

3. torchtitan's Llama 3.1 runs on H100s (Liang et al., 2024; the torchtitan repository's
   docs/performance.md): 70B on 256 GPUs as 2D, FSDP 32 x TP 8, global batch 512; 405B on
   512 GPUs as 3D, PP 8 x FSDP 8 x TP 8, global batch 256, where interleaved 1F1B ran at 128
   tokens/s/GPU against 1F1B's 100 (1.28x), 72.7 and 82.5 GiB at most per GPU. Sequences of
   8,192 tokens, full activation checkpointing, bfloat16. Hosts of 8 H100s (96 GB HBM2e,
   2.4 TB/s) on NVLink, 400 Gb/s RDMA per GPU between hosts. The planner ranks every layout,
   the hybrids with it, for tfdist's collectives (ZeRO's exchange not overlapped with the
   passes); the models are counted from their shapes (ModelCost.decoder), and
   micro-batches as torchtitan's default, one per pipeline stage.

What sets each device's speed: the one-device figure the source gives or points to. For
Horovod, TensorFlow's published tf_cnn_benchmarks rates on one P100 of a DGX-1 (synthetic
data, batch 64: Inception V3 142, VGG-16 132, ResNet-152 95.6 images/s; ResNet-101, not
listed, at ResNet-152's FLOP/s). For Megatron, the 1.2 B model's 1288 ms per iteration on
one GPU. The predicted efficiency is then the exchange model's alone.

  python -m tools.plan_published          # about a minute; --tables torchtitan: seconds (builds the models, no weights
                                          # are downloaded)
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402

GIB = 2**30

# (model, GPUs) -> published scaling efficiency. Horovod's README (early 2018: 32 servers)
# and docs/benchmarks (128 servers).
HOROVOD = {
    ("InceptionV3", 128): 0.90, ("ResNet101", 128): 0.90, ("VGG16", 128): 0.79,
    ("InceptionV3", 512): 0.90, ("ResNet101", 512): 0.90, ("VGG16", 512): 0.68,
}  # fmt: skip
# Images per second on one P100, tf_cnn_benchmarks, synthetic data, batch 64 (TensorFlow's
# performance guide, "Details for NVIDIA DGX-1 (NVIDIA Tesla P100)").
P100_IMAGES_PER_SECOND = {"InceptionV3": 142.0, "VGG16": 132.0, "ResNet152": 95.6}
# Megatron V1.0 post, Table 1: (parameters B, model-parallel GPUs, ms per iteration, weak
# scaling); shapes (hidden, heads, layers) as the module says.
MEGATRON = [
    (1.2, 1, 1288, 1.000, (1536, 16, 40)),
    (2.0, 2, 1242, 0.907, (1920, 20, 43)),
    (4.2, 4, 1357, 0.865, (2304, 24, 64)),
    (8.7, 8, 1508, 0.796, (3072, 32, 76)),
]
MEGATRON_BATCH, MEGATRON_SEQ, MEGATRON_VOCAB = 8, 1024, 51200
# torchtitan's Llama 3.1 runs: shapes from Meta's published configs (layers, width, MLP
# width, query and key/value heads, vocabulary), GPUs, global batch in sequences of 8,192
# tokens, the layout it ran and the published figures.
LLAMA_70B = dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256)
LLAMA_405B = dict(layers=126, hidden=16384, ffn=53248, heads=128, kv_heads=8, vocab=128256)
TORCHTITAN_SEQ = 8192
TORCHTITAN_INTERLEAVED_SPEEDUP = 128 / 100  # tokens/s/GPU, interleaved 1F1B over 1F1B


@dataclasses.dataclass
class Row:
    source: str
    model: str
    devices: int
    published: float
    predicted: float
    compute_ms: float
    exchange_ms: float


def horovod_rows(overlap: bool) -> list[Row]:
    import keras

    from tfdist.plan import Cluster, Device, Link, ModelCost, ParallelLayout, Training, estimate

    builders = {
        "InceptionV3": keras.applications.InceptionV3,
        "ResNet101": keras.applications.ResNet101,
        "VGG16": keras.applications.VGG16,
        "ResNet152": keras.applications.ResNet152,
    }
    costs = {}
    for name, build in builders.items():
        model = build(weights=None)
        costs[name] = ModelCost.of(model)
        costs[name].slots_per_param = 1  # tf_cnn_benchmarks: SGD with momentum
        del model
        keras.backend.clear_session()
    rows = []
    for (name, gpus), published in HOROVOD.items():
        rate_model = name if name in P100_IMAGES_PER_SECOND else "ResNet152"
        # FLOP/s that make one GPU's step the published rate: 3 forward passes per image.
        speed = P100_IMAGES_PER_SECOND[rate_model] * 3 * costs[rate_model].forward_flops
        cluster = Cluster(
            hosts=gpus // 4, devices_per_host=4,
            device=Device("p100", {"float32": speed}, 16 * GIB),
            intra=Link(10e-6, 96e9 / 8),  # PCIe 3.0 x16
            inter=Link(10e-6, 25e9 / 8),  # 25 Gbit/s RoCE
            efficiency=1.0, overlap=overlap, name="Horovod's cluster",
        )  # fmt: skip
        training = Training(costs[name], batch=64 * gpus)
        e = estimate(ParallelLayout(data=gpus), training, cluster)
        rows.append(
            Row("Horovod" + ("" if overlap else " (after)"), name, gpus, published, e.efficiency(gpus), e.compute * 1e3,
                e.exchange * 1e3)
        )  # fmt: skip
    return rows


def gpt2_cost(hidden: int, heads: int, layers: int):
    """The cost of a keras-hub GPT-2 of `layers` layers, from models of 1 and 2 layers (the
    layers are alike: their cost is linear in the count), random weights."""
    import keras
    import keras_hub

    from tfdist.plan import ModelCost

    def built(n):
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=MEGATRON_VOCAB, num_layers=n, num_heads=heads, hidden_dim=hidden,
            intermediate_dim=4 * hidden, max_sequence_length=MEGATRON_SEQ,
        )  # fmt: skip
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        cost = ModelCost.of(model, example=[(MEGATRON_SEQ,), (MEGATRON_SEQ,)])
        keras.backend.clear_session()
        return cost

    one, two = built(1), built(2)
    extra = layers - 1
    layer = [u for u in two.units if u.name.endswith("transformer_layer_1")][0]
    cost = dataclasses.replace(
        one,
        units=one.units + [dataclasses.replace(layer, name=f"layer_{i + 2}") for i in range(extra)],
        trainable_params=one.trainable_params
        + extra * (two.trainable_params - one.trainable_params),
        trainable_bytes=one.trainable_bytes + extra * (two.trainable_bytes - one.trainable_bytes),
        split_bytes=one.split_bytes + extra * (two.split_bytes - one.split_bytes),
        tensor_blocks=one.tensor_blocks + extra * (two.tensor_blocks - one.tensor_blocks),
        slots_per_param=2,  # Adam
    )
    return cost


def megatron_rows() -> list[Row]:
    from tfdist.plan import Cluster, Device, Link, ParallelLayout, Training, estimate

    rows, speed = [], None
    for params, gpus, ms, published, (hidden, heads, layers) in MEGATRON:
        cost = gpt2_cost(hidden, heads, layers)
        training = Training(
            cost, batch=MEGATRON_BATCH, precision="float16", weight_bytes=2,
            activation_bytes=2, recompute=True,
        )  # fmt: skip
        if speed is None:  # the 1.2 B model's 1288 ms on one GPU sets the speed
            speed = MEGATRON_BATCH * 4 * cost.forward_flops / (ms / 1e3)
        cluster = Cluster(
            hosts=1, devices_per_host=16,
            device=Device("v100", {"float16": speed}, 32 * GIB),
            intra=Link(5e-6, 1200e9 / 8),  # NVSwitch: 6 NVLink 2 links, 150 GB/s a way
            inter=Link(5e-6, 1200e9 / 8), efficiency=1.0, name="DGX-2H",
            tensor_exchange="group",  # Megatron's all-reduce within the group
        )  # fmt: skip
        e = estimate(ParallelLayout(tensor=gpus), training, cluster)
        rows.append(
            Row("Megatron", f"GPT-2 {params}B", gpus, published, e.efficiency(gpus),
                e.compute * 1e3, e.exchange * 1e3)
        )  # fmt: skip
    return rows


def torchtitan_cluster(gpus: int):
    from tfdist.plan import Cluster, Device, Link

    return Cluster(
        hosts=gpus // 8, devices_per_host=8,
        device=Device("h100 (96 GB)", {"bfloat16": 989e12}, 96e9, memory_bandwidth=2.4e12),
        intra=Link(3e-6, 450e9),  # NVLink 4: 900 GB/s both ways
        inter=Link(10e-6, 400e9 / 8),  # 400 Gb/s RDMA per GPU
        efficiency=0.4, tensor_exchange="group", name="Grand Teton",
    )  # fmt: skip


def torchtitan_training(shape: dict, batch: int):
    from tfdist.plan import ModelCost, Training

    cost = ModelCost.decoder("llama", **shape, sequence=TORCHTITAN_SEQ)
    return Training(
        cost, batch=batch, precision="bfloat16", activation_bytes=2, recompute=True
    )  # fmt: skip


def torchtitan_plans() -> dict:
    """The planner's ranking for each run (hybrids included), and at 405B the step of the
    layout torchtitan ran under 1F1B and interleaved 1F1B (v = 2)."""
    from tfdist.plan import ParallelLayout, estimate, plan

    out = {}
    for name, shape, gpus, batch in (("70B", LLAMA_70B, 256, 512), ("405B", LLAMA_405B, 512, 256)):
        cluster = torchtitan_cluster(gpus)
        out[name] = cluster, plan(torchtitan_training(shape, batch), cluster, hybrid=True)
    cluster = torchtitan_cluster(512)
    training = torchtitan_training(LLAMA_405B, 256)
    ran = ParallelLayout(data=8, stages=8, micro_batches=8, tensor=8, zero=3)
    interleaved = dataclasses.replace(ran, chunks=2, schedule="interleaved")
    out["schedules"] = [estimate(x, training, cluster) for x in (ran, interleaved)]
    return out


def print_torchtitan() -> None:
    plans = torchtitan_plans()
    for name, ran in (("70B", "tensor 8 x zero3 x data 32"),
                      ("405B", "pipeline 8 M=8 x tensor 8 x zero3 x data 8")):  # fmt: skip
        cluster, estimates = plans[name]
        print(f"Llama 3.1 {name} on {cluster.devices} H100s: the planner's first 5 of "
              f"{len(estimates)} layouts (torchtitan ran {ran})")  # fmt: skip
        print(f"  {'layout':48s} {'GiB':>6s} {'step s':>7s} {'bubble s':>8s}")
        names = [e.layout.name for e in estimates]
        for e in estimates[:5]:
            print(f"  {e.layout.name:48s} {e.memory / GIB:6.1f} {e.step:7.2f} {e.bubble:8.2f}")
        if ran in names:
            e = estimates[names.index(ran)]
            print(f"  torchtitan's, ranked {names.index(ran) + 1}: {e.memory / GIB:.1f} GiB, "
                  f"{e.step:.2f} s a step ({e.step / estimates[0].step:.2f}x the first)")  # fmt: skip
    one, interleaved = plans["schedules"]
    print(
        f"405B as torchtitan ran it: 1F1B {one.step:.2f} s a step ({one.memory / GIB:.1f} GiB), "
        f"interleaved v=2 {interleaved.step:.2f} s ({interleaved.memory / GIB:.1f} GiB): "
        f"{one.step / interleaved.step:.3f}x; torchtitan measured "
        f"{TORCHTITAN_INTERLEAVED_SPEEDUP:.2f}x (82.5 and 72.7 GiB)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.plan_published", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--tables", default="horovod,megatron,torchtitan")
    args = parser.parse_args(argv)
    if "torchtitan" in args.tables:
        print_torchtitan()
        print()
    rows = []
    if "horovod" in args.tables:
        rows += horovod_rows(overlap=True)
        rows += horovod_rows(overlap=False)
    if "megatron" in args.tables:
        rows += megatron_rows()
    print(
        f"{'source':17s} {'model':12s} {'GPUs':>5s} {'published':>9s} {'predicted':>9s} "
        f"{'points':>6s} {'compute ms':>10s} {'exchange ms':>11s}"
    )
    for r in rows:
        print(
            f"{r.source:17s} {r.model:12s} {r.devices:5d} {r.published:9.1%} {r.predicted:9.1%} "
            f"{100 * (r.predicted - r.published):+6.1f} {r.compute_ms:10.1f} {r.exchange_ms:11.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

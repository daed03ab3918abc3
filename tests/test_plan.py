"""The planner (tfdist.plan): its arithmetic against hand-computed cases (the ring, the
bubble, the ZeRO formulas, a pipeline's and a tensor layout's bytes), its FLOP count
against the layers' formulas, the cluster file, the console script on a keras-hub causal
LM for 2 hosts x 8 GPUs, and its bytes per device against what each device holds during
tfdist.fit (tfdist.DeviceBytes) for every layout that runs here.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import keras
import pytest

from tfdist.plan import (
    Cluster,
    Device,
    Link,
    ModelCost,
    ParallelLayout,
    PlanError,
    Training,
    Unit,
    costs,
    estimate,
    hybrid_layouts,
    layouts_for,
)
from tfdist.plan.cli import main as plan_main

pytestmark = pytest.mark.fast

MIB = 2**20


def cluster(hosts=1, per_host=4, **kw) -> Cluster:
    fields = dict(
        hosts=hosts, devices_per_host=per_host,
        device=Device("test", {"float32": 1e12}, 80 * 2**30, memory_bandwidth=1e12),
        intra=Link(1e-6, 1e9), inter=Link(1e-5, 1e8), efficiency=1.0,
    )  # fmt: skip
    fields.update(kw)
    return Cluster(**fields)


def four_units(slots: int = 2) -> ModelCost:
    """Four equal layers of 1 MiB of weights, 1 GFLOP and 1 MiB of activations each."""
    units = [Unit(f"u{i}", MIB // 4, MIB, 1e9, MIB, 4096.0) for i in range(4)]
    return ModelCost("four", units, 4 * MIB // 4, 4 * MIB, slots_per_param=slots)


# --- arithmetic ---------------------------------------------------------------------------------


def test_the_ring_collectives_follow_their_formulas():
    link = Link(1e-6, 1e3)  # 1 us, 1 kB/s
    assert costs.all_reduce(1000, 4, link) == pytest.approx(2 * 3 * 1e-6 + 2 * 3 / 4 * 1.0)
    assert costs.reduce_scatter(1000, 4, link) == pytest.approx(3e-6 + 0.75)
    assert costs.all_gather(1000, 4, link) == pytest.approx(3e-6 + 0.75)
    assert costs.point_to_point(1000, link) == pytest.approx(1e-6 + 1.0)
    assert costs.all_reduce(1000, 1, link) == 0.0
    # The bandwidth term tends to 2x the bytes as the ring grows: 2(N-1)/N.
    assert costs.all_reduce(1000, 512, Link(0.0, 1e3)) == pytest.approx(2 * 511 / 512)


def test_the_bubble_is_s_minus_1_over_m_plus_s_minus_1():
    assert costs.bubble(4, 8) == pytest.approx(3 / 11)
    assert costs.bubble(2, 1) == pytest.approx(1 / 2)
    assert costs.bubble(4, 8, chunks=2) == pytest.approx(3 / 19)


@pytest.mark.parametrize(
    ("zero", "weights", "grads", "optimizer"),
    [
        (0, 4, 4, 8),  # W, G, 2W (Adam)
        (1, 4, 4, (8 + 4) / 4),  # slots and the slice's weights over D = 4
        (2, 4, 4, (8 + 4) / 4),  # the whole gradients, before they are reduce-scattered
        (3, 1, 1, 2),
    ],
)
def test_the_zero_stages_hold_their_share(zero, weights, grads, optimizer):
    e = estimate(ParallelLayout(data=4, zero=zero), Training(four_units(), batch=16), cluster())
    assert e.weights == pytest.approx(weights * MIB)
    assert e.gradients == pytest.approx(grads * MIB)
    assert e.optimizer == pytest.approx(optimizer * MIB)
    assert e.activations == pytest.approx(16 * MIB)  # 4 examples x 4 layers x 1 MiB


def test_data_parallel_time_is_compute_update_and_one_ring_all_reduce():
    c = cluster()
    e = estimate(ParallelLayout(data=4), Training(four_units(), batch=16), c)
    compute = 4 * 3 * 4e9 / 1e12  # 4 examples x 3 passes x 4 GFLOP at 1 TFLOP/s
    update = 4 * MIB * (3 + 2 * 2) / 1e12
    assert e.compute == pytest.approx(compute + update)
    assert e.exchange == pytest.approx(2 * 3 * 1e-6 + 1.5 * 4 * MIB / 1e9)
    assert e.bubble == 0.0
    # Across hosts the ring takes the slower link.
    two_hosts = estimate(ParallelLayout(data=8), Training(four_units(), batch=32), cluster(2, 4))
    assert two_hosts.exchange == pytest.approx(2 * 7 * 1e-5 + 2 * 7 / 8 * 4 * MIB / 1e8)


def test_a_pipeline_holds_its_stage_and_its_schedules_micro_batches():
    training = Training(four_units(), batch=16)
    one_f_one_b = estimate(ParallelLayout(stages=4, micro_batches=8), training, cluster())
    assert one_f_one_b.weights == pytest.approx(MIB)  # one layer a stage
    assert one_f_one_b.optimizer == pytest.approx(2 * MIB)
    micro = 16 / 8
    assert one_f_one_b.activations == pytest.approx(MIB * micro * 4)  # stage 0: S in flight
    gpipe = estimate(
        ParallelLayout(stages=4, micro_batches=8, schedule="gpipe"), training, cluster()
    )
    assert gpipe.activations == pytest.approx(MIB * micro * 8)  # all M
    # The idle time is the bubble's share of the (M + S - 1) slots.
    slot = 3 * 1e9 * micro / 1e12 + 2 * (1e-6 + 4096 * micro / 1e9)
    update = MIB * 7 / 1e12
    assert one_f_one_b.compute == pytest.approx(8 * 3 * 1e9 * micro / 1e12 + update)
    assert one_f_one_b.compute + one_f_one_b.bubble == pytest.approx(11 * slot + update)


def test_stages_are_cut_where_their_flops_are_nearest_equal():
    """Eight equal layers and a small head over 4 stages: two layers a stage (the head
    with the last), not three on the first."""
    units = [Unit(f"u{i}", 1, 4, 1e9) for i in range(8)] + [Unit("head", 1, 4, 1e7)]
    groups = costs.stage_units(units, 4)
    assert [[u.name for u in g] for g in groups] == [
        ["u0", "u1"], ["u2", "u3"], ["u4", "u5"], ["u6", "u7", "head"],
    ]  # fmt: skip
    # Every stage gets a unit, however uneven: one large layer and three small ones.
    uneven = [Unit("big", forward_flops=1e12)] + [
        Unit(f"s{i}", forward_flops=1.0) for i in range(3)
    ]
    assert [len(g) for g in costs.stage_units(uneven, 4)] == [1, 1, 1, 1]
    # Units of no FLOPs (a position embedding, an add) stay with the stage before them.
    lm = [Unit("tokens", forward_flops=4e9), Unit("positions"), Unit("add")]
    lm += [Unit(f"block{i}", forward_flops=1e9) for i in range(8)]
    names = [[u.name for u in g] for g in costs.stage_units(lm, 2)]
    assert names[0][:3] == ["tokens", "positions", "add"] and len(names[1]) == 6


def test_the_tensor_exchange_counts_every_gather_tfdist_s_layers_run():
    """tfdist's split block over all N = T replicas: forward the batch sizes, the examples
    and the partial sums gathered; backward the two gathers' gradients all-reduced. The
    all-gather takes the link's own gather figures where it has them."""
    cost = four_units()
    cost.split_bytes, cost.tensor_blocks = 3 * MIB, 1  # 1 MiB stays whole
    link = Link(1e-6, 1e9, gathers=Link(1e-5, 1e8))
    c = cluster(intra=link, inter=link)
    e = estimate(ParallelLayout(tensor=4), Training(cost, batch=16), c)
    width = cost.block_activation_bytes  # 4096 per example
    inputs, partials = width * 4 * 4, width * 16 * 4  # every replica's 4, its group's 16
    gather = lambda nbytes: 3 * 1e-5 + 0.75 * nbytes / 1e8  # noqa: E731
    reduce = lambda nbytes: 6 * 1e-6 + 1.5 * nbytes / 1e9  # noqa: E731
    forward = gather(4 * 4) + gather(inputs) + gather(partials)
    replicated = reduce(MIB)  # the whole weights' gradients, over all 4
    assert e.exchange == pytest.approx(forward + reduce(inputs) + reduce(partials) + replicated)


def test_a_tensor_layout_divides_the_split_weights():
    cost = four_units()
    cost.split_bytes, cost.tensor_blocks = 2 * MIB, 1
    e = estimate(ParallelLayout(tensor=4), Training(cost, batch=16), cluster())
    assert e.weights == pytest.approx(2 * MIB / 4 + 2 * MIB)


def test_the_layouts_are_those_tfdist_runs_on_the_devices():
    names = [layout.name for layout in layouts_for(8, 64, units=10)]
    assert names[:4] == ["data 8", "zero1 x data 8", "zero2 x data 8", "zero3 x data 8"]
    assert "pipeline 2 M=8 x data 4" in names and "pipeline 8 M=32" in names
    assert "tensor 2 x data 4" in names and "tensor 8" in names
    assert all(layout.devices == 8 for layout in layouts_for(8, 64, units=10))


def test_bad_clusters_get_one_clear_message(tmp_path):
    with pytest.raises(PlanError, match="hosts must be a whole number >= 1"):
        cluster(hosts=0)
    path = tmp_path / "c.toml"
    path.write_text('hosts = 2\ndevice = "h100"\nintra_gbps = 3600\nbandwidth = 1\n')
    with pytest.raises(PlanError, match="Received: bandwidth"):
        Cluster.from_file(path)
    path.write_text('device = "tpu9"\nintra_gbps = 100\n')
    with pytest.raises(PlanError, match="device 'tpu9' is not one the planner knows"):
        Cluster.from_file(path)
    path.write_text('device = "h100"\nintra_gbps = 100\ninter_gbps = -1\n')
    with pytest.raises(PlanError, match=r"inter_gbps must be > 0. Received: inter_gbps=-1"):
        Cluster.from_file(path)
    path.write_text('device = "h100"\nintra_gbps = 100\nintra_latency_us = "fast"\n')
    with pytest.raises(PlanError, match="intra_latency_us must be a number"):
        Cluster.from_file(path)
    with pytest.raises(PlanError, match="global batch must be a whole number >= 1"):
        Training(four_units(), batch=0)
    path.write_text('name = "2 x DGX"\nhosts = 2\ndevices_per_host = 8\ndevice = "h100"\n'
                    "intra_gbps = 3600\ninter_gbps = 400\nefficiency = 0.5\n")  # fmt: skip
    read = Cluster.from_file(path)
    assert (read.devices, read.inter.bandwidth, read.efficiency) == (16, 50e9, 0.5)


# --- counting a model ---------------------------------------------------------------------------


def test_flops_and_parameters_are_counted_from_the_layers():
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    x = keras.layers.Flatten(name="flat")(x)
    outputs = keras.layers.Dense(10, name="dense")(x)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    cost = ModelCost.of(model)
    by = {u.name: u for u in cost.units}
    assert by["conv"].forward_flops == 2 * 8 * 8 * 3 * 3 * 3 * 4
    assert by["dense"].forward_flops == 2 * 256 * 10
    assert by["conv"].params == 3 * 3 * 3 * 4 + 4 and by["dense"].params == 256 * 10 + 10
    assert by["conv"].output_bytes == 8 * 8 * 4 * 4
    assert cost.slots_per_param == 1  # SGD with momentum
    model.compile("adam", "mse")
    assert ModelCost.of(model).slots_per_param == 2


def test_attention_counts_its_products_and_its_scores():
    inputs = keras.Input((16, 32))
    outputs = keras.layers.MultiHeadAttention(4, 8, name="attention")(inputs, inputs)
    cost = ModelCost.of(keras.Model(inputs, outputs))
    projections = 4 * 2 * 16 * 32 * 32  # Q, K, V, O: 16 tokens, 32 -> 4 heads x 8
    scores = 2 * 2 * 16 * 16 * 32  # QK^T and its weighted sum of V
    assert cost.forward_flops == projections + scores
    assert cost.tensor_blocks == 1


# --- layouts that combine axes ------------------------------------------------------------------


def split_units() -> ModelCost:
    """four_units, every weight of which tensor parallelism splits (8 blocks)."""
    return dataclasses.replace(four_units(), split_bytes=4 * MIB, tensor_blocks=8)


def test_hybrid_layouts_keep_each_tensor_group_within_a_host():
    found = hybrid_layouts(16, 64, units=10, devices_per_host=8)
    assert found and all(x.devices == 16 for x in found)
    assert all(8 % x.tensor == 0 for x in found)
    names = {x.name for x in found}
    assert "pipeline 2 M=4 x tensor 2 x zero3 x data 4" in names
    assert "pipeline 2 M=4 v=2 x tensor 2 x zero3 x data 4" in names
    assert "tensor 8 x zero3 x data 2" in names
    pipeline_tensor = ParallelLayout(data=2, stages=2, micro_batches=2, tensor=2)
    assert pipeline_tensor.built(hosts=1)
    # Over 2 hosts each holds a stage of both pipelines (whole stages); over 4, one
    # pipeline's replica of a stage (not built with tensor groups).
    assert pipeline_tensor.built(hosts=2)
    assert not pipeline_tensor.built(hosts=4)
    assert dataclasses.replace(pipeline_tensor, zero=3).built(hosts=1)  # all three
    interleaved = dataclasses.replace(pipeline_tensor, chunks=2, schedule="interleaved")
    assert interleaved.built(hosts=1)  # tensor-parallel stages interleaved
    assert not interleaved.built(hosts=2)
    assert ParallelLayout(data=2, tensor=2, zero=3).built(hosts=1)
    assert ParallelLayout(data=2, tensor=2, zero=3).built(hosts=2)  # a tensor group a host
    assert not ParallelLayout(data=4, tensor=2, zero=3).built(hosts=2)  # two a host
    assert ParallelLayout(data=2, stages=2, micro_batches=2, zero=3).built(hosts=2)


def test_a_hybrid_layout_holds_its_share_and_interleaving_halves_its_bubble():
    """2 stages x 2 tensor x 2 data under zero3: a device holds its stage's weights (half
    the model) / T / D, and Adam's two slots of that; two chunks a device halve the bubble
    (the sends of a slot aside)."""
    training = Training(split_units(), batch=32)
    layout = ParallelLayout(data=2, stages=2, micro_batches=4, tensor=2, zero=3)
    e = estimate(layout, training, cluster(per_host=8))
    assert e.weights == e.gradients == pytest.approx(2 * MIB / 2 / 2)
    assert e.optimizer == pytest.approx(2 * e.weights)
    interleaved = dataclasses.replace(layout, chunks=2, schedule="interleaved")
    v = estimate(interleaved, training, cluster(per_host=8))
    assert v.bubble == pytest.approx(e.bubble / 2, rel=0.05)
    unsharded = estimate(dataclasses.replace(layout, zero=0), training, cluster(per_host=8))
    assert unsharded.weights == pytest.approx(2 * MIB / 2)


def test_the_hybrid_arithmetic_on_one_axis_is_the_single_axis_arithmetic():
    """_hybrid, given a layout of one axis, predicts what the pipeline's and the tensor
    layout's own arithmetic predict: the same bytes held and the step within 1% (its
    sends are counted per slot)."""
    training = Training(split_units(), batch=64, recompute=True)
    c = cluster(per_host=8)
    for layout in (
        ParallelLayout(data=2, stages=4, micro_batches=8),
        ParallelLayout(data=2, tensor=4),
    ):
        single = estimate(layout, training, c)
        link = c.link(layout.data, stride=layout.tensor * layout.stages)
        hybrid = costs._hybrid(layout, training, c, 1e12, link)
        for field in ("weights", "gradients", "optimizer", "activations"):
            assert getattr(hybrid, field) == pytest.approx(getattr(single, field)), (layout, field)
        assert hybrid.step == pytest.approx(single.step, rel=0.01), layout


def test_the_planner_prints_the_calls_that_train_its_choice():
    """What to paste: the stages' cut points (where the FLOPs balance), the tensor degree
    and the ZeRO stage."""
    layout = ParallelLayout(data=2, stages=2, micro_batches=4, zero=3)
    assert costs.recipe(layout, four_units()).splitlines() == [
        "# a strategy of 4 replica(s): tfdist.build_strategy(...)",
        "# the model built and compiled under tfdist.host_scope(strategy): no device holds it "
        "whole",
        "tfdist.fit(model, dataset, pipeline=tfdist.parallel.Pipeline(cut_before=['u2'], "
        "micro_batches=4), shard_optimizer='zero3')",
    ]
    interleaved = ParallelLayout(
        data=1, stages=2, micro_batches=4, chunks=2, schedule="interleaved"
    )
    assert "cut_before=['u1', 'u2', 'u3'], micro_batches=4, schedule='interleaved', " \
        "chunks_per_device=2" in costs.recipe(interleaved, four_units())  # fmt: skip
    assert costs.recipe(ParallelLayout(data=2, tensor=2), four_units()).splitlines()[2:4] == [
        'mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)',
        "tfdist.parallel.tensor_parallel(model, "
        "layout_map=tfdist.parallel.derive_layout_map(model, mesh))",
    ]


# --- against published runs ----------------------------------------------------------------------


@pytest.mark.slow  # builds and traces keras-hub's Llama in this process
def test_a_decoder_counted_from_its_shapes_is_the_traced_decoder():
    """ModelCost.decoder (for a model too big to build) against ModelCost.of on keras-hub's
    Llama of the same shapes: the same parameters, layer by layer; FLOPs within 1% (the
    traced count has a few small products more); the split weights within 2%."""
    from tools import keras_hub_models

    traced = ModelCost.of(keras_hub_models.llama_causal_lm(), example=[(64,), (64,)])
    shaped = ModelCost.decoder(
        "llama", layers=2, hidden=16, ffn=32, heads=4, kv_heads=1,
        vocab=keras_hub_models.VOCAB, sequence=64,
    )  # fmt: skip
    assert shaped.params == traced.params
    assert [u.params for u in shaped.units[1:-1]] == [u.params for u in traced.units[1:-1]]
    assert shaped.forward_flops == pytest.approx(traced.forward_flops, rel=0.01)
    assert shaped.split_bytes == pytest.approx(traced.split_bytes, rel=0.02)


def test_the_planner_ranks_torchtitans_layouts_for_llama_3_on_h100s():
    """torchtitan trained Llama 3.1 70B on 256 H100s as 2D (FSDP x TP) and 405B on 512 as
    3D (PP x FSDP x TP), where interleaved 1F1B ran 1.28x as fast as 1F1B
    (tools/plan_published.py has the figures and their source)."""
    from tools import plan_published

    plans = plan_published.torchtitan_plans()
    cluster_70b, ranked = plans["70B"]
    first = ranked[0].layout
    assert (first.stages, first.zero) == (1, 3) and first.tensor > 1 and first.data > 1, first
    assert ranked[0].fits(cluster_70b)
    cluster_405b, ranked = plans["405B"]
    first = ranked[0].layout
    assert first.stages > 1 and first.tensor > 1 and first.data > 1, first
    assert ranked[0].fits(cluster_405b)
    one, interleaved = plans["schedules"]
    assert one.fits(cluster_405b) and interleaved.fits(cluster_405b)  # as torchtitan ran them
    speedup = one.step / interleaved.step
    assert speedup == pytest.approx(plan_published.TORCHTITAN_INTERLEAVED_SPEEDUP, rel=0.10)


# --- the console script -------------------------------------------------------------------------


def test_tfdist_plan_ranks_a_keras_hub_causal_lm_on_two_hosts_of_eight(capsys):
    code = plan_main([
        "--model", "tools.keras_hub_models:llama_causal_lm", "--batch", "64",
        "--example", "64", "--example", "64", "--precision", "bfloat16",
        "--hosts", "2", "--devices_per_host", "8", "--device", "h100",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert "2 host(s) x 8 h100" in lines[0]
    rows = [line for line in lines if line[:4].strip().isdigit()]
    assert rows and rows[0].split()[0] == "1"
    assert any("pipeline" in r for r in rows)
    # A tensor group stays within a host: over 2 hosts of 8, one group of 8 a host.
    assert all("tensor 8 x data 2" in r for r in rows if "tensor" in r)
    assert any("zero3 x data 16" in r for r in rows)
    steps = [float(r.split()[-6]) for r in rows]
    assert steps == sorted(steps)  # ranked fastest first


def test_a_model_too_small_to_split_is_planned_on_one_device(capsys):
    """Every split costs a tiny model more in exchange than it saves: one device ranks
    first and the verdict says so, naming the fastest split and its ratio."""
    code = plan_main(["--model", "tests.test_plan:tiny", "--batch", "64",
                      "--hosts", "1", "--devices_per_host", "4", "--device", "h100"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert rows[0].split()[1:3] == ["one", "device"], rows[0]
    assert float(rows[0].split()[-6]) > 0  # its step shows, not 0.0
    verdict = next(line for line in out.splitlines() if line.startswith("Best: "))
    assert verdict.startswith("Best: one device. The fastest layout of several devices, ")
    assert "x data 4" in verdict


def test_a_model_that_gains_from_devices_is_not_planned_on_one():
    cost = four_units()
    estimates = costs.plan(Training(cost, batch=64), cluster())
    assert "one device" in [e.layout.name for e in estimates]
    best = estimates[0]
    assert best.layout.devices == 4 and best.speedup > 1
    assert costs.best_choice(estimates, cluster()) == (
        f"Best: {best.layout.name}, {best.speedup:.1f}x one device's step."
    )


def test_tfdist_plan_hybrid_marks_the_layouts_tfdist_does_not_train_yet(capsys):
    code = plan_main(["--model", "tests.test_plan:tiny", "--batch", "64", "--hybrid",
                      "--hosts", "2", "--devices_per_host", "4", "--device", "h100"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert any("tensor 2 x data 4 *" in line for line in out.splitlines()), out
    # tensor 2 x data 4 over 2 hosts of 4: two tensor groups a host, not built; tensor 4 x
    # data 2 is one a host, built.
    assert "* not trained by tfdist yet: in a job of several hosts, the interleaved" in out
    built = [line for line in out.splitlines() if "  tensor 4 x data 2 " in line]
    assert built and "*" not in built[0], out
    # A batch large enough to gain from the 8 devices: the calls that train the best, to paste
    code = plan_main(["--model", "tests.test_plan:tiny", "--batch", str(2**22), "--top", "3",
                      "--hybrid", "--hosts", "2", "--devices_per_host", "4", "--device", "h100"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    paste = out.split("To train it:\n")[1].splitlines()
    assert paste[0] == "    # a strategy of 8 replica(s): tfdist.build_strategy(...)", out
    assert paste[1].startswith("    tfdist.fit(model, dataset"), out


def tiny() -> keras.Model:
    model = keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10),
    ])  # fmt: skip
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


@pytest.mark.slow  # builds and traces models in this process
def test_an_uncompiled_model_needs_optimizer_to_be_planned(capsys):
    """Its optimizer's state cannot be counted: one line says so; --optimizer plans it."""
    flags = ["--model", "tests.test_plan:uncompiled", "--batch", "8", "--top", "1"]
    assert plan_main(flags) == 2
    assert "is not compiled, so its optimizer's state is unknown" in capsys.readouterr().err
    assert plan_main([*flags, "--optimizer", "momentum"]) == 0
    assert "optimizer state 1 x the weights" in capsys.readouterr().out


def uncompiled() -> keras.Model:
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])


def test_tfdist_plan_says_what_was_wrong_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.plan.cli", "--model", "no_such_module:build",
         "--batch", "8"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("tfdist-plan: error: --model")
    assert "Traceback" not in result.stderr

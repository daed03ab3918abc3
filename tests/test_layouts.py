"""Layouts that compose: a tensor-parallel layout with its parts sharded (ZeRO) over their
data groups, against Keras's own fit on one device, with the bytes each device holds.

Over a mirrored strategy on 4 logical CPUs: 2-way tensor x 2-way data. A 5-Dense MLP split
by a layout map written as for Keras on JAX, and a keras.io transformer classifier (an embedding
table, attention, an MLP block), trained with Adam by tfdist.fit, called twice as users do.
"""

from __future__ import annotations

import gc
import json
import re
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import run_module
from tfdist.errors import FitError
from tfdist.parallel import TensorParallelError, tensor_parallel
from tfdist.parallel.tensor.layout_map import plan_of

TOLERANCE = 1e-5
FEATURES, CLASSES = 16, 4


def mlp(width: int = 64, learning_rate: float = 0.01) -> keras.Model:
    """Five Dense layers: two widen-then-narrow blocks (to `width`) and a head, each with a
    bias; Adam at `learning_rate`."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((FEATURES,))
    x = inputs
    for block in range(2):
        x = keras.layers.Dense(width, activation="relu", name=f"up{block}")(x)
        x = keras.layers.Dense(FEATURES, name=f"down{block}")(x)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(x))
    model.compile(
        keras.optimizers.Adam(learning_rate),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data() -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, FEATURES)).astype("float32")
    y = (np.abs(x[:, :CLASSES]).argmax(axis=1)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(32)


def mesh():
    devices = [f"cpu:{i}" for i in range(4)]
    return keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)


def mlp_layout():
    """The MLP's map as a user writes one for Keras: Megatron's split, each widening layer
    by its outputs (a column), each narrowing one by its inputs (a row); the head whole."""
    layout = keras.distribution.LayoutMap(mesh())
    layout["up.*/kernel"] = (None, "model")
    layout["down.*/kernel"] = ("model", None)
    return layout


def mirrored():
    return tfdist.build_strategy("mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(4)])


def _split_mlp() -> tuple[keras.Model, tfdist.DeviceBytes]:
    """The MLP built in host_scope over 4 devices and split by its layout map, and a record
    of each device's bytes made before it (the model's own count)."""
    strategy = mirrored()
    gc.collect()
    record = tfdist.DeviceBytes()
    with tfdist.host_scope(strategy):
        model = mlp()
    tensor_parallel(model, layout_map=mlp_layout())
    return model, record


def _saves_as(reference: keras.Model, model: keras.Model, tmp_path) -> None:
    """model.save writes the whole weights and the optimizer's whole slots: loaded by Keras
    alone, they equal the reference's (Keras's own fit on one device)."""
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    for want, have in zip(reference.get_weights(), loaded.get_weights(), strict=True):
        assert np.max(np.abs(want - have)) <= TOLERANCE
    slots = zip(reference.optimizer.variables, loaded.optimizer.variables, strict=True)
    for want, have in slots:
        assert want.path.split("/", 1)[1] == have.path.split("/", 1)[1]  # "adam_3/..."
        np.testing.assert_allclose(have.numpy(), want.numpy(), rtol=1e-4, atol=1e-7)


@pytest.fixture(scope="module")
def mlp_reference():
    """Keras's own fit of the MLP on one device, 2 epochs."""
    model = mlp()
    history = model.fit(data(), epochs=2, verbose=0, shuffle=False)
    return model, history.history["loss"]


@pytest.mark.xdist_group("layouts_mlp")  # mlp_reference's fit runs once
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_zero_x_tensor_trains_as_keras_on_one_device_holding_its_share(
    stage, mlp_reference, tmp_path, caplog
):
    """2-way tensor x 2-way data, each part's optimizer state (zero1, zero2) or the part
    itself too (zero3) sharded over the replicas that hold it: 2 for a split weight's part,
    all 4 for a weight held whole. fit twice, an epoch each. Each device (CPU:1-3; CPU:0 is
    also the host) holds a quarter of every weight as its slice, with Adam's two slots for
    it; under zero1 and zero2 its parts whole too (what its step reads). model.save writes
    the whole weights and Adam's whole slots, put together from the slices."""
    reference, losses = mlp_reference
    model, record = _split_mlp()
    plan = plan_of(model)
    with caplog.at_level("DEBUG", logger="tfdist"):  # verbose=0: fit's lines are debug
        got = [
            tfdist.fit(model, data(), verbose=0, shard_optimizer=stage, callbacks=[record])
            for _ in range(2)
        ]
    # The layout in one line, in the planner's form.
    line = f"(mirrored); trained as tensor 2 x {stage} x data 2 over 4 devices in 1 process"
    assert line in caplog.text
    assert [h.history["loss"][0] for h in got] == pytest.approx(losses, abs=1e-5)
    weights = zip(reference.weights, reference.get_weights(), model.get_weights(), strict=True)
    for v, want, have in weights:
        assert np.max(np.abs(want - have)) <= TOLERANCE, v.path

    split, whole = plan.split_bytes(model)
    assert split / (split + whole) > 0.9  # the blocks' kernels: most of the model
    sliced = 3 * (split + whole) / 4  # its slice of each weight and the slice's 2 slots
    share = sliced if stage == "zero3" else sliced + split / 2 + whole
    for device in (1, 2, 3):
        held = record.added[f"CPU:{device}"]
        assert held == pytest.approx(share, rel=0.03), (device, held / share)

    _saves_as(reference, model, tmp_path)

    # Another sharding would start Adam's state afresh: refused, as zero's own modes are.
    other = None if stage == "zero3" else "zero3"
    with pytest.raises(FitError, match=r"held by its tensor-parallel update .* Fit it again"):
        tfdist.fit(model, data(), verbose=0, shard_optimizer=other)


# --- a pipeline's stages sharded over its pipelines --------------------------------------------


def _stage_bytes(model: keras.Model, prefixes: tuple[str, ...]) -> int:
    return sum(
        int(np.prod(v.shape)) * 4
        for v in model.trainable_variables
        if v.path.split("/")[0].startswith(prefixes)
    )


@pytest.mark.xdist_group("layouts_mlp")  # mlp_reference's fit runs once
@pytest.mark.parametrize("first, then", [("zero1", "zero3"), ("zero2", "zero1"), ("zero3", None)])
def test_pipeline_x_zero_trains_as_keras_on_one_device_holding_its_share(
    first, then, mlp_reference, tmp_path, caplog
):
    """2 stages x 2 pipelines on 4 devices, each stage's optimizer state (zero1, zero2: its
    summed gradients too) or its weights too (zero3) in flat halves over its 2 replicas.
    An epoch with `first`, then one with `then`: the state moves between the shardings and
    Adam goes on as Keras's. Each stage replica holds its stage's share: half of each weight
    with Adam's two slots for it, and under zero1 and zero2 the whole weights its passes
    read. model.save writes the whole
    weights and Adam's whole slots."""
    reference, losses = mlp_reference
    strategy = mirrored()
    pipeline = tfdist.parallel.Pipeline(cut_before=["up1"], micro_batches=2)
    gc.collect()
    record = tfdist.DeviceBytes()
    with pipeline.scope(strategy):
        model = mlp()
    with caplog.at_level("DEBUG", logger="tfdist"):  # verbose=0: fit's lines are debug
        got = tfdist.fit(model, data(), verbose=0, pipeline=pipeline, shard_optimizer=first,
                         callbacks=[record])  # fmt: skip
    assert f"shard_optimizer={first!r}: each stage's" in caplog.text
    assert (
        f"in 2 micro-batch(es) of 8 (1f1b, {first}; mirrored); trained as pipeline 2 M=2 x "
        f"{first} x data 2 over 4 devices in 1 process"
    ) in caplog.text
    again = tfdist.fit(model, data(), verbose=0, pipeline=pipeline, shard_optimizer=then)
    assert [got.history["loss"][0], again.history["loss"][0]] == pytest.approx(losses, abs=1e-5)
    weights = zip(reference.weights, reference.get_weights(), model.get_weights(), strict=True)
    for v, want, have in weights:
        assert np.max(np.abs(want - have)) <= TOLERANCE, v.path

    # Stage 0 (up0, down0) on CPU:0 and CPU:2, stage 1 (up1, down1, head) on CPU:1 and 3.
    whole = {2: _stage_bytes(model, ("up0", "down0")),
             1: _stage_bytes(model, ("up1", "down1", "head"))}  # fmt: skip
    whole[3] = whole[1]
    for device, weights_bytes in whole.items():
        # Half of each weight (zero3: all it keeps; zero1, zero2: the slice it updates,
        # beside the whole weights) and Adam's two slots for that half.
        share = 1.5 * weights_bytes if first == "zero3" else 2.5 * weights_bytes
        held = record.added[f"CPU:{device}"]
        assert held == pytest.approx(share, rel=0.03), (device, held / share)

    _saves_as(reference, model, tmp_path)


# --- a pipeline's stages split by a layout (tensor parallelism inside stages) ----------------


@pytest.mark.xdist_group("layouts_mlp")  # mlp_reference's fit runs once
def test_pipeline_x_tensor_trains_as_keras_on_one_device_holding_its_share(
    mlp_reference, tmp_path, caplog
):
    """2 stages x 2-way tensor on 4 devices: each stage's layers split by the layout map over
    its 2 devices (a column layer's outputs, a row layer's inputs), the cut between the
    blocks; fit twice, an epoch each (Adam goes on), under 1F1B then GPipe. Each device
    holds its part of each split weight of its stage and the rest of its stage whole, with
    Adam's two slots for them; model.save writes the whole weights and Adam's whole slots,
    put together from the parts."""
    reference, losses = mlp_reference
    model, record = _split_mlp()
    got = []
    with caplog.at_level("DEBUG", logger="tfdist"):  # verbose=0: fit's lines are debug
        for schedule in ("1f1b", "gpipe"):
            pipeline = tfdist.parallel.Pipeline(
                cut_before=["up1"], micro_batches=2, schedule=schedule
            )
            got.append(tfdist.fit(model, data(), verbose=0, pipeline=pipeline,
                                  callbacks=[record]))  # fmt: skip
            assert (
                "each of 2 stages over 4 device(s) (2 a stage, its layers split) in 2 "
                f"micro-batch(es) of 16 ({schedule}; mirrored); trained as pipeline 2 M=2 x "
                "tensor 2 over 4 devices in 1 process"
            ) in caplog.text
    assert [h.history["loss"][0] for h in got] == pytest.approx(losses, abs=1e-5)
    weights = zip(reference.weights, reference.get_weights(), model.get_weights(), strict=True)
    for v, want, have in weights:
        assert np.max(np.abs(want - have)) <= TOLERANCE, v.path

    # Stage 0 (up0, down0) on CPU:0 and CPU:1, stage 1 (up1, down1, head) on CPU:2 and 3
    # (CPU:0 is also the host). A member: its half of each split weight, the rest whole.
    stage = _member_bytes()
    for device, weights_bytes in ((1, stage[0]), (2, stage[1]), (3, stage[1])):
        held = record.added[f"CPU:{device}"]
        assert held == pytest.approx(3 * weights_bytes, rel=0.03), (device, held / weights_bytes)

    _saves_as(reference, model, tmp_path)


@pytest.mark.xdist_group("layouts_mlp")  # mlp_reference's fit runs once
def test_pipeline_x_tensor_interleaved_then_zero_bubble_trains_as_keras_on_one_device(
    mlp_reference,
):
    """Tensor-parallel stages under the other schedules, an epoch each: interleaved (4
    stages, each 2-device group holding stages k and k + 2), then zero-bubble (2 stages,
    each member's backward in an input pass, then a weights' pass from the same tape).
    Keras's weights on one device within 1e-5."""
    reference, losses = mlp_reference
    model, _ = _split_mlp()
    pipelines = [
        tfdist.parallel.Pipeline(
            cut_before=["down0", "up1", "down1"], micro_batches=2, schedule="interleaved",
            chunks_per_device=2,
        ),
        tfdist.parallel.Pipeline(cut_before=["up1"], micro_batches=2, schedule="zero_bubble"),
    ]  # fmt: skip
    got = [tfdist.fit(model, data(), verbose=0, pipeline=p) for p in pipelines]
    assert [h.history["loss"][0] for h in got] == pytest.approx(losses, abs=1e-5)
    weights = zip(reference.weights, reference.get_weights(), model.get_weights(), strict=True)
    for v, want, have in weights:
        assert np.max(np.abs(want - have)) <= TOLERANCE, v.path


def _member_bytes(width: int = 64) -> dict[int, int]:
    """By stage of the MLP cut before up1 (0: up0, down0; 1: up1, down1, head): the bytes of
    its weights a member of a 2-way tensor group holds, its parts and the rest whole."""
    model = mlp(width)
    tensor_parallel(model, layout_map=mlp_layout())
    held = list(zip(model.trainable_variables, plan_of(model).placements, strict=True))

    def of(prefixes):
        return sum(int(np.prod(v.shape)) * 4 // p.parts for v, p in held
                   if v.path.split("/")[0].startswith(prefixes))  # fmt: skip

    return {0: of(("up0", "down0")), 1: of(("up1", "down1", "head"))}


@pytest.mark.multiprocess
@pytest.mark.xdist_group("layouts_mlp")  # mlp_reference's fit runs once
def test_pipeline_x_tensor_x_zero_trains_as_keras_on_one_device_holding_its_share(
    mlp_reference, tmp_path
):
    """All three on 8 devices (a process of its own: tests/workers/layouts_worker.py): 2
    stages x 2-way tensor x 2 pipelines, each member's parts sliced over the stage's
    pipelines, an epoch under zero3 then one under zero1 (Adam's state moves between the
    shardings). Keras's weights on one device within 1e-5; under zero3 each device holds
    its member's share of its stage halved: its slices of the parts and of the weights it
    holds whole, with Adam's two slots for them."""
    reference, losses = mlp_reference
    result = run_module("tests.workers.layouts_worker", str(tmp_path), "one_host", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    stage = _member_bytes()
    written = json.loads((tmp_path / "zero3.json").read_text())
    assert written["losses"] == pytest.approx(losses, abs=1e-5)
    for v, want, have in zip(reference.weights, reference.get_weights(),
                             written["weights"], strict=True):  # fmt: skip
        assert np.max(np.abs(want - np.asarray(have))) <= TOLERANCE, v.path
    for shard in ("zero3", "zero1"):
        assert any(
            f"trained as pipeline 2 M=2 x tensor 2 x {shard} x data 2 over 8 devices" in line
            for line in written["layout"]
        ), written["layout"]
    # Pipeline p's stage s on CPU:(4p + 2s) and the next (CPU:0 is also the host).
    for device in range(1, 8):
        share = 1.5 * stage[device % 4 // 2]
        held = written["bytes"][f"CPU:{device}"]
        assert held == pytest.approx(share, rel=0.03), (device, held / share)


@pytest.mark.xdist_group("layouts_mlp")  # mlp_reference's fit runs once
def test_the_planners_printed_calls_train_the_layout_they_name(mlp_reference, caplog):
    """What tfdist-plan prints under its verdict, run as printed (the fit twice): 2 stages
    x 2 pipelines under zero3, cut where the planner balances the MLP's FLOPs, trains as
    Keras's fit on one device. (A tensor split prints derive_layout_map, which finds no
    block in this MLP's top-level Dense layers to split, and says so: below.)"""
    from tfdist import plan

    reference, losses = mlp_reference
    layout = plan.ParallelLayout(data=2, stages=2, micro_batches=2, zero=3)
    printed = plan.recipe(layout, plan.ModelCost.of(mlp())).splitlines()
    assert "tfdist.host_scope(strategy)" in printed[1]
    with tfdist.host_scope(mirrored()):
        model = mlp()
    calls = {"tfdist": tfdist, "model": model, "dataset": data()}
    got = []
    with caplog.at_level("DEBUG", logger="tfdist"):  # verbose=0: fit's lines are debug
        for _ in range(2):
            exec(f"history = {printed[-1]}", calls)  # noqa: S102 - the planner's own line
            got.append(calls["history"].history["loss"][0])
    assert "cut_before=['up1'], micro_batches=2" in printed[-1]
    # fit names the layout in the words the planner named it in.
    assert f"trained as {layout.name} over 4 devices in 1 process" in caplog.text
    assert got == pytest.approx(losses, abs=1e-5)
    weights = zip(reference.weights, reference.get_weights(), model.get_weights(), strict=True)
    for v, want, have in weights:
        assert np.max(np.abs(want - have)) <= TOLERANCE, v.path
    # The tensor split's printed calls, on an MLP with no block to split: one clear line.
    tensor = plan.recipe(plan.ParallelLayout(data=2, tensor=2), plan.ModelCost.of(mlp()))
    calls.update(keras=keras, devices=[f"cpu:{i}" for i in range(4)])
    exec(tensor.splitlines()[2], calls)  # noqa: S102 - the planner's mesh line
    with pytest.raises(TensorParallelError, match="derive_layout_map found nothing in"):
        exec(tensor.splitlines()[3], calls)  # noqa: S102 - its tensor_parallel line


# --- checkpoints that move between layouts ----------------------------------------------------

# The MLP of the resharding tests: 2.1M weights (8.4 MB; with Adam's slots 25 MB), so that
# a process reading more than its part (half, for a stage of two) shows past a 4 MiB read.
# Adam at 1e-3: at 1e-2 so wide a model's loss grows to 37, where the rounding of its sums
# over replicas moves it 4e-4 from one device's.
WIDE = 32768
WIDE_RATE = 1e-3


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """A checkpoint of the wide MLP written under zero3 by 4 worker processes after an epoch
    (OUT/zero3), and its second epoch resumed from copies by 2 worker processes of 4
    devices each as 2 stages x 2-way tensor x 2 pipelines under zero3 (what each wrote:
    OUT/all_three_worker_<task>.json), and by 2 of 2 devices each as 2-way tensor x zero3
    (OUT/zero3_tensor_worker_<task>.json); with Keras's own 2 epochs on one device from
    that checkpoint. Returns (OUT, the reference model, its losses)."""
    import shutil

    out = tmp_path_factory.mktemp("resharded")
    for workers, mode, copy in ((4, "save", None), (2, "resume", "all_three"),
                                (2, "resume_tensor", "zero3_tensor")):  # fmt: skip
        if copy:
            shutil.copytree(out / "zero3", out / copy)
        result = run_module(
            "tools.launch", "--workers", str(workers), "--timeout", "400", "--",
            sys.executable, "-m", "tests.workers.layouts_worker", str(out), mode, str(WIDE),
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    reference = _keras_from(out / "zero3")
    history = reference.fit(data(), initial_epoch=1, epochs=2, verbose=0, shuffle=False)
    return out, reference, history.history["loss"]


def _keras_from(directory) -> keras.Model:
    """The wide MLP in plain Keras, its weights, Adam's slots and step count read from the
    checkpoint in `directory` by TensorFlow's own reader (the shards merged by the chief:
    each weight and slot flat, by its place among the model's weights): the reference a
    resume is held to, Keras's own fit on one device from that checkpoint. (Keras's fit
    from the start lands 1.3e-4 from a 4-process zero3 epoch on the wide first kernel:
    Adam amplifies the rounding of the processes' sums where the gradients are tiny.)"""
    from tfdist.training import shards

    merged = sorted(directory.rglob("ckpt-*.shards"))[-1] / "merged"
    reader = tf.train.load_checkpoint(str(merged))
    model = mlp(WIDE, WIDE_RATE)
    weights = model.trainable_variables
    model.optimizer.build(weights)
    for i, v in enumerate(weights):
        v.assign(reader.get_tensor(shards.weight_key(i)).reshape(v.shape))
    paths = {v.path.replace("/", "_"): i for i, v in enumerate(weights)}
    for slot in model.optimizer.variables:
        i = shards.weight_of_slot(slot.name, paths)
        if i is not None:
            name = slot.name[len(weights[i].path) + 1 :]  # "momentum", "velocity"
            saved = reader.get_tensor(shards.slot_key(i, name))
            slot.assign(saved.reshape(slot.shape))
    model.optimizer.iterations.assign(len(list(data())))  # the epoch's steps
    return model


def _read(lines: list[str]) -> tuple[float, float]:
    """(MB of slices, MB read) from a resume's 'Read this process's part' line."""
    found = [re.search(r": ([\d.]+) MB of slices .* ([\d.]+) MB read", x) for x in lines]
    found = [m for m in found if m]
    assert len(found) == 1, lines
    return float(found[0][1]), float(found[0][2])


def _resumed_as_keras(resharded, name: str, layout: str):
    """Yields (task, what it wrote, the checkpoint's bytes) for each process of the 2-process
    resume `name`, once its loss and weights are Keras's from that checkpoint on one device
    (1e-5) and the chief's log names `layout`."""
    out, reference, losses = resharded
    whole = 3 * sum(int(np.prod(v.shape)) * 4 for v in reference.trainable_variables)
    for task in (0, 1):
        written = json.loads((out / f"{name}_worker_{task}.json").read_text())
        assert written["losses"][-1] == pytest.approx(losses[-1], abs=1e-5)
        for v, want, have in zip(reference.weights, reference.get_weights(),
                                 written["weights"], strict=True):  # fmt: skip
            assert np.max(np.abs(want - np.asarray(have))) <= TOLERANCE, (task, v.path)
        assert task == 1 or any(f"trained as {layout}" in line for line in written["lines"]), (
            written["lines"]
        )
        yield task, written, whole


@pytest.mark.multiprocess
@pytest.mark.xdist_group("layouts_resharded")
def test_a_zero3_checkpoint_of_four_processes_resumes_as_all_three_over_two(resharded):
    """Saved under zero3 by 4 processes, resumed by 2 processes of 4 devices each as 2
    stages x 2-way tensor x 2 pipelines under zero3, zero-bubble (each process one stage of both
    pipelines): both end at Keras's weights after 2 epochs on one device (1e-5), each device
    holds its member's share of its stage halved, and each process asked for its stage's
    weights and slots (half the checkpoint) only. The reference: Keras's own fit from that
    checkpoint, on one device. What each process read from storage is what it asked for,
    plus the metadata and index, within one 4 MiB buffer."""
    share = _member_bytes(WIDE)
    layout = "pipeline 2 M=2 x tensor 2 x zero3 x data 2 over 8 devices in 2 processes"
    for task, written, whole in _resumed_as_keras(resharded, "all_three", layout):
        for k in range(4):  # process t holds stage t
            held = written["bytes"][f"/job:worker/task:{task}/CPU:{k}"]
            assert held == pytest.approx(1.5 * share[task], rel=0.03), (task, k, held)
        wanted, read = _read(written["lines"])
        assert wanted * 2**20 < 0.6 * whole, (task, wanted)  # its stage, not the model
        assert read <= wanted + 4, (task, wanted, read)  # MB


@pytest.mark.multiprocess
@pytest.mark.xdist_group("layouts_resharded")
def test_a_zero3_checkpoint_of_four_processes_resumes_as_zero3_x_tensor_over_two(resharded):
    """The same checkpoint resumed by 2 processes of 2 devices each, the model split by its
    layout map and trained with shard_optimizer='zero3' (FSDP x TP: each process a 2-way
    tensor group, each part sliced over the 2 processes): both end at Keras's weights on
    one device (1e-5); each device holds its part's half, weights and Adam's slots; each
    process asked for its slices (half the checkpoint: a process's slices of the parts of
    a column layer are the same rows of every part, read once) and read no more, within
    one 4 MiB buffer."""
    share = _member_bytes(WIDE)
    layout = "tensor 2 x zero3 x data 2 over 4 devices in 2 processes"
    for task, written, whole in _resumed_as_keras(resharded, "zero3_tensor", layout):
        member = 1.5 * (share[0] + share[1])  # half its parts, and their two Adam slots
        for k in range(2):
            held = written["bytes"][f"/job:worker/task:{task}/CPU:{k}"]
            assert held == pytest.approx(member, rel=0.03), (task, k, held)
        wanted, read = _read(written["lines"])
        assert wanted * 2**20 == pytest.approx(whole / 2, rel=0.02), (task, wanted)
        assert read <= wanted + 4, (task, wanted, read)  # MB


@pytest.mark.xdist_group("layouts_resharded")
@pytest.mark.parametrize("target", ["pipeline", "pipeline x tensor", "one device"])
def test_a_zero3_checkpoint_of_four_processes_resumes_in_other_layouts(
    target, resharded, tmp_path, caplog
):
    """The same checkpoint resumed for the second epoch in this process as 2 stages x 2
    pipelines, as 2 stages x 2-way tensor, and on one device: each reads every weight and
    Adam slot it holds whole from the saved slices, by the offsets the checkpoint's
    metadata gives, and ends at the weights Keras's own fit takes from that checkpoint."""
    import shutil

    out, reference, losses = resharded
    shutil.copytree(out / "zero3", tmp_path / "resumed")
    resume = [tfdist.StepCheckpoint(str(tmp_path / "resumed"))]
    caplog.set_level("INFO", logger="tfdist")
    if target == "one device":
        model = mlp(WIDE, WIDE_RATE)
        got = tfdist.fit(model, data(), epochs=2, verbose=0, callbacks=resume)
    else:
        pipeline = tfdist.parallel.Pipeline(cut_before=["up1"], micro_batches=2)
        with pipeline.scope(mirrored()):
            model = mlp(WIDE, WIDE_RATE)
        if target == "pipeline x tensor":
            tensor_parallel(model, layout_map=mlp_layout())
        got = tfdist.fit(model, data(), epochs=2, verbose=0, pipeline=pipeline, callbacks=resume)
    assert got.history["loss"][-1] == pytest.approx(losses[-1], abs=1e-5)
    weights = zip(reference.weights, reference.get_weights(), model.get_weights(), strict=True)
    for v, want, have in weights:
        assert np.max(np.abs(want - have)) <= TOLERANCE, v.path
    wanted, read = _read(caplog.messages)
    whole = 3 * sum(int(np.prod(v.shape)) * 4 for v in reference.trainable_variables)
    assert wanted * 2**20 == pytest.approx(whole, rel=0.01)  # every weight and slot, whole
    assert read <= wanted + 4  # MB: the metadata and the index besides


def test_a_layout_map_that_splits_nothing_is_refused_naming_the_paths():
    """A Sequential model's weight paths start with the model's name: a map written for
    the layers' own names matches none of them, and would train nothing split."""
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(64, name="up"),
         keras.layers.Dense(FEATURES, name="down")],
        name="blocks",
    )  # fmt: skip
    layout = keras.distribution.LayoutMap(mesh())
    layout["up/kernel"] = (None, "model")
    with pytest.raises(TensorParallelError, match="splits none of 'blocks'.* 'blocks/up/kernel'"):
        tensor_parallel(model, layout_map=layout)
    layout = keras.distribution.LayoutMap(mesh())
    layout[".*up/kernel"] = (None, "model")
    layout[".*down/kernel"] = ("model", None)
    tensor_parallel(model, layout_map=layout)
    assert [p.parts for p in plan_of(model).placements] == [2, 2, 2, 1]  # up's bias too


def test_a_pipeline_refuses_what_its_stages_cannot_shard():
    """Offload, an optimizer whose update reads a whole weight, and, for a model split by
    a layout map, BatchNormalization in a split stage, each in one line before anything
    trains."""
    strategy = mirrored()
    pipeline = tfdist.parallel.Pipeline(cut_before=["up1"], micro_batches=2)
    with pipeline.scope(strategy):
        model = mlp()
    with pytest.raises(FitError, match="offload='optimizer' .* a pipeline's stages keep"):
        tfdist.fit(model, data(), verbose=0, pipeline=pipeline, shard_optimizer="zero1",
                   offload="optimizer")  # fmt: skip
    with pipeline.scope(strategy):
        model = mlp()
        model.compile(keras.optimizers.Lamb(), "sparse_categorical_crossentropy")
    with pytest.raises(FitError, match="Lamb reads a whole variable's gradient"):
        tfdist.fit(model, data(), verbose=0, pipeline=pipeline, shard_optimizer="zero2")
    # Each member would normalise its own rows: other numbers than the unsplit stage's.
    with tfdist.host_scope(strategy):
        inputs = keras.Input((FEATURES,))
        x = keras.layers.Dense(64, activation="relu", name="up0")(inputs)
        x = keras.layers.BatchNormalization(name="norm")(keras.layers.Dense(16, name="down0")(x))
        normalised = keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(x))
        normalised.compile("adam", "sparse_categorical_crossentropy")
    tensor_parallel(normalised, layout_map=mlp_layout())
    with pytest.raises(FitError, match=r"BatchNormalization \(norm\) in a split stage"):
        tfdist.fit(normalised, data(), verbose=0,
                   pipeline=tfdist.parallel.Pipeline(cut_before=["head"]))  # fmt: skip


def test_a_host_scope_model_is_refused_by_the_modes_that_keep_it_whole():
    """A model built in host_scope holds its weights in slices: plain data parallelism is
    refused by fit, zero1 in its own words (it keeps every weight whole), each in one line
    before anything trains."""
    strategy = mirrored()
    with tfdist.host_scope(strategy):
        model = mlp()
    with pytest.raises(FitError, match=r"was built in tfdist.host_scope.*no such mode"):
        tfdist.fit(model, data(), verbose=0)
    with pytest.raises(FitError, match=r"Received: shard_optimizer='zero1' on a host_scope"):
        tfdist.fit(model, data(), verbose=0, shard_optimizer="zero1")
    assert int(model.optimizer.iterations.numpy()) == 0


# --- keras-hub's Llama -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_reference():
    """Keras's own fit of keras-hub's Llama causal LM on one device, 2 epochs."""
    from tools import keras_hub_models

    model = keras_hub_models.llama_causal_lm()
    history = model.fit(keras_hub_models.token_data(), epochs=2, verbose=0, shuffle=False)
    return model, history.history["loss"]


@pytest.mark.xdist_group("layouts_llama")  # llama_reference's fit runs once
def test_llama_under_its_own_map_with_zero3_trains_as_keras_on_one_device(llama_reference):
    """keras-hub's Llama (4 query heads, 1 key/value head, untied logits) split by its own
    layout map over 2 x 2, each part sharded over its data group (zero3), fit twice; its
    plain Keras copy holds the model's 21 weights, each once."""
    import keras_hub

    from tools import keras_hub_models

    reference, losses = llama_reference
    with tfdist.host_scope(mirrored()):
        model = keras_hub_models.llama_causal_lm()
    tensor_parallel(model, layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh()))
    got = [
        tfdist.fit(model, keras_hub_models.token_data(), verbose=0, shard_optimizer="zero3")
        for _ in range(2)
    ]
    assert [h.history["loss"][0] for h in got] == pytest.approx(losses, abs=1e-5)
    for v, want, have in zip(
        reference.weights, reference.get_weights(), model.get_weights(), strict=True
    ):
        assert np.max(np.abs(want - have)) <= TOLERANCE, v.path
    dense = tfdist.parallel.dense_model(model)
    assert len(dense.weights) == len(reference.weights) == 21
    assert [w.path for w in dense.weights] == [w.path for w in reference.weights]


@pytest.mark.parametrize("name, backbone", [("qwen", "QwenBackbone"), ("gemma", "GemmaBackbone")])
def test_qwen_and_gemma_under_their_own_maps_with_zero3_train_as_keras_on_one_device(
    name, backbone
):
    """keras-hub's Qwen (biased query, key and value projections) and Gemma (its logits from
    the embedding table, tied) split by their own layout maps over 2 x 2, each part sharded
    over its data group (zero3), fit twice; their plain Keras copies hold each weight once."""
    import keras_hub

    from tools import keras_hub_models

    make = getattr(keras_hub_models, f"{name}_causal_lm")
    reference = make()
    history = reference.fit(keras_hub_models.token_data(), epochs=2, verbose=0, shuffle=False)
    with tfdist.host_scope(mirrored()):
        model = make()
    tensor_parallel(model, layout_map=getattr(keras_hub.models, backbone).get_layout_map(mesh()))
    got = [
        tfdist.fit(model, keras_hub_models.token_data(), verbose=0, shard_optimizer="zero3")
        for _ in range(2)
    ]
    assert [h.history["loss"][0] for h in got] == pytest.approx(history.history["loss"], abs=1e-5)
    for v, want, have in zip(
        reference.weights, reference.get_weights(), model.get_weights(), strict=True
    ):
        assert np.max(np.abs(want - have)) <= TOLERANCE, v.path
    dense = tfdist.parallel.dense_model(model)
    assert [w.path for w in dense.weights] == [w.path for w in reference.weights]


@pytest.mark.xdist_group("layouts_llama")
def test_llama_under_its_own_map_in_a_pipeline_trains_as_keras_on_one_device(llama_reference):
    """The Llama split by its own layout map and cut inside its backbone: 2 stages, each
    over 2 devices (its attention by heads, its MLP by Megatron's column and row layers,
    its vocabulary split); fit twice; its plain Keras copy holds the model's 21 weights."""
    import keras_hub

    from tools import keras_hub_models

    reference, losses = llama_reference
    with tfdist.host_scope(mirrored()):
        model = keras_hub_models.llama_causal_lm()
    tensor_parallel(model, layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh()))
    cut = f"{model.backbone.name}/transformer_layer_1"
    pipeline = tfdist.parallel.Pipeline(cut_before=[cut], micro_batches=2)
    got = [
        tfdist.fit(model, keras_hub_models.token_data(), verbose=0, pipeline=pipeline)
        for _ in range(2)
    ]
    assert [h.history["loss"][0] for h in got] == pytest.approx(losses, abs=1e-5)
    for v, want, have in zip(
        reference.weights, reference.get_weights(), model.get_weights(), strict=True
    ):
        assert np.max(np.abs(want - have)) <= TOLERANCE, v.path
    dense = tfdist.parallel.dense_model(model)
    assert [w.path for w in dense.weights] == [w.path for w in reference.weights]
    assert len(dense.weights) == 21


@pytest.mark.xdist_group("layouts_llama")
def test_llama_in_a_pipeline_with_zero3_stages_trains_as_keras_on_one_device(llama_reference):
    """The Llama cut inside its backbone into 2 stages x 2 pipelines, each stage's weights
    and state sharded over its 2 replicas (zero3), its lookup table whole (sparse rows), the
    logits' table sliced; fit twice."""
    from tools import keras_hub_models

    reference, losses = llama_reference
    with tfdist.host_scope(mirrored()):
        model = keras_hub_models.llama_causal_lm()
    cut = f"{model.backbone.name}/transformer_layer_1"
    pipeline = tfdist.parallel.Pipeline(cut_before=[cut], micro_batches=2)
    got = [
        tfdist.fit(
            model,
            keras_hub_models.token_data(),
            verbose=0,
            pipeline=pipeline,
            shard_optimizer="zero3",
        )  # fmt: skip
        for _ in range(2)
    ]
    assert [h.history["loss"][0] for h in got] == pytest.approx(losses, abs=1e-5)
    for v, want, have in zip(
        reference.weights, reference.get_weights(), model.get_weights(), strict=True
    ):
        assert np.max(np.abs(want - have)) <= TOLERANCE, v.path

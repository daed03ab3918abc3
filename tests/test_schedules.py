"""Pipeline schedules (tfdist.parallel.pipeline.schedules): dependencies, bubble and memory."""

from __future__ import annotations

import doctest

import pytest

from tfdist.parallel.pipeline import schedules
from tfdist.parallel.pipeline.schedules import (
    COMPUTE,
    Action,
    Kind,
    bubble_formula,
    lowered,
    schedule,
    simulate,
)

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("name, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 1),
                                          ("interleaved", 2), ("interleaved", 4)])  # fmt: skip
@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 4, 8, 16])
def test_each_schedule_runs_every_pass_once_with_the_bubble_of_the_formula(
    name, chunks, stages, micro_batches
):
    if name == "interleaved" and micro_batches % stages:
        with pytest.raises(ValueError, match=f"micro_batches must be a multiple of {stages}"):
            schedule(name, stages, micro_batches, chunks=chunks)
        return
    plans = schedule(name, stages, micro_batches, chunks=chunks)
    for plan in plans:
        assert sorted(map(str, plan)) == sorted(
            str(Action(kind, m, c)) for kind in "FB" for m in range(micro_batches)
            for c in range(chunks)
        )  # fmt: skip
        for p in plan:  # a device's backward of a chunk's micro-batch follows its forward
            if p.kind == "B":
                assert plan.index(Action("F", p.micro_batch, p.chunk)) < plan.index(p)
    timeline = simulate(plans)  # a backward as long as a forward
    assert timeline.bubble == pytest.approx(
        bubble_formula(stages, micro_batches, chunks), abs=1e-12
    )
    # (vM + S - 1) forward and backward slots of a chunk, each 1/v of a stage's work here.
    assert timeline.length == 2 * (chunks * micro_batches + stages - 1)


@pytest.mark.parametrize("stages, micro_batches", [(2, 8), (4, 4), (4, 16)])
def test_1f1b_holds_at_most_the_stages_ahead_where_gpipe_holds_every_micro_batch(
    stages, micro_batches
):
    gpipe = simulate(schedule("gpipe", stages, micro_batches)).peak_activations
    one_f_one_b = simulate(schedule("1f1b", stages, micro_batches)).peak_activations
    assert gpipe == (micro_batches,) * stages
    assert one_f_one_b == tuple(min(stages - s, micro_batches) for s in range(stages))


def test_unequal_pass_times_lengthen_the_step_as_the_slowest_stage_does():
    plans = schedule("1f1b", 4, 8)
    even = simulate(plans, forward_time=1.0, backward_time=2.0)
    assert even.length == pytest.approx((8 + 4 - 1) * 3.0)  # (M + S - 1)(F + B)
    slow = simulate(plans, forward_time=lambda s: 2.0 if s == 2 else 1.0, backward_time=2.0)
    assert slow.length > even.length and slow.busy[2] == 8 * 4.0


def test_a_schedule_that_deadlocks_and_bad_arguments_are_refused():
    backwards_first = [[Action("B", 0), Action("F", 0)]]
    with pytest.raises(ValueError, match="deadlocks: stages wait on B0"):
        simulate(backwards_first)
    with pytest.raises(ValueError, match="schedule must be one of gpipe, 1f1b, interleaved"):
        schedule("zero-bubble", 2, 2)
    with pytest.raises(ValueError, match="chunks apply to the interleaved schedule"):
        schedule("1f1b", 2, 2, chunks=2)
    with pytest.raises(ValueError, match="micro_batches must be a whole number >= 1"):
        schedule("gpipe", 2, 0)


def test_the_module_example_holds():
    failures, _ = doctest.testmod(schedules)
    assert failures == 0


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 2, 4, 8, 16])
def test_zero_bubble_runs_each_forward_input_and_weight_pass_once_below_1f1b_s_bubble(
    stages, micro_batches
):
    """ZB-H1: every F, I and W once, each W after its I, no more held than 1F1B holds, and
    a smaller bubble than 1F1B's at the same S and M wherever 1F1B has one."""
    plans = schedule("zero_bubble", stages, micro_batches)
    for plan in plans:
        assert sorted(map(str, plan)) == sorted(
            f"{kind}{m}" for kind in "FIW" for m in range(micro_batches)
        )
        for p in plan:
            if p.kind == Kind.BACKWARD_WEIGHT:
                assert plan.index(Action("I", p.micro_batch)) < plan.index(p)
    zero_bubble = simulate(plans)
    one_f_one_b = simulate(schedule("1f1b", stages, micro_batches))
    assert zero_bubble.peak_activations <= one_f_one_b.peak_activations
    if stages > 1:
        assert zero_bubble.bubble < one_f_one_b.bubble
        assert zero_bubble.length < one_f_one_b.length
    else:
        assert zero_bubble.bubble == one_f_one_b.bubble == 0.0


@pytest.mark.parametrize("name, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                          ("zero_bubble", 1)])  # fmt: skip
def test_every_plan_gets_its_sends_receives_and_updates_from_its_compute_order(name, chunks):
    """`lowered`: a receive just before each pass whose input another stage makes, a send
    just after each pass another stage takes from, each send matched by one receive on the
    neighbouring stage, one update per stage after its every pass; simulate reads the
    lowered lists as it reads the compute orders."""
    stages, micro_batches = 4, 8
    plans = schedule(name, stages, micro_batches, chunks=chunks)
    program = lowered(plans)
    last = stages * chunks - 1
    sent, received = set(), set()
    for device, (plan, actions) in enumerate(zip(plans, program, strict=True)):
        assert [a for a in actions if a.kind in COMPUTE] == plan
        for k, a in enumerate(actions):
            stage = a.stage(device, stages)
            if a.kind in (Kind.SEND_ACTIVATION, Kind.SEND_GRADIENT):
                made = Kind.FORWARD if a.kind == Kind.SEND_ACTIVATION else actions[k - 1].kind
                assert actions[k - 1] == Action(made, a.micro_batch, a.chunk)
                to = stage + (1 if a.kind == Kind.SEND_ACTIVATION else -1)
                sent.add((a.kind == Kind.SEND_ACTIVATION, to, a.micro_batch))
            if a.kind in (Kind.RECV_ACTIVATION, Kind.RECV_GRADIENT):
                consumer = actions[k + 1]
                assert consumer.kind in COMPUTE and consumer.micro_batch == a.micro_batch
                received.add((a.kind == Kind.RECV_ACTIVATION, stage, a.micro_batch))
        updates = [a for a in actions if a.kind == Kind.UPDATE]
        assert updates == [Action(Kind.UPDATE, None, c) for c in range(chunks)]
        assert actions[-chunks:] == updates
    assert sent == received
    assert len(sent) == 2 * last * micro_batches  # each cut: M activations and M gradients
    assert simulate(program).bubble == simulate(plans).bubble
    assert simulate(program).length == simulate(plans).length


def test_actions_are_typed_and_print_as_their_letters():
    assert Action("F", 3) == Action(Kind.FORWARD, 3) and Action("F", 3).kind is Kind.FORWARD
    assert [str(a) for a in lowered(schedule("zero_bubble", 2, 2))[0]] == [
        "F0", "SF0", "F1", "SF1", "RB0", "I0", "W0", "RB1", "I1", "W1", "U",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="'X' is not a valid Kind"):
        Action("X", 0)

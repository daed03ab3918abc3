"""Pipeline schedules (tfdist.parallel.schedules): dependencies, bubble and memory."""

from __future__ import annotations

import doctest

import pytest

from tfdist.parallel import schedules
from tfdist.parallel.schedules import Pass, bubble_formula, schedule, simulate

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("name", schedules.SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 4, 8, 16])
def test_each_schedule_runs_every_pass_once_with_the_bubble_of_the_formula(
    name, stages, micro_batches
):
    plans = schedule(name, stages, micro_batches)
    for plan in plans:
        assert sorted(map(str, plan)) == sorted(
            f"{kind}{m}" for kind in "FB" for m in range(micro_batches)
        )
        for m in range(micro_batches):  # a stage's backward of m follows its forward of m
            assert plan.index(Pass("F", m)) < plan.index(Pass("B", m))
    timeline = simulate(plans)  # a backward as long as a forward
    assert timeline.bubble == pytest.approx(bubble_formula(stages, micro_batches), abs=1e-12)
    assert timeline.length == 2 * (micro_batches + stages - 1)


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
    backwards_first = [[Pass("B", 0), Pass("F", 0)]]
    with pytest.raises(ValueError, match="deadlocks: stages wait on B0"):
        simulate(backwards_first)
    with pytest.raises(ValueError, match="schedule must be one of gpipe, 1f1b"):
        schedule("interleaved", 2, 2)
    with pytest.raises(ValueError, match="micro_batches must be a whole number >= 1"):
        schedule("gpipe", 2, 0)


def test_the_module_example_holds():
    failures, _ = doctest.testmod(schedules)
    assert failures == 0

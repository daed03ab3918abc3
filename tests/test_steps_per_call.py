"""Many steps per call (steps_per_execution, and 'auto'): the same weights and history as one
step a call, the callbacks fired as Keras fires them, checkpoints at the steps they name.

Across worker processes: tests/test_fit_multiworker.py (the `per_call` mode); a SIGTERM in the
middle of a call: tests/test_training.py (the binary, --steps_per_execution=8).
"""

from __future__ import annotations

import os
import re
import time

import keras
import numpy as np
import pytest

import tfdist
from tests import zero_cases
from tfdist.parallel import Pipeline

TOLERANCE = 1e-6
EPOCHS = 3  # 10 steps an epoch


def _mirrored():
    return tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:0", "/cpu:1"])


def _train(strategy, per_call, mode=None):
    x, y = zero_cases.data()
    with strategy.scope():
        model = zero_cases.mlp("adam")
    history = tfdist.fit(
        model, x, y, batch_size=zero_cases.GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
        verbose=0, steps_per_execution=per_call, **(MODES[mode](model) if mode else {}),
    )  # fmt: skip
    return model, history.history


# tfdist's modes by their fit keywords, on mirrored x2 (the pipeline: two stages).
MODES = {
    "zero2": lambda model: {"shard_optimizer": "zero2"},
    "zero3": lambda model: {"shard_optimizer": "zero3"},
    "local SGD": lambda model: {"average_every": 3},
    "pipeline": lambda model: {
        "pipeline": Pipeline(cut_before=[model.layers[2].name], micro_batches=2)
    },
}


@pytest.mark.parametrize(
    "layout",
    ["one_device", "mirrored x2", *(f"{mode} on mirrored x2" for mode in MODES)],
)
def test_many_steps_a_call_train_what_one_step_a_call_trains(layout):
    strategy = (
        tfdist.build_strategy("one_device", cluster=None) if layout == "one_device" else _mirrored()
    )
    mode = layout.removesuffix(" on mirrored x2")
    mode = mode if mode in MODES else None
    one, one_history = _train(strategy, 1, mode)
    # 4 a call: calls of 4, 4 and 2 steps an epoch; 'auto': probes, then its own count.
    for per_call in (4, "auto"):
        many, history = _train(strategy, per_call, mode)
        diff = zero_cases.max_diff(one.get_weights(), many.get_weights())
        assert diff <= TOLERANCE, (per_call, diff)
        assert int(many.optimizer.iterations.numpy()) == EPOCHS * zero_cases.STEPS
        for key, values in one_history.items():
            np.testing.assert_allclose(history[key], values, atol=TOLERANCE, err_msg=key)


class _Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch))

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("batch_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch_end", batch, round(float(logs["loss"]), 5)))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, round(float(logs["loss"]), 5)))


def test_batch_hooks_fire_once_a_call_as_keras_fires_them():
    x, y = zero_cases.data()
    seen = {}
    for trainer in ("keras", "tfdist"):
        model = zero_cases.mlp("adam")
        model.compile(model.optimizer, "mse", steps_per_execution=3)  # calls of 3, 3, 3, 1
        record = _Record()
        options = dict(batch_size=zero_cases.GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                       callbacks=[record])  # fmt: skip
        if trainer == "keras":
            model.fit(x, y, **options)
        else:
            tfdist.fit(model, x, y, **options)
        seen[trainer] = record.calls
    # Keras numbers a short last call's end as if it had run them all (batch 11 of an epoch
    # of 10); tfdist gives the step that ran, which its StepCheckpoint counts from.
    last = zero_cases.STEPS - 1
    first_epoch_end = seen["keras"].index(next(c for c in seen["keras"] if c[0] == "epoch_end"))
    assert seen["keras"][first_epoch_end - 1][:2] == ("batch_end", last + 2)
    keras_calls = [(c[0], min(c[1], last), *c[2:]) if c[0] == "batch_end" else c
                   for c in seen["keras"]]  # fmt: skip
    assert seen["tfdist"] == keras_calls
    assert seen["keras"][:5] == [
        ("epoch_begin", 0), ("batch_begin", 0), seen["keras"][2], ("batch_begin", 3),
        seen["keras"][4],
    ]  # fmt: skip
    assert seen["keras"][2][:2] == ("batch_end", 2)


def test_a_call_ends_where_a_checkpoint_is_due(tmp_path):
    x, y = zero_cases.data()
    model = zero_cases.mlp("adam")
    saves = tfdist.StepCheckpoint(str(tmp_path), every_n_steps=4, max_to_keep=20)
    tfdist.fit(
        model, x, y, batch_size=zero_cases.GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
        steps_per_execution=3, callbacks=[saves],
    )  # fmt: skip
    steps = sorted(
        int(name[len("ckpt-") : -len(".index")])
        for name in os.listdir(tmp_path / "checkpoints")
        if name.endswith(".index")
    )
    # Every 4th step and every epoch's end (10 steps an epoch), though a call runs 3.
    assert steps == [4, 8, 10, 12, 16, 20]


def test_auto_keeps_one_step_a_call_for_a_callback_that_needs_every_batch(caplog):
    x, y = zero_cases.data()
    model = zero_cases.mlp("adam")
    record = _Record()
    with caplog.at_level("DEBUG", logger="tfdist"):  # verbose=0: fit's own lines are debug
        tfdist.fit(model, x, y, batch_size=zero_cases.GLOBAL_BATCH, epochs=1, shuffle=False,
                   verbose=0, steps_per_execution="auto", callbacks=[record])  # fmt: skip
    assert "one step a call, as _Record hook every batch" in caplog.text
    assert [c[1] for c in record.calls if c[0] == "batch_end"] == list(range(zero_cases.STEPS))


@pytest.mark.parametrize("value", [0, -1, "fast", 2.5])
def test_a_bad_steps_per_execution_is_one_line(value):
    x, y = zero_cases.data()
    model = zero_cases.mlp("adam")
    with pytest.raises(tfdist.FitError, match=r"steps_per_execution must be a whole number >= 1"):
        tfdist.fit(model, x, y, batch_size=zero_cases.GLOBAL_BATCH, verbose=0,
                   steps_per_execution=value)  # fmt: skip


def test_auto_chooses_the_count_that_makes_a_call_s_fixed_cost_five_percent():
    from tfdist.training.auto_steps_per_execution import SCHEDULE, AutoStepsPerExecution

    fixed, step = 1e-3, 0.5e-3
    tallies = []
    auto = AutoStepsPerExecution(lambda counts: tallies.append(counts) or counts, is_chief=True)
    for call in range(len(SCHEDULE)):
        n = auto.length()
        # The first call traces (slow, not counted); the others take c + n s.
        auto.observe(n, 2.0 if call == 0 else fixed + n * step)
    assert auto.chosen == 40 == auto.length()  # 1 ms / (5% of 0.5 ms)
    assert tallies == [[40]]
    # A worker takes the chief's count, whatever it measured itself.
    worker = AutoStepsPerExecution(lambda counts: [40], is_chief=False)
    for _ in SCHEDULE:
        worker.observe(worker.length(), 1.0)
    assert worker.chosen == 40
    # A fixed cost too small to measure (noise puts the line below zero): a probe's length.
    quiet = AutoStepsPerExecution(lambda counts: counts, is_chief=True)
    for call in range(len(SCHEDULE)):
        n = quiet.length()
        quiet.observe(n, 2.0 if call == 0 else n * step - 1e-5)
    assert quiet.chosen == 16


def test_lockstep_workers_vote_on_a_stop_about_once_a_second_at_the_steps_the_chief_sets(
    monkeypatch,
):
    from tfdist.training import preemption

    clock = [0.0]
    monkeypatch.setattr(preemption.time, "perf_counter", lambda: clock[0])
    votes = []  # (steps run, what the chief put in)
    ran = 0
    chief = preemption.PreemptionWatcher(
        lambda counts: votes.append((ran, list(counts))) or list(counts), is_chief=True
    )
    for call in range(1, 19):  # calls of 16 steps, 0.1 s each; an epoch's end at call 8
        clock[0] += 0.1
        ran = 16 * call
        assert chief.agreed(ran, now=call == 8) is False
    # The first call votes and asks for the next; from then on the chief's steps of a second
    # (160) set the next vote, counted from the last (an epoch's end votes whenever it comes).
    assert votes == [(16, [0, 1]), (32, [0, 160]), (128, [0, 160]), (288, [0, 160])]
    # A worker proposes nothing: it takes the sum of the tally, the chief's steps, and a stop
    # any worker was signalled for.
    tallies = []
    worker = preemption.PreemptionWatcher(
        lambda counts: tallies.append(list(counts)) or [1, 160], is_chief=False
    )
    assert worker.agreed(16) is True
    assert worker.agreed(100) is False and tallies == [[0, 0]]  # not due: no collective
    assert worker.agreed(176) is True and len(tallies) == 2


class _EpochWall(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.began = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.began


def test_a_call_s_timed_step_is_one_step_not_the_call(caplog):
    # The call's last step is timed; its clock starts when the call's loop has run. Started
    # with the call, its 'input' held the 15 steps before it.
    x, y = zero_cases.data()
    model = zero_cases.mlp("adam")
    wall = _EpochWall()
    with caplog.at_level("DEBUG", logger="tfdist"):  # verbose=0: fit's own lines are debug
        tfdist.fit(model, x, y, batch_size=len(x) // 16, epochs=2, shuffle=False, verbose=0,
                   steps_per_execution=16, callbacks=[wall])  # fmt: skip
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Epoch 2:"))
    step_ms = float(re.match(r"Epoch 2: step (\S+) ms", line)[1])
    per_step_ms = 1e3 * wall.seconds / 16  # the epoch's wall time, its one call included
    # A clock started with the call would time the call's 16 steps; one step is a sample that
    # a busy host can stretch (one took 5.8x the mean in a whole-suite run): half the call.
    assert step_ms < 8 * per_step_ms, (line, per_step_ms)

"""A user's script with asynchronous corrections, run by every task of a parameter-server job.

  python -m tools.launch --chief --workers 1 --ps 1 -- python -m tests.workers.async_worker OUT
  python -m tools.launch --chief --workers 2 --ps 2 -- python -m tests.workers.async_worker OUT

The chief trains the SGD-with-momentum MLP of tests/zero_cases.py plain and with each
correction (one epoch, the data in order), and writes each run's weights to OUT/<case>.npz and
its record (staleness, the corrections' figures) to OUT/<case>.json, for
tests/test_asynchronous.py.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tests import custom_step_models, zero_cases  # noqa: E402
from tfdist import compat  # noqa: E402
from tfdist.parallel import BoundedStaleness, MomentumCorrection  # noqa: E402

# name -> (fit keywords, the hook whose summary is kept), made fresh for each run
# Unbounded (max_staleness=None) unless the case bounds it: fit's default bound is 0.
CASES = {
    "plain": lambda: ({"max_staleness": None}, None),
    "dc": lambda: ({"async_correction": "dc", "max_staleness": None}, None),
    "momentum": lambda: _hooked(MomentumCorrection()),
    "max_staleness_0": lambda: _hooked(BoundedStaleness(0)),
    "max_staleness_1": lambda: _hooked(BoundedStaleness(1)),
    "dc_max_staleness_1": lambda: ({"async_correction": "dc", "max_staleness": 1}, None),
    "staleness_aware_lr": lambda: ({"staleness_aware_lr": True, "max_staleness": None}, None),
    # Two epochs, the first of them taking turns; max_staleness left to fit ('auto': none
    # after a warm-up).
    "warmup": lambda: ({"async_warmup": zero_cases.STEPS, "epochs": 2}, None),
}


def _hooked(hook):
    return {"step_hooks": [hook], "max_staleness": None}, hook


def main(out: str) -> None:
    if tfdist.serve_if_needed():
        return  # a worker or ps: served until the chief finished
    strategy = tfdist.build_strategy("parameter_server")
    x, y = zero_cases.data()
    os.makedirs(out, exist_ok=True)
    for name, case in CASES.items():
        keywords, hook = case()
        with strategy.scope():
            model = zero_cases.mlp("sgd_momentum")
        history = tfdist.fit(
            model, x, y, batch_size=zero_cases.GLOBAL_BATCH, shuffle=False, verbose=0,
            steps_per_epoch=zero_cases.STEPS, **keywords,
        )  # fmt: skip
        np.savez(os.path.join(out, f"{name}.npz"), *model.get_weights())
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            rate = type(compat.learning_rate_schedule(model.optimizer)).__name__
            json.dump({"history": history.history, "hook": hook.summary() if hook else {},
                       "rate": rate}, f)  # fmt: skip
    # The keras.io model with its own train_step, which applies its update itself.
    with strategy.scope():
        model, data = custom_step_models.keras_io()
    history = tfdist.fit(
        model, data, verbose=0, max_staleness=0,
        steps_per_epoch=custom_step_models.EXAMPLES // custom_step_models.GLOBAL_BATCH,
    )  # fmt: skip
    with open(os.path.join(out, "custom_max_staleness_0.json"), "w") as f:
        json.dump({"history": history.history}, f)


if __name__ == "__main__":
    main(sys.argv[1])

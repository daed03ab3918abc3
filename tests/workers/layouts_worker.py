"""All three layouts in one job: the MLP of tests/test_layouts.py split by its layout map over
2-way tensor groups, cut into 2 pipeline stages, each stage's state sharded over its 2
pipelines by shard_optimizer, on 8 devices (more than a pytest process has).

  python -m tests.workers.layouts_worker OUT one_host

`one_host`: 8 logical CPUs of this process; for each of (zero1 then zero2) and (zero3 then
zero3) a model trained two epochs, an epoch a fit, written to OUT/<first>.json: each fit's
loss, the weights, the bytes each device holds in the first fit (tfdist.DeviceBytes) and
fit's layout lines.
tests/test_layouts.py compares them with Keras's fit on one device.
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfdist  # noqa: E402

RUNS = [("zero1", "zero2"), ("zero3", "zero3")]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def one_host(out: str) -> None:
    tfdist.configure_cpu_devices(8)
    from tests import test_layouts as layouts
    from tfdist.parallel import tensor_parallel

    strategy = tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(8)]
    )
    lines = _Lines()
    logging.getLogger("tfdist").addHandler(lines)
    logging.getLogger("tfdist").setLevel(logging.DEBUG)
    for first, then in RUNS:
        pipeline = tfdist.parallel.Pipeline(cut_before=["up1"], micro_batches=2)
        record = tfdist.DeviceBytes()
        with pipeline.scope(strategy):
            model = layouts.mlp()
        tensor_parallel(model, layout_map=layouts.mlp_layout())
        losses = []
        for shard, callbacks in ((first, [record]), (then, [])):  # the bytes of `first`
            history = tfdist.fit(
                model, layouts.data(), verbose=0, pipeline=pipeline, shard_optimizer=shard,
                callbacks=callbacks,
            )  # fmt: skip
            losses.append(history.history["loss"][0])
        written = {
            "losses": losses,
            "weights": [w.tolist() for w in model.get_weights()],
            "bytes": dict(record.added),
            "layout": [line for line in lines.lines if "trained as" in line],
        }
        with open(os.path.join(out, f"{first}.json"), "w") as f:
            json.dump(written, f)


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    {"one_host": one_host}[mode](out)

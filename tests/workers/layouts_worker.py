"""All three layouts in one job: the MLP of tests/test_layouts.py split by its layout map over
2-way tensor groups, cut into 2 pipeline stages, each stage's state sharded over its 2
pipelines by shard_optimizer, on 8 devices (more than a pytest process has).

  python -m tests.workers.layouts_worker OUT one_host
  python -m tools.launch --workers 4 -- python -m tests.workers.layouts_worker OUT save WIDTH
  python -m tools.launch --workers 2 -- python -m tests.workers.layouts_worker OUT resume WIDTH
  python -m tools.launch --workers 2 -- python -m tests.workers.layouts_worker OUT resume_tensor WIDTH

`one_host`: 8 logical CPUs of this process; a model trained two epochs, an epoch a fit,
zero3 then zero1 (the state moves between the shardings), written to OUT/<first>.json: each fit's
loss, the weights, the bytes each device holds in the first fit (tfdist.DeviceBytes) and
fit's layout lines.
`save`, `resume` and `resume_tensor`: a checkpoint written under zero3 by 4 processes, resumed
by 2 processes of 4 devices under all three, and by 2 processes of 2 devices under zero3 x
tensor (see each); each resume writes OUT/<its checkpoint directory>_<task>.json.
tests/test_layouts.py compares them with Keras's fit on one device.
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfdist  # noqa: E402

RUNS = [("zero3", "zero1")]


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


def save(out: str, width: str) -> None:
    """A worker of a 4-process job (one device each): the MLP `width` wide under zero3 for an
    epoch, saved by a StepCheckpoint in OUT/zero3 (each process its slices)."""
    strategy = tfdist.build_strategy("multi_worker_mirrored")
    from tests import test_layouts as layouts

    with tfdist.host_scope(strategy):
        model = layouts.mlp(int(width), layouts.WIDE_RATE)
    checkpoint = tfdist.StepCheckpoint(os.path.join(out, "zero3"))
    tfdist.fit(model, layouts.data(), verbose=0, shard_optimizer="zero3", callbacks=[checkpoint])


def resume(out: str, width: str) -> None:
    """A worker of a 2-process job, 4 logical CPUs each: the MLP `width` wide, resumed from
    the checkpoint in OUT/all_three for its second epoch as 2 stages x 2-way tensor x 2
    pipelines under zero3, on the zero-bubble schedule (each tensor group's backward an
    input pass, then a weights' pass). Each process holds one stage of both pipelines,
    each stage replica over 2 of its devices."""
    tfdist.configure_cpu_devices(4)
    pipeline = tfdist.parallel.Pipeline(cut_before=["up1"], micro_batches=2, schedule="zero_bubble")
    _resumed(out, width, "all_three", pipeline)


def resume_tensor(out: str, width: str) -> None:
    """A worker of a 2-process job, 2 logical CPUs each: the MLP `width` wide, resumed from
    the checkpoint in OUT/zero3_tensor for its second epoch as 2-way tensor x zero3 over the
    processes (FSDP x TP: each process a tensor group over its devices, each part sliced
    over the 2 processes): what tfdist.fit does with a layout map's model and
    shard_optimizer='zero3' across worker processes."""
    tfdist.configure_cpu_devices(2)
    _resumed(out, width, "zero3_tensor", None)


def _resumed(out: str, width: str, name: str, pipeline) -> None:
    """Resumes the MLP split by its layout map from OUT/`name` under zero3 (and `pipeline`)
    for a second epoch; writes OUT/<name>_<task>.json: the losses, the weights, the bytes
    each device holds and fit's lines that name the layout and the checkpoint's reads."""
    strategy = tfdist.build_strategy("multi_worker_mirrored")
    from tests import test_layouts as layouts
    from tfdist.parallel import tensor_parallel

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    lines = _Lines()
    logging.getLogger("tfdist").addHandler(lines)
    record = tfdist.DeviceBytes()
    with tfdist.host_scope(strategy):
        model = layouts.mlp(int(width), layouts.WIDE_RATE)
    tensor_parallel(model, layout_map=layouts.mlp_layout())
    checkpoint = tfdist.StepCheckpoint(os.path.join(out, name))
    history = tfdist.fit(
        model, layouts.data(), epochs=2, verbose=2, pipeline=pipeline, shard_optimizer="zero3",
        callbacks=[checkpoint, record],
    )  # fmt: skip
    written = {
        "losses": history.history["loss"],
        "weights": [w.tolist() for w in model.get_weights()],
        "bytes": dict(record.added),
        "lines": [line for line in lines.lines if "trained as" in line or "Read this" in line],
    }
    with open(os.path.join(out, f"{name}_{task['type']}_{task['index']}.json"), "w") as f:
        json.dump(written, f)


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    modes = {"one_host": one_host, "save": save, "resume": resume, "resume_tensor": resume_tensor}
    modes[mode](out, *sys.argv[3:])

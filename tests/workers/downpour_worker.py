"""A user's script for Downpour's model-parallel replicas, run by every task of a
parameter-server job; each task first splits its CPU into 2 logical devices.

  python -m tools.launch --chief --workers 1 --ps 2 -- python -m tests.workers.downpour_worker OUT one
  python -m tools.launch --chief --workers 3 --ps 2 -- python -m tests.workers.downpour_worker OUT many

one: the pipeline tests' Adam MLP (tests/pipeline_cases.py), each worker's replica split over
its 2 devices, one epoch in order (fit twice in one case), for each case below; writes OUT/<case>.npz (the weights),
OUT/<case>.json (history, the devices its program asked for) for tests/test_downpour.py;
then SPARSE_ROWS_CASES (keras-hub's Mistral, for tests/test_sparse_rows.py); then
CALLBACK_CASES, with the learning-rate callbacks.
many: the same model with SGD, 3 workers training asynchronously for 3 epochs; then a model
whose replica needs 3 devices (refused: the workers have 2).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tests import pipeline_cases  # noqa: E402
from tfdist.parallel import Pipeline  # noqa: E402

CASES = {
    "1f1b_m2": dict(cut_before=["d3"], micro_batches=2),
    "gpipe_m4": dict(cut_before=["d3"], micro_batches=4, schedule="gpipe"),
    "zero_bubble_m4": dict(cut_before=["d3"], micro_batches=4, schedule="zero_bubble"),
    "interleaved": dict(
        cut_before=["d2", "d3", "d4"],
        micro_batches=2,
        schedule="interleaved",
        chunks_per_device=2,
    ),  # fmt: skip
    "1f1b_m2_fit_twice": dict(cut_before=["d3"], micro_batches=2),
}
# Cases fit more than once (the same model and Pipeline), as Keras's own fit called again.
FITS = {"1f1b_m2_fit_twice": 2}
# Cases trained with tests/test_optimizer_changes.py's epoch callbacks (a scheduler, a
# plateau, a callback assigning the rate, the step count at each epoch's end) for its epochs:
# the plain parameter-server replica and the split one, each applying through the user's
# optimizer.
CALLBACK_CASES = {
    "callbacks_ps": None,
    "callbacks_downpour": dict(cut_before=["d3"], micro_batches=2),
}


class KeptPipeline(Pipeline):
    """A Pipeline that keeps the runner it made, to read the devices its program asks for."""

    made: list = []

    def runner(self, model, strategy):
        runner = super().runner(model, strategy)
        KeptPipeline.made.append(runner)
        return runner


def asked_devices(runner) -> list[str]:
    """The devices named by the ops of the runner's traced step closure (its traces for each
    count of steps; nested functions too)."""
    devices = set()
    for closure in [runner._closure()]:
        for concrete in closure._list_all_concrete_functions():
            graph = concrete.graph.as_graph_def()
            nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
            devices.update(n.device for n in nodes if n.device)
    return sorted(devices)


# keras-hub's Mistral (token rows repeated within a batch, Adam): its gradient's rows go
# to the ps as rows, from the plain replica and from the split one (tests/test_sparse_rows.py).
SPARSE_ROWS_CASES = {
    "mistral_ps": None,
    "mistral_downpour": "transformer_layer_1",
}


def sparse_rows(strategy, out: str) -> None:
    from tools import keras_hub_models

    for name, cut in SPARSE_ROWS_CASES.items():
        with strategy.scope():
            model = keras_hub_models.mistral_causal_lm()
        pipeline = None
        if cut is not None:
            pipeline = Pipeline(cut_before=[f"{model.backbone.name}/{cut}"], micro_batches=2)
        history = tfdist.fit(
            model, keras_hub_models.token_data(), epochs=1, verbose=0, max_staleness=0,
            steps_per_epoch=keras_hub_models.EXAMPLES // keras_hub_models.GLOBAL_BATCH,
            pipeline=pipeline,
        )  # fmt: skip
        np.savez(os.path.join(out, f"{name}.npz"), *model.get_weights())
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump({"history": history.history}, f)


def main(out: str, what: str) -> None:
    tfdist.configure_cpu_devices(2)
    if tfdist.serve_if_needed():
        return
    strategy = tfdist.build_strategy("parameter_server")
    os.makedirs(out, exist_ok=True)
    if what == "one":
        for name, options in CASES.items():
            with strategy.scope():
                model = pipeline_cases.mlp()
            pipeline = KeptPipeline(**options)
            for _ in range(FITS.get(name, 1)):  # a user's second fit goes on from the first
                history = tfdist.fit(
                    model, pipeline_cases.data(), epochs=1, verbose=0, max_staleness=0,
                    steps_per_epoch=pipeline_cases.STEPS, pipeline=pipeline,
                )  # fmt: skip
            np.savez(os.path.join(out, f"{name}.npz"), *model.get_weights())
            record = {"history": history.history, "devices": asked_devices(KeptPipeline.made[-1])}
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump(record, f)
        sparse_rows(strategy, out)
        from tests import test_optimizer_changes

        for name, options in CALLBACK_CASES.items():
            with strategy.scope():
                model = pipeline_cases.mlp()
            given = test_optimizer_changes.epoch_callbacks()
            history = tfdist.fit(
                model, pipeline_cases.data(), epochs=test_optimizer_changes.EPOCHS, verbose=0,
                max_staleness=0, steps_per_epoch=pipeline_cases.STEPS, callbacks=given,
                pipeline=None if options is None else Pipeline(**options),
            )  # fmt: skip
            np.savez(os.path.join(out, f"{name}.npz"), *model.get_weights())
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump({"history": history.history, "steps": given[-1].seen}, f)
        return
    import keras

    with strategy.scope():
        model = pipeline_cases.mlp()
        model.compile(
            keras.optimizers.SGD(0.1, momentum=0.5),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    # Arrays: each worker reads them in an order of its own.
    x, y = (t.numpy() for t in next(iter(pipeline_cases.data().unbatch().batch(1 << 20))))
    history = tfdist.fit(
        model, x, y, batch_size=pipeline_cases.GLOBAL_BATCH, epochs=3, steps_per_epoch=20,
        verbose=0, max_staleness=None, pipeline=Pipeline(cut_before=["d3"], micro_batches=2),
    )  # fmt: skip
    with open(os.path.join(out, "many.json"), "w") as f:
        json.dump({"history": history.history}, f)
    with strategy.scope():
        model = pipeline_cases.mlp()
    try:
        tfdist.fit(
            model, x, y, batch_size=pipeline_cases.GLOBAL_BATCH, epochs=1, steps_per_epoch=2,
            verbose=0, pipeline=Pipeline(cut_before=["d2", "d3"]),
        )  # fmt: skip
        refused = None
    except tfdist.FitError as e:
        refused = str(e)
    with open(os.path.join(out, "refused.json"), "w") as f:
        json.dump({"error": refused}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Sparse rows across worker processes: a user's script run by both workers of a launched job.

  python -m tools.launch --workers 2 -- python -m tests.workers.sparse_rows_worker OUT

keras-hub causal LMs (tools/keras_hub_models.py) look up token rows that repeat within a
batch: one device's tape holds a row per occurrence, and Adam squares each apart. Each worker
trains every run of RUNS, one after the other, on the same token batches, and writes the
weights and the history to OUT/<run>/<task>.{npz,json}, and for the runs in SAVED the
chief's model.save to OUT/<run>/worker_0.keras; tests/test_sparse_rows.py holds each against
Keras's fit on one device, tests/test_saves.py trains the saves on.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tools import keras_hub_models  # noqa: E402

MODELS = {
    "mistral": keras_hub_models.mistral_causal_lm,
    "llama": keras_hub_models.llama_causal_lm,
    "gemma": keras_hub_models.gemma_causal_lm,
}

# (model, how the job trains it, optimizer): the paths on which a gradient's rows cross
# between the processes. `local_sgd` averages weights, not gradients: under plain SGD and
# every step it is one device's math, so its rows are checked too.
RUNS = [
    ("mistral", "pipeline", "adam"),
    ("llama", "pipeline", "adam"),
    ("mistral", "data_parallel", "adam"),
    ("mistral", "zero1", "adam"),
    ("mistral", "zero2", "adam"),
    ("mistral", "zero3", "adam"),
    ("mistral", "local_sgd", "sgd"),
]


# Runs whose model every worker saves with model.save (tests/test_saves.py loads them).
SAVED = ("zero1", "zero2", "zero3", "pipeline")


def run_name(model: str, mode: str, optimizer: str) -> str:
    return f"{model}_{mode}_{optimizer}"


def build(model: str, optimizer: str) -> keras.Model:
    built = MODELS[model]()
    if optimizer == "sgd":
        built.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"],
        )
    return built


def train(strategy, model_name: str, mode: str, optimizer: str):
    # Modes that keep no whole copy are built where no device holds the model whole.
    sharded = mode in ("pipeline", "zero3")
    with tfdist.host_scope(strategy) if sharded else strategy.scope():
        model = build(model_name, optimizer)
    keywords: dict = {}
    if mode == "pipeline":
        cut = f"{model.backbone.name}/transformer_layer_1"
        keywords["pipeline"] = tfdist.parallel.Pipeline(
            cut_before=[cut], micro_batches=2, schedule="1f1b", timeout_seconds=120
        )
    elif mode.startswith("zero"):
        keywords["shard_optimizer"] = mode
    elif mode == "local_sgd":
        keywords["average_every"] = 1
    history = tfdist.fit(model, keras_hub_models.token_data(), verbose=0, **keywords)
    return model, history


def main(out: str) -> None:
    strategy = tfdist.build_strategy("multi_worker_mirrored")
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    name = f"{task['type']}_{task['index']}"
    for run in RUNS:
        here = os.path.join(out, run_name(*run))
        os.makedirs(here, exist_ok=True)
        model, history = train(strategy, *run)
        np.savez(os.path.join(here, f"{name}.npz"), *model.get_weights())
        with open(os.path.join(here, f"{name}.json"), "w") as f:
            json.dump(history.history, f)
        if run[1] in SAVED:
            # Every worker saves (the sharded state is gathered: a collective); the chief
            # writes the path, the others a scratch copy (tfdist's guard of model.save).
            model.save(os.path.join(here, f"{name}.keras"))


if __name__ == "__main__":
    main(sys.argv[1])

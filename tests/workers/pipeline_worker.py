"""A user's script with a pipeline, run by every worker of a launched job.

  python -m tools.launch --workers 4 -- python -m tests.workers.pipeline_worker OUT

Each worker trains, one after the other, each run of RUNS over the job's 4 workers (4
stages, the model built under strategy.scope(); or 2 pipelines x 2 stages, built under
host_scope, what Pipeline.scope returns): tests/pipeline_cases.py's model under each
schedule with M = 1 and 4, once under mixed_bfloat16 (activations cross the processes in
bfloat16), and keras-hub's Gemma causal LM cut inside its backbone (its tied embedding held
by the first and the last stage), and its Mistral (untied tables: each stage's token rows
gathered as rows over its 2 pipelines); then the 2 x 2 MLP with its stages sharded
(SHARDED: zero1, zero2, and zero3 with validation and a StepCheckpoint). It writes the weights and history to
OUT/<run>/<task>.{npz,json} for tests/test_pipeline.py to compare.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tests import pipeline_cases  # noqa: E402
from tools import keras_hub_models  # noqa: E402

# (model, stages, schedule, micro-batches, dtype policy)
RUNS = [
    ("mlp", 4, "gpipe", 4, None),
    ("mlp", 4, "1f1b", 1, None),
    ("mlp", 2, "gpipe", 1, None),
    ("mlp", 2, "1f1b", 4, None),
    ("mlp", 2, "1f1b", 2, "mixed_bfloat16"),
    ("gemma", 2, "1f1b", 2, None),
    ("mistral", 2, "1f1b", 2, None),
]


# Then the 2 x 2 MLP with each stage's state sharded over its 2 pipelines (shard_optimizer);
# zero3's run also evaluates and checkpoints, as EVALUATED does (its weights are slices).
SHARDED = [("mlp", 2, "1f1b", 2, None, shard) for shard in ("zero1", "zero2", "zero3")]
# Runs fit twice, a call an epoch, as users call it: the second goes on with the stages, rings
# and traced programs the first left on the model (its runner is kept across calls).
FITS = {SHARDED[0]: 2}


def run_name(model: str, stages: int, schedule: str, micro_batches: int, policy, shard=None) -> str:
    name = f"{model}_{stages}_{schedule}_m{micro_batches}" + (f"_{policy}" if policy else "")
    return name + (f"_{shard}" if shard else "")


def main(out: str) -> None:
    strategy = tfdist.build_strategy("multi_worker_mirrored")
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    for run in [*RUNS, *SHARDED]:
        here = os.path.join(out, run_name(*run))
        os.makedirs(here, exist_ok=True)
        keras.mixed_precision.set_dtype_policy(run[4] or "float32")
        logs: dict[str, list] = {}
        model = None
        for _ in range(FITS.get(run, 1)):
            model, history = train(
                strategy, *run[:4], here=here, shard=run[5] if len(run) > 5 else None,
                model=model,
            )  # fmt: skip
            for key, values in history.history.items():
                logs.setdefault(key, []).extend(values)
        name = f"{task['type']}_{task['index']}"
        np.savez(os.path.join(here, f"{name}.npz"), *model.get_weights())
        with open(os.path.join(here, f"{name}.json"), "w") as f:
            json.dump(logs, f)


# The run that also evaluates after each epoch (on every process: the weights are read from
# the stages that hold them) and saves a StepCheckpoint (each process its stage's part).
EVALUATED = ("mlp", 2, "1f1b", 4, None)


def train(
    strategy, model_name: str, stages: int, schedule: str, micro_batches: int, *, here,
    shard=None, model=None,
):  # fmt: skip
    """One fit of the run (on `model` if given: a second fit goes on from the first)."""
    # 4 stages: built as users of tf.distribute build (mirrored on every worker); 2 stages:
    # in Pipeline.scope, each process's device holding only its stage.
    scope = strategy.scope() if stages == 4 else tfdist.host_scope(strategy)
    with scope:
        if model is not None:
            data, cuts = pipeline_cases.data(), pipeline_cases.CUTS[stages]
        elif model_name == "gemma":
            model, data = keras_hub_models.gemma_causal_lm(), keras_hub_models.token_data()
            cuts = [f"{model.backbone.name}/decoder_block_1"]
        elif model_name == "mistral":
            model, data = keras_hub_models.mistral_causal_lm(), keras_hub_models.token_data()
            cuts = [f"{model.backbone.name}/transformer_layer_1"]
        else:
            model, data = pipeline_cases.mlp(), pipeline_cases.data()
            cuts = pipeline_cases.CUTS[stages]
    pipeline = tfdist.parallel.Pipeline(
        cut_before=cuts, micro_batches=micro_batches, schedule=schedule, timeout_seconds=120
    )
    keywords = {"shard_optimizer": shard}
    evaluated = (model_name, stages, schedule, micro_batches, None) == EVALUATED
    if (evaluated and not run_policy() and not shard) or shard == "zero3":
        keywords |= {
            "validation_data": data,
            "callbacks": [tfdist.StepCheckpoint(os.path.join(here, "run"))],
        }
    return model, tfdist.fit(model, data, verbose=0, pipeline=pipeline, **keywords)


def run_policy() -> str | None:
    policy = keras.mixed_precision.dtype_policy().name
    return None if policy == "float32" else policy


if __name__ == "__main__":
    main(sys.argv[1])

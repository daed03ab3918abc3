"""A user's script with a pipeline, run by every worker of a launched job.

  python -m tools.launch --workers 4 -- python -m tests.workers.pipeline_worker OUT 4,2
  python -m tools.launch --workers 2 -- python -m tests.workers.pipeline_worker OUT 2 POLICY

Each worker trains tests/pipeline_cases.py's model cut into each of STAGES stages over the
job's workers (4 workers, 2 stages: 2 pipelines x 2 stages) with each schedule and M = 1
and 4, or, given a Keras dtype POLICY (mixed_bfloat16), once under it with 1F1B and M = 2,
and writes the weights and history to OUT/<stages>/<task>/ for tests/test_pipeline.py to
compare.
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


def main(out: str, layouts: list[int], policy: str | None = None) -> None:
    strategy = tfdist.build_strategy("multi_worker_mirrored")
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    runs = [(s, m) for s in ("gpipe", "1f1b") for m in (1, 4)]
    if policy is not None:
        keras.mixed_precision.set_dtype_policy(policy)
        runs = [("1f1b", 2)]
    for stages in layouts:
        here = os.path.join(out, str(stages), f"{task['type']}_{task['index']}")
        os.makedirs(here, exist_ok=True)
        train(strategy, here, stages, runs)


def train(strategy, here: str, stages: int, runs) -> None:
    for schedule, micro_batches in runs:
        with strategy.scope():
            model = pipeline_cases.mlp()
        pipeline = tfdist.parallel.Pipeline(
            cut_before=pipeline_cases.CUTS[stages],
            micro_batches=micro_batches,
            schedule=schedule,
            timeout_seconds=120,
        )
        history = tfdist.fit(model, pipeline_cases.data(), verbose=0, pipeline=pipeline)
        name = f"{schedule}_m{micro_batches}"
        np.savez(os.path.join(here, f"{name}.npz"), *model.get_weights())
        with open(os.path.join(here, f"{name}.json"), "w") as f:
            json.dump(history.history, f)


if __name__ == "__main__":
    main(sys.argv[1], [int(n) for n in sys.argv[2].split(",")], *sys.argv[3:4])

"""Input check: read one epoch of a TFRecord dataset through a strategy and report who read what.

It shows the input side of a distributed job on its own: the batch arithmetic, how the files
are sharded over the input pipelines, and which examples each worker received. Each task
prints "INPUT_RESULT {json}" with the example ids its replicas saw, so a test (or a user)
can check that every example was read exactly once.

  tfdist-launch --workers 2 -- python -m experiments.input_check --strategy=multi_worker_mirrored
  python -m experiments.input_check --strategy=mirrored --num_cpu_devices=2 --global_batch_size=32
"""

from __future__ import annotations

import json

from absl import flags

from experiments import common
from tfdist.data import PipelineOptions, distribute_dataset, prepare_digits, tfrecord_dataset

_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "Where the digits TFRecords live (written on first use)."
)
_SPLIT = flags.DEFINE_enum("split", "train", ["train", "test"], "Split to read.")
_GLOBAL_BATCH_SIZE = flags.DEFINE_integer(
    "global_batch_size", 64, "Examples per step, all replicas."
)


def main(argv: list[str]) -> None:
    started = common.start_task(argv)
    if started is None:
        return
    cluster, strategy = started
    source = prepare_digits(_DATA_DIR.value).sources[_SPLIT.value]
    # One epoch in file order, partial last batches kept: every example should arrive once.
    options = PipelineOptions(
        repeat=False, shuffle_buffer=0, drop_remainder=False, deterministic=True
    )
    dataset = distribute_dataset(
        strategy,
        lambda context, batch_size: tfrecord_dataset(
            source, batch_size=batch_size, input_context=context, options=options
        ),
        global_batch_size=_GLOBAL_BATCH_SIZE.value,
    )
    ids, steps = [], 0
    for batch in dataset:
        steps += 1
        for local in strategy.experimental_local_results(batch["id"]):
            ids.extend(int(i) for i in local.numpy())
    task = cluster.task_name if cluster else "local"
    print(f"{task}: {steps} steps, {len(ids)} examples, {len(set(ids))} distinct", flush=True)
    print("INPUT_RESULT " + json.dumps({"task": task, "steps": steps, "ids": ids}), flush=True)


if __name__ == "__main__":
    common.run(main)

"""Which order each parameter-server worker streams its copy of the data in.

  python -m tools.launch --chief --workers 3 --ps 2 -- python -m tests.workers.streams_worker OUT

The chief builds per-worker datasets of the example ids 0..N-1 (batches of one) the two ways
fit takes them: arrays shuffled by fit (also weighted by class), and a dataset_fn that shuffles with
`tfdist.data.worker_shuffle` (as tfdist's own pipelines do). It draws ids from them in closures that
any worker may run, and writes the ids in scheduling order to OUT/<form>.json beside the
orders seed + n gives one process, for tests/test_worker_streams.py.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.training.fit_data import ARRAY_SHUFFLE_SEED, make_fit_data  # noqa: E402

EXAMPLES = 1000
DRAWS = 60
SEED = 7


def ids_dataset_fn(context):
    del context  # every parameter-server worker reads the whole data
    ids = tf.data.Dataset.range(EXAMPLES)
    return tfdist.data.worker_shuffle(ids, EXAMPLES, SEED).batch(1)


def draw(coordinator, data) -> list[int]:
    iterator = iter(data.per_worker(coordinator))

    @tf.function
    def next_id(iterator):
        batch = next(iterator)
        return tf.reshape(batch[0] if isinstance(batch, tuple) else batch, [-1])[0]

    # Scheduled together, so every idle worker takes some; each takes its share in order.
    values = [coordinator.schedule(next_id, args=(iterator,)) for _ in range(DRAWS)]
    coordinator.join()
    return [int(value.fetch()) for value in values]


def main(out: str) -> None:
    if tfdist.serve_if_needed():
        return  # a worker or ps: served until the chief finished
    keras.utils.set_random_seed(0)  # a global seed of 0, as the binary's default sets
    strategy = tfdist.build_strategy("parameter_server")
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    ids = np.arange(EXAMPLES, dtype=np.int64)
    arrays = make_fit_data(
        ids, ids, batch_size=1, shuffle=True, strategy=strategy, for_training=True
    )
    forms = {
        "arrays": arrays,
        "arrays_class_weight": arrays.class_weighted({0: 2.0}),
        "dataset_fn": make_fit_data(ids_dataset_fn, strategy=strategy, for_training=True),
    }
    seeds = {"arrays": ARRAY_SHUFFLE_SEED, "arrays_class_weight": ARRAY_SHUFFLE_SEED}
    seeds["dataset_fn"] = SEED
    os.makedirs(out, exist_ok=True)
    for form, data in forms.items():
        drawn = draw(coordinator, data)
        # The reference: the order each seed + n gives one process, shuffled here eagerly.
        orders = [
            tf.data.Dataset.from_tensor_slices(ids)
            .shuffle(EXAMPLES, seed=seeds[form] + n)
            .take(DRAWS)
            .as_numpy_iterator()
            for n in range(tfdist.num_workers())
        ]
        with open(os.path.join(out, f"{form}.json"), "w") as f:
            json.dump({"ids": drawn, "orders": [[int(i) for i in o] for o in orders]}, f)


if __name__ == "__main__":
    main(sys.argv[1])

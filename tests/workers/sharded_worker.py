"""A parameter-server job whose large variables a partitioner splits across the ps tasks.

  tfdist-launch --chief --workers 1 --ps 2 -- python -m tests.workers.sharded_worker SHARD_BYTES OUT

Every task runs it; the workers and ps serve, the chief builds the strategy with
`ps_min_shard_bytes=SHARD_BYTES` (0: whole variables), trains one model per optimizer with
tfdist.fit on fixed data in a fixed order, and writes each model's weights to OUT/<name>.npz
with the shapes and devices of its variables' shards in OUT/<name>.json.
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

ROWS, WIDTH, IDS = 1000, 16, 4  # a 64,000-byte table: split at the test's 16 KiB shard size
STEPS, BATCH = 10, 32
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
}


def build(optimizer) -> keras.Model:
    keras.utils.set_random_seed(7)
    model = keras.Sequential([
        keras.Input((IDS,), dtype="int32"),
        keras.layers.Embedding(ROWS, WIDTH, name="table"),
        keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu", name="hidden"),  # 64 x 256: 65,536 bytes
        keras.layers.Dense(10, name="logits"),
    ], name="model")  # fmt: skip
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data() -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.integers(0, ROWS, size=(STEPS * BATCH, IDS)).astype("int32")
    y = (x[:, 0] % 10).astype("int32")  # learnable from the first id's row alone
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()


def shards(variable) -> list[dict]:
    parts = getattr(variable.value, "variables", None) or [variable.value]
    return [{"shape": list(part.shape), "device": part.device} for part in parts]


def main(shard_bytes: int, out: str) -> None:
    cluster = tfdist.cluster_from_environment()
    if tfdist.serve_if_needed(cluster):
        return
    strategy = tfdist.build_strategy(
        "parameter_server", cluster=cluster, ps_min_shard_bytes=shard_bytes
    )
    os.makedirs(out, exist_ok=True)
    for name, optimizer in OPTIMIZERS.items():
        with strategy.scope():
            model = build(optimizer())
        history = tfdist.fit(model, data(), epochs=1, steps_per_epoch=STEPS, verbose=0)
        np.savez(os.path.join(out, f"{name}.npz"), *[v.numpy() for v in model.trainable_variables])
        layout = {v.path: shards(v) for v in model.trainable_variables}
        slots = {v.path: v.value.device for v in model.optimizer.variables}
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(
                {"variables": layout, "slots": slots, "optimizer": model.optimizer.name,
                 "history": history.history},
                f,
            )  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])

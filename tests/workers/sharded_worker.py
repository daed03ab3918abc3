"""A parameter-server job whose large variables a partitioner splits across the ps tasks.

  tfdist-launch --chief --workers 1 --ps 2 -- \
      python -m tests.workers.sharded_worker SHARD_BYTES OUT [RESUME_FROM]

Every task runs it; the workers and ps serve, the chief builds the strategy with
`ps_min_shard_bytes=SHARD_BYTES` (0: whole variables; "own:N": the user's own
ParameterServerStrategy with a MinSizePartitioner of N bytes, not tfdist's builder), trains one model per optimizer with
tfdist.fit for two epochs on fixed data in a fixed order, and writes each model's weights to
OUT/<name>.npz with the shapes and devices of its variables' shards in OUT/<name>.json.

After the first epoch it keeps the state that resuming needs: the BackupAndRestore backup
(OUT/backup-1/<name>), a tf.train.Checkpoint of model and optimizer (OUT/ckpt-1/<name>), and
the values of both (OUT/<name>.epoch1.npz; the optimizer's as it saves them). The SGD model
is saved with model.save (OUT/sgd_momentum.keras), and what tfdist.fit says to optimizers
that need whole variables is kept in OUT/refused.json.

With RESUME_FROM (the OUT of an earlier run, perhaps with another number of ps tasks) the
chief resumes each model from that run's first-epoch backup and trains the second epoch only;
then it restores that run's first-epoch checkpoint and writes the values it restored to
OUT/<name>.restored.npz.
"""

from __future__ import annotations

import json
import os
import shutil
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


def state(model: keras.Model) -> list[np.ndarray]:
    """The model's weights, then its optimizer's variables as the optimizer saves them."""
    saved: dict[str, np.ndarray] = {}
    model.optimizer.save_own_variables(saved)
    return [v.numpy() for v in model.trainable_variables] + [
        saved[k] for k in sorted(saved, key=int)
    ]


class FirstEpoch(keras.callbacks.Callback):
    """Keeps what a job needs to resume after the first epoch, and what it held then."""

    def __init__(self, out: str, name: str, backup: str):
        super().__init__()
        self.out, self.name, self.backup = out, name, backup

    def on_epoch_end(self, epoch, logs=None):
        if epoch != 0:
            return
        shutil.copytree(self.backup, os.path.join(self.out, "backup-1", self.name))
        checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer)
        checkpoint.write(os.path.join(self.out, "ckpt-1", self.name, "ckpt"))
        np.savez(os.path.join(self.out, f"{self.name}.epoch1.npz"), *state(self.model))


def shards(variable) -> list[dict]:
    parts = getattr(variable.value, "variables", None) or [variable.value]
    return [{"shape": list(part.shape), "device": part.device} for part in parts]


def main(shard_bytes: str, out: str, resume_from: str | None) -> None:
    cluster = tfdist.cluster_from_environment()
    if tfdist.serve_if_needed(cluster):
        return
    if shard_bytes.startswith("own:"):  # the user's own strategy and partitioner
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=int(shard_bytes[4:]), max_shards=cluster.num_ps
        )
        strategy = tf.distribute.experimental.ParameterServerStrategy(
            tf.distribute.cluster_resolver.TFConfigClusterResolver(),
            variable_partitioner=partitioner,
        )
    else:
        strategy = tfdist.build_strategy(
            "parameter_server", cluster=cluster, ps_min_shard_bytes=int(shard_bytes)
        )
    os.makedirs(out, exist_ok=True)
    names = ["sgd_momentum", "adam"] if resume_from else list(OPTIMIZERS)
    for name in names:
        with strategy.scope():
            model = build(OPTIMIZERS[name]())
        backup = os.path.join(out, "backup", name)
        callbacks = [keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)]
        if resume_from:
            shutil.copytree(os.path.join(resume_from, "backup-1", name), backup)
        else:
            callbacks.append(FirstEpoch(out, name, backup))
        history = tfdist.fit(
            model, data(), epochs=2, steps_per_epoch=STEPS, callbacks=callbacks, verbose=0
        )
        np.savez(os.path.join(out, f"{name}.npz"), *[v.numpy() for v in model.trainable_variables])
        if name == "sgd_momentum" and not resume_from:
            model.save(os.path.join(out, f"{name}.keras"))
        if resume_from:
            checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
            checkpoint.read(os.path.join(resume_from, "ckpt-1", name, "ckpt")).assert_consumed()
            np.savez(os.path.join(out, f"{name}.restored.npz"), *state(model))
        layout = {v.path: shards(v) for v in model.trainable_variables}
        slots = {v.path: v.value.device for v in model.optimizer.variables}
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(
                {"variables": layout, "slots": slots, "optimizer": model.optimizer.name,
                 "history": history.history},
                f,
            )  # fmt: skip
    if not resume_from:
        refuse_whole_variable_optimizers(strategy, out)


def refuse_whole_variable_optimizers(strategy, out: str) -> None:
    """Writes what tfdist.fit says to optimizers that need whole variables (OUT/refused.json)."""
    refused = {}
    for name, optimizer in [
        ("lamb", lambda: keras.optimizers.Lamb(0.01)),
        ("clipnorm", lambda: keras.optimizers.SGD(0.1, clipnorm=1.0)),
    ]:
        with strategy.scope():
            model = build(optimizer())
        try:
            tfdist.fit(model, data(), epochs=1, steps_per_epoch=1, verbose=0)
        except tfdist.FitError as error:
            refused[name] = str(error)
    with open(os.path.join(out, "refused.json"), "w") as f:
        json.dump(refused, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)

"""One training function for Ray Train and for tfdist's launcher: tfdist.ray.fit at work.

  python -m tools.launch --workers 2 -- python -m tests.workers.ray_worker OUT

runs `train_loop` in two processes of tfdist's launcher; tests/test_ray.py runs the same
function in a Ray Train TensorflowTrainer with two workers. Each worker writes its final
weights and what it trained (epochs, losses, optimizer steps) to OUT/<task>.npz and
OUT/<task>.json. `train_on_ray_data` reads its data from a Ray Dataset shard instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist.ray  # noqa: E402

EXAMPLES = 256
GLOBAL_BATCH = 32  # 8 batches a pass
EPOCHS = 4
# 6 steps an epoch over the repeated data: epochs start mid-pass, so a resumed run that
# restarted the data instead of continuing it would train other batches.
STEPS_PER_EPOCH = 6


def build_model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(4),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),  # has state: a resume must restore it
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def examples() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(EXAMPLES, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + 2 * (x[:, 1] > 0)
    return x, y


def make_dataset() -> tf.data.Dataset:
    """The data in a fixed order, batched with the global batch, repeated."""
    return tf.data.Dataset.from_tensor_slices(examples()).batch(GLOBAL_BATCH).repeat()


def task_name() -> str:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return f"{task['type']}_{task['index']}"


class KillOnce(keras.callbacks.Callback):
    """SIGKILLs this process as `epoch` begins, the first time (a marker file remembers).

    Under Ray it first waits until Ray Train's controller has registered every report made
    so far (a report reaches it a moment after `ray.train.report` returns), so the run
    resumes from the checkpoint of the epoch before, not sometimes from an older one.
    """

    def __init__(self, marker: str, epoch: int):
        super().__init__()
        self.marker, self.epoch = marker, epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch and not os.path.exists(self.marker):
            if tfdist.ray.in_ray_train_worker():
                import ray.train

                ray.train.get_all_reported_checkpoints()
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def train_loop(config: dict) -> None:
    """Trains on every worker; config: out, and optionally kill (task, epoch, marker)."""
    callbacks = []
    kill = config.get("kill")
    if kill and task_name() == kill["task"]:
        callbacks.append(KillOnce(kill["marker"], kill["epoch"]))
    history = tfdist.ray.fit(
        build_model,
        make_dataset,
        epochs=EPOCHS,
        steps_per_epoch=STEPS_PER_EPOCH,
        verbose=0,
        callbacks=callbacks,
    )
    save(config["out"], history)


def train_on_ray_data(config: dict) -> None:
    """Trains on this worker's shard of the trainer's Ray Dataset "train" (x, y columns)."""
    data = tfdist.ray.dataset_shard(
        "train", feature_columns="x", label_columns="y", global_batch_size=GLOBAL_BATCH
    )
    history = tfdist.ray.fit(build_model, data, epochs=2, verbose=0)
    save(config["out"], history)


def save(out: str, history: keras.callbacks.History) -> None:
    model = history.model
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, f"{task_name()}.npz"), *model.get_weights())
    with open(os.path.join(out, f"{task_name()}.json"), "w") as f:
        json.dump(
            {
                "epochs": history.epoch,
                "loss": history.history.get("loss", []),
                "steps": int(model.optimizer.iterations.numpy()),
            },
            f,
        )


if __name__ == "__main__":
    train_loop({"out": sys.argv[1]})

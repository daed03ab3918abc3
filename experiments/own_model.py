"""Your own Keras model under tfdist: TensorFlow's "Multi-worker training with Keras" tutorial,
with `tfdist.fit` where Keras 3's `model.fit` fails under MultiWorkerMirroredStrategy.

  # two worker processes on this machine (tfdist's launcher sets each one's TF_CONFIG)
  tfdist-launch --workers 2 -- python -m experiments.own_model
  # one process, no distribution; or a parameter-server job (workers and ps serve)
  python -m experiments.own_model
  tfdist-launch --chief --workers 2 --ps 1 -- python -m experiments.own_model

Nothing in it is tfdist's but the strategy, `tfdist.fit` and `tfdist.evaluate`: the model,
its loss, metrics and callbacks are plain Keras. On 2 workers the chief prints each epoch's
loss and accuracy (those of both workers' batches) and ends near "test accuracy 0.93".
"""

from __future__ import annotations

import os

from tfdist.signals import route_stop_signals  # noqa: E402

if __name__ == "__main__":
    # Before TensorFlow starts a thread, so SIGTERM ends this task at any moment (tfdist/signals.py).
    route_stop_signals()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import flags  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfdist  # noqa: E402
from experiments import common  # noqa: E402

flags.DEFINE_integer("epochs", 3, "Epochs to train.", lower_bound=1)
flags.DEFINE_integer("steps_per_epoch", 70, "Steps per epoch.", lower_bound=1)
flags.DEFINE_integer("global_batch_size", 64, "Examples per step over all workers.", lower_bound=1)
flags.DEFINE_string(
    "backup_dir",
    None,
    "Where BackupAndRestore keeps the training state, so a killed job resumes (default: a "
    "directory under /tmp named after the job).",
)
FLAGS = flags.FLAGS


def digits_dataset(global_batch_size: int) -> tuple[tf.data.Dataset, tf.data.Dataset]:
    """The tutorial's mnist_dataset(), on the 8x8 digits that ship with scikit-learn."""
    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    train = (
        tf.data.Dataset.from_tensor_slices((x[:1500], y[:1500]))
        .shuffle(1500, seed=0)
        .repeat()
        .batch(global_batch_size)
    )
    test = tf.data.Dataset.from_tensor_slices((x[1500:], y[1500:])).batch(global_batch_size)
    return train, test


def build_and_compile_cnn_model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
        metrics=["accuracy"],
    )
    return model


def main(argv):
    del argv
    tfdist.setup_logging()  # tfdist's INFO lines; TensorFlow's from WARNING up
    if tfdist.serve_if_needed():
        return  # a parameter-server worker or ps: it served until the chief finished
    strategy = tfdist.build_strategy("auto")  # from TF_CONFIG: multi_worker_mirrored here
    train, test = digits_dataset(FLAGS.global_batch_size)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = build_and_compile_cnn_model()
    backup_dir = FLAGS.backup_dir or os.path.join("/tmp", f"tfdist-own-model-{os.getppid()}")
    tfdist.fit(
        model,
        train,
        epochs=FLAGS.epochs,
        steps_per_epoch=FLAGS.steps_per_epoch,
        verbose=2,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir)],
    )
    results = tfdist.evaluate(model, test, return_dict=True, verbose=0)
    if tfdist.is_chief():  # the chief reports
        print(f"test loss {results['loss']:.4f}, test accuracy {results['accuracy']:.4f}")


if __name__ == "__main__":
    common.run(main, strategy_flags=False)

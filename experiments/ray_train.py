"""The digits cnn trained by Ray Train: a TensorflowTrainer whose loop is `tfdist.ray.fit`.

  # a laptop: starts a local Ray cluster in this process (2 workers)
  python -m experiments.ray_train
  # a Ray cluster (or KubeRay): run on its head node, or point RAY_ADDRESS at it
  python -m experiments.ray_train --address=auto --num_workers=4 --storage_path=/mnt/shared/ray

Ray starts --num_workers processes and sets each one's TF_CONFIG; each builds the strategy
from it (multi_worker_mirrored), the cnn in its scope, and trains with tfdist.fit, reading
its own shard of the digits TFRecords. Every epoch's logs and a checkpoint (worker 0's
weights and optimizer state) go to Ray Train; run the same command again (same --name and
--storage_path, more --epochs) and it resumes from the last checkpoint. Every node needs
tfdist installed (`pip install "tfdist[ray]"`); the training function travels with the job.

Expect on 2 cores, in about 45 s with Ray's start-up: "final: 2 Ray Train worker(s), epoch 5:
train loss 0.29, test accuracy 0.955" (five runs gave 0.936-0.961: the input pipeline reads
its files in parallel, in no fixed order).
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Ray's workers inherit it

import keras  # noqa: E402
import ray  # noqa: E402
import ray.train  # noqa: E402
from absl import flags  # noqa: E402
from ray.train.tensorflow import TensorflowTrainer  # noqa: E402

import tfdist.ray  # noqa: E402
from experiments import common  # noqa: E402
from tfdist.data import PipelineOptions, prepare_digits  # noqa: E402
from tfdist.models import build_model  # noqa: E402

flags.DEFINE_string(
    "address",
    None,
    "Ray cluster to run on: 'auto' (the one this node belongs to) or ray://HOST:10001. "
    "Default: $RAY_ADDRESS if set, else a local Ray cluster started here.",
)
flags.DEFINE_integer("num_workers", 2, "Training workers Ray starts (1 CPU each).", lower_bound=1)
flags.DEFINE_integer(
    "epochs", 5, "Epochs to train (in all, counting a resumed run's).", lower_bound=1
)
flags.DEFINE_integer("steps_per_epoch", 22, "Steps per epoch (1,438 examples / 64).", lower_bound=1)
flags.DEFINE_integer("global_batch_size", 64, "Examples per step over all workers.", lower_bound=1)
flags.DEFINE_string(
    "storage_path",
    "/tmp/tfdist-ray",
    "Where Ray Train keeps the run's checkpoints and results: a directory every node can "
    "read (NFS) or a bucket (s3://, gs://) on a cluster.",
)
flags.DEFINE_string("name", "digits_cnn", "The run's name; the same name and storage resume it.")
flags.DEFINE_string(
    "data_dir",
    None,
    "Where each worker finds (or writes, on first use) the digits TFRecords. Default: "
    "$TFDIST_DATA_DIR or ~/.cache/tfdist on each node.",
)
FLAGS = flags.FLAGS


def build_and_compile_cnn() -> keras.Model:
    model = build_model("cnn", input_shape=(8, 8, 1), num_classes=10)
    model.compile(
        optimizer=keras.optimizers.Adam(0.003),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def train_loop(config: dict) -> None:
    """What every Ray Train worker runs: the same call on a laptop and on a cluster.

    Ray pickles it with what it uses from this file; the rest comes from the tfdist
    installed on each node.
    """
    logging.getLogger("tfdist").setLevel(logging.INFO)  # strategy, batch arithmetic, resume
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    global_batch = config["global_batch_size"]

    def digits(split: str, context, options: PipelineOptions):
        # Each worker reads its own shard of the TFRecords, in per-replica batches.
        return prepare_digits(config["data_dir"]).dataset(
            split,
            batch_size=context.get_per_replica_batch_size(global_batch),
            input_context=context,
            options=options,
        )

    tfdist.ray.fit(
        build_and_compile_cnn,
        lambda context: digits("train", context, PipelineOptions(seed=0)),
        epochs=config["epochs"],
        steps_per_epoch=config["steps_per_epoch"],
        validation_data=lambda context: digits(
            "test", context, PipelineOptions(shuffle_buffer=0, repeat=False, drop_remainder=False)
        ),
        verbose=2,
    )


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    common.setup_logging()
    # The workers of a cluster started elsewhere do not inherit this process's environment.
    quiet = {"env_vars": {"TF_CPP_MIN_LOG_LEVEL": os.environ["TF_CPP_MIN_LOG_LEVEL"]}}
    address = FLAGS.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=quiet)
    else:  # a laptop: this process starts a Ray cluster of its own
        ray.init("local", num_cpus=max(FLAGS.num_workers, os.cpu_count() or 1), runtime_env=quiet)
    trainer = TensorflowTrainer(
        train_loop,
        train_loop_config={
            "epochs": FLAGS.epochs,
            "steps_per_epoch": FLAGS.steps_per_epoch,
            "global_batch_size": FLAGS.global_batch_size,
            "data_dir": FLAGS.data_dir,
        },
        scaling_config=ray.train.ScalingConfig(num_workers=FLAGS.num_workers),
        run_config=ray.train.RunConfig(name=FLAGS.name, storage_path=FLAGS.storage_path),
    )
    result = trainer.fit()
    metrics = result.metrics or {}
    if "loss" not in metrics:  # a run resumed after its last epoch trains nothing more
        print(f"final: nothing left to train; checkpoint {result.checkpoint.path}", flush=True)
        return
    print(
        f"final: {FLAGS.num_workers} Ray Train worker(s), epoch {metrics['epoch']}: train loss "
        f"{metrics['loss']:.4f}, test accuracy {metrics['val_accuracy']:.4f}; "
        f"checkpoint {result.checkpoint.path}",
        flush=True,
    )


if __name__ == "__main__":
    common.run(main, strategy_flags=False)

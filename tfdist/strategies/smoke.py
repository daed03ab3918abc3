"""A few real distributed training steps of a tiny model, for any strategy.

This proves a strategy works end to end on the hardware present: variables are created
under its scope, data is distributed to its replicas, gradients are aggregated and applied.
The data and the initial weights depend only on `seed`, so the weights after the steps can
be compared across strategies: synchronous data parallelism must match one device.
"""

from __future__ import annotations

import dataclasses
import time

import keras
import numpy as np
import tensorflow as tf

from tfdist.strategies import needs_coordinator, strategy_kind

FEATURES, HIDDEN, CLASSES = 8, 16, 4


@dataclasses.dataclass(frozen=True)
class SmokeResult:
    """What a smoke run did: the losses of its steps and the weights it ended with."""

    strategy: str
    replicas: int
    global_batch_size: int
    losses: tuple[float, ...]
    weights: tuple[float, ...]
    seconds: float

    def max_abs_diff(self, other: SmokeResult) -> float:
        return float(np.max(np.abs(np.subtract(self.weights, other.weights))))


def smoke_data(*, steps: int, global_batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixed examples of a smoke run, `steps` global batches of them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * global_batch_size, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=steps * global_batch_size).astype(np.int32)
    return x, y


def run_smoke_steps(
    strategy: tf.distribute.Strategy,
    *,
    steps: int = 3,
    global_batch_size: int = 16,
    learning_rate: float = 0.1,
    seed: int = 0,
) -> SmokeResult:
    """Trains a 2-layer MLP for `steps` SGD steps under `strategy` and reports the result.

    Every global batch is split across the input pipelines and replicas, each replica's loss
    is averaged over the global batch, and the strategy sums the gradients — so with any
    synchronous strategy the weights equal those of one device up to float rounding. Under
    ParameterServerStrategy each step is scheduled through a ClusterCoordinator and waited
    for before the next, with its global batch passed along, so whichever worker runs step k
    trains on batch k and the result is exact too.

    Raises:
      ValueError: the global batch does not split evenly over the replicas.
    """
    replicas = strategy.num_replicas_in_sync
    if global_batch_size % replicas:
        raise ValueError(
            f"The global batch size must be divisible by the {replicas} replicas in sync. "
            f"Received: global_batch_size={global_batch_size}"
        )
    x, y = smoke_data(steps=steps, global_batch_size=global_batch_size, seed=seed)
    start = time.perf_counter()
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(HIDDEN, activation="relu"),
                keras.layers.Dense(CLASSES),
            ]
        )
        optimizer = keras.optimizers.SGD(learning_rate)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        per_replica = global_batch_size // replicas
        # This pipeline's contiguous share of every global batch, cut into per-replica batches.
        share = global_batch_size // context.num_input_pipelines
        lo = context.input_pipeline_id * share
        xs = x.reshape(steps, global_batch_size, FEATURES)[:, lo : lo + share].reshape(-1, FEATURES)
        ys = y.reshape(steps, global_batch_size)[:, lo : lo + share].reshape(-1)
        return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(per_replica)

    def replica_step(features, labels):
        with tf.GradientTape() as tape:
            per_example = loss_fn(labels, model(features, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_step(iterator):
        per_replica_loss = strategy.run(replica_step, args=next(iterator))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_loss, axis=None)

    losses = []
    if needs_coordinator(strategy):
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        ps_step = tf.function(lambda xb, yb: strategy.run(replica_step, args=(xb, yb)))
        for k in range(steps):
            batch = slice(k * global_batch_size, (k + 1) * global_batch_size)
            remote = coordinator.schedule(ps_step, args=(x[batch], y[batch]))
            coordinator.join()  # one step at a time: concurrent steps would race
            losses.append(float(remote.fetch()))
    else:
        iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
        losses = [float(train_step(iterator)) for _ in range(steps)]
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()])
    return SmokeResult(
        strategy=strategy_kind(strategy),
        replicas=replicas,
        global_batch_size=global_batch_size,
        losses=tuple(losses),
        weights=tuple(float(w) for w in weights),
        seconds=time.perf_counter() - start,
    )

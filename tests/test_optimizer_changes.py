"""A change to the user's optimizer during fit reaches every copy or shard of it, in every
mode: a callback's new learning rate (LearningRateScheduler, ReduceLROnPlateau, a custom
callback assigning `model.optimizer.learning_rate`), and the step count callbacks read.

The reference is Keras's own fit on one device with the same callbacks, same data, same
order. Modes that step copies of the user's optimizer (pipeline stages, ZeRO's slices, the
tensor-parallel parts, local SGD's replicas) once trained on at the rate they were built
with: a pipeline ignored every callback's rate.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfdist
from tests import pipeline_cases
from tfdist.parallel import Pipeline, dense_model, tensor_parallel

TOLERANCE = 1e-5
EPOCHS = 3


class HalveAtThirdBatch(keras.callbacks.Callback):
    """Assigns the optimizer's rate in the middle of each epoch, as a user's callback does."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 2:
            rate = self.model.optimizer.learning_rate
            rate.assign(rate * 0.5)


class Steps(keras.callbacks.Callback):
    """Records the optimizer's step count after each batch."""

    def __init__(self):
        super().__init__()
        self.seen: list[int] = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(int(self.model.optimizer.iterations.numpy()))


def callbacks() -> list[keras.callbacks.Callback]:
    return [
        keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.1 if epoch else rate),
        HalveAtThirdBatch(),
        # min_delta above any improvement: the rate halves at every epoch's end
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10),
        Steps(),
    ]


class HalveEachEpoch(keras.callbacks.Callback):
    """Assigns the optimizer's rate as each epoch after the first begins."""

    def on_epoch_begin(self, epoch, logs=None):
        if epoch:
            rate = self.model.optimizer.learning_rate
            rate.assign(rate * 0.5)


class EpochSteps(keras.callbacks.Callback):
    """Records the optimizer's step count at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.seen: list[int] = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(int(self.model.optimizer.iterations.numpy()))


def epoch_callbacks() -> list[keras.callbacks.Callback]:
    """The same changes made between epochs only: under parameter_server, batch-level
    callbacks run as steps are scheduled, not as the workers finish them (README)."""
    return [
        keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.1 if epoch else rate),
        HalveEachEpoch(),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10),
        EpochSteps(),
    ]


def sgd_momentum(model: keras.Model) -> keras.Model:
    """Local SGD averaging every step, and gossip between two replicas, are synchronous SGD
    only for an optimizer whose update is linear in the gradient."""
    model.compile(
        keras.optimizers.SGD(0.05, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def split(model: keras.Model) -> keras.Model:
    made = tensor_parallel(model, degree=2)
    made.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return made


# name -> (devices, how the model is made from pipeline_cases.mlp(), fit's keywords)
MODES = {
    "plain": (2, None, {}),
    "zero1": (2, None, {"shard_optimizer": "zero1"}),
    "zero2": (2, None, {"shard_optimizer": "zero2"}),
    "zero3": (2, None, {"shard_optimizer": "zero3"}),
    "accumulate": (2, None, {"accumulate_steps": 2}),
    "pipeline 1f1b": (2, None, {"pipeline": ("1f1b", 1, ["d3"])}),
    "pipeline gpipe 2x2": (4, None, {"pipeline": ("gpipe", 1, ["d3"])}),
    "pipeline interleaved": (2, None, {"pipeline": ("interleaved", 2, ["d2", "d3", "d4"])}),
    "tensor": (2, split, {}),
    "local sgd": (2, sgd_momentum, {"average_every": 1}),
    "gossip": (2, sgd_momentum, {"gossip": "ring"}),
}


def reference(make, made_callbacks=callbacks) -> tuple[list[np.ndarray], dict, list[int]]:
    model = pipeline_cases.mlp()
    if make is sgd_momentum:
        model = sgd_momentum(model)
    given = made_callbacks()
    history = model.fit(
        pipeline_cases.data(), epochs=EPOCHS, verbose=0, shuffle=False, callbacks=given
    )
    return model.get_weights(), history.history, given[-1].seen


@pytest.mark.parametrize("mode", list(MODES))
def test_every_callback_s_rate_reaches_every_copy_as_keras_applies_it(mode):
    devices, make, keywords = MODES[mode]
    want, history, steps = reference(make)
    strategy = tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(devices)]
    )
    with strategy.scope():
        model = pipeline_cases.mlp()
        if make is not None:
            model = make(model)
    if "pipeline" in keywords:
        schedule, chunks, cuts = keywords["pipeline"]
        keywords = {
            "pipeline": Pipeline(
                cut_before=cuts, micro_batches=2, schedule=schedule, chunks_per_device=chunks
            )
        }
    given = callbacks()
    got = tfdist.fit(
        model, pipeline_cases.data(), epochs=EPOCHS, verbose=0, callbacks=given, **keywords
    )
    weights = (dense_model(model) if make is split else model).get_weights()
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(want, weights, strict=True))
    assert diff <= TOLERANCE, f"{mode}: max |dw| {diff:.2e} from Keras's fit with the callbacks"
    assert got.history["learning_rate"] == pytest.approx(history["learning_rate"], rel=1e-6)
    assert got.history["loss"] == pytest.approx(history["loss"], abs=1e-5)
    assert given[-1].seen == steps  # the step count, after every batch


def test_the_rate_a_callback_sets_changes_what_a_pipeline_trains():
    """The check above cannot pass by accident: without the callbacks the pipeline trains
    other weights."""
    with_callbacks, _, _ = reference(None)
    plain = pipeline_cases.mlp()
    plain.fit(pipeline_cases.data(), epochs=EPOCHS, verbose=0, shuffle=False)
    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(with_callbacks, plain.get_weights(), strict=True)
    )
    assert diff > 100 * TOLERANCE

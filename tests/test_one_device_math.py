"""One device's math in every mode, on keras.io's models as keras.io writes them.

keras.io's seq2seq Transformer (two named inputs, padded sequences, a loss masked by the
padding, causal and cross attention) and its ViT (patches, a position Embedding, AdamW or
RMSprop) trained by tfdist.fit over 2 replicas, against Keras's own fit on one device, same
initial weights, same data, same order. Two things made the replicas differ (as Keras's own
MirroredStrategy still does, which the last test shows):

- each replica divided its masked loss by its own count of real tokens, where one device
  divides by the whole batch's (tfdist.training.loss_normalisation);
- an Embedding looked up by ids that do not depend on the batch (positions) gives one row
  per id on one device, but one per replica when split, and Adam, AdamW and RMSprop square
  each row apart (tfdist.training.sparse_rows).

Two worker processes are held to the same figures in tests/test_fit_multiworker.py.
"""

from __future__ import annotations

import pytest

from tools import keras_io_models
from tools.one_device_math import EPOCHS, MODELS, MODES, data, mirrored, train

# Every test reads the references (4 of Keras's fits): one pytest worker runs the module.
pytestmark = pytest.mark.xdist_group("one_device_math")

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def references():
    """Keras's own fit on one device, per model: (the model, its history)."""
    out = {}
    for name, (make, source) in MODELS.items():
        model = make()
        history = model.fit(data(source), epochs=EPOCHS, verbose=0, shuffle=False).history
        out[name] = model, history
    return out


# SGD's seq2seq run only plain and pipelined (the masked loss's normalisation; every mode
# shares it, and rmsprop holds each mode to the rows too): the suite's time.
CASES = [
    (model, mode)
    for model in MODELS
    for mode in MODES
    if model != "seq2seq sgd" or mode in ("plain", "pipeline")
]


@pytest.mark.parametrize("model, mode", CASES)
def test_keras_io_models_train_as_keras_on_one_device(references, model, mode):
    reference, history = references[model]
    trained, got = train(model, MODES[mode])
    diff = keras_io_models.max_diff(reference, trained)
    assert diff <= TOLERANCE, f"{model} under {mode}: max |dw| {diff:.2e} from one device"
    if mode == "accumulate" and model.startswith("seq2seq"):
        # The logged loss averages the micro-batches' own masked means (Keras's train_step
        # logs each); the weights above take the whole batch's.
        return
    assert got["loss"] == pytest.approx(history["loss"], abs=1e-5)


@pytest.mark.parametrize("model", ["seq2seq rmsprop", "seq2seq sgd", "vit adamw"])
def test_keras_s_own_mirrored_fit_is_not_one_device_s_math_here(references, model):
    """What the tests above hold tfdist to is stricter than Keras's own MirroredStrategy,
    which divides each replica's loss by its own tokens and keeps each replica's position
    rows apart: the comparison can tell the two apart."""
    reference, _ = references[model]
    make, source = MODELS[model]
    with mirrored().scope():
        keras_mirrored = make()
    keras_mirrored.fit(data(source), epochs=EPOCHS, verbose=0, shuffle=False)
    assert keras_io_models.max_diff(reference, keras_mirrored) > 100 * TOLERANCE

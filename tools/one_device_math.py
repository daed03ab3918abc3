"""Measurement: how far each mode of tfdist.fit lands from Keras's own fit on one device.

keras.io's seq2seq Transformer (padded pairs, a masked loss, two inputs) and ViT (a position
Embedding), with the optimizers keras.io uses and one other, trained 2 epochs over 2
replicas (logical CPUs) in each mode: plain data parallelism, zero1/2/3, accumulation of 2,
tensor_parallel(degree=2) and a 2-stage pipeline (the seq2seq cut between encoder and
decoder, the ViT between its blocks). Each cell is the largest |difference| of any weight
from Keras's fit of the same model on one device, same initial weights, same data, same
order (the attention key biases apart: tools/keras_io_models.py says why), beside Keras's
own fit under its MirroredStrategy over the same 2 devices. tests/test_one_device_math.py
holds every tfdist cell to 1e-5.

  python -m tools.one_device_math                  # the whole table, about 6 minutes
  python -m tools.one_device_math --models "vit adamw" --modes plain pipeline
"""

from __future__ import annotations

import argparse
import sys

import keras

import tfdist
from tfdist.parallel import Pipeline, dense_model, split_layers, tensor_parallel
from tools import keras_io_models

# The matrix, shared with tests/test_one_device_math.py (which holds every cell to 1e-5).
EPOCHS = 2
MODELS = {
    "seq2seq rmsprop": (lambda: keras_io_models.seq2seq(optimizer="rmsprop"), "sentence_pairs"),
    "seq2seq sgd": (lambda: keras_io_models.seq2seq(optimizer="sgd"), "sentence_pairs"),
    "vit adamw": (lambda: keras_io_models.vit(optimizer="adamw"), "images"),
    "vit rmsprop": (lambda: keras_io_models.vit(optimizer="rmsprop"), "images"),
}
# Where the 2-stage pipeline cuts each: the seq2seq model between its encoder and decoder (the
# encoder's output and the decoder's embedded input cross, each with its padding mask), the
# ViT between its transformer blocks.
CUTS = {"seq2seq": "decoder", "vit": "ln1a"}
MODES = {
    "plain": {},
    "zero1": {"shard_optimizer": "zero1"},
    "zero2": {"shard_optimizer": "zero2"},
    "zero3": {"shard_optimizer": "zero3"},
    "accumulate": {"accumulate_steps": 2},
    "tensor": {"tensor_parallel": 2},
    "pipeline": {"pipeline": CUTS},
}


def mirrored(devices: int = 2):
    return tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(devices)]
    )


def data(name: str):
    return getattr(keras_io_models, name)()


def train(name: str, mode: dict) -> tuple[keras.Model, dict]:
    """Model `name` trained by tfdist.fit over 2 replicas in `mode` (one of MODES):
    (the model, dense again if it was split; the history's logs)."""
    make, source = MODELS[name]
    keywords = dict(mode)
    with mirrored().scope():
        model = make()
        if "tensor_parallel" in keywords:
            optimizer, loss = model.optimizer, model.loss
            model = tensor_parallel(model, degree=keywords.pop("tensor_parallel"))
            model.compile(
                type(optimizer).from_config(optimizer.get_config()), loss, metrics=["accuracy"]
            )
    if "pipeline" in keywords:
        cut = keywords["pipeline"][name.split()[0]]
        keywords["pipeline"] = Pipeline(cut_before=[cut], micro_batches=2)
    history = tfdist.fit(model, data(source), epochs=EPOCHS, verbose=0, **keywords).history
    return (dense_model(model) if split_layers(model) else model), history


def main(argv=None) -> int:
    tfdist.configure_cpu_devices(2)

    parser = argparse.ArgumentParser(
        prog="python -m tools.one_device_math", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args(argv)

    columns = ["Keras MirroredStrategy", *args.modes]
    print(f"max |dw| from Keras's fit on one device, {EPOCHS} epochs, 2 replicas")
    print("| model | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name in args.models:
        make, source = MODELS[name]
        reference = make()
        reference.fit(data(source), epochs=EPOCHS, verbose=0, shuffle=False)
        with mirrored().scope():
            keras_mirrored = make()
        keras_mirrored.fit(data(source), epochs=EPOCHS, verbose=0, shuffle=False)
        cells = [keras_io_models.max_diff(reference, keras_mirrored)]
        for mode in args.modes:
            trained, _ = train(name, MODES[mode])
            cells.append(keras_io_models.max_diff(reference, trained))
        print(f"| {name} | " + " | ".join(f"{c:.1e}" for c in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

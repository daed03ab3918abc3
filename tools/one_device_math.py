"""Measurement: how far each mode of tfdist.fit lands from Keras's own fit on one device.

keras.io's seq2seq Transformer (padded pairs, a masked loss, two inputs) and ViT (a position
Embedding), with the optimizers keras.io uses and one other, trained 2 epochs over 2
replicas (logical CPUs) in each mode: plain data parallelism, zero1/2/3, accumulation of 2,
tensor_parallel(degree=2) and a 2-stage pipeline (the seq2seq cut between encoder and
decoder, the ViT between its blocks). Each cell is the largest |difference| of any weight
from Keras's fit of the same model on one device, same initial weights, same data, same
order (the attention key biases apart: tests/keras_io_models.py says why), beside Keras's
own fit under its MirroredStrategy over the same 2 devices. tests/test_one_device_math.py
holds every tfdist cell to 1e-5.

  python -m tools.one_device_math                  # the whole table, about 6 minutes
  python -m tools.one_device_math --models "vit adamw" --modes plain pipeline
"""

from __future__ import annotations

import argparse
import sys

import tfdist


def main(argv=None) -> int:
    tfdist.configure_cpu_devices(2)
    from tests import keras_io_models
    from tests.test_one_device_math import EPOCHS, MODELS, MODES, data, mirrored, train

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

"""`tfdist.patch_keras()`: the one line that lets an existing Keras script keep its
`model.fit`, `model.evaluate` and `model.predict` calls and train through tfdist.

After it, those methods call `tfdist.fit`, `tfdist.evaluate` and `tfdist.predict` with the same
arguments wherever Keras 3's own cannot train: across the worker processes of
multi_worker_mirrored (where Keras fails with "Attempt to convert a value (PerReplica..."),
under parameter_server and central_storage, on a model tfdist split, and for a `fit` that names
one of tfdist's modes (`model.fit(..., shard_optimizer="zero2")`). Everywhere else Keras's own
method runs, untouched (tfdist/strategies/keras_guard.py decides which).

    import tfdist
    tfdist.patch_keras()              # the one added line
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_and_compile_model()
    model.fit(dataset, epochs=3, steps_per_epoch=70)   # trains through tfdist.fit

`tfdist.patch_keras(False)` turns the routing off: those calls then stop with one line naming
the fix.
"""

from __future__ import annotations

import inspect
from typing import Any

import keras

from tfdist.errors import FitError
from tfdist.parallel import registry
from tfdist.strategies import keras_guard


def patch_keras(enabled: bool = True) -> None:
    """Sends `model.fit` / `evaluate` / `predict` to tfdist where Keras's own cannot train
    (see the module); `enabled=False` stops sending them."""
    keras_guard.set_router(_route if enabled else None, registry.keywords())


def _route(name: str, model: keras.Model, args: tuple, kwargs: dict) -> Any:
    modes = {k: kwargs.pop(k) for k in list(kwargs) if k in registry.keywords()}
    if modes and name != "fit":
        raise FitError(
            f"model.{name} takes none of tfdist's modes; they shape training. Received: "
            + ", ".join(f"{k}={v!r}" for k, v in modes.items())
        )
    try:
        bound = inspect.signature(keras_guard.keras_method(name)).bind(model, *args, **kwargs)
    except TypeError as error:
        raise FitError(f"model.{name}: {error}") from None
    arguments = dict(bound.arguments)
    del arguments["self"]
    arguments.update(arguments.pop("kwargs", {}))
    return _tfdist_method(name)(model, **arguments, **modes)


def _tfdist_method(name: str):
    if name == "predict":
        from tfdist.api.predict import predict

        return predict
    from tfdist.api import fit as fit_module

    return getattr(fit_module, name)

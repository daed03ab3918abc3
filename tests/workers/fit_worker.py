"""A user's own training script, run by every task of a launched job: tfdist.fit at work.

  python -m tools.launch --workers 2 -- python -m tests.workers.fit_worker equivalence OUT
  python -m tools.launch --workers 2 -- python -m tests.workers.fit_worker equivalence,custom OUT
  python -m tools.launch --chief --workers 3 --ps 2 -- python -m tests.workers.fit_worker ps,custom_ps OUT

MODES is one mode or several, comma-separated, run one after another on one strategy (a
job's start costs more than most of its modes): the multi-worker ones (equivalence,
callbacks, custom, cnn, per_call, batch_norm, outside_scope, dropin) on a multi_worker_mirrored
strategy, the parameter-server ones (ps, custom_ps, dropin_ps) on a parameter_server one. Each task
writes what a mode trained to OUT/<task>/ (one mode) or OUT/<mode>/<task>/ (several) for
tests/test_fit_multiworker.py to check.
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tests import custom_step_models, fit_models  # noqa: E402
from tools import keras_io_models  # noqa: E402


def task_name() -> str:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return f"{task['type']}_{task['index']}"


def save(out: str, name: str, model: keras.Model, history: dict) -> None:
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, f"{name}.npz"), *model.get_weights())
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(history, f)


def equivalence(out: str, strategy) -> None:
    for name, case in fit_models.CASES.items():
        with strategy.scope():
            model, data = case()
        history = tfdist.fit(model, data, epochs=fit_models.EPOCHS, verbose=0)
        evaluation = tfdist.evaluate(model, data, verbose=0, return_dict=True)
        save(out, name, model, {"history": history.history, "evaluate": evaluation})


def per_call(out: str, strategy) -> None:
    """The cnn case at 1 and 4 steps a call (calls of 4, 4 and 2 of its 10 batches), and
    'auto'."""
    for steps in (1, 4, "auto"):
        with strategy.scope():
            model, data = fit_models.cnn()
        history = tfdist.fit(
            model, data, epochs=fit_models.EPOCHS, verbose=0, steps_per_execution=steps
        )
        save(out, f"cnn_{steps}", model, {"history": history.history})


def custom_steps(out: str, strategy) -> None:
    """The models with their own train_step / test_step (tests/custom_step_models.py)."""
    parameter_server = tfdist.strategy_kind(strategy) == "parameter_server"
    for name, case in custom_step_models.CASES.items():
        with strategy.scope():
            model, data = case()
        batches = custom_step_models.BatchLogs()
        steps = custom_step_models.EXAMPLES // custom_step_models.GLOBAL_BATCH
        history = tfdist.fit(
            model, data, epochs=custom_step_models.EPOCHS, verbose=0, callbacks=[batches],
            steps_per_epoch=steps if parameter_server else None,
        )  # fmt: skip
        evaluation = tfdist.evaluate(model, data, verbose=0, return_dict=True)
        save(
            out,
            name,
            model,
            {"history": history.history, "batches": batches.batches, "evaluate": evaluation},
        )


def cnn(out: str, strategy) -> None:
    """The cnn case alone, under multi_worker_mirrored (for layouts of several hosts)."""
    with strategy.scope():
        model, data = fit_models.cnn()
    history = tfdist.fit(model, data, epochs=fit_models.EPOCHS, verbose=0)
    save(out, "cnn", model, {"history": history.history})


def batch_norm(out: str, strategy) -> None:
    with strategy.scope():
        model, data = fit_models.batch_norm()
    history = tfdist.fit(model, data, epochs=fit_models.EPOCHS, verbose=0)
    evaluation = tfdist.evaluate(model, data, verbose=0, return_dict=True)
    save(out, "batch_norm", model, {"history": history.history, "evaluate": evaluation})
    np.save(os.path.join(out, "predictions.npy"), tfdist.predict(model, data, verbose=0))


def outside_scope(out: str, strategy) -> None:
    """A common mistake: the strategy is built, but the model is made outside its scope."""
    del out, strategy
    model, data = fit_models.cnn()
    tfdist.fit(model, data, epochs=1, verbose=0)


def callbacks(out: str, strategy) -> None:
    shared = os.path.join(os.path.dirname(out), "shared")
    with strategy.scope():
        model, data = fit_models.cnn()
    stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=0.05, patience=0)
    history = tfdist.fit(
        model,
        data,
        epochs=20,
        verbose=0,
        validation_data=data.take(2),
        callbacks=[
            stop,
            keras.callbacks.ModelCheckpoint(
                os.path.join(shared, "ckpt-{epoch:02d}.weights.h5"),
                save_weights_only=True,
                verbose=1,  # says "saving model to ..." on the chief only
            ),
            keras.callbacks.CSVLogger(os.path.join(shared, "log.csv"), append=True),
            keras.callbacks.TensorBoard(os.path.join(shared, "tb")),
        ],
    )
    save(out, "cnn", model, {"history": history.history, "stopped_epoch": stop.stopped_epoch})


class CountsTraces(keras.layers.Layer):
    """Counts the traces that call it: Python runs in a traced function only while tracing
    (here, on the coordinator, which traces the closures the workers run)."""

    traces = 0

    def call(self, x):
        if tf.inside_function() and not isinstance(x, keras.KerasTensor):
            CountsTraces.traces += 1
        return x


def parameter_server(out: str, strategy) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = digits.target.astype("int64")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Flatten(),
                CountsTraces(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.003),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    train = tf.data.Dataset.from_tensor_slices((x[:1400], y[:1400])).shuffle(1400).batch(64)
    test = tf.data.Dataset.from_tensor_slices((x[1400:], y[1400:])).batch(64)
    history = tfdist.fit(
        model, train, epochs=4, steps_per_epoch=40, validation_data=test, verbose=2
    )
    evaluation = tfdist.evaluate(model, test, return_dict=True, verbose=0)
    print(f"parameter_server test accuracy {evaluation['accuracy']:.3f}", flush=True)
    logits = tfdist.predict(model, x[1400:], batch_size=64, verbose=0)
    evaluation["predicted_accuracy"] = float(np.mean(np.argmax(logits, axis=1) == y[1400:]))
    # A second fit goes on with the first's coordinator, counter and traced closures.
    evaluation["first_traces"] = CountsTraces.traces
    again = tfdist.fit(model, train, epochs=1, steps_per_epoch=40, verbose=0)
    evaluation["second_fit_traces"] = CountsTraces.traces - evaluation["first_traces"]
    evaluation["second_fit_loss"] = again.history["loss"][0]
    evaluation["second_fit_staleness_max"] = again.history["staleness_max"][0]
    evaluation["iterations"] = int(model.optimizer.iterations.numpy())
    # Sharded optimizer state means nothing here: the ps hold each variable's state once.
    try:
        tfdist.fit(model, train, steps_per_epoch=1, verbose=0, shard_optimizer="zero2")
        evaluation["zero2"] = "trained"
    except tfdist.FitError as e:
        evaluation["zero2"] = str(e)
    save(out, "mlp", model, {"history": history.history, "evaluate": evaluation})


def tutorial_cnn() -> keras.Model:
    """The tensorflow.org multi-worker tutorial's `build_and_compile_cnn_model`, for the
    digits' 8x8 images (its 28x28 MNIST would be downloaded)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input(shape=(8, 8)),
            keras.layers.Reshape(target_shape=(8, 8, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.SGD(learning_rate=0.01),
        metrics=["accuracy"],
    )
    return model


def digits_dataset(global_batch_size: int) -> tf.data.Dataset:
    """The tutorial's `mnist_dataset`, on the digits: scaled, repeated, batched (no shuffle,
    so both routes see one order)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.images / 16.0).astype("float32"), digits.target.astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch_size)


def dropin(out: str, strategy) -> None:
    """The multi-worker tutorial's script as written for Keras 3, with the one line added:
    model.fit / evaluate / predict as the tutorial calls them; beside it, the same model
    trained by tfdist.fit, for the test to compare. Without the line, model.fit stops at once
    with one line."""
    dataset = digits_dataset(64 * strategy.num_replicas_in_sync)
    with strategy.scope():
        multi_worker_model = tutorial_cnn()
    try:
        multi_worker_model.fit(dataset, epochs=2, steps_per_epoch=6, verbose=0)
        without_the_line = "trained"
    except tfdist.FitError as error:
        without_the_line = str(error)
    images = dataset.map(lambda x, y: x)
    keras_logits = multi_worker_model.predict(images, steps=1, verbose=0)  # Keras's own
    tfdist_logits = tfdist.predict(multi_worker_model, images, steps=1, verbose=0)
    keras_predict = {
        "rows": int(keras_logits.shape[0]),
        "diff": float(np.max(np.abs(keras_logits - tfdist_logits))),
    }
    tfdist.patch_keras()
    history = multi_worker_model.fit(dataset, epochs=2, steps_per_epoch=6, verbose=0)
    evaluation = multi_worker_model.evaluate(dataset, steps=2, verbose=0, return_dict=True)
    logits = multi_worker_model.predict(dataset.map(lambda x, y: x), steps=1, verbose=0)
    evaluation["predicted_rows"] = int(logits.shape[0])
    # As keras.io writes it: every worker calls model.save on one path; only the chief's
    # write may reach it (each worker counts the files it opens there for writing).
    path = os.path.join(os.path.dirname(out), "model.keras")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    opened = []
    sys.addaudithook(
        lambda event, args: event == "open" and os.fspath(args[0]) == path
        and args[1] not in (None, "r", "rb") and opened.append(args[1])
    )  # fmt: skip
    multi_worker_model.save(path)
    record = {
        "history": history.history, "evaluate": evaluation, "without": without_the_line,
        "opened_for_writing": len(opened), "keras_predict": keras_predict,
    }  # fmt: skip
    save(out, "dropin", multi_worker_model, record)
    tfdist.patch_keras(False)
    with strategy.scope():
        model = tutorial_cnn()
    history = tfdist.fit(model, dataset, epochs=2, steps_per_epoch=6, verbose=0)
    evaluation = tfdist.evaluate(model, dataset, steps=2, verbose=0, return_dict=True)
    save(out, "tfdist", model, {"history": history.history, "evaluate": evaluation})


def dropin_ps(out: str, strategy) -> None:
    """The parameter-server tutorial's `model.fit` shape, with the one line added: a
    dataset_fn of per-replica batches (its DatasetCreator is gone from Keras 3), epochs and
    steps_per_epoch, a callback."""
    tfdist.patch_keras()

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(64)
        data = digits_dataset(batch).unbatch()
        data = data.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return data.shuffle(256, seed=input_context.input_pipeline_id).batch(batch).prefetch(2)

    with strategy.scope():
        model = tutorial_cnn()
    history = model.fit(
        dataset_fn, epochs=3, steps_per_epoch=10, verbose=0,
        callbacks=[keras.callbacks.TerminateOnNaN()],
    )  # fmt: skip
    save(out, "dropin", model, {"history": history.history})


def keras_io(out: str, strategy) -> None:
    """keras.io's seq2seq Transformer (masked loss, sparse rows) and ViT (a position
    Embedding under AdamW), as tests/test_one_device_math.py checks them in one process."""
    for name, (make, data) in keras_io_models.ONE_DEVICE_MATH.items():
        with strategy.scope():
            model = make()
        history = tfdist.fit(model, data(), epochs=2, verbose=0)
        save(out, name, model, {"history": history.history})


MODES = {
    "equivalence": equivalence,
    "per_call": per_call,
    "keras_io": keras_io,
    "dropin": dropin,
    "dropin_ps": dropin_ps,
    "callbacks": callbacks,
    "custom": custom_steps,
    "cnn": cnn,
    "batch_norm": batch_norm,
    "outside_scope": outside_scope,
    "ps": parameter_server,
    "custom_ps": custom_steps,
}
PARAMETER_SERVER_MODES = {"ps", "custom_ps", "dropin_ps"}


def main(modes: list[str], out: str) -> None:
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"unknown mode(s) {unknown}: {', '.join(MODES)}")
    if set(modes) & PARAMETER_SERVER_MODES:
        if tfdist.serve_if_needed():
            return  # a worker or ps: served until the chief finished
        strategy = tfdist.build_strategy("parameter_server")
    else:
        strategy = tfdist.build_strategy("multi_worker_mirrored")
    for mode in modes:
        where = out if len(modes) == 1 else os.path.join(out, mode)
        MODES[mode](os.path.join(where, task_name()), strategy)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tfdist").setLevel(logging.INFO)
    main(sys.argv[1].split(","), sys.argv[2])

"""ZeRO stage 3 (tfdist.parallel.zero.stage3): weights, gradients and optimizer state sharded over
the replicas, against Keras's own fit on one device (same data, same order), over 2 and 3
logical CPUs in this process. Worker processes: tests/test_zero.py's jobs; bytes per
device: tests/test_memory.py.
"""

from __future__ import annotations

import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests import custom_step_models, fit_models, zero_cases
from tfdist import compat
from tfdist.parallel import ShardedParameters, ShardingError
from tools import keras_hub_models, keras_io_models

TOLERANCE = 1e-5


def replicas(n: int):
    """n replicas on CPU:1..n (CPU:0 is the host, where host_scope keeps the whole model);
    4 on CPU:0..3."""
    first = 0 if n == 4 else 1
    return tfdist.build_strategy(
        "mirrored", cluster=None, devices=[f"/cpu:{i}" for i in range(first, first + n)]
    )


def max_diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def keras_fit(case, epochs: int = 1, calls: int = 1):
    """Keras's own fit on one device: the reference."""
    model, data = case()
    for _ in range(calls):
        model.fit(data, epochs=epochs, verbose=0, shuffle=False)
    return model


def zero3_fit(case, strategy, *, host: bool, epochs: int = 1, calls: int = 1):
    with tfdist.host_scope(strategy) if host else strategy.scope():
        model, data = case()
    for _ in range(calls):
        tfdist.fit(model, data, epochs=epochs, verbose=0, shard_optimizer="zero3")
    return model


CASES = {
    **fit_models.CASES,
    **{f"custom_step_{name}": case for name, case in custom_step_models.CASES.items()},
    "keras_io_padded_transformer": lambda: (
        keras_io_models.padded_classifier(),
        keras_io_models.reviews(padded=True),
    ),
    # keras.io's ViT with its position table indexed (`self.position[None]`): a gathered
    # weight answers indexing as the tensor it stands for.
    "keras_io_vit_indexed_positions": lambda: (
        keras_io_models.vit(indexed_positions=True),
        keras_io_models.images(),
    ),
    # keras-hub's layers (ReversibleEmbedding read twice: a lookup and the logits), GQA.
    "keras_hub_gemma_causal_lm": lambda: (
        keras_hub_models.gemma_causal_lm(),
        keras_hub_models.token_data(),
    ),
}


# A model whose loss is each replica's own mean, not scaled by the replicas, trains under a
# strategy as Keras's fit under that strategy does (the replicas' gradients add up): the
# reference for it is Keras's fit over the same replicas.
PER_REPLICA_LOSS = {"custom_step_own_keys"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_zero3_trains_the_models_users_bring_as_keras_fit_on_one_device(name):
    """A CNN, two inputs and outputs with sample weights, a regulariser, an Embedding, two
    models with their own train_step, keras.io's Transformer block behind a masking
    Embedding: built under host_scope over 2 replicas; the CNN also under strategy.scope()
    over 4 (its weights moved to the host when fit begins; 4 does not divide every weight)."""
    layouts = [(2, True)]
    if name == "cnn":
        layouts.append((4, False))
    for devices, host in layouts:
        if name in PER_REPLICA_LOSS:
            with replicas(devices).scope():
                reference = keras_fit(CASES[name], epochs=2)
        elif devices == layouts[0][0]:
            reference = keras_fit(CASES[name], epochs=2)
        model = zero3_fit(CASES[name], replicas(devices), host=host, epochs=2)
        # (attention key biases, whose true gradient is zero, held apart: keras_io_models)
        diff = keras_io_models.max_diff(reference, model)
        assert diff <= TOLERANCE, (name, devices, host, diff)


def test_fit_called_twice_trains_as_keras_fit_called_twice():
    """The slices and their optimizer state go on from one fit to the next."""
    case = CASES["cnn"]
    reference = keras_fit(case, calls=2).get_weights()
    model = zero3_fit(case, replicas(2), host=True, calls=2)
    assert max_diff(reference, model.get_weights()) <= TOLERANCE
    assert int(model.optimizer.iterations.numpy()) == 2 * fit_models.EXAMPLES // 32


def test_each_replica_holds_a_slice_of_each_weight_and_of_its_slots():
    strategy = replicas(2)
    hook = ShardedParameters()
    with tfdist.host_scope(strategy):
        model, data = fit_models.cnn()
    tfdist.fit(model, data, verbose=0, step_hooks=[hook])
    weights = sum(int(np.prod(w.shape)) * 4 for w in model.get_weights())
    held = hook.state_bytes()  # both replicas: the whole once, to a padding element a weight
    padding = 2 * 4 * len(model.trainable_variables)
    assert weights <= held["weight_slices"] <= weights + padding
    assert 2 * weights <= held["optimizer_state"] <= 2 * (weights + padding)
    for slices in hook.shards:  # each replica: 1/2 of every weight
        for shard, variable in zip(slices, model.trainable_variables, strict=True):
            assert int(shard.shape[0]) == -(-int(np.prod(variable.shape)) // 2)
    # No whole copy is left, on the host or elsewhere: each weight reads its slices.
    for i, variable in enumerate(model.trainable_variables):
        storage = compat.storage_of(variable)
        assert not isinstance(storage, tf.Variable)
        assert storage.handle is hook.shards[0][i].handle  # the tape's: the first replica's
        np.testing.assert_array_equal(
            np.concatenate([s[i].numpy() for s in hook.shards])[: storage.shape.num_elements()],
            np.reshape(variable.numpy(), [-1]),
        )  # fmt: skip


def test_predict_evaluate_and_save_after_fit_see_the_trained_weights(tmp_path):
    strategy = replicas(2)
    with tfdist.host_scope(strategy):
        model, data = fit_models.cnn()
    before = model.predict(data, verbose=0)
    tfdist.fit(model, data, verbose=0, shard_optimizer="zero3", validation_data=data)
    after = model.predict(data, verbose=0)
    assert np.abs(after - before).max() > 1e-3  # trained, and predict sees it
    path = tmp_path / "model.keras"
    # A model held in parts saves its weights through a file on disk, a weight at a time
    # (Keras would buffer the whole model in memory first: tools/peak_bench.py's save).
    from keras.src.saving import saving_lib

    assert saving_lib.is_memory_sufficient(model) is False
    assert saving_lib.is_memory_sufficient(fit_models.cnn()[0]) is True
    model.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.keras"]  # no file left
    loaded = keras.models.load_model(path)
    # One device against 2 replicas' kernels: the logits (about 3) agree to float32 rounding
    # (1.4e-6 measured), far inside what training moved them (> 1e-3).
    np.testing.assert_allclose(loaded.predict(data, verbose=0), after, atol=1e-5)


def test_a_checkpoint_resumes_with_another_number_of_replicas(tmp_path):
    """Saved with 2 replicas after one epoch, resumed with 4 for the second: the same weights
    as two epochs without a stop (the slots are saved whole)."""
    case = CASES["regularised"]
    reference = keras_fit(case, epochs=2).get_weights()
    for devices, epochs in ((2, 1), (4, 2)):
        with replicas(devices).scope():
            model, data = case()
        checkpoint = tfdist.StepCheckpoint(str(tmp_path / "checkpoints"))
        tfdist.fit(
            model, data, epochs=epochs, verbose=0, shard_optimizer="zero3",
            callbacks=[checkpoint],
        )  # fmt: skip
    assert max_diff(reference, model.get_weights()) <= TOLERANCE


def test_a_damaged_shard_is_passed_over_for_the_checkpoint_before(tmp_path, caplog):
    """Two epochs on 2 replicas save ckpt after each; bytes of the second's merged shards
    flipped, a resume on 4 replicas finds it from the checksum of what it reads (the
    metadata says it is whole), passes it over for the first and trains the second epoch
    again: the weights of two epochs without a stop."""
    import logging
    import re

    case = CASES["regularised"]
    reference = keras_fit(case, epochs=2).get_weights()
    directory = tmp_path / "checkpoints"  # the model_dir's
    caplog.set_level(logging.INFO, logger="tfdist")
    for devices in (2, 4):
        with replicas(devices).scope():
            model, data = case()
        tfdist.fit(
            model, data, epochs=2, verbose=0, shard_optimizer="zero3",
            callbacks=[tfdist.StepCheckpoint(str(tmp_path))],
        )  # fmt: skip
        if devices == 2:
            steps = sorted(int(p.name[5:-7]) for p in directory.glob("ckpt-*.shards"))
            assert len(steps) == 2, steps
            damaged = directory / f"ckpt-{steps[1]}.shards"
            (data_file,) = damaged.glob("merged.data-*")  # this process's one part
            content = bytearray(data_file.read_bytes())
            content[len(content) // 2] ^= 0xFF
            data_file.write_bytes(bytes(content))
    assert re.search(rf"ckpt-{steps[1]} is incomplete or corrupt: DataLossError", caplog.text)
    assert f"Resuming from {directory}/ckpt-{steps[0]}" in caplog.text
    assert re.search(
        rf"Read this process's part of ckpt-{steps[0]}: [\d.]+ MB of slices", caplog.text
    )
    assert max_diff(reference, model.get_weights()) <= TOLERANCE


def test_a_checkpoint_written_in_parts_resumes_where_the_whole_model_is_held(tmp_path, caplog):
    """zero3's StepCheckpoint holds the weights in its shards only, as slices of their
    flattened values. A job that holds the whole model (one device, no shard_optimizer)
    reads each weight and each of Adam's slots whole from them, and its second epoch gives
    the weights of two epochs without a stop. zero1, which keeps Adam's slots in slices of
    its own, has no place for the saved ones: one line, not a silent restart of Adam."""
    import logging

    from tfdist.training.checkpoints import CheckpointMismatchError

    case = CASES["regularised"]
    reference = keras_fit(case, epochs=2).get_weights()
    with replicas(4).scope():
        model, data = case()
    tfdist.fit(model, data, verbose=0, shard_optimizer="zero3",
               callbacks=[tfdist.StepCheckpoint(str(tmp_path / "zero3"))])  # fmt: skip
    for name in ("zero1", "one device"):
        shutil.copytree(tmp_path / "zero3", tmp_path / name)
    with replicas(2).scope():
        model, data = case()
    with pytest.raises(
        CheckpointMismatchError, match=r"holds state this job has no place for: trainable/0/.slot/"
    ):
        tfdist.fit(model, data, epochs=2, verbose=0, shard_optimizer="zero1",
                   callbacks=[tfdist.StepCheckpoint(str(tmp_path / "zero1"))])  # fmt: skip
    model, data = case()  # one device: Keras's default strategy
    caplog.set_level(logging.INFO, logger="tfdist")
    tfdist.fit(model, data, epochs=2, verbose=0,
               callbacks=[tfdist.StepCheckpoint(str(tmp_path / "one device"))])  # fmt: skip
    assert "Read this process's part of ckpt-" in caplog.text
    assert max_diff(reference, model.get_weights()) <= TOLERANCE


def test_mixed_bfloat16_trains_as_plain_data_parallelism_does():
    """Each replica computes in bfloat16 on its half of the batch, as under plain data
    parallelism (one device's bfloat16 sums round differently, so it is no reference)."""

    def train(shard):
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        try:
            with tfdist.host_scope(replicas(2)) if shard else replicas(2).scope():
                model = zero_cases.mlp("adam")
        finally:
            keras.mixed_precision.set_global_policy("float32")
        x, y = zero_cases.data()
        tfdist.fit(
            model, x, y, batch_size=zero_cases.GLOBAL_BATCH, shuffle=False, verbose=0,
            shard_optimizer=shard,
        )  # fmt: skip
        return model

    plain, sharded = train(None), train("zero3")
    assert sharded.layers[0].compute_dtype == "bfloat16"
    assert max_diff(plain.get_weights(), sharded.get_weights()) <= TOLERANCE


@pytest.mark.parametrize(
    "optimizer, devices, fragment",
    [
        (lambda: keras.optimizers.Adam(clipnorm=1.0), 2, "clipnorm"),
        (lambda: keras.optimizers.SGD(clipvalue=0.5), 2, "clipvalue"),
        (lambda: keras.optimizers.Lamb(), 2, "Lamb reads whole weights"),
        (keras.optimizers.Adam, 1, "this strategy has 1"),
    ],
)
def test_what_zero3_cannot_do_is_one_clear_line(optimizer, devices, fragment):
    with replicas(devices).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer(), "mse")
    x = np.zeros((8, 4), "float32")
    with pytest.raises(ShardingError, match=fragment):
        tfdist.fit(model, x, x[:, :2], batch_size=4, verbose=0, shard_optimizer="zero3")


def test_a_step_that_changes_the_gradients_is_refused_in_one_line():
    """zero3 sums the gradients the backward pass made; a hook that scales them (here
    accumulation, which weighs each micro-batch's) would be lost, so it is refused."""
    with replicas(2).scope():
        model, data = fit_models.regularised()
    with pytest.raises(
        ShardingError, match=r"changed the gradient of sequential\w*/dense\w*/kernel"
    ):
        tfdist.fit(model, data, verbose=0, shard_optimizer="zero3", accumulate_steps=2)


@pytest.mark.parametrize("shard_optimizer", ["zero1", "zero2"])
def test_a_host_scope_model_under_zero1_or_zero2_is_one_clear_line(shard_optimizer):
    """zero1/zero2 keep whole weights on every replica, which a host_scope model does not
    have there (it ended in 'IndexError: tuple index out of range')."""
    with tfdist.host_scope(replicas(2)):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("adam", "mse")
    x = np.zeros((8, 4), "float32")
    with pytest.raises(ShardingError, match="built in tfdist.host_scope.*zero3"):
        tfdist.fit(model, x, x[:, :2], batch_size=4, verbose=0, shard_optimizer=shard_optimizer)


def test_keras_s_own_fit_of_a_host_scope_model_is_one_line_naming_both_fixes():
    """Keras's fit cannot update weights held on the host (it failed deep in tf.distribute:
    'colocate_vars_with must only be passed a variable created in this ...')."""
    with tfdist.host_scope(replicas(2)):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("adam", "mse")
    x = np.zeros((8, 4), "float32")
    with pytest.raises(
        tfdist.FitError, match=r"host_scope.*tfdist\.fit\(model, \.\.\.\).*tfdist\.patch_keras"
    ):
        model.fit(x, x[:, :2], batch_size=4, verbose=0)


def test_a_host_scope_model_without_a_mode_made_for_it_is_one_clear_line():
    """Plain data parallelism keeps every weight whole on every replica; a host_scope model
    holds them in slices (before, TensorFlow's raw `colocate_vars_with` error)."""
    with tfdist.host_scope(replicas(2)):
        model, data = fit_models.CASES["cnn"]()
    with pytest.raises(tfdist.FitError, match=r"built in tfdist.host_scope.*zero3.*Pipeline"):
        tfdist.fit(model, data, verbose=0)

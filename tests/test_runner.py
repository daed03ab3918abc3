"""The engine's seam (tfdist/training/engine.py, job.py, hooks.py, runners/, controller.py): StepHooks sit
between a step's gradients and the update under every runner, the registry covers every
strategy kind, and the step-time breakdown is measured and written where users look."""

from __future__ import annotations

import glob
import logging
import os
import re
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests import custom_step_models
from tests.conftest import free_ports, run_python
from tfdist.errors import FitError
from tfdist.strategies import keras_guard
from tfdist.training.runners import RUNNERS

STRATEGIES = {
    "one_device": lambda: tfdist.build_strategy("one_device", cluster=None),
    "mirrored_x2": lambda: tfdist.build_strategy(
        "mirrored", cluster=None, devices=["/cpu:0", "/cpu:1"]
    ),
    "central_storage": lambda: tfdist.build_strategy("central_storage", cluster=None),
}


class ClipGlobalNorm(tfdist.StepHook):
    """The docstring's example hook: clips each replica's gradients by their global norm."""

    def __init__(self, norm: float):
        self.norm = norm
        self.calls = 0

    def apply(self, grads_and_vars, apply_next):
        self.calls += 1  # counted at trace time: once per traced replica step
        grads, variables = zip(*grads_and_vars, strict=True)
        grads, _ = tf.clip_by_global_norm(list(grads), self.norm)
        return apply_next(list(zip(grads, variables, strict=True)))


class HoldBack(tfdist.StepHook):
    """Never hands the gradients on: the weights must stay as they were."""

    def apply(self, grads_and_vars, apply_next):
        return None


def regression(seed: int = 3, **optimizer_options):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05, **optimizer_options), "mse", metrics=["mae"])
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 4)).astype("float32") * 5  # large gradients: clipping acts
    y = (x @ rng.normal(size=(4, 1)) * 3).astype("float32")
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_a_clipping_hook_trains_as_keras_global_clipnorm(strategy_name):
    # Keras clips inside the optimizer, per replica, before the all-reduce: the hook sits at
    # that point, so the two must train the same weights under the same strategy.
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        reference, data = regression(global_clipnorm=1.0)
    # Keras's own fit (tfdist guards it under central_storage, whose weights it trains right).
    keras_guard.keras_method("fit")(reference, data, epochs=2, verbose=0, shuffle=False)
    strategy = STRATEGIES[strategy_name]()
    hook = ClipGlobalNorm(1.0)
    with strategy.scope():
        model, data = regression()
    tfdist.fit(model, data, epochs=2, verbose=0, step_hooks=[hook])
    assert hook.calls >= 1
    assert max_diff(model.get_weights(), reference.get_weights()) <= 1e-5
    with strategy.scope():
        unclipped, data = regression()
    tfdist.fit(unclipped, data, epochs=2, verbose=0)
    pairs = zip(unclipped.get_weights(), reference.get_weights(), strict=True)
    assert not all(np.allclose(a, b, atol=1e-3) for a, b in pairs)  # the hook did clip


@pytest.mark.parametrize("strategy_name", ["mirrored_x2", "central_storage"])
def test_a_models_own_train_step_updates_through_the_hooks_too(strategy_name):
    # keras.io's custom train_step calls optimizer.apply itself; HoldBack must still stop it.
    def built(epochs: int, hooks=()):
        with STRATEGIES[strategy_name]().scope():
            model, data = custom_step_models.CASES["keras_io"]()
        history = tfdist.fit(model, data, epochs=epochs, verbose=0, step_hooks=hooks)
        return model, history

    initial, _ = built(0)  # built from the same seed, trained for no epoch
    held, history = built(1, [HoldBack()])
    trained, _ = built(1)
    assert history.history["loss"]  # the steps ran and logged
    assert max_diff(held.get_weights(), initial.get_weights()) == 0
    assert max_diff(trained.get_weights(), initial.get_weights()) > 1e-4


def test_step_hooks_take_step_hook_objects_only():
    model, data = regression()
    with pytest.raises(FitError, match=r"step_hooks takes tfdist.StepHook .* type function"):
        tfdist.fit(model, data, step_hooks=[lambda g, n: n(g)], verbose=0)


def test_every_strategy_kind_has_a_runner():
    kinds = set(tfdist.strategy_names()) - {"auto"}
    assert kinds | {"default"} <= set(RUNNERS), sorted(kinds - set(RUNNERS))


# The chief's line each epoch (step_times.describe): the step, then each phase.
STEP_TIMES = re.compile(
    r"Epoch (\d+): step (\S+) ms: input (\S+) ms \(\S+%\), compute (\S+) ms \(\S+%\), "
    r"exchange (\S+) ms \(\S+%\)"
)


def check_step_times(lines: list[str], board: str, epochs: int) -> None:
    """Every epoch's step times were measured, logged and written to TensorBoard's run."""
    assert len(lines) == epochs, lines
    for epoch, line in enumerate(lines, 1):
        match = STEP_TIMES.fullmatch(line)
        assert match and int(match[1]) == epoch, line
        phases = [float(value) for value in match.groups()[2:]]
        assert min(phases) >= 0 and sum(phases) > 0, line
    values: dict[str, list[float]] = {}
    for path in glob.glob(os.path.join(board, "step_time", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag.startswith("step_time/"):
                    values.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    assert sorted(values) == ["step_time/compute_ms", "step_time/exchange_ms", "step_time/input_ms"]
    for tag, per_epoch in values.items():
        assert len(per_epoch) == epochs, (tag, per_epoch)
        assert all(0 <= v < 10_000 for v in per_epoch), (tag, per_epoch)
    assert sum(phase[-1] for phase in values.values()) > 0


@pytest.mark.parametrize("strategy_name", ["mirrored_x2", "central_storage"])
def test_the_step_time_breakdown_is_logged_and_written_to_tensorboard(
    strategy_name, tmp_path, caplog
):
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        model, data = regression()
    board = keras.callbacks.TensorBoard(str(tmp_path / "tb"))
    with caplog.at_level(logging.DEBUG, logger="tfdist"):  # verbose=0: the lines are debug
        tfdist.fit(model, data, epochs=2, verbose=0, callbacks=[board])
    lines = [r.getMessage() for r in caplog.records if "input" in r.getMessage()]
    check_step_times(lines, str(tmp_path / "tb"), epochs=2)


# A parameter-server job in one process: its worker and ps servers run beside the chief (a
# process of its own, so that no other test's runtime is connected to the cluster).
PS_JOB = textwrap.dedent(
    """
    import logging, sys
    import keras, tensorflow as tf
    import tfdist
    from tests.test_runner import regression

    worker, ps, chief, board = sys.argv[1:]
    cluster = tf.train.ClusterSpec({"chief": [chief], "worker": [worker], "ps": [ps]})
    for job in ("worker", "ps"):
        tf.distribute.Server(cluster, job_name=job, task_index=0, protocol="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.SimpleClusterResolver(
            cluster, task_type="chief", task_id=0, rpc_layer="grpc"
        )
    )
    logging.basicConfig(stream=sys.stdout, format="%(message)s", force=True)
    logging.getLogger("tfdist").setLevel(logging.INFO)
    with strategy.scope():
        model, data = regression()
    callbacks = [keras.callbacks.TensorBoard(board)]
    tfdist.fit(model, data, epochs=2, steps_per_epoch=4, verbose=2, callbacks=callbacks)
    """
)


def test_parameter_server_steps_are_timed_on_the_workers(tmp_path):
    addresses = [f"localhost:{port}" for port in free_ports(3)]
    result = run_python(
        [sys.executable, "-c", PS_JOB, *addresses, str(tmp_path / "tb")],
        env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"},  # its cluster is its own
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if " ms: input " in line]
    check_step_times(lines, str(tmp_path / "tb"), epochs=2)


def test_each_replica_runs_its_own_chain_and_the_optimizer_is_left_as_it_was():
    # Mirrored traces its replicas' steps in threads of their own, at the same time: each
    # replica's update must go through its own chain, once, and the patch must not outlive fit.
    import collections
    import threading

    calls = collections.Counter()

    class CountThreads(tfdist.StepHook):
        def apply(self, grads_and_vars, apply_next):
            calls[threading.get_ident()] += 1
            return apply_next(grads_and_vars)

    strategy = STRATEGIES["mirrored_x2"]()
    with strategy.scope():
        model, data = regression()
    tfdist.fit(model, data, epochs=1, verbose=0, step_hooks=[CountThreads()])
    assert len(calls) == 2 and len(set(calls.values())) == 1, calls  # once per replica trace
    assert "apply" not in vars(model.optimizer)

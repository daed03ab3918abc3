"""What 'auto' means per strategy (tfdist.strategies.defaults for the hardware, the runners'
mode_defaults for the parallel modes), and the training binary's use of both."""

from __future__ import annotations

import pytest
from absl import flags

import tfdist
from experiments import train as train_binary
from tfdist.strategies.defaults import (
    TPU_STEPS_PER_EXECUTION,
    auto_mixed_precision,
    auto_steps_per_execution,
)
from tfdist.training.runners import describe_mode_default, mode_defaults
from tfdist.training.runners.parameter_server import PS_MAX_STALENESS

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "kind, steps, precision",
    [
        ("tpu", TPU_STEPS_PER_EXECUTION, "mixed_bfloat16"),
        ("one_device", 1, None),
        ("mirrored", 1, None),
        ("multi_worker_mirrored", 1, None),
        ("parameter_server", 1, None),
    ],
)
def test_auto_settings_by_strategy_kind(kind, steps, precision):
    assert auto_steps_per_execution(kind) == steps
    assert auto_mixed_precision(kind) == precision
    # Only parameter-server updates are stale: the bound that measured best, else none.
    bound = PS_MAX_STALENESS if kind == "parameter_server" else None
    assert mode_defaults(kind).get("max_staleness") == bound


def test_the_binary_says_what_auto_means_for_a_mode():
    said = describe_mode_default("max_staleness")
    assert said == f"{PS_MAX_STALENESS} under parameter_server; none elsewhere"
    assert said in train_binary.FLAGS["max_staleness"].help


@pytest.mark.parametrize(
    "args, bound",
    [((), None), (("--max_staleness=0",), 0), (("--max_staleness=none",), None)],
)
def test_binary_takes_a_staleness_bound(train_flags, args, bound):
    train_flags(*args)
    config = train_binary.train_config(tfdist.build_strategy("one_device", cluster=None))
    assert config.max_staleness == bound


def test_binary_rejects_a_bad_staleness_bound(train_flags):
    with pytest.raises(flags.IllegalFlagValueError, match="'auto', 'none' or a whole number"):
        train_flags("--max_staleness=-1")


def test_auto_settings_of_a_strategy_object():
    strategy = tfdist.build_strategy("mirrored", cluster=None, devices=("/cpu:0", "/cpu:1"))
    assert auto_steps_per_execution(strategy) == 1
    assert auto_mixed_precision(strategy) is None


@pytest.mark.parametrize(
    "args, steps, precision, before",
    [
        # 'auto' off a TPU: tfdist.fit measures the first calls, then chooses.
        ((), "auto", None, 1),
        (("--steps_per_execution=8", "--mixed_precision=mixed_bfloat16"), 8, "mixed_bfloat16", 8),
        (("--mixed_precision=none",), "auto", None, 1),
    ],
)
def test_binary_resolves_auto_flags_for_the_strategy(train_flags, args, steps, precision, before):
    train_flags(*args)
    config = train_binary.train_config(tfdist.build_strategy("one_device", cluster=None))
    assert (config.steps_per_execution, config.mixed_precision) == (steps, precision)
    # Before the strategy exists, 'auto' takes TrainConfig's defaults, so flags validate early.
    assert train_binary.train_config().steps_per_execution == before


def test_binary_rejects_a_bad_steps_per_execution(train_flags):
    with pytest.raises(
        flags.IllegalFlagValueError, match=r"must be 'auto' or a positive whole number"
    ):
        train_flags("--steps_per_execution=0")

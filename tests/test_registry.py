"""The registry of parallel modes (tfdist/parallel/registry.py) reaches every entry point:
fit's keywords and docstring, TrainConfig's fields, the binary's flags, the chain's order,
the chain's rules (tfdist/training/chain.py) and the resume check."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

import tfdist
from experiments import train as train_binary
from tfdist.app import ConfigError, TrainConfig
from tfdist.errors import FitError
from tfdist.parallel import registry
from tfdist.parallel.accumulate import Accumulate
from tfdist.parallel.asynchronous import BoundedStaleness, DelayCompensation
from tfdist.parallel.local_sgd import LocalSGD
from tfdist.parallel.zero.sharded import ShardedUpdate
from tfdist.training import chain
from tfdist.training.hooks import StepHook

pytestmark = pytest.mark.fast


def test_every_keyword_is_one_of_fit_s_with_its_default_and_its_line_in_the_docstring():
    parameters = inspect.signature(tfdist.fit).parameters
    doc = inspect.getdoc(tfdist.fit)
    for mode in registry.MODES:
        if mode.keyword is None:
            continue
        # A mode whose default depends on the strategy defaults to 'auto', as the binary's flag.
        want = registry.AUTO if mode.auto else mode.default
        assert parameters[mode.keyword].default == want
        assert parameters[mode.keyword].kind is inspect.Parameter.KEYWORD_ONLY
        first_words = " ".join(mode.summary.split()[:6])
        assert f"{mode.keyword}: {first_words}" in " ".join(doc.split()), mode.keyword


def test_every_flagged_mode_is_a_train_config_field_and_a_flag_of_the_binary():
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for mode in registry.flagged():
        assert fields[mode.keyword].default == mode.default
        flag = train_binary.FLAGS[mode.keyword]
        help_start = (mode.help or mode.summary).split("{auto}")[0][:40]
        assert help_start in flag.help, mode.keyword
    assert TrainConfig().mode_options() == {m.keyword: m.default for m in registry.flagged()}
    assert "pipeline" not in fields  # a layout object: no flag, no field


@pytest.mark.parametrize(
    "options, message",
    [
        ({"shard_optimizer": "zero4"}, r"shard_optimizer must be None or one of 'zero1', 'zero2'"),
        ({"accumulate_steps": 0}, "accumulate_steps must be a whole number >= 1"),
        ({"max_staleness": 1.5}, "max_staleness must be a whole number >= 0"),
        ({"gossip": "star"}, r"Received: gossip='star'"),
        ({"pipeline": 3}, "pipeline takes a tfdist.parallel.Pipeline"),
    ],
)
def test_a_bad_value_gets_one_message_wherever_it_is_given(options, message):
    (problem,) = registry.problems(options)
    assert re.search(message, problem), problem
    if "pipeline" not in options:
        with pytest.raises(ConfigError, match=message):
            TrainConfig(**options)


def test_the_chain_puts_each_mode_at_its_place_around_the_user_s_hooks():
    class Mine(StepHook):
        pass

    mine = Mine()
    hooks = registry.chain(
        {"shard_optimizer": "zero2", "accumulate_steps": 4, "max_staleness": 0,
         "async_correction": "dc"},
        [mine],
        model=None,
    )  # fmt: skip
    assert [type(h) for h in hooks] == [
        Accumulate, Mine, DelayCompensation, BoundedStaleness, ShardedUpdate,
    ]  # fmt: skip
    assert hooks[1] is mine and hooks[-1].stage == 2
    # Off by default: no keyword, no hook.
    assert registry.chain({}, [], model=None) == []


def test_the_chain_s_rules_come_from_what_hooks_declare():
    with pytest.raises(FitError, match="updates the weights its own way, and a step has one"):
        chain.check_chain([LocalSGD(2), ShardedUpdate(2)])
    with pytest.raises(FitError, match="must be the last of the step hooks"):
        chain.check_chain([ShardedUpdate(2), Accumulate(2)])
    chain.check_chain([Accumulate(2), ShardedUpdate(2)])
    with pytest.raises(FitError, match="accumulate_steps=3 must divide each replica's batch"):
        chain.check_batch([Accumulate(3)], per_replica_batch=16)
    with pytest.raises(FitError, match="step_hooks takes tfdist.StepHook objects"):
        chain.check_hooks([lambda grads: grads])


def test_a_resume_checks_the_modes_whose_state_is_laid_out_by_them():
    assert registry.resume_settings({"shard_optimizer": "zero1"}) == {"shard_optimizer": "zero1"}
    assert registry.resume_settings({}) == {"shard_optimizer": None}


def test_an_entry_marked_resume_must_match_is_all_a_mode_needs_to_refuse_a_changed_resume(
    tmp_path, monkeypatch
):
    """The binary's resume check reads the registry: an entry that says resume_must_match
    (here local SGD's, marked so for the test, as a new mode's would be) is refused on a
    resume under another value, with nothing else to edit."""
    from tfdist.app import Trainer
    from tfdist.training.checkpoints import CheckpointMismatchError

    def trainer(**options):
        config = TrainConfig(
            model="mlp", shuffle_buffer=0, global_batch_size=32, epochs=1, steps_per_epoch=2,
            eval_every=0, data_dir=str(tmp_path / "data"), model_dir=str(tmp_path / "run"),
            **options,
        )  # fmt: skip
        mirrored = tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:0", "/cpu:1"])
        return Trainer(config, strategy=mirrored)

    trainer(average_every=None).fit()
    trainer(average_every=2)  # unmarked: local SGD keeps no state of its own, it resumes
    marked = tuple(
        dataclasses.replace(m, resume_must_match=True) if m.keyword == "average_every" else m
        for m in registry.MODES
    )
    monkeypatch.setattr(registry, "MODES", marked)
    trainer(average_every=None).fit()  # the run.json of a run under the marked entry
    with pytest.raises(CheckpointMismatchError, match=r"saved with average_every=None; this "
                       r"job has average_every=2"):  # fmt: skip
        trainer(average_every=2)


def test_an_unknown_keyword_names_the_closest_one_of_fit_s():
    with pytest.raises(FitError, match="unknown keyword `shard_optimiser` .*`shard_optimizer`"):
        tfdist.fit(None, shard_optimiser="zero2")


def test_the_binary_parses_each_mode_s_flag_into_the_config(train_flags):
    train_flags("--shard_optimizer=zero1", "--accumulate_steps=2", "--max_staleness=3")
    config = train_binary.train_config(tfdist.build_strategy("one_device", cluster=None))
    assert (config.shard_optimizer, config.accumulate_steps, config.max_staleness) == (
        "zero1", 2, 3,
    )  # fmt: skip


def _edge_values(value) -> list:
    """The values at the edge of what an entry's value kind takes."""
    if isinstance(value, registry.Number):
        step = 1 if value.whole else 1e-3
        return [value.minimum + step if value.above else value.minimum]
    if isinstance(value, registry.Options):
        return [{name: _edge_values(field)[0] for name, field in value.fields.items()}]
    if isinstance(value, registry.Choice):
        return list(value.choices)
    if isinstance(value, registry.Switch):
        return [True]
    return []


def test_each_mode_s_builder_takes_every_value_at_its_entry_s_bounds():
    """The registry is the only truth on bounds: what an entry's value kind takes, the
    mode's builder takes too (a bound the builder alone holds would refuse it there)."""
    built = 0
    for m in registry.MODES:
        if m.keyword is None or m.builder is None:
            continue
        settings = {k: registry.mode(k).default for k in m.takes}
        for value in _edge_values(m.value):
            assert registry.problems({m.keyword: value}) == [], (m.keyword, value)
            m.build(value, model=None, settings=settings)
            built += 1
    assert built >= len(registry.MODES) - 3


def test_a_mode_is_one_file_and_one_registry_entry(monkeypatch, caplog):
    """tests/toy_mode.py's hook and one entry added to MODES: fit takes its keyword, checks
    its value, puts its hook in the chain and names it, and the step scales its gradients.
    Under SGD, gradients times 0.5 train as a rate times 0.5: Keras's own fit on one device
    at half the rate, the same batch."""
    import keras
    import numpy as np
    import tensorflow as tf

    toy = registry.Mode(
        keyword="gradient_scale",
        summary="multiply each step's gradients by this (tests/toy_mode.py)",
        value=registry.Number(minimum=0.0),
        default=1.0,
        place=registry.Place.USER,
        builder="tests.toy_mode:GradientScale",
    )
    monkeypatch.setattr(registry, "MODES", (*registry.MODES, toy))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")

    def model(strategy, rate):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            made = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                                     keras.layers.Dense(1)])  # fmt: skip
            made.compile(keras.optimizers.SGD(rate), "mse")
        return made

    reference = model(tf.distribute.get_strategy(), 0.05)
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    strategy = tfdist.build_strategy("mirrored", cluster=None, devices=["/cpu:0", "/cpu:1"])
    trained = model(strategy, 0.1)
    with pytest.raises(FitError, match=r"gradient_scale must be a number >= 0"):
        tfdist.fit(trained, x, y, batch_size=16, gradient_scale=-1.0, verbose=0)
    with caplog.at_level("DEBUG", logger="tfdist"):
        tfdist.fit(trained, x, y, batch_size=16, gradient_scale=0.5, shuffle=False, verbose=0)
    assert "Between each step's gradients and its update: gradient_scale=0.5" in caplog.text
    for want, have in zip(reference.get_weights(), trained.get_weights(), strict=True):
        np.testing.assert_allclose(have, want, atol=1e-6)

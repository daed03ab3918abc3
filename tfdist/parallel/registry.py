"""The registry of parallel modes: one entry per mode, and everything else reads it.

A mode is one file in tfdist/parallel/ and one `Mode` entry in MODES below. From the entry:

  tfdist.fit          takes `keyword=value` (checked by `value`), lists it in its docstring
                      (`summary`) and builds the hook in the chain at `place`;
  TrainConfig         has a field `keyword` with the entry's default (tfdist/app/config.py);
  experiments.train   has a flag `--keyword` with `help` (and 'auto' where `auto`);
  checkpoints         refuse a resume under another value where `resume_must_match`.

Example (a mode that adds Gaussian noise to the gradients, in tfdist/parallel/noise.py):

    Mode(
        keyword="gradient_noise",
        value=Number(minimum=0.0),
        summary="the standard deviation of Gaussian noise added to each gradient",
        place=Place.USER,
        builder="tfdist.parallel.noise:GradientNoise",
    )

The builder is named by its import path ("module:attribute"), so reading the registry
imports no mode (nor TensorFlow): the binary builds its flags from it, and TrainConfig its
fields, before anything heavy loads. A builder is called with the keyword's value and
returns a StepHook; a mode no keyword turns on (split layers) is built from the model, and
returns None where the model asks for nothing.

A mode that replaces the runner rather than adding a hook (the pipeline) takes an object
that makes a runner: `value=RunnerFactoryValue()`, checked against the engine's
`RunnerFactory` protocol, and no builder.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import re
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from tfdist.errors import FitError


class Place(enum.IntEnum):
    """Where a mode's hook sits in the step's chain, first to last."""

    # Reshapes the step (accumulation's micro-batches), so the hooks after it see each
    # step's summed gradients once.
    RESHAPE = 0
    # The user's own `step_hooks`, in their order.
    USER = 10
    # Corrections of asynchronous updates (delay, momentum), then the staleness bound.
    CORRECTION = 20
    BOUND = 25
    # Hooks that apply the update their own way, after every other, in the order their own
    # flags say (the chain's rules read the same flags): one that applies its part and hands
    # the rest on (StepHook.applies_update: the split layers' parts) before the one that ends
    # the chain (StepHook.ends_chain: a sharded update, local SGD).
    UPDATE = 30


# --- what a keyword takes ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of `choices`, or None (off)."""

    choices: tuple[str, ...]

    def problem(self, keyword: str, value: Any) -> str | None:
        if value is None or value in self.choices:
            return None
        listed = ", ".join(repr(c) for c in self.choices)
        return f"{keyword} must be None or one of {listed}. Received: {keyword}={value!r}"

    def describe(self) -> str:
        return " | ".join(self.choices)


@dataclasses.dataclass(frozen=True)
class Number:
    """A number >= `minimum` (> it if `above`), a whole one if `whole` (None also means off
    where the default is None). The bound is the mode's own: its builder checks no other."""

    minimum: float
    whole: bool = False
    above: bool = False

    def problem(self, keyword: str, value: Any) -> str | None:
        kinds = (int,) if self.whole else (int, float)
        if value is None or (
            isinstance(value, kinds)
            and not isinstance(value, bool)
            and (value > self.minimum if self.above else value >= self.minimum)
        ):
            return None
        return f"{keyword} must be {self.describe()}. Received: {keyword}={value!r}"

    def describe(self) -> str:
        kind = "a whole number" if self.whole else "a number"
        return f"{kind} {'>' if self.above else '>='} {self.minimum:g}"


@dataclasses.dataclass(frozen=True)
class Switch:
    """True (on) or False (off)."""

    def problem(self, keyword: str, value: Any) -> str | None:
        if isinstance(value, bool):
            return None
        return f"{keyword} must be True or False. Received: {keyword}={value!r}"

    def describe(self) -> str:
        return "True | False"


def Whole(minimum: int) -> Number:  # noqa: N802 (reads as the type it makes)
    """A whole number >= `minimum`."""
    return Number(minimum, whole=True)


@dataclasses.dataclass(frozen=True)
class RunnerFactoryValue:
    """An object with a `runner(model, strategy)` method (tfdist.training.RunnerFactory)."""

    example: str

    def problem(self, keyword: str, value: Any) -> str | None:
        if value is None or callable(getattr(value, "runner", None)):
            return None
        return (
            f"{keyword} takes {self.example}, an object whose runner(model, strategy) makes the "
            f"runner that trains. Received: {keyword} of type {type(value).__name__}"
        )

    def describe(self) -> str:
        return self.example


@dataclasses.dataclass(frozen=True)
class Options:
    """Several named settings: a dict (fit) or "name=value,name=value" (the flag); each
    setting checked by its own Value, those with a default optional. The mode's builder
    gets the dict, defaults filled in."""

    fields: Mapping[str, Number]
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def parse(self, text: str) -> dict[str, Any] | str:
        """The dict "name=value,..." spells, or the text itself when it spells none."""
        parsed: dict[str, Any] = {}
        for part in text.split(","):
            name, equals, raw = part.strip().partition("=")
            if not equals:
                return text
            for kind in (int, float):
                try:
                    parsed[name.strip()] = kind(raw)
                    break
                except ValueError:
                    pass
            else:
                parsed[name.strip()] = raw.strip()
        return parsed

    def problem(self, keyword: str, value: Any) -> str | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = self.parse(value)
        if not isinstance(value, Mapping):
            return f"{keyword} must be {self.describe()}. Received: {keyword}={value!r}"
        unknown = sorted(set(value) - set(self.fields))
        missing = sorted(set(self.fields) - set(value) - set(self.defaults))
        if unknown or missing:
            what = "; ".join(
                [f"unknown {', '.join(unknown)}"] * bool(unknown)
                + [f"missing {', '.join(missing)}"] * bool(missing)
            )
            return f"{keyword} takes {self.describe()} ({what}). Received: {keyword}={value!r}"
        for name, setting in value.items():
            problem = self.fields[name].problem(f"{keyword}[{name!r}]", setting)
            if problem or setting is None:
                return problem or f"{keyword}[{name!r}] must be {self.fields[name].describe()}"
        return None

    def filled(self, value: Mapping[str, Any] | str) -> dict[str, Any]:
        """`value` (dict or flag text) with the defaults of the settings it leaves out."""
        given = self.parse(value) if isinstance(value, str) else dict(value)
        return {**self.defaults, **given}

    def describe(self) -> str:
        def one(name: str) -> str:
            optional = f", default {self.defaults[name]!r}" if name in self.defaults else ""
            return f"{name} ({self.fields[name].describe()}{optional})"

        return "a dict of " + ", ".join(one(name) for name in self.fields)


Value = Choice | Number | Options | RunnerFactoryValue | Switch


# --- the entries --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mode:
    """One parallel mode, as every entry point offers it.

    Attributes:
      keyword: fit's keyword, TrainConfig's field and the binary's flag; None for a mode
        the model itself asks for (split layers), which no keyword turns on.
      summary: one line for fit's and TrainConfig's docstrings.
      value: what the keyword takes (None: no keyword).
      place: where the mode's hook sits in the step's chain.
      builder: "module:attribute" of a callable value -> StepHook (model -> StepHook or None
        where there is no keyword); None for a mode whose value is the runner factory.
      default: the value that leaves the mode off.
      help: the flag's help (default: the summary); "{auto}" is replaced by what 'auto'
        means under each runner.
      flag: offered by the binary (a flag and a TrainConfig field).
      auto: the flag takes 'auto', resolved by the strategy kind's mode_defaults (tfdist.training.runners).
      auto_off_with: keywords whose mode, when on, makes this one's 'auto' mean off (a
        staleness bound's 'auto' under an asynchronous warm-up: the warm-up is the bound).
      resume_must_match: a checkpoint written under another value cannot be resumed (the
        state it keeps is laid out by this mode).
      takes: keywords of other entries whose values the builder also gets, as keyword
        arguments (a setting of this mode offered as a keyword of its own).
      needs: (keyword, why) for a setting that means something only with that keyword's
        mode on: set without it, it is refused with `why`.
      reads_model: the builder also gets `model=` (the model, or None where there is none):
        a mode another hook may take over for some models (a tensor-parallel layout shards
        its own parts under shard_optimizer).
      runner_factory: for a mode the model asks for, "module:attribute" of a callable
        (model, strategy) -> the runner factory it trains under where fit names none
        (None: its hook will do): a layout map's model across worker processes trains as
        a pipeline of one stage.
    """

    keyword: str | None
    summary: str
    value: Value | None = None
    place: Place | None = None
    builder: str | None = None
    default: Any = None
    help: str | None = None
    flag: bool = True
    auto: bool = False
    auto_off_with: tuple[str, ...] = ()
    resume_must_match: bool = False
    takes: tuple[str, ...] = ()
    needs: tuple[str, str] | None = None
    reads_model: bool = False
    runner_factory: str | None = None

    @property
    def name(self) -> str:
        return self.keyword or self.builder or "?"

    def build(self, value: Any, *, model, settings: Mapping[str, Any] | None = None) -> Any:
        """The hook this mode adds for `value` (None if it adds none); `settings` are the
        values of the keywords it `takes`."""
        if self.builder is None:
            return None
        target = _imported(self.builder)
        if isinstance(self.value, Options):
            value = self.value.filled(value)
        settings = dict(settings or {})
        if not self.keyword:
            return target(model, **settings)
        if self.reads_model:
            settings["model"] = model
        return target(value, **settings)

    def is_on(self, value: Any) -> bool:
        return self.keyword is None or value != self.default


def _imported(path: str) -> Any:
    """The object "module:attribute" names."""
    module, _, attribute = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


MODES: tuple[Mode, ...] = (
    Mode(
        keyword="accumulate_steps",
        summary="split each replica's batch into this many micro-batches, summing their "
        "gradients into one exchange and update per step (tfdist.parallel.accumulate)",
        help="Split each replica's batch into this many micro-batches, summing their gradients "
        "into one exchange and update per step (must divide the per-replica batch).",
        value=Whole(minimum=1),
        default=1,
        place=Place.RESHAPE,
        builder="tfdist.parallel.accumulate:Accumulate",
    ),
    Mode(
        keyword="async_correction",
        summary="parameter_server: 'dc' (delay-compensated gradients) or 'momentum' (SGD's "
        "momentum lowered by asynchrony's); tfdist.parallel.asynchronous",
        help="parameter_server only: correct stale updates. dc: delay compensation, g + lambda "
        "g*g (w_now - w_read) on the ps (Zheng et al., 2017); momentum: SGD's momentum lowered "
        "by the momentum asynchrony adds, 1 - 1/(1 + mean staleness) (Mitliagkas et al., 2016).",
        value=Choice(("dc", "momentum")),
        place=Place.CORRECTION,
        builder="tfdist.parallel.asynchronous:correction",
    ),
    Mode(
        keyword="staleness_aware_lr",
        summary="parameter_server: True divides each update's learning rate by max(1, its "
        "staleness) (Zhang et al., 2016); tfdist.parallel.asynchronous",
        help="parameter_server only: divide each update's learning rate by max(1, its "
        "staleness), the updates that reached the parameters between the worker's read and its "
        "write (Zhang et al., 2016). Staleness is reported either way (summary.json, "
        "TensorBoard).",
        value=Switch(),
        default=False,
        place=Place.CORRECTION,
        builder="tfdist.parallel.asynchronous:StalenessAwareRate",
    ),
    Mode(
        keyword="max_staleness",
        summary="parameter_server: no update is applied more than this many updates stale "
        "(0: every update to the weights it was computed from; None: unbounded). Default "
        "'auto': {auto} (none with async_warmup)",
        help="parameter_server only: no update more than this many updates stale (a step waits "
        "for the steps before it; 0: every update applies to the weights it was computed "
        "from); 'none': unbounded. 'auto': {auto} (none with --async_warmup). The parameter-server default measured best "
        "(tools/exchange_bench, 4 workers, digits cnn, 220 steps, medians of 3): test accuracy "
        "with Adam 0.967 against 0.958 at 1 and 0.911 unbounded (sync: 0.981); with SGD and "
        "momentum 0.802 against 0.089 at 1 and 0.092 unbounded (sync: 0.889). At 0 the workers "
        "take turns; 1 lets two steps compute at once (Adam: 1764 examples/s against 1313).",
        value=Whole(minimum=0),
        place=Place.BOUND,
        builder="tfdist.parallel.asynchronous:BoundedStaleness",
        auto=True,
        auto_off_with=("async_warmup",),
    ),
    Mode(
        keyword="async_warmup",
        summary="parameter_server: the first this many steps take turns (staleness 0), "
        "then the updates go through asynchronously (within max_staleness, if set); "
        "tfdist.parallel.asynchronous",
        help="parameter_server only: the first this many steps take turns (staleness 0), then "
        "the updates go through asynchronously (within --max_staleness). For SGD with "
        "momentum, whose stale updates stall it on the first steps' plateau "
        "(docs/guides/exchange.md).",
        value=Whole(minimum=1),
        place=Place.BOUND,
        builder="tfdist.parallel.asynchronous:SynchronousWarmup",
    ),
    Mode(
        keyword=None,
        summary="the update of a model's tensor-parallel layers (added when it has them)",
        place=Place.UPDATE,
        builder="tfdist.parallel.tensor:update_for",
        flag=False,
        takes=("shard_optimizer", "offload", "pipeline"),
        runner_factory="tfdist.parallel.pipeline:for_layout_map",
    ),
    Mode(
        keyword="shard_optimizer",
        summary="None, 'zero1' (the optimizer's state sharded over the replicas), 'zero2' "
        "(the gradients too) or 'zero3' (the weights too); tfdist.parallel.zero. "
        "Synchronous strategies",
        help="Synchronous strategies: shard the optimizer's state over the replicas (zero1: "
        "1/N of the slots per replica), with zero2 the gradients too (reduce-scatter, then "
        "all-gather), with zero3 the weights too (each gathered where a layer reads it). Same "
        "result as unsharded; see docs/guides/zero.md.",
        value=Choice(("zero1", "zero2", "zero3")),
        place=Place.UPDATE,
        builder="tfdist.parallel.zero.stage3:shard_hook",
        resume_must_match=True,
        takes=("offload",),
        reads_model=True,
    ),
    Mode(
        keyword="offload",
        summary="'optimizer': with shard_optimizer, each replica's optimizer state (its "
        "slots, and zero1/zero2's float32 slice of the weights) kept in host memory, where "
        "its update runs (ZeRO-Offload); tfdist.parallel.zero",
        help="With --shard_optimizer: keep each replica's optimizer state (its slots, and "
        "zero1/zero2's float32 slice of the weights) in host memory and run its update there "
        "(ZeRO-Offload), so a device holds only the weights (zero3: its slice of them) and "
        "the gradients. Same result as without it.",
        value=Choice(("optimizer",)),
        needs=(
            "shard_optimizer",
            "offload='optimizer' moves a sharded optimizer's state to host memory; set "
            "shard_optimizer='zero1', 'zero2' or 'zero3' too",
        ),
    ),
    Mode(
        keyword="average_every",
        summary="local SGD: each replica takes this many optimizer steps on its own, then "
        "the replicas' weights are averaged (tfdist.parallel.local_sgd)",
        help="Synchronous strategies: local SGD, each replica takes this many optimizer steps "
        "on its own, then the weights are averaged in one all-reduce. Default: all-reduce "
        "every step.",
        value=Whole(minimum=1),
        place=Place.UPDATE,
        builder="tfdist.parallel.local_sgd:LocalSGD",
    ),
    Mode(
        keyword="gossip",
        summary="'ring' or 'exponential': after each local step, each replica averages its "
        "weights with its peers', with no all-reduce (tfdist.parallel.gossip)",
        help="Synchronous strategies: gossip SGD, each replica averages its weights with its "
        "peers after every local step (ring: both neighbours; exponential: one peer, 2^k away "
        "in turn), with no all-reduce.",
        value=Choice(("ring", "exponential")),
        place=Place.UPDATE,
        builder="tfdist.parallel.gossip:Gossip",
    ),
    Mode(
        keyword="admm",
        summary="ADMM SGD, a dict {'rho': ..., 'every': ...}: each replica takes local "
        "steps on its own loss plus rho/2 ||w - z + u||^2, and every `every` steps a "
        "consensus z and the duals u join them (tfdist.parallel.admm)",
        help="Synchronous strategies: consensus ADMM (Boyd et al., 2011). Each replica takes "
        "local steps on its own data's loss plus rho/2 ||w - z + u||^2; every `every` steps "
        "one all-reduce sets the consensus z and the duals u. Converges to the optimum of the "
        "whole data although no example crosses between replicas.",
        value=Options(
            {"rho": Number(minimum=0.0, above=True), "every": Whole(minimum=1)}, {"every": 1}
        ),
        place=Place.UPDATE,
        builder="tfdist.parallel.admm:from_options",
    ),
    Mode(
        keyword="pipeline",
        summary="a tfdist.parallel.Pipeline: the model cut into stages over the replicas, "
        "trained in micro-batches (GPipe or 1F1B; with shard_optimizer, each stage's state "
        "sharded over its pipelines); see tfdist.parallel.pipeline",
        value=RunnerFactoryValue("a tfdist.parallel.Pipeline(cut_before=[...], ...)"),
        flag=False,
        takes=("shard_optimizer", "offload"),
    ),
)


# The attribute of a model that holds {(mode, value): the hook keeping optimizer state for
# it}: on the model (not in a table here), so it lives and goes with the model it serves.


def keywords() -> tuple[str, ...]:
    """Every mode's keyword, in the registry's order."""
    return tuple(m.keyword for m in MODES if m.keyword)


def mode(keyword: str) -> Mode:
    """The entry of `keyword`."""
    for m in MODES:
        if m.keyword == keyword:
            return m
    raise KeyError(
        f"No parallel mode takes the keyword {keyword!r}. Known: {', '.join(keywords())}"
    )


def flagged() -> tuple[Mode, ...]:
    """The modes the binary offers as flags (and TrainConfig as fields)."""
    return tuple(m for m in MODES if m.keyword and m.flag)


def problems(options: Mapping[str, Any]) -> list[str]:
    """What is wrong with `options` (keyword -> value), one message each; unknown keywords
    are the caller's to refuse."""
    found = []
    for keyword, value in options.items():
        entry = mode(keyword)
        problem = entry.value.problem(keyword, value)
        if problem:
            found.append(problem)
        elif entry.needs and entry.is_on(value):
            needed, why = entry.needs
            if not mode(needed).is_on(options.get(needed, mode(needed).default)):
                found.append(f"{why}. Received: {keyword}={value!r}, {needed}=None")
    return found


def with_model_layout(options: Mapping[str, Any], *, model, strategy) -> dict[str, Any]:
    """`options`, with the runner factory a mode the model asks for trains it under where
    `options` name none (Mode.runner_factory), under the keyword of the factory's mode."""
    options = dict(options)
    if _factory_mode(options) is not None:
        return options
    for m in MODES:
        if m.keyword is None and m.runner_factory:
            factory = _imported(m.runner_factory)(model, strategy)
            if factory is not None:
                keyword = next(k.keyword for k in MODES if isinstance(k.value, RunnerFactoryValue))
                options[keyword] = factory
                return options
    return options


def runner_factory_of(options: Mapping[str, Any]) -> Any:
    """The runner factory `options` name (the pipeline), or None."""
    entry = _factory_mode(options)
    return None if entry is None else options[entry.keyword]


def factory_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """The settings the runner factory `options` name takes over from their own modes
    (a pipeline shards its stages' state itself under shard_optimizer): those turned on,
    as keyword arguments of its `runner`."""
    entry = _factory_mode(options)
    if entry is None:
        return {}
    return {k: options[k] for k in entry.takes if mode(k).is_on(options.get(k, mode(k).default))}


def _factory_mode(options: Mapping[str, Any]) -> Mode | None:
    for m in MODES:
        if isinstance(m.value, RunnerFactoryValue) and options.get(m.keyword) is not None:
            return m
    return None


def chain(options: Mapping[str, Any], user_hooks: Sequence[Any], *, model) -> list[Any]:
    """The step's chain of hooks: each mode `options` turn on (and the model asks for,
    unless `model` is None), and the user's own hooks, in the order of their places. A hook
    that keeps optimizer state is the one an earlier fit of the model made with the same
    options (tfdist.training.chain.kept_across_fits)."""
    from tfdist.training.chain import kept_across_fits  # TensorFlow, once a chain is built

    placed: list[tuple[int, int, tuple | None, Any]] = [
        (Place.USER, order, None, hook) for order, hook in enumerate(user_hooks)
    ]
    factory = _factory_mode(options)
    taken = set(factory.takes) if factory is not None else set()  # the engine's own
    for order, m in enumerate(MODES):
        if m.place is None or (m.keyword is None and model is None) or m.keyword in taken:
            continue
        value = options.get(m.keyword, m.default) if m.keyword else None
        if not m.is_on(value):
            continue
        settings = {k: options.get(k, mode(k).default) for k in m.takes}
        hook = m.build(value, model=model, settings=settings)
        if hook is not None:
            placed.append((m.place, order, (m.keyword, repr(value), repr(settings)), hook))
    placed.sort(key=lambda p: (p[0], p[0] == Place.UPDATE and p[3].ends_chain, p[1]))
    return kept_across_fits(
        model,
        [(key, hook) for _, _, key, hook in placed],
        left_behind=lambda key: _state_left_behind(key, options),
    )


def _state_left_behind(key: tuple, options: Mapping[str, Any]) -> FitError:
    """An earlier fit's mode holds this optimizer's state (zero1/2/3's shards, local SGD's
    replicas' slots): a fit without that mode would not continue it (Keras's own optimizer
    was never built on the model's weights, or would start again from zero)."""
    keyword, value = key[:2]
    if keyword is None:  # a hook the model asked for, built with other settings
        return FitError(
            "This model's optimizer state is held by its tensor-parallel update from an "
            f"earlier tfdist.fit with {key[2]}, which this fit would not continue. Fit it "
            "again with the same shard_optimizer and offload, or compile the model again "
            "(a new optimizer) to train it another way. Received: "
            + repr({k: options.get(k) for k in ("shard_optimizer", "offload")})
        )
    now = options.get(keyword, mode(keyword).default)
    return FitError(
        f"This model's optimizer state is held by {keyword}={value} from an earlier "
        f"tfdist.fit, which this fit ({keyword}={now!r}) would not continue. Fit it "
        f"again with {keyword}={value}, or compile the model again (a new optimizer) "
        f"to train it another way. Received: {keyword}={now!r} after {keyword}={value}"
    )


AUTO = "auto"


def resolve_auto(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`options` with each mode that takes 'auto' and was left out (or given 'auto') set to
    `defaults`' value for it (the strategy kind's mode_defaults; a keyword not there: off). So
    tfdist.fit and the binary start from the same value."""
    resolved = dict(options)
    for m in MODES:
        if m.auto and resolved.get(m.keyword, AUTO) == AUTO:
            off = any(resolved.get(k) not in (None, AUTO) for k in m.auto_off_with)
            resolved[m.keyword] = None if off else defaults.get(m.keyword)
    return resolved


def resume_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """The modes' values a resumed checkpoint must have been written under."""
    return {m.keyword: options.get(m.keyword, m.default) for m in MODES if m.resume_must_match}


def fill_docstring(doc: str, *, modes: Sequence[Mode] = MODES) -> str:
    """`doc` with its "{modes}" line replaced by one Args entry per mode's keyword, at that
    line's indentation (continuations 2 deeper), wrapped at 96 columns."""

    from tfdist.training.runners import describe_mode_default

    def entries(match: re.Match) -> str:
        indent = match.group(1)
        return "\n".join(
            textwrap.fill(
                f"{m.keyword}: {m.summary.replace('{auto}', describe_mode_default(m.keyword))}.",
                width=96,
                initial_indent=indent,
                subsequent_indent=indent + "  ",
            )
            for m in modes
            if m.keyword
        )

    return re.sub(r"^( *)\{modes\}$", entries, doc, flags=re.MULTILINE)


__all__ = [
    "AUTO",
    "MODES",
    "Choice",
    "Mode",
    "Number",
    "Options",
    "Place",
    "RunnerFactoryValue",
    "Switch",
    "Whole",
    "chain",
    "factory_settings",
    "fill_docstring",
    "flagged",
    "keywords",
    "runner_factory_of",
    "with_model_layout",
    "mode",
    "resolve_auto",
    "problems",
    "resume_settings",
]

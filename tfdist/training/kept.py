"""The runner a model trained with, kept on the model across calls, as Keras keeps
`model.train_function` until the model is compiled again.

A runner's traced train and test functions close over the model, its optimizer, the strategy
and the chain of hooks; tracing them again costs a small model most of a second and a
keras-hub causal LM many (Keras retraces only after a recompile). So `fit` and `evaluate`
take the runner of the model's last call where nothing they close over changed: the same
strategy, optimizer and compiled loss, the same kind of runner (no other layout), and a
chain of the same hooks (the user's own by identity, the modes' by their settings). A batch
of another shape retraces inside the kept functions, as tf.function does. Otherwise a new
runner is made, and one debug line says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.training.engine import Engine

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Kept:
    # What the runner's traced functions close over, by name: the objects themselves (held,
    # so that another object cannot take a freed one's id), compared by identity.
    facts: dict[str, Any]
    runner: Engine
    hooks: list


# The model's attribute that holds the runner of its last call: set in its __dict__, which
# Keras's attribute tracking does not see, and a cycle (the runner holds the model) that the
# garbage collector frees with the model (a weak-keyed table would keep the model alive).
_ATTRIBUTE = "_tfdist_kept_runner"


def runner_for_call(
    model: keras.Model,
    strategy: tf.distribute.Strategy,
    make: Callable[[], Engine],
    hooks: Sequence[Any] | None,
    *,
    user_hooks: Sequence[Any] = (),
    layout: Any = None,
) -> tuple[Engine, list, bool]:
    """(the runner, the hooks to build it with, whether it is the kept one, built).

    Args:
      make: makes a new runner (not built).
      layout: the call's runner factory (a Pipeline), or None.
      hooks: the chain this call asks for; None for a call that trains nothing (evaluate),
        which takes the kept runner whatever its chain and layout (a pipeline's evaluates
        as a plain runner does, reading the weights from the stages).
      user_hooks: the user's own step_hooks (kept by identity; the modes' by their names).
    """
    facts = _facts(model, strategy, hooks, user_hooks)
    facts["layout"] = layout
    kept = vars(model).get(_ATTRIBUTE)
    if kept is not None:
        changed = [
            name
            for name, value in facts.items()
            if not _same(kept.facts.get(name), value)
            and not (hooks is None and name in ("hooks", "layout"))
        ]
        if not changed:
            return kept.runner, kept.hooks, True
        log.debug(
            "%s: the traced step is made again (%s changed since the last call)",
            model.name, ", ".join(changed),
        )  # fmt: skip
    runner = make()
    vars(model)[_ATTRIBUTE] = _Kept(facts, runner, list(hooks or []))
    return runner, list(hooks or []), False


def _facts(model, strategy, hooks, user_hooks) -> dict[str, Any]:
    mine = {id(h) for h in user_hooks}
    return {
        "strategy": strategy,
        "optimizer": model.optimizer,
        "compiled loss": compat.compiled_loss(model),
        # The user's hooks and those that keep optimizer state (the registry keeps them
        # across fits) by identity; the others by their kind and settings.
        "hooks": tuple(
            h if id(h) in mine or h.keeps_optimizer_state else (type(h).__qualname__, h.name)
            for h in hooks or ()
        ),
    }


def _same(a, b) -> bool:
    """Facts are the same object, or (a hook's kind and settings) the same strings."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is b or (isinstance(a, str) and a == b)


@contextlib.contextmanager
def forgotten_on_error(model: keras.Model) -> Iterator[None]:
    """Drops the runner kept for `model` if the block raises: a call that failed midway
    leaves nothing half made for the next."""
    try:
        yield
    except BaseException:
        vars(model).pop(_ATTRIBUTE, None)
        raise


__all__ = ["forgotten_on_error", "runner_for_call"]

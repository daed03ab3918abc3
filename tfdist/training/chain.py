"""The rules of a step's chain of StepHooks, checked before training.

A chain is built by tfdist.fit from its keywords (tfdist.parallel.registry) and the user's
`step_hooks`; whatever built it, the same rules hold, read from what each hook declares
(StepHook.applies_update, ends_chain, keeps_optimizer_state, check_batch):

- a step has one update: at most one hook applies it its own way;
- a hook that does not hand the gradients on is the last of the chain;
- a hook that keeps optimizer state of its own cannot be backed up by Keras's
  BackupAndRestore, which saves the model and its optimizer only;
- every hook takes the per-replica batch it will see.

And the life of the hooks that keep optimizer state across fits (`kept_across_fits`): kept
on the model they serve, handed to its next fit under the same options, and a fit that
would drop one refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras

from tfdist.errors import FitError
from tfdist.training.hooks import StepHook


def check_hooks(hooks: Sequence[object]) -> list[StepHook]:
    """`hooks` as a list, each a StepHook."""
    hooks = list(hooks or ())
    for hook in hooks:
        if not isinstance(hook, StepHook):
            raise FitError(
                "step_hooks takes tfdist.StepHook objects (a subclass with an "
                "apply(grads_and_vars, apply_next) method). "
                f"Received: an element of type {type(hook).__name__}"
            )
    return hooks


def check_chain(hooks: Sequence[StepHook]) -> None:
    """Refuses two hooks that each apply the update their own way, or one that ends the
    chain before others (they would never run)."""
    own = [h for h in hooks if h.applies_update]
    if len(own) > 1:
        raise FitError(
            "Each of " + ", ".join(h.name for h in own) + " updates the weights its own way, "
            "and a step has one update: keep one of them. Received: "
            + ", ".join(h.name for h in own)
        )
    enders = [h for h in hooks if h.ends_chain]
    if enders and hooks[-1] is not enders[0]:
        raise FitError(
            f"{enders[0].name} applies the update itself, so it must be the last of the step "
            "hooks (the hooks after it would never run). "
            f"Received: step_hooks ending with {hooks[-1].name}"
        )


def check_callbacks(hooks: Sequence[StepHook], callbacks) -> None:
    """Refuses a hook that keeps optimizer state of its own (a sharded update, local SGD's
    per-replica copies) beside Keras's BackupAndRestore, which saves the model and its
    optimizer only (Keras's own weights file): that state would be lost, and a resume
    would restart it from zero. tfdist.StepCheckpoint saves it whole."""
    keeper = next((h for h in hooks if h.keeps_optimizer_state), None)
    backups = [c for c in callbacks or () if isinstance(c, keras.callbacks.BackupAndRestore)]
    if keeper is not None and backups:
        raise FitError(
            f"{keeper.name} keeps the optimizer's state apart from the model, and "
            "BackupAndRestore saves only what Keras's weights file holds: a resume would "
            "restart Adam's moments (or momentum) from zero and train differently from the "
            f"run it resumes. Use tfdist.StepCheckpoint(model_dir) instead, which saves that "
            f"state too. Received: {keeper.name} with BackupAndRestore"
        )


def check_batch(hooks: Sequence[StepHook], per_replica_batch: int) -> None:
    """Refuses a per-replica batch a hook cannot work with."""
    for hook in hooks:
        hook.check_batch(per_replica_batch)


__all__ = ["check_batch", "check_callbacks", "check_chain", "check_hooks"]


# Where a model keeps the hooks that hold its optimizer's state between fits (an attribute
# Keras does not track), by (its optimizer, the hook's key).
_KEPT_ATTRIBUTE = "_tfdist_kept_hooks"


def kept_across_fits(
    model: keras.Model | None,
    made: Sequence[tuple[tuple | None, StepHook]],
    *,
    left_behind: Callable[[tuple], FitError],
) -> list[StepHook]:
    """The chain to train with: `made`'s hooks, each that keeps optimizer state replaced by
    the one an earlier fit of `model` made under the same key (its state goes on, as Keras's
    optimizer's slots do between fit calls; a recompiled model, a new optimizer, starts
    afresh). A hook an earlier fit kept for this optimizer that this chain does not take
    raises `left_behind(its key)`: this fit would not continue its state.

    Args:
      model: the model the chain trains (None: nothing is kept).
      made: (key, hook) in the chain's order; the key of a hook that may keep state says
        what made it (its mode and settings), None for the user's own hooks.
    """
    if model is None:
        return [hook for _, hook in made]
    kept = vars(model).setdefault(_KEPT_ATTRIBUTE, {})
    optimizer = id(getattr(model, "optimizer", None))
    used, new, chain = set(), {}, []
    for key, hook in made:
        if key is not None and hook.keeps_optimizer_state:
            key = (optimizer, *key)
            hook = kept[key] if key in kept else new.setdefault(key, hook)
            used.add(key)
        chain.append(hook)
    for key in kept:
        if key[0] == optimizer and key not in used:
            raise left_behind(key[1:])
    kept.update(new)  # only once this fit's chain is allowed
    return chain

"""Keras's own `model.fit`, `evaluate` and `predict`, guarded where they cannot train.

Keras 3's own methods fail across the worker processes of multi_worker_mirrored ("Attempt to
convert a value (PerReplica...", keras#20585), cannot run parameter_server, report wrong
losses and metrics under central_storage, and cannot train a model whose layers tfdist split.
Once tfdist builds a strategy or splits a model it puts guarded methods on keras.Model: each
runs Keras's own method wherever that can train and, where it cannot, hands the call to the
router `tfdist.patch_keras()` sets (tfdist.api.keras_patch: tfdist.fit and its siblings), or
without one stops at once with one line naming the fix, instead of Keras's traceback. And
`model.save` / `save_weights` on a worker other than the chief of a multi_worker_mirrored job
write into a scratch directory, so the path the script names is written once, by the chief.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import tempfile
import threading
import weakref
from collections.abc import Callable, Collection
from typing import Any

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.strategies.multi_worker import joins_worker_processes, worker_rank

log = logging.getLogger(__name__)

METHODS = ("fit", "evaluate", "predict")
# Writers: on a worker other than the chief of a multi_worker_mirrored job they write into a
# scratch directory that is removed after, so the file the user names is written once.
WRITERS = ("save", "save_weights")

# (method name, model, args, kwargs) -> what the method returns.
Router = Callable[[str, keras.Model, tuple, dict], Any]

_LOCK = threading.Lock()
_KERAS: dict[str, Callable[..., Any]] = {}  # Keras's own methods, as keras.Model had them
_SPLIT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> why
_router: dict[str, Any] = {"route": None, "keywords": frozenset()}


def keras_method(name: str) -> Callable[..., Any]:
    """Keras's own `keras.Model.<name>`, guarded or not."""
    return _KERAS.get(name) or getattr(keras.Model, name)


def mark_split(model: keras.Model, why: str) -> None:
    """Records that `model`'s layers or weights are split the way only tfdist trains
    (tensor parallelism), and puts the guard in place."""
    _SPLIT[model] = why
    install()


def set_router(route: Router | None, keywords: Collection[str] = ()) -> None:
    """Where a guarded call goes when Keras's own method cannot train (None: a one-line
    FitError); a call naming one of `keywords` (tfdist's modes) goes there too."""
    install()
    _router.update(route=route, keywords=frozenset(keywords) if route else frozenset())


def install() -> None:
    """Puts the guarded methods on keras.Model, once per process."""
    with _LOCK:
        if _KERAS:
            return
        for name in METHODS:
            _KERAS[name] = getattr(keras.Model, name)
            setattr(keras.Model, name, _guarded(name, _KERAS[name]))
        for name in WRITERS:
            _KERAS[name] = getattr(keras.Model, name)
            setattr(keras.Model, name, _written_once(_KERAS[name]))


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why Keras's own methods cannot be trusted with a model, and which of them fail
    outright (the others run, and give what tfdist's give)."""

    why: str
    fails: frozenset[str]


_ALL = frozenset(METHODS)


def why_keras_cannot_train(strategy: tf.distribute.Strategy) -> Reason | None:
    """Why Keras 3's own methods cannot be trusted under `strategy`, or None where they can
    (one device, mirrored, multi_worker_mirrored in one process, TPU).

    Measured with Keras 3.15: across worker processes multi_worker_mirrored's fit fails
    (its predict returns every row on every worker); under central_storage the weights train
    right but the loss and metrics fit and evaluate report are wrong (0.769 for 0.823 over
    the same steps); parameter_server runs only through a coordinator, which Keras 3 does
    not drive.
    """
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return Reason(
            "it was made under parameter_server, whose steps only a coordinator runs", _ALL
        )
    if isinstance(strategy, tf.distribute.experimental.CentralStorageStrategy):
        return Reason(
            "it was made under central_storage, where Keras's loss and metrics come out wrong",
            frozenset({"fit", "evaluate"}),
        )
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    if multi_worker and compat.sync_worker_count(strategy) > 1:
        return Reason(
            "it was made under multi_worker_mirrored across worker processes",
            frozenset({"fit", "evaluate"}),
        )
    return None


def why_not_keras(model: keras.Model) -> Reason | None:
    """Why Keras's own methods cannot be trusted with `model`, or None where they can."""
    if model in _SPLIT:
        return Reason(_SPLIT[model], frozenset({"fit"}))  # its predict reads the whole weights
    strategy = compat.strategy_of(model)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    if strategy is None:
        return None
    if _held_on_the_host(model, strategy):
        return Reason(
            "it was built in tfdist.host_scope, which keeps its weights in host memory "
            "for tfdist's sharded modes (shard_optimizer='zero3', a Pipeline), where Keras's "
            "fit cannot update them",
            frozenset({"fit"}),
        )
    return why_keras_cannot_train(strategy)


def _held_on_the_host(model: keras.Model, strategy: tf.distribute.Strategy) -> bool:
    """Whether a model made under a strategy of several replicas holds plain variables (one
    copy on the host, made in tfdist.host_scope) where the strategy would mirror them."""
    mirrors = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
    if not isinstance(strategy, mirrors) or strategy.num_replicas_in_sync < 2 or not model.built:
        return False
    weights = model.trainable_variables
    return bool(weights) and not isinstance(weights[0].value, tf.distribute.DistributedValues)


def _guarded(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        route = _router["route"]
        modes = [k for k in kwargs if k in _router["keywords"]]
        reason = why_not_keras(self)
        if route is not None and (reason is not None or modes):
            return route(name, self, args, kwargs)
        if reason is None or name not in reason.fails:
            return method(self, *args, **kwargs)
        raise FitError(
            f"Model {self.name!r} cannot use Keras's own model.{name}: {reason.why}. Call "
            f"tfdist.{name}(model, ...) with the same arguments, or add `tfdist.patch_keras()` "
            f"at the top of the script to send model.{name} there."
        )

    return guarded


def _written_once(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def written_once(self, filepath, *args, **kwargs):
        strategy = compat.strategy_of(self)
        if (
            not isinstance(filepath, (str, os.PathLike))
            or strategy is None
            or not joins_worker_processes(strategy)
            or worker_rank(strategy) == 0
        ):
            return method(self, filepath, *args, **kwargs)
        # Every worker runs the save (reading a variable may take part in a collective), and
        # only the chief's copy lands where the user looks.
        with tempfile.TemporaryDirectory(prefix="tfdist-worker-") as scratch:
            name = os.path.basename(os.fspath(filepath)) or "model.keras"
            result = method(self, os.path.join(scratch, name), *args, **kwargs)
        log.debug("%s: the chief writes %s; this worker's copy went to scratch", self.name, name)
        return result

    return written_once


__all__ = [
    "METHODS", "WRITERS", "Reason", "install", "keras_method", "mark_split", "set_router",
    "why_keras_cannot_train", "why_not_keras",
]  # fmt: skip

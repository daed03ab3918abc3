"""Keras callbacks in a multi-worker job: one writer, the same decisions everywhere.

Every worker of a synchronous job runs the user's callbacks (saving can need every worker's
part, and EarlyStopping must stop them all at the same epoch), but only the chief writes
where the user asked. On the other workers the file-writing callbacks Keras ships
(ModelCheckpoint, BackupAndRestore, CSVLogger, TensorBoard) write into a private scratch
directory removed at the end — the rule tf.distribute applies to checkpoints. A worker
still *reads* BackupAndRestore's backup from the shared directory, so every worker resumes
from the chief's state.

`callback_list` is Keras's CallbackList whose progress bar tells tfdist.logs when its line
is open, so that a log line never lands inside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence

import keras

from tfdist import logs as tfdist_logs

log = logging.getLogger(__name__)

# The path attributes of the writing callbacks, redirected on non-chief workers.
_WRITE_PATHS = {
    keras.callbacks.ModelCheckpoint: ("filepath",),
    keras.callbacks.CSVLogger: ("filename",),
    keras.callbacks.TensorBoard: ("log_dir",),
}
# BackupAndRestore reads its paths in on_train_begin and writes them later.
_BACKUP_PATHS = (
    "backup_dir",
    "_weights_path",
    "_training_metadata_path",
    "_prev_weights_path",
    "_prev_training_metadata_path",
)
# Callbacks that hook batches but read no batch logs: they need no logs fetched per batch.
_NO_BATCH_LOGS = (keras.callbacks.BackupAndRestore, keras.callbacks.History)


def hooks_batches(callback: keras.callbacks.Callback) -> bool:
    """Whether `callback` overrides a per-batch training hook: in its class, or on the
    instance (keras.callbacks.LambdaCallback sets the functions it is given there)."""
    base = keras.callbacks.Callback

    def overridden(hook: str) -> bool:
        found = getattr(callback, hook)
        return getattr(found, "__func__", found) is not getattr(base, hook)

    return any(
        overridden(hook)
        for hook in ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
    )


def reads_batch_logs(callback: keras.callbacks.Callback) -> bool:
    """Whether `callback` hooks batches and reads their logs.

    A callback that hooks batches without reading their logs can say so with a class
    attribute `reads_batch_logs = False`, and spare every step a read of the metrics.
    """
    return (
        hooks_batches(callback)
        and not isinstance(callback, _NO_BATCH_LOGS)
        and getattr(callback, "reads_batch_logs", True)
    )


def needs_batch_logs(callbacks: Sequence[keras.callbacks.Callback], *, progress_bar: bool) -> bool:
    """Whether any callback reads per-batch logs (every worker must agree: it is collective)."""
    return progress_bar or any(reads_batch_logs(c) for c in callbacks)


def backups(
    callbacks: Sequence[keras.callbacks.Callback],
) -> list[keras.callbacks.BackupAndRestore]:
    return [c for c in callbacks if isinstance(c, keras.callbacks.BackupAndRestore)]


@contextlib.contextmanager
def released(callbacks: Sequence[keras.callbacks.Callback]) -> Iterator[None]:
    """Calls each callback's `release()` when fit ends, however it ends: what a callback
    holds for the length of a fit (tfdist's model_dir lock) is let go even when an error
    skips `on_train_end`."""
    try:
        yield
    finally:
        for callback in callbacks:
            if callable(getattr(callback, "release", None)):
                callback.release()


@contextlib.contextmanager
def writes_redirected(
    callbacks: Sequence[keras.callbacks.Callback], *, is_chief: bool
) -> Iterator[_Redirect]:
    """On a non-chief worker, points the writing callbacks at a private scratch directory.

    Yields a `_Redirect` whose `after_restore()` also moves BackupAndRestore's writes once it
    has read the chief's backup. The callbacks' paths are put back, and the scratch directory
    removed, on exit.
    """
    redirect = _Redirect(callbacks, is_chief=is_chief)
    try:
        redirect.start()
        yield redirect
    finally:
        redirect.undo()


class _Redirect:
    def __init__(self, callbacks, *, is_chief: bool):
        self.callbacks, self.is_chief = list(callbacks), is_chief
        self.scratch: str | None = None
        self._saved: list[tuple[object, str, object]] = []

    def _move(self, callback, attribute: str) -> None:
        value = getattr(callback, attribute, None)
        if value is None:
            return
        self._saved.append((callback, attribute, value))
        name = os.path.basename(os.fspath(value).rstrip("/")) or attribute
        setattr(callback, attribute, os.path.join(self.scratch, f"{id(callback)}-{name}"))

    def start(self) -> None:
        if self.is_chief:
            return
        self.scratch = tempfile.mkdtemp(prefix="tfdist-worker-")
        for callback in self.callbacks:
            for kind, attributes in _WRITE_PATHS.items():
                if isinstance(callback, kind):
                    for attribute in attributes:
                        self._move(callback, attribute)
                    if getattr(callback, "verbose", 0):  # "saving model to <scratch>" misleads
                        self._saved.append((callback, "verbose", callback.verbose))
                        callback.verbose = 0

    def after_restore(self) -> None:
        if self.is_chief:
            return
        for callback in backups(self.callbacks):
            for attribute in _BACKUP_PATHS:
                self._move(callback, attribute)

    def original(self, callback, attribute: str):
        """What `callback.attribute` was before it was redirected (the user's path)."""
        for moved, name, value in self._saved:
            if moved is callback and name == attribute:
                return value
        return getattr(callback, attribute, None)

    def undo(self) -> None:
        for callback, attribute, value in reversed(self._saved):
            setattr(callback, attribute, value)
        self._saved.clear()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def callback_list(callbacks, *, verbose, **params) -> keras.callbacks.CallbackList:
    """Keras's CallbackList (`add_progbar`, `add_history` and the params as Keras takes them),
    whose progress bar, if it draws one, tells tfdist.logs when its line is left open: a log
    line then ends the bar's line instead of landing inside it."""
    callback_list = keras.callbacks.CallbackList(callbacks, verbose=verbose, **params)
    if getattr(callback_list, "_progbar", None) is not None and verbose not in (0, 2):
        callback_list.callbacks.append(_BarLine())  # after the bar: it has drawn by then
        callback_list.callbacks[-1].set_model(params.get("model"))
    return callback_list


class _BarLine(keras.callbacks.Callback):
    """Tells tfdist.logs whether Keras's progress bar has a line open (drawn in place)."""

    async_safe = True  # Keras may dispatch batch ends on a thread; this only sets a flag

    def __init__(self):
        super().__init__()
        self._fitting = False

    def on_train_begin(self, logs=None):
        self._fitting = True

    def on_train_batch_end(self, batch, logs=None):
        tfdist_logs.progress_bar_open(True)

    def on_test_batch_end(self, batch, logs=None):
        if not self._fitting:  # inside fit, Keras draws no bar for validation
            tfdist_logs.progress_bar_open(True)

    def on_predict_batch_end(self, batch, logs=None):
        tfdist_logs.progress_bar_open(True)

    def on_epoch_end(self, epoch, logs=None):
        tfdist_logs.progress_bar_open(False)  # the bar has ended its line

    def on_train_end(self, logs=None):
        self._fitting = False
        tfdist_logs.progress_bar_open(False)

    def on_test_end(self, logs=None):
        if not self._fitting:
            tfdist_logs.progress_bar_open(False)

    def on_predict_end(self, logs=None):
        tfdist_logs.progress_bar_open(False)

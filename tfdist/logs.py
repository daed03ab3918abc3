"""tfdist's own log lines, shown by default in one format.

Importing tfdist gives its logger a console handler, so a script that never configures
logging still sees the lines a user needs: waiting for a peer, the strategy built, the
batch arithmetic, the step-time breakdown, the corrections in force, faults. They read

    04:18:10 INFO tfdist: Built multi_worker_mirrored: 2 replica(s) in sync ...

on standard error (under tfdist-launch each line also gets its task's `[worker:0] `).

- Workers other than the chief print WARNING and up (and what they wait for), so a job of N
  workers does not say everything N times; TFDIST_LOG_WORKERS=all shows every task's lines.
  The chief, the ps tasks and the evaluator print INFO.
- TFDIST_LOG_LEVEL turns the lines down or up (WARNING, ERROR, DEBUG; default INFO).
- Once the user configures logging (logging.basicConfig, absl's app.run, a handler of
  their own on the root logger), the default handler steps aside and tfdist's records go
  where the user's go, in the user's format: nothing is printed twice.
- A line never lands inside Keras's progress bar: while a bar is drawn (Keras redraws it
  in place, without ending the line), the bar's line is ended first.

`setup_logging()` (tfdist.setup_logging) and the binaries use the same format.
"""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(source)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
LEVEL_ENV = "TFDIST_LOG_LEVEL"
WORKERS_ENV = "TFDIST_LOG_WORKERS"

_bar_open = False
_said: set[tuple] = set()  # what once() (and a bad TFDIST_LOG_LEVEL) said already


class _Formatter(logging.Formatter):
    """FORMAT, where `source` is "tfdist" for all of tfdist's loggers, else the logger's name
    (TensorFlow's and the user's lines, where a root handler takes this format)."""

    def format(self, record: logging.LogRecord) -> str:
        record.source = "tfdist" if _of_tfdist(record) else record.name
        return super().format(record)


def _of_tfdist(record: logging.LogRecord) -> bool:
    return record.name == "tfdist" or record.name.startswith("tfdist.")


def formatter() -> logging.Formatter:
    return _Formatter(FORMAT, DATE_FORMAT)


def use_format_of_tfdist() -> None:
    """absl's handler on the root logger (a binary run by absl's app.run) takes tfdist's
    format and quiet workers (TaskFilter); a root logger without handlers gets tfdist's
    console handler. A handler the user set up keeps its format."""
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig, in tfdist's format
        console = ConsoleHandler()
        console.addFilter(TaskFilter())
        root.addHandler(console)
        root.setLevel(logging.WARNING)
        return
    for handler in root.handlers:
        if type(handler).__name__ == "ABSLHandler":  # not a format the user chose
            handler.setFormatter(formatter())
            if not any(isinstance(f, TaskFilter) for f in handler.filters):
                handler.addFilter(TaskFilter())


def progress_bar_open(is_open: bool) -> None:
    """Keras's progress bar has drawn a line it has not ended (True), or ended it (False)."""
    global _bar_open
    _bar_open = is_open


def end_bar_line() -> None:
    """Ends the line a progress bar is drawing in place, so that what follows starts clean."""
    global _bar_open
    if _bar_open:
        _bar_open = False
        try:
            sys.stdout.write("\n")
            sys.stdout.flush()
        except (OSError, ValueError):  # stdout closed or gone: nothing to end
            pass


class ConsoleHandler(logging.StreamHandler):
    """Writes to the standard error of the moment (pytest and notebooks swap it), after
    ending a progress bar's line."""

    def __init__(self):
        super().__init__()
        self.setFormatter(formatter())

    @property
    def stream(self):  # the stream of the moment, not the one at import
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ sets it; always stderr
        pass

    def emit(self, record: logging.LogRecord) -> None:
        end_bar_line()
        super().emit(record)


class _DefaultHandler(ConsoleHandler):
    """The handler importing tfdist installs: steps aside once the root logger has a handler
    (the user configured logging), and holds INFO back on workers that are not the chief."""

    def __init__(self):
        super().__init__()
        self.addFilter(TaskFilter())

    def handle(self, record: logging.LogRecord) -> bool:
        root = logging.getLogger()
        if any(not _implicit(h) for h in root.handlers):
            return False  # the record propagates to the user's handlers
        for handler in root.handlers:  # keep the implicit one from saying it again
            if not any(isinstance(f, _NotTfdist) for f in handler.filters):
                handler.addFilter(_NotTfdist())
        return super().handle(record)


def _implicit(handler: logging.Handler) -> bool:
    """The handler Python's logging.info() or absl's logging.log() give the root logger
    when nothing configured it (logging.basicConfig() with its defaults): no one's choice.
    TensorFlow logs through absl at times (connecting to a cluster), so it appears in
    scripts that never asked for it."""
    formatter = handler.formatter
    return (
        type(handler) is logging.StreamHandler
        and handler.level == logging.NOTSET
        and formatter is not None
        and formatter._fmt == logging.BASIC_FORMAT
    )


class _NotTfdist(logging.Filter):
    """On the implicit root handler: tfdist's records are the default handler's to print."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _of_tfdist(record)


# Passed as `extra=` to a line every task should say even when quiet: what it waits for,
# what it serves.
EVERY_TASK = {"every_task": True}


class TaskFilter(logging.Filter):
    """On a worker that is not the chief, tfdist's lines below WARNING are held back (the
    chief says them for the job) unless marked EVERY_TASK or TFDIST_LOG_WORKERS=all. Other
    loggers' records, and the chief's, ps's and evaluator's, pass."""

    def __init__(self):
        super().__init__()
        self._quiet: bool | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or getattr(record, "every_task", False):
            return True
        if not _of_tfdist(record):
            return True
        if self._quiet is None:
            self._quiet = _quiet_task()
        return not self._quiet


def _quiet_task() -> bool:
    if os.environ.get(WORKERS_ENV, "").strip().lower() == "all":
        return False
    try:
        from tfdist.task import this_task

        task = this_task()
        return task.type == "worker" and not task.is_chief
    except Exception:  # a malformed TF_CONFIG is reported where it is used, not here
        return False


def level_from_environment() -> int:
    """TFDIST_LOG_LEVEL as a logging level (INFO when unset; a bad value says so once)."""
    text = os.environ.get(LEVEL_ENV, "").strip().upper()
    if not text:
        return logging.INFO
    level = logging.getLevelName(text)
    if isinstance(level, int):
        return level
    if (LEVEL_ENV, text) not in _said:
        _said.add((LEVEL_ENV, text))
        sys.stderr.write(
            f"tfdist: {LEVEL_ENV}={text!r} is not a level; use DEBUG, INFO, WARNING or ERROR. "
            "Using INFO.\n"
        )
    return logging.INFO


def once(logger: logging.Logger, level: int, message: str, *args) -> None:
    """Logs `message % args` the first time this process would say it; repeats say nothing
    (an input pipeline rebuilt each epoch, a corrupt file read again)."""
    key = (logger.name, level, message % args if args else message)
    if key in _said:
        return
    _said.add(key)
    logger.log(level, message, *args)


def setup_logging(level: int | str = logging.INFO, *, quiet_workers: bool = False) -> None:
    """Shows tfdist's log lines (the strategy built, the batch arithmetic, warnings) at
    `level`, TensorFlow's own only from WARNING up, in tfdist's format (absl's handler, under
    absl's app.run, takes it); one call, first thing in main(). tfdist's lines show without
    it: call it to set their level in code, to give absl's handler the format, or to silence
    the other workers altogether. As by default, workers other than the chief say only
    warnings and what they wait for (TFDIST_LOG_WORKERS=all: everything).

    Args:
      level: the level of tfdist's lines, e.g. logging.INFO or "DEBUG".
      quiet_workers: on every task but the chief, print nothing but errors: standard
        output (the user's prints, progress) goes nowhere and log lines below ERROR are
        dropped, so a job of N workers does not print everything N times. Errors (and
        tfdist's one-line error messages, on standard error) still show on every task.
    """
    from tfdist.task import is_chief

    use_format_of_tfdist()
    logging.getLogger("tfdist").setLevel(level)
    for name in ("tensorflow", "absl"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up lines
    if quiet_workers and not is_chief():
        logging.getLogger().setLevel(logging.ERROR)
        logging.getLogger("tfdist").setLevel(logging.ERROR)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)


def install_default() -> None:
    """Gives the tfdist logger its default console handler (once; importing tfdist does)."""
    logger = logging.getLogger("tfdist")
    if any(isinstance(h, _DefaultHandler) for h in logger.handlers):
        return
    if logger.level == logging.NOTSET:
        logger.setLevel(level_from_environment())
    logger.addHandler(_DefaultHandler())

"""The bases of the errors tfdist raises for mistakes it can explain, and one way to quote
another library's error in a line.

Binaries catch `TfdistError` to print its one-line message instead of a traceback; library
users can keep catching the standard type each subclass also derives from (ValueError, ...).
Every layer imports its bases from here, so a mode in tfdist.parallel raises `FitError`
without importing the engine that defines the step.
"""

from __future__ import annotations

import re


class TfdistError(Exception):
    """A mistake in the user's configuration or environment, with the fix in its message."""


class FitError(TfdistError, ValueError):
    """A model, its data or an argument `tfdist.fit` cannot train with; the message says why."""


# Lines of TensorFlow's messages that say nothing about the cause.
_NOISE = re.compile(r"(Graph execution error|\d+ root err)")


def first_line(error: BaseException | str, *, limit: int = 300) -> str:
    """The first line of an error's message that says what happened, at most `limit` long.

    TensorFlow's messages go on with registered kernels and graph nodes and often open with
    "Graph execution error:"; those lines are skipped. An error with no message is named by
    its type.
    """
    text = error if isinstance(error, str) else getattr(error, "message", None) or str(error)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    useful = [line for line in lines if not _NOISE.match(line)]
    if not (useful or lines):
        return "(no message)" if isinstance(error, str) else type(error).__name__
    return (useful or lines)[0][:limit]

"""What every tfdist binary does the same way: quiet logs, one-line errors."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable

from absl import logging as absl_logging

from tfdist.errors import TfdistError

EXIT_USAGE = 2


def setup_logging() -> None:
    """Shows tfdist's INFO lines; TensorFlow (which logs through absl) only from WARNING up."""
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("tfdist").setLevel(logging.INFO)
    logging.getLogger("tensorflow").setLevel(logging.WARNING)


def friendly_errors(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """Turns a TfdistError into one 'error: ...' line and exit code 2 instead of a traceback.

    Mistakes tfdist can detect (a bad TF_CONFIG, a strategy the cluster cannot run) already
    carry their fix in the message; a traceback would only bury it.
    """

    @functools.wraps(main)
    def wrapper(argv: list[str]) -> None:
        try:
            main(argv)
        except TfdistError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USAGE)

    return wrapper

"""The base of every error tfdist raises for a mistake it can explain.

Binaries catch `TfdistError` to print its one-line message instead of a traceback; library
users can keep catching the standard type each subclass also derives from (ValueError, ...).
"""


class TfdistError(Exception):
    """A mistake in the user's configuration or environment, with the fix in its message."""

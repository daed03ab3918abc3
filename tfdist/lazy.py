"""A package's public names, imported on first use.

    __getattr__, __dir__ = lazy_exports(__name__, {"fit": "tfdist.api.fit", ...})

Importing a package that lists its names this way runs none of the modules behind them:
tools that only read TF_CONFIG start without TensorFlow, and importing one module of a layer
(tfdist.training.hooks) does not pull in the rest of it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package` for `exports` (name ->
    the module that defines it); a name is set on the package once looked up."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *exports])

    return __getattr__, __dir__


__all__ = ["lazy_exports"]

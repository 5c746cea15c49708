"""A package's names loaded on first use (PEP 562), by fedax's convention: a module-level
``_NAMES`` mapping of name -> defining module, and ``__getattr__ = lazy_getattr(__name__,
_NAMES)``. Importing the package then loads none of the modules behind its names."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``names[name]``'s attribute ``name``."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__

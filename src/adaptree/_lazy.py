"""Names of a package imported on first use (PEP 562), so that importing the package stays cheap."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence


def lazy_exports(package: str, exports: Mapping[str, str], names: Sequence[str]) -> tuple[Callable, Callable]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: ``exports`` maps each name to the module that
    defines it, imported (and the name kept in the package) on first access; ``names`` is what ``dir()`` lists."""

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__

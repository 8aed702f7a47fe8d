"""Package attributes imported on first use (PEP 562).

A Spark Python worker unpickles a step and imports only the modules that step needs;
a package ``__init__`` that imported every source, sink and the engine made each new
worker pay for all of them (~0.25 s of CPU a worker, and a failed job replaces every
worker it used).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps each attribute
    to ``"module:attribute"``, or to ``"module"`` for a submodule."""

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attr = where.partition(":")
        value = importlib.import_module(module)
        if attr:
            value = getattr(value, attr)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *names})

    return __getattr__, __dir__

"""Package namespaces whose names import on first use, so that importing one light module of a package (the
tokenizer loader, the sampling parameters) does not pull in torch through the package's other modules."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: names[name] is the submodule that defines `name`."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)

    return __getattr__

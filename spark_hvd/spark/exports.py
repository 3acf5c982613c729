"""Lazy package exports: a package names its public objects and the modules that define them, and
each is imported on first use (PEP 562), so a rank process that needs one submodule (its training
loop, the reader) does not import the driver's side (pyspark, pandas) with the package."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Mapping, Tuple

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], namespace: Dict[str, Any]
                 ) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps each public name to the
    module it comes from (``"module:attribute"`` when the attribute has another name); a name
    is imported once and then kept in the package's ``namespace``."""

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = source.partition(":")
        value = getattr(importlib.import_module(module), attribute or name)
        namespace[name] = value
        return value

    def __dir__() -> List[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__

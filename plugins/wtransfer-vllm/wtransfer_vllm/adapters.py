"""One adapter class per wtransfer name, made on demand behind a module's ``__getattr__``.

vLLM's lazy registration is ``register_engine(name, module_path, class_name)`` and, at
creation, ``getattr(import_module(module_path), class_name)``. The bridge registers the
adapter module with the qualified wtransfer name as ``class_name``; the module's
``__getattr__`` (PEP 562) then returns a subclass of the adapter bound to that name. So
registering costs nothing, and looking a class up imports no wtransfer engine module.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import TypeVar

T = TypeVar("T", bound=type)


def adapter_classes(base: T, module: str) -> Callable[[str], T]:
    """A module ``__getattr__`` serving ``base`` subclasses bound to ``wtransfer_backend = name``."""

    @lru_cache(maxsize=None)
    def make(name: str) -> T:
        return type(f"{base.__name__}[{name}]", (base,), {"wtransfer_backend": name, "__module__": module})

    def __getattr__(name: str) -> T:
        if ":" not in name:  # only qualified wtransfer names are served here
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return make(name)

    return __getattr__

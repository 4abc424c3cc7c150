"""A lazy reference to one component: metadata now, the class on first use."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from wtransfer.errors import ComponentLoadError, InvalidComponentError
from wtransfer._registry.kinds import Kind, resolve_kind
from wtransfer._registry.loading import import_target
from wtransfer._registry.names import qualify

RUNTIME_ORIGIN = "runtime"


@dataclass(eq=False)
class ComponentRef:
    """Where a component comes from and how to load it, without loading it (``wtransfer_components`` returns these).
    ``target`` is ``"module:Class"``; a runtime registration of a class object passes ``obj``."""

    kind: str
    name: str
    target: str
    distribution: str | None = None
    version: str | None = None
    origin: str = "entry-point"
    obj: type | None = None
    _error: BaseException | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.kind = resolve_kind(self.kind).name

    @property
    def qualified_name(self) -> str:
        return qualify(self.distribution, self.name)

    @property
    def loaded(self) -> bool:
        return self.obj is not None

    def provider(self) -> str:
        if self.distribution is None:
            return f"({self.origin})"
        return f"{self.distribution} {self.version or ''}".strip()

    def describe(self) -> str:
        if not self.distribution:
            where = f"{self.origin} registration"
        elif self.origin in ("entry-point", "hook"):
            where = f"distribution '{self.distribution}' {self.version or ''}".rstrip()
        else:  # another origin: the distribution is only its label
            where = f"{self.origin} (as '{self.distribution}')"
        return f"{resolve_kind(self.kind).singular} '{self.name}' ({self.target}) from {where}"

    def load(self) -> type:
        """Import and validate the class once per process; later calls return the cached class."""
        if self.obj is not None:
            return self.obj
        with self._lock:
            if self.obj is not None:
                return self.obj
            if self._error is not None:
                raise self._error
            kind = resolve_kind(self.kind)
            try:
                obj: Any = import_target(self.target)
            except Exception as exc:  # a plugin may fail in any way while importing
                self._error = ComponentLoadError(
                    f"Could not load {self.describe()}: {type(exc).__name__}: {exc}. "
                    f"Other components are unaffected; fix or uninstall this plugin, or "
                    f"disable it with WTRANSFER_DISABLE_PLUGINS."
                )
                self._error.__cause__ = exc
                raise self._error from exc
            self.obj = check_subclass(kind, obj, self.describe())
            return self.obj


def check_subclass(kind: Kind, obj: object, what: str) -> type:
    """Reject anything that is not a subclass of the kind's base (the seeds used ``assert``)."""
    base = kind.base_class()
    if not (isinstance(obj, type) and issubclass(obj, base)):
        shown = obj.__qualname__ if isinstance(obj, type) else repr(obj)
        raise InvalidComponentError(
            f"{what} resolved to {shown}, which is not a subclass of "
            f"{base.__module__}.{base.__qualname__}; every {kind.singular} must subclass it."
        )
    return obj

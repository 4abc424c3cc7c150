"""One generic lazy registry; each kind (engines, connectors, specs, policies) gets an instance.

Components come from the hook manager's ``wtransfer_components`` (installed entry points plus what hook plugins
add), discovered once per process, and from runtime ``register`` calls, which belong to the calling process only.
A bare name with two providers is an error naming the qualified names, never a silent pick.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from wtransfer.errors import (
    AmbiguousComponentError,
    ComponentLoadError,
    DisabledComponentError,
    DuplicateComponentError,
    UnknownComponentError,
)
from wtransfer._registry import discovery
from wtransfer._registry.component import RUNTIME_ORIGIN, ComponentRef, check_subclass
from wtransfer._registry.hints import install_hint
from wtransfer._registry.kinds import KINDS, Kind, resolve_kind
from wtransfer._registry.loading import import_target
from wtransfer._registry.names import normalize_distribution, split_qualified, suggest

logger = logging.getLogger("wtransfer")


@dataclass(frozen=True)
class ComponentInfo:
    """Metadata-only view of one component, as ``wtransfer list --json`` prints it."""

    kind: str
    name: str
    distribution: str | None
    version: str | None
    target: str
    status: str  # "available" | "loaded" | "conflict" | "disabled"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ComponentRegistry:
    """Lazy registry of one kind. Thread-safe; discovery runs at most once until refresh."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self._discovered: dict[str, list[ComponentRef]] | None = None
        self._disabled = discovery.DisabledSet()
        self._runtime: dict[str, ComponentRef] = {}
        self._lock = threading.RLock()

    # -- discovery -------------------------------------------------------------
    def _by_name(self) -> dict[str, list[ComponentRef]]:
        with self._lock:
            if self._discovered is None:
                from wtransfer._registry import manager

                discovered, self._disabled = self._discover()
                if manager.building():
                    # Asked by a hook module while it is imported: later plugins may still contribute, so
                    # answer without keeping the answer.
                    return discovered
                self._discovered = discovered
                self._check_disabled_names(discovered)
            return self._discovered

    def _check_disabled_names(self, discovered: dict[str, list[ComponentRef]]) -> None:
        """Warn about a component ``WTRANSFER_DISABLE_PLUGINS`` names that nothing provides (a typo blocks nothing)."""
        for kind, name in sorted(self._disabled.components):
            if kind == self.kind.name and name not in discovered:
                close = suggest(name, list(discovered))
                hint = f"; did you mean {' or '.join(f'{kind}:{c}' for c in close)}?" if close else ""
                discovery.warn_once(f"{discovery.DISABLE_ENV}: '{kind}:{name}' blocks nothing: no installed "
                                    f"distribution or hook plugin provides {self.kind.singular} {name!r}{hint}")

    def _discover(self) -> tuple[dict[str, list[ComponentRef]], discovery.DisabledSet]:
        from wtransfer._registry.manager import call_each

        by_name: dict[str, list[ComponentRef]] = {}
        # each plugin on its own: one that raises is blocked and left out, the others still contribute
        for contributed in call_each("wtransfer_components", block=True, kind=self.kind.name):
            for ref in contributed:
                if not isinstance(ref, ComponentRef) or ref.kind != self.kind.name:
                    logger.warning("Ignoring %r contributed as a %s", ref, self.kind.singular)
                    continue
                providers = by_name.setdefault(ref.name, [])
                if not any(_same_provider(ref, p) for p in providers):
                    providers.append(ref)
        return by_name, discovery.disabled_from_env()

    def clear(self) -> None:
        """Drop discovered components (runtime registrations stay: they are this process's)."""
        with self._lock:
            self._discovered = None

    def is_disabled(self, ref: ComponentRef) -> bool:
        self._by_name()
        return self._disabled.blocks(self.kind.name, ref.name, ref.distribution)

    # -- registration ------------------------------------------------------------
    def register(self, name: str, target: str | type, class_name: str | None = None) -> ComponentRef:
        """Register ``name`` for this process: lazily by module path + class name, or a class."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"A {self.kind.singular} name must be a non-empty string without ':', got {name!r}")
        if isinstance(target, str):
            if class_name is None:
                raise ValueError(
                    f"class_name is required when registering {self.kind.singular} {name!r} "
                    f"with a module path ({target!r})"
                )
            ref = ComponentRef(self.kind.name, name, f"{target}:{class_name}", origin=RUNTIME_ORIGIN)
        elif isinstance(target, type):
            check_subclass(self.kind, target, f"{self.kind.singular} {name!r}")
            ref = ComponentRef(
                self.kind.name, name, f"{target.__module__}:{target.__qualname__}",
                origin=RUNTIME_ORIGIN, obj=target,
            )
        else:
            raise TypeError(f"Expected a module path or a class for {name!r}, got {type(target).__name__}")
        with self._lock:
            holders = [self._runtime[name]] if name in self._runtime else self._by_name().get(name, [])
            if holders:
                held_by = "; ".join(h.describe() for h in holders)
                raise DuplicateComponentError(
                    f"{self.kind.singular.capitalize()} {name!r} is already registered: {held_by}. "
                    f"Pick another name."
                )
            self._runtime[name] = ref
        return ref

    def unregister(self, name: str) -> None:
        """Remove a runtime registration (used by tests' isolated registries)."""
        with self._lock:
            self._runtime.pop(name, None)

    def snapshot(self) -> dict[str, ComponentRef]:
        """The runtime registrations, to put back later with :meth:`restore`."""
        with self._lock:
            return dict(self._runtime)

    def restore(self, snapshot: dict[str, ComponentRef]) -> None:
        with self._lock:
            self._runtime = dict(snapshot)

    # -- lookup --------------------------------------------------------------------
    def resolve(self, name: str) -> ComponentRef:
        """The one component a bare or qualified name means, or a helpful error."""
        distribution, bare = split_qualified(name)
        with self._lock:
            by_name = self._by_name()
            runtime = self._runtime.get(bare)
        if distribution is None and runtime is not None:
            return runtime
        providers = by_name.get(bare, [])
        if distribution is not None:
            providers = [
                p for p in providers
                if p.distribution and normalize_distribution(p.distribution) == distribution
            ]
        enabled = [p for p in providers if not self.is_disabled(p)]
        if len(enabled) == 1:
            return enabled[0]
        if len(enabled) > 1:
            listed = "; ".join(f"'{p.qualified_name}' ({p.provider()}, {p.target})" for p in enabled)
            raise AmbiguousComponentError(
                f"{self.kind.singular.capitalize()} name {bare!r} is provided by {len(enabled)} "
                f"distributions: {listed}. Use a qualified name to choose one, or disable the others "
                f"with {discovery.DISABLE_ENV}."
            )
        if providers:
            raise DisabledComponentError(
                f"{self.kind.singular.capitalize()} {name!r} ({providers[0].provider()}) is disabled "
                f"by the {discovery.DISABLE_ENV} environment variable; remove it from there to use it."
            )
        raise self._unknown(name, bare)

    def _unknown(self, name: str, bare: str) -> UnknownComponentError:
        available = sorted(self.names())
        message = f"Unknown {self.kind.singular} {name!r}."
        hint = install_hint(self.kind.name, bare)
        if hint is not None:
            message += (
                f" {bare!r} is provided by the separately installed package "
                f"'{hint['distribution']}' ({hint['note']}): {hint['install']}."
            )
        else:
            close = suggest(bare, available)
            if close:
                message += " Did you mean " + " or ".join(repr(c) for c in close) + "?"
        message += f" Available {self.kind.name}: {', '.join(available) if available else '(none)'}."
        return UnknownComponentError(message)

    def names(self) -> set[str]:
        with self._lock:
            return set(self._by_name()) | set(self._runtime)

    def get_class(self, name: str, module_path: str | None = None) -> type:
        """Load the named class, or (seed fallback) import ``name`` from ``module_path``."""
        try:
            ref = self.resolve(name)
        except UnknownComponentError:
            if not module_path:
                raise
            return self._from_module_path(name, module_path)
        return ref.load()

    def _from_module_path(self, name: str, module_path: str) -> type:
        what = f"{self.kind.singular} {name!r} from module path {module_path!r}"
        try:
            obj = import_target(f"{module_path}:{name}")
        except Exception as exc:
            raise ComponentLoadError(f"Could not load {what}: {type(exc).__name__}: {exc}") from exc
        return check_subclass(self.kind, obj, what)

    # -- listing --------------------------------------------------------------------
    def refs(self) -> list[ComponentRef]:
        with self._lock:
            discovered = [ref for providers in self._by_name().values() for ref in providers]
            return discovered + list(self._runtime.values())

    def entries(self) -> list[tuple[ComponentInfo, ComponentRef]]:
        """Every component with its metadata view, sorted by name; imports nothing."""
        refs = sorted(self.refs(), key=lambda r: (r.name, r.distribution or ""))
        disabled = {id(ref) for ref in refs if self.is_disabled(ref)}
        counts = Counter(ref.name for ref in refs if id(ref) not in disabled)
        pairs = []
        for ref in refs:
            if id(ref) in disabled:
                status = "disabled"
            elif counts[ref.name] > 1:
                status = "conflict"
            else:
                status = "loaded" if ref.loaded else "available"
            info = ComponentInfo(self.kind.name, ref.name, ref.distribution, ref.version, ref.target, status)
            pairs.append((info, ref))
        return pairs

    def list(self) -> list[ComponentInfo]:
        """Metadata of every component of this kind; imports nothing."""
        return [info for info, _ in self.entries()]


def _same_provider(a: ComponentRef, b: ComponentRef) -> bool:
    return a.target == b.target and (a.distribution or "") == (b.distribution or "")


_registries: dict[str, ComponentRegistry] = {}
_registries_lock = threading.Lock()


def registry_for(kind: str | Kind) -> ComponentRegistry:
    """The process-wide registry of ``kind`` (created cheaply; discovery waits for first use)."""
    resolved = resolve_kind(kind)
    with _registries_lock:
        if resolved.name not in _registries:
            _registries[resolved.name] = ComponentRegistry(resolved)
        return _registries[resolved.name]


# -- the functional API ----------------------------------------------------------------
def get_class(kind: str, name: str, module_path: str | None = None) -> type:
    """The class of component ``name`` (bare or ``distribution:name``) of ``kind``."""
    return registry_for(kind).get_class(name, module_path)


def list_components(kind: str | None = None) -> list[ComponentInfo]:
    """Metadata of installed and registered components (all kinds, or one); imports no plugin."""
    kinds = [resolve_kind(kind)] if kind is not None else list(KINDS.values())
    return [info for k in kinds for info in registry_for(k).list()]


def refresh() -> None:
    """Rescan installed distributions (e.g. after ``pip install`` in a live process)."""
    from wtransfer._registry import manager

    discovery.clear_cache()
    manager.reset()
    with _registries_lock:
        registries = list(_registries.values())
    for registry in registries:
        registry.clear()

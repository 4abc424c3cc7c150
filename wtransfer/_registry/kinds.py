"""The four plugin kinds as data: one generic registry serves them all."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    """One kind of component: where its entry points live and what it must subclass."""

    name: str  # plural, as in the CLI and list output: "engines"
    singular: str  # "engine"
    group: str  # entry-point group
    base: str  # "module:Class" of the base class every component must subclass
    created_hook: str | None = None
    """Hook called with each new instance; ``None`` for kinds whose instances are internal parts of another component
    (a policy belongs to its spec, which is announced)."""

    def base_class(self) -> type:
        from wtransfer._registry.loading import import_target

        return import_target(self.base)


ENGINES = Kind("engines", "engine", "wtransfer.engines", "wtransfer.engines:WeightTransferEngine",
               "wtransfer_engine_created")
CONNECTORS = Kind("connectors", "connector", "wtransfer.connectors", "wtransfer.connectors:KVConnectorBase",
                  "wtransfer_connector_created")
SPECS = Kind("specs", "spec", "wtransfer.specs", "wtransfer.specs:OffloadingSpec", "wtransfer_spec_created")
POLICIES = Kind("policies", "policy", "wtransfer.policies", "wtransfer.specs:EvictionPolicy")
"""Eviction policies for offloading tiers, named by a spec's ``eviction_policy`` option."""
KINDS: dict[str, Kind] = {kind.name: kind for kind in (ENGINES, CONNECTORS, SPECS, POLICIES)}

HOOK_PLUGIN_GROUP = "wtransfer.plugins"
"""Entry-point group whose values are modules of ``@wtransfer.hookimpl`` functions."""


def resolve_kind(kind: str | Kind) -> Kind:
    """``"engines"``, ``"engine"`` (any case) or a :class:`Kind` -> the :class:`Kind`."""
    if isinstance(kind, Kind):
        return kind
    key = kind.strip().lower()
    for candidate in KINDS.values():
        if key in (candidate.name, candidate.singular):
            return candidate
    choices = ", ".join(f"{k.name!r}" for k in KINDS.values())
    raise ValueError(f"Unknown component kind {kind!r}; expected one of {choices} (singular accepted)")

"""Entry-point discovery: one metadata scan per process, kept as plain records.

Rather than ``importlib.metadata.entry_points()`` (an object per entry point of every distribution), :func:`scan`
reads each ``entry_points.txt`` once and parses only those mentioning ``wtransfer.``. As in the stdlib, the first
distribution of a given name on ``sys.path`` wins.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from wtransfer._registry.kinds import HOOK_PLUGIN_GROUP, KINDS
from wtransfer._registry.names import normalize_distribution

GROUP_PREFIX = "wtransfer."
GROUPS = frozenset({kind.group for kind in KINDS.values()} | {HOOK_PLUGIN_GROUP})
DISABLE_ENV = "WTRANSFER_DISABLE_PLUGINS"
logger = logging.getLogger("wtransfer")
_warned: set[str] = set()  # what this process already warned about (each discovery parses the variable again)


@dataclass(frozen=True)
class EntryPointRecord:
    """One entry point in one of wtransfer's groups, with its distribution's identity."""

    group: str
    name: str
    value: str
    distribution: str
    version: str

    def describe(self) -> str:
        return f"entry point '{self.name} = {self.value}' in group '{self.group}'"


def parse_entry_points(text: str, groups: frozenset[str] = GROUPS) -> list[tuple[str, str, str]]:
    """``entry_points.txt`` text -> ``(group, name, value)`` for the wanted groups only."""
    found: list[tuple[str, str, str]] = []
    group: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line[0] == "[" and line[-1] == "]":
            group = line[1:-1].strip()
            continue
        if group in groups:
            name, sep, value = line.partition("=")
            if sep:
                found.append((group, name.strip(), value.strip()))
    return found


def scan(groups: frozenset[str] = GROUPS) -> list[EntryPointRecord]:
    """Read every installed distribution's entry points in ``groups`` (one pass over sys.path)."""
    from importlib.metadata import distributions

    records: list[EntryPointRecord] = []
    seen: set[str] = set()
    for dist in distributions():
        key = getattr(dist, "_normalized_name", None)
        if key is None:  # pragma: no cover - non-path distributions
            key = normalize_distribution(dist.metadata["Name"] or "")
        if key in seen:
            continue
        seen.add(key)
        text = dist.read_text("entry_points.txt")
        if not text or GROUP_PREFIX not in text:
            continue
        wanted = parse_entry_points(text, groups)
        if not wanted:
            continue
        meta = dist.metadata
        distribution, version = meta["Name"] or key, meta["Version"] or "unknown"
        records.extend(EntryPointRecord(g, n, v, distribution, version) for g, n, v in wanted)
    return records


_cache: list[EntryPointRecord] | None = None
_cache_lock = threading.Lock()


def cached_scan() -> list[EntryPointRecord]:
    """The process-wide scan, done on first use and kept until :func:`clear_cache`."""
    global _cache
    with _cache_lock:
        if _cache is None:
            _cache = scan()
        return _cache


def clear_cache() -> None:
    global _cache
    with _cache_lock:
        _cache = None


@dataclass(frozen=True)
class DisabledSet:
    """What ``WTRANSFER_DISABLE_PLUGINS`` names: whole distributions and single components."""

    distributions: frozenset[str] = frozenset()
    components: frozenset[tuple[str, str]] = frozenset()  # (kind plural, bare name)

    def blocks_distribution(self, distribution: str | None) -> bool:
        return distribution is not None and normalize_distribution(distribution) in self.distributions

    def blocks(self, kind: str, name: str, distribution: str | None) -> bool:
        return (kind, name) in self.components or self.blocks_distribution(distribution)


def parse_disabled(value: str | None) -> DisabledSet:
    """``"acme-wt, engines:shm, connector:storage"`` -> a :class:`DisabledSet`."""
    from wtransfer._registry.kinds import resolve_kind

    dists: set[str] = set()
    comps: set[tuple[str, str]] = set()
    for item in (value or "").split(","):
        item = item.strip()
        if not item:
            continue
        head, sep, tail = item.partition(":")
        if sep:  # a distribution name has no ':'
            try:
                comps.add((resolve_kind(head).name, tail.strip()))
            except ValueError as exc:
                warn_once(f"{DISABLE_ENV}: {item!r} blocks nothing: {exc}")
            continue
        dists.add(normalize_distribution(item))
    return DisabledSet(frozenset(dists), frozenset(comps))


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process sees it."""
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


def disabled_from_env() -> DisabledSet:
    return parse_disabled(os.environ.get(DISABLE_ENV))

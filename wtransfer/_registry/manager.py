"""The process's pluggy plugin manager, created on first use (never at import).

It holds the built-in ``wtransfer_components`` implementation (which turns the
entry-point scan into component references) and every hook module named in the
``wtransfer.plugins`` group. A hook module that fails to import is logged and
remembered for ``wtransfer list`` and ``check``; it never stops the others.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import pluggy

from wtransfer._registry import discovery
from wtransfer._registry.component import ComponentRef
from wtransfer._registry.hooks import PROJECT, WTransferHookSpecs, hookimpl
from wtransfer._registry.kinds import HOOK_PLUGIN_GROUP, resolve_kind

logger = logging.getLogger("wtransfer")
TRACE_ENV = "WTRANSFER_TRACE"
BUILTIN_PLUGIN_NAME = "wtransfer.entry-points"


class EntryPointComponents:
    """Built-in hook implementation: components declared in entry-point groups."""

    @hookimpl
    def wtransfer_components(self, kind: str) -> list[ComponentRef]:
        group = resolve_kind(kind).group
        return [
            ComponentRef(kind, r.name, r.value, r.distribution, r.version)
            for r in discovery.cached_scan()
            if r.group == group
        ]


@dataclass(frozen=True)
class HookPluginStatus:
    """One module from the ``wtransfer.plugins`` group and what became of it."""

    record: discovery.EntryPointRecord
    status: str  # "loaded" | "broken" | "disabled"
    error: str | None = None


_manager: pluggy.PluginManager | None = None
_building: pluggy.PluginManager | None = None
_builder: int | None = None  # the thread importing the hook plugins, while it does
_hook_plugins: list[HookPluginStatus] = []
_lock = threading.RLock()


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager; built (and hook plugins imported) on first call.

    A hook module may use wtransfer while it is being imported (register an engine, look
    one up): that call re-enters here from the same thread and gets the manager being
    built, rather than building a second one that would import (and warn about) every
    hook plugin again. See :func:`building`.
    """
    global _manager, _building, _builder
    with _lock:  # an RLock: only the building thread itself gets past it while _building is set
        if _manager is not None:
            return _manager
        if _building is not None:
            return _building
        pm = _building = _new_manager()
        _builder = threading.get_ident()
        statuses: list[HookPluginStatus] = []
        try:
            _load_hook_plugins(pm, statuses)
        finally:
            _building, _builder = None, None
        _hook_plugins[:] = statuses
        _manager = pm
        return pm


def building() -> bool:
    """Whether this thread is importing hook plugins right now (other threads wait for it).

    What the manager answers meanwhile may lack contributions of plugins not yet
    registered, so callers must not cache it (the registries do not). Takes no lock.
    """
    return _builder == threading.get_ident()


def hook_plugins() -> list[HookPluginStatus]:
    """Every module of the ``wtransfer.plugins`` group and what became of it (imports them
    on first use, as the manager does anyway; each broken one was warned about once)."""
    plugin_manager()
    return list(_hook_plugins)


def reset() -> None:
    """Forget the manager; the next use rebuilds it from a fresh scan (see ``refresh``)."""
    global _manager
    with _lock:
        _manager = None
        _hook_plugins.clear()


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(WTransferHookSpecs)
    pm.register(EntryPointComponents(), name=BUILTIN_PLUGIN_NAME)
    return pm


def _load_hook_plugins(pm: pluggy.PluginManager, statuses: list[HookPluginStatus]) -> None:
    """Import and register every hook module, recording each one's status in ``statuses``."""
    disabled = discovery.disabled_from_env()
    for record in discovery.cached_scan():
        if record.group != HOOK_PLUGIN_GROUP:
            continue
        if disabled.blocks_distribution(record.distribution):
            statuses.append(HookPluginStatus(record, "disabled"))
            continue
        try:
            module = importlib.import_module(record.value.partition(":")[0])
            pm.register(module, name=f"{record.distribution}:{record.name}")
            _refuse_unknown_hooks(pm, module)
        except Exception as exc:
            logger.warning(
                "Skipping hook plugin %s from distribution '%s' %s: %s: %s",
                record.describe(), record.distribution, record.version, type(exc).__name__, exc,
            )
            statuses.append(HookPluginStatus(record, "broken", f"{type(exc).__name__}: {exc}"))
        else:
            statuses.append(HookPluginStatus(record, "loaded"))
    if os.environ.get(TRACE_ENV, "").strip() not in ("", "0"):
        pm.trace.root.setwriter(lambda message: logger.info("%s", message.rstrip()))
        pm.enable_tracing()


def _refuse_unknown_hooks(pm: pluggy.PluginManager, plugin: object) -> None:
    """A ``@hookimpl`` whose name matches no hook spec would simply never be called:
    unregister the plugin and raise, naming the function and the hooks that exist
    (pluggy's ``check_pending``, per plugin, so one typo does not silence the others)."""
    for caller in pm.get_hookcallers(plugin) or []:
        if caller.has_spec():
            continue
        if all(impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is plugin):
            continue
        from wtransfer._registry.names import suggest

        pm.unregister(plugin)
        known = sorted(n for n in dir(pm.hook) if not n.startswith("_") and getattr(pm.hook, n).has_spec())
        close = suggest(caller.name, known)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise pluggy.PluginValidationError(
            plugin, f"implements unknown hook {caller.name!r}.{hint} Known hooks: {', '.join(known)}"
        )


def notify(hook_name: str, **kwargs: Any) -> None:
    """Call an observer hook (created / update finished / failed).

    Observers are for metrics and logging; one that raises is logged, never allowed
    to break the transfer that triggered it.
    """
    caller = getattr(plugin_manager().hook, hook_name)
    try:
        caller(**kwargs)
    except Exception:
        logger.exception("A wtransfer plugin's %s hook raised; ignoring it", hook_name)

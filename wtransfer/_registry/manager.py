"""The process's pluggy plugin manager, created on first use (never at import).

**Hook plugins** (modules in the ``wtransfer.plugins`` group: observers, contributors of components) are handled
pluggy's way: loaded by ``load_setuptools_entrypoints``, blocked with ``set_blocked`` (``WTRANSFER_DISABLE_PLUGINS``,
a broken plugin), checked with ``check_pending``. **Components** (engines, connectors, specs, policies) come from the
``wtransfer_components`` hook as lazy :class:`ComponentRef` objects: pluggy cannot load lazily, and importing every
installed engine to list them would be slow and fail without CUDA. The built-in implementation reads the entry-point
groups.

A hook plugin that fails (import, registration, unknown hook, a ``wtransfer_components`` that raises) is logged,
blocked and remembered for ``wtransfer list`` and ``check``; it never stops the others. So each plugin's hook is
called on its own (:func:`call_each`): pluggy's own call stops at the first implementation that raises.
"""

from __future__ import annotations

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
from wtransfer._registry.names import normalize_distribution

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
_failed_calls: dict[str, str] = {}  # plugin name -> why its hook failed when called (it is blocked since)
_lock = threading.RLock()


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager; built (and hook plugins imported) on first call.

    A hook module that uses wtransfer while being imported re-enters here from the same thread and gets the manager
    being built, rather than building (and importing every hook plugin) again. See :func:`building`."""
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
    """Whether this thread is importing hook plugins right now (other threads wait for it). Takes no lock.
    The manager's answers meanwhile may lack plugins not yet registered, so callers must not cache them."""
    return _builder == threading.get_ident()


def hook_plugins() -> list[HookPluginStatus]:
    """Every module of the ``wtransfer.plugins`` group and what became of it (imports them on first use)."""
    plugin_manager()
    with _lock:
        return [HookPluginStatus(p.record, "broken", _failed_calls[p.record.name])
                if p.status == "loaded" and p.record.name in _failed_calls else p for p in _hook_plugins]


def reset() -> None:
    """Forget the manager; the next use rebuilds it from a fresh scan (see ``refresh``)."""
    global _manager
    with _lock:
        _manager = None
        _hook_plugins.clear()
        _failed_calls.clear()


def call_each(hook_name: str, *, block: bool, **kwargs: Any) -> list[Any]:
    """Call hook ``hook_name`` as pluggy would (its order, tracing, ``None`` results dropped), but each plugin on its
    own: one that raises is logged with its distribution and the others still run. With ``block`` it is also blocked
    (none of its hooks runs again in this process) and reported broken. wtransfer's built-in contributor is not
    guarded: its error is a bug here."""
    pm = plugin_manager()
    impls = getattr(pm.hook, hook_name).get_hookimpls()
    results = []
    for impl in reversed(impls):  # pluggy calls the last registered first
        others = {other.plugin for other in impls if other.plugin is not impl.plugin}
        try:
            returned = pm.subset_hook_caller(hook_name, remove_plugins=others)(**kwargs)
            if hook_name == "wtransfer_components":  # an iterator failing part-way fails here, as this plugin's
                returned = [list(contributed) for contributed in returned]
        except Exception as exc:
            if impl.plugin_name == BUILTIN_PLUGIN_NAME:
                raise
            _failed_call(pm, impl.plugin_name, hook_name, kwargs, exc, block)
            continue
        results.extend(returned)
    return results


def _failed_call(pm: pluggy.PluginManager, name: str, hook_name: str, kwargs: dict[str, Any], exc: Exception,
                 block: bool) -> None:
    arguments = ", ".join(f"{key}={value!r}" for key, value in kwargs.items() if isinstance(value, str))
    error = f"its {hook_name}({arguments}) raised {type(exc).__name__}: {exc}"
    with _lock:
        if pm is not _manager and pm is not _building:
            return  # a manager dropped by refresh() meanwhile: the new one has its own view of this plugin
        record = next((p.record for p in _hook_plugins if p.record.name == name), None)
        if block:
            pm.set_blocked(name)
            _failed_calls.setdefault(name, error)
    where = (f"hook plugin {record.describe()} from distribution '{record.distribution}' {record.version}"
             if record is not None else f"hook plugin {name!r}")
    if block:
        hint = (f" (WTRANSFER_DISABLE_PLUGINS={record.distribution} turns it off without this warning)"
                if record is not None else "")
        logger.warning("Blocking %s for this process: %s%s", where, error, hint)
    else:
        logger.error("Ignoring %s: %s", where, error, exc_info=exc)


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(WTransferHookSpecs)
    pm.register(EntryPointComponents(), name=BUILTIN_PLUGIN_NAME)
    return pm


def _load_hook_plugins(pm: pluggy.PluginManager, statuses: list[HookPluginStatus]) -> None:
    """Load every hook module with pluggy's loader, one entry point at a time so a failure blocks only that plugin;
    record each one's status in ``statuses``.

    pluggy knows a plugin by its entry point's name alone, so of two distributions declaring the same name it would
    load whichever comes first on ``sys.path``, even a disabled one. Neither is loaded, and both are reported.
    """
    disabled = discovery.disabled_from_env()
    declared = {normalize_distribution(r.distribution) for r in discovery.cached_scan()}
    for distribution in sorted(disabled.distributions - declared):  # a typo blocks nothing
        discovery.warn_once(f"{discovery.DISABLE_ENV}: {distribution!r} blocks nothing: no installed distribution of "
                            f"that name declares wtransfer components or hook plugins ('wtransfer list' shows them)")
    records = [r for r in discovery.cached_scan() if r.group == HOOK_PLUGIN_GROUP]
    for record in records:
        if disabled.blocks_distribution(record.distribution):
            pm.set_blocked(record.name)
            statuses.append(HookPluginStatus(record, "disabled"))
            continue
        twins = [r.distribution for r in records if r.name == record.name and r is not record]
        if twins:
            pm.set_blocked(record.name)
            _broken(statuses, record, f"ConflictError: distributions {', '.join(sorted([record.distribution, *twins]))} "
                                      f"each declare hook plugin {record.name!r}, and hook plugins are known by name "
                                      f"alone (pluggy's rule), so neither is loaded; uninstall one")
            continue
        if pm.has_plugin(record.name):  # one of wtransfer's own: blocking the name would remove it
            _broken(statuses, record, f"NameError: hook plugin name {record.name!r} is wtransfer's own; "
                                      f"the distribution must declare its hook plugin under another name")
            continue
        try:
            if pm.load_setuptools_entrypoints(HOOK_PLUGIN_GROUP, name=record.name) != 1:
                raise LookupError(  # uninstalled since the scan, or a name pluggy already holds
                    f"pluggy's loader registered no plugin named {record.name!r} (taken, or no longer "
                    f"installed: wtransfer.refresh() rescans)")
            _check_hooks_exist(pm, record.name)
            _check_no_wrappers(pm, record.name)
        except Exception as exc:
            pm.set_blocked(record.name)  # unregisters it too, if it got that far
            _broken(statuses, record, f"{type(exc).__name__}: {exc}")
        else:
            statuses.append(HookPluginStatus(record, "loaded"))
    if os.environ.get(TRACE_ENV, "").strip() not in ("", "0"):
        pm.trace.root.setwriter(lambda message: logger.info("%s", message.rstrip()))
        pm.enable_tracing()


def _broken(statuses: list[HookPluginStatus], record: discovery.EntryPointRecord, error: str) -> None:
    logger.warning("Skipping hook plugin %s from distribution '%s' %s: %s",
                   record.describe(), record.distribution, record.version, error)
    statuses.append(HookPluginStatus(record, "broken", error))


def _check_hooks_exist(pm: pluggy.PluginManager, name: str) -> None:
    """pluggy's ``check_pending``, after each plugin (so only it can be pending): a ``@hookimpl`` matching no hook
    spec would never be called. The error names the function and suggests the hook probably meant."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        from wtransfer._registry.names import suggest

        pending = [n for n in vars(pm.hook) if not n.startswith("_") and not getattr(pm.hook, n).has_spec()
                   and any(i.plugin is pm.get_plugin(name) for i in getattr(pm.hook, n).get_hookimpls())]
        known = sorted(n for n in vars(pm.hook) if not n.startswith("_") and getattr(pm.hook, n).has_spec())
        typo = pending[0] if pending else "?"
        close = suggest(typo, known)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise pluggy.PluginValidationError(
            exc.plugin, f"implements unknown hook {typo!r}.{hint} Known hooks: {', '.join(known)}"
        ) from None


def _check_no_wrappers(pm: pluggy.PluginManager, name: str) -> None:
    """Refuse hook wrappers: wtransfer calls each plugin's hooks on its own (:func:`call_each`), where a wrapper
    would wrap nothing but its own plugin's implementation."""
    plugin = pm.get_plugin(name)
    wrappers = sorted({caller.name for caller in pm.get_hookcallers(plugin) or [] for impl in caller.get_hookimpls()
                       if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper)})
    if wrappers:
        raise pluggy.PluginValidationError(
            plugin, f"implements {', '.join(wrappers)} as a hook wrapper; wtransfer calls each plugin's hooks on "
                    f"their own, so a wrapper would wrap nothing: implement it as a plain hook")


def notify(hook_name: str, **kwargs: Any) -> None:
    """Call an observer hook (created / update finished / failed) in every plugin; one that raises is logged
    (:func:`call_each`), never allowed to break the transfer that triggered it or to silence the others."""
    call_each(hook_name, block=False, **kwargs)

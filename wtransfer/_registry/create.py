"""The one ``create`` behind the three seed factories (engines, connectors, specs): resolve, check, instantiate,
announce. They differ only in which config field names the component and what its constructor takes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from wtransfer._registry.kinds import Kind
from wtransfer._registry.manager import notify
from wtransfer._registry.registry import registry_for

logger = logging.getLogger("wtransfer")


def create(
    kind: Kind,
    name: str,
    module_path: str | None,
    *args: Any,
    check: Callable[[type], None] | None = None,
    context: str = "",
) -> Any:
    """Instantiate component ``name`` of ``kind`` with ``*args`` and call its created-hook.

    ``module_path`` is the seed fallback for unregistered names; ``check`` may refuse the class before anything is
    built (an undeclared KV layout, say); ``context`` is appended to the log line."""
    component_cls = registry_for(kind).get_class(name, module_path)
    if check is not None:
        check(component_cls)
    logger.info("Creating %s %s (%s)%s", kind.singular, name, component_cls.__name__, context)
    component = component_cls(*args)
    if kind.created_hook:
        notify(kind.created_hook, **{kind.singular: component})
    return component

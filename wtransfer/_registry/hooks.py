"""The hook specifications and the ``hookimpl`` / ``hookspec`` markers.

A hook plugin is a module listed in the ``wtransfer.plugins`` entry-point group; its
``@wtransfer.hookimpl`` functions are registered with the process's plugin manager.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "wtransfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class WTransferHookSpecs:
    """Every hook a wtransfer plugin may implement."""

    @hookspec
    def wtransfer_components(self, kind: str) -> list[Any]:
        """Contribute lazy :class:`~wtransfer._registry.ComponentRef` objects of ``kind``
        (``"engines"``, ``"connectors"``, ``"specs"`` or ``"policies"``; more kinds may be
        added, so return an empty list for any kind you do not contribute to). The
        built-in implementations read the entry-point groups and the TOML files named by
        ``WTRANSFER_COMPONENTS``; references stay lazy (the class is imported on first use)."""

    @hookspec
    def wtransfer_engine_created(self, engine: Any) -> None:
        """A weight-transfer engine (worker or trainer side) was created."""

    @hookspec
    def wtransfer_connector_created(self, connector: Any) -> None:
        """A KV connector was created."""

    @hookspec
    def wtransfer_spec_created(self, spec: Any) -> None:
        """A KV offloading spec was created."""

    @hookspec
    def wtransfer_update_finished(self, stats: dict[str, Any]) -> None:
        """A weight update round completed; ``stats`` is a JSON-safe dict."""

    @hookspec
    def wtransfer_update_failed(self, error: BaseException) -> None:
        """A weight update round failed with ``error``."""

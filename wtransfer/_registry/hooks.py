"""The hook specifications and the ``hookimpl``/``hookspec`` markers. A hook plugin is a module in the
``wtransfer.plugins`` entry-point group; its ``@wtransfer.hookimpl`` functions join the process's plugin manager."""

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
        """Contribute lazy :class:`~wtransfer._registry.ComponentRef` objects of ``kind`` (``"engines"``,
        ``"connectors"``, ``"specs"``, ``"policies"``; more kinds may come, so return ``[]`` for any other). The
        built-in implementation reads the entry-point groups; classes are imported on first use."""

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

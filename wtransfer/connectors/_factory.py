"""``KVConnectorFactory``: vLLM's API, backed by the generic registry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from wtransfer._registry.create import create
from wtransfer._registry.kinds import CONNECTORS
from wtransfer._registry.registry import registry_for
from wtransfer.config import KVTransferConfig
from wtransfer.kvcache import check_layout

if TYPE_CHECKING:
    from wtransfer.connectors._base import KVConnectorBase, KVConnectorRole
    from wtransfer.kvcache import KVCacheSpec


class KVConnectorFactory:
    """Creates KV connectors by name, one instance per role as in vLLM V1."""

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register a connector for this process (lazy import). ``ValueError`` if taken."""
        registry_for(CONNECTORS).register(name, module_path, class_name)

    @classmethod
    def create_connector(
        cls,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_spec: KVCacheSpec | None = None,
    ) -> KVConnectorBase:
        """Instantiate ``config.kv_connector`` for ``role`` (fallback: ``kv_connector_module_path``)."""
        return create(
            CONNECTORS, config.kv_connector, config.kv_connector_module_path, config, role, kv_cache_spec,
            check=lambda cls: check_layout(kv_cache_spec, cls, "KV connector"),
            context=f" for role {getattr(role, 'name', role)}, engine_id {config.engine_id}",
        )

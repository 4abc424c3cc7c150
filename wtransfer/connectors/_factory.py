"""``KVConnectorFactory``: vLLM's API, backed by the generic registry."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from wtransfer.config import KVTransferConfig
from wtransfer.kvcache import check_layout
from wtransfer._registry.kinds import CONNECTORS
from wtransfer._registry.manager import notify
from wtransfer._registry.registry import registry_for

if TYPE_CHECKING:
    from wtransfer.connectors._base import KVConnectorBase, KVConnectorRole
    from wtransfer.kvcache import KVCacheSpec

logger = logging.getLogger("wtransfer")


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
        connector_cls = registry_for(CONNECTORS).get_class(
            config.kv_connector, config.kv_connector_module_path
        )
        check_layout(kv_cache_spec, connector_cls, "KV connector")
        logger.info(
            "Creating KV connector %s (%s) for role %s, engine_id %s",
            config.kv_connector, connector_cls.__name__, getattr(role, "name", role), config.engine_id,
        )
        connector = connector_cls(config, role, kv_cache_spec)
        notify(CONNECTORS.created_hook, connector=connector)
        return connector

"""KV connector contract (minimal here; completed by the KV-connector work)."""

from __future__ import annotations

import enum
from abc import ABC
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wtransfer.config import KVTransferConfig
    from wtransfer.kvcache import KVCacheSpec


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is: one instance per role, as in vLLM V1."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorBase(ABC):  # noqa: B024
    """Base class of KV connectors."""

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_spec: KVCacheSpec | None = None,
    ) -> None:
        self.config = config
        self.role = role
        self.kv_cache_spec = kv_cache_spec

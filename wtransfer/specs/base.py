"""KV offloading spec contract (minimal here; completed by the KV-offloading work)."""

from __future__ import annotations

from abc import ABC
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wtransfer.config import KVTransferConfig
    from wtransfer.kvcache import KVCacheSpec


class OffloadingSpec(ABC):  # noqa: B024
    """Base class of KV offloading specs."""

    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec | None = None) -> None:
        self.config = config
        self.kv_cache_spec = kv_cache_spec
        self.extra_config = dict(config.kv_connector_extra_config)

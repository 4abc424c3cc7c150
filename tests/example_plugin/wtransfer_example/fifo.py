"""A CPU offloading tier that evicts in arrival order: a real, small third-party spec.

It reuses wtransfer's CPU tier and contributes only an eviction policy, the way a
plugin author adds behaviour without rewriting the data path. The policy is its own
entry point (``fifo`` in ``wtransfer.policies``), so any spec's ``eviction_policy`` can
name it, in every process, without importing this module first.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable

from wtransfer import KVTransferConfig
from wtransfer.specs import EvictionPolicy, KVCacheSpec
from wtransfer.specs.cpu import CPUOffloadingSpec


class FIFOPolicy(EvictionPolicy):
    """First in, first out: hits do not matter."""

    name = "fifo"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._arrivals: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._arrivals[key] = None

    def touch(self, key: Hashable) -> None:
        pass

    def remove(self, key: Hashable) -> None:
        self._arrivals.pop(key, None)

    def evict(self, count: int, can_evict: Callable[[Hashable], bool]) -> list[Hashable] | None:
        victims = [key for key in self._arrivals if can_evict(key)][:count]
        if len(victims) < count:
            return None
        for key in victims:
            del self._arrivals[key]
        return victims

    def __len__(self) -> int:
        return len(self._arrivals)

    def __contains__(self, key: object) -> bool:
        return key in self._arrivals


class FIFOOffloadingSpec(CPUOffloadingSpec):
    """wtransfer's CPU tier with FIFO eviction (``eviction_policy`` may still override it)."""

    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec | None = None) -> None:
        extra = {"eviction_policy": "fifo", **config.kv_connector_extra_config}
        super().__init__(dataclasses.replace(config, kv_connector_extra_config=extra), kv_cache_spec)

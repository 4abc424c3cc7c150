"""wtransfer: move model state between processes, with backends as entry-point plugins.

This module stays thin: every public name is imported on first access (PEP 562),
so ``import wtransfer`` loads neither torch nor pluggy nor importlib.metadata.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # configs
    "WeightTransferConfig": "wtransfer.config",
    "ParallelConfig": "wtransfer.config",
    "KVTransferConfig": "wtransfer.config",
    # factories (the seed API)
    "WeightTransferEngineFactory": "wtransfer.engines.factory",
    "KVConnectorFactory": "wtransfer.connectors.factory",
    "OffloadingSpecFactory": "wtransfer.specs.factory",
    # weight transfer, worker side
    "WeightTransferEngine": "wtransfer.engines.base",
    "WeightTransferInitInfo": "wtransfer.engines.base",
    "WeightTransferUpdateInfo": "wtransfer.engines.base",
    "WeightTransferInitRequest": "wtransfer.engines.base",
    "WeightTransferUpdateRequest": "wtransfer.engines.base",
    "module_loader": "wtransfer.engines.loader",
    # weight transfer, trainer side
    "create_trainer": "wtransfer.engines.trainer",
    "TrainerWeightTransferEngine": "wtransfer.engines.trainer",
    "NoTrainerSideError": "wtransfer.engines.trainer",
    "WeightSyncClient": "wtransfer.engines.client",
    "WeightSource": "wtransfer.engines.source",
    "ModuleSource": "wtransfer.engines.source",
    "TensorSource": "wtransfer.engines.source",
    "TensorEntry": "wtransfer.engines.manifest",
    "dtype_name": "wtransfer.dtypes",
    # KV connectors and offloading
    "KVCacheSpec": "wtransfer.kvcache",
    "KV_LAYOUTS": "wtransfer.kvcache",
    "block_view": "wtransfer.kvcache",
    "KVConnectorBase": "wtransfer.connectors.base",
    "KVConnectorRole": "wtransfer.connectors.base",
    "KVConnectorMetadata": "wtransfer.connectors.base",
    "KVRequest": "wtransfer.connectors.request",
    "block_hashes": "wtransfer.connectors.hashing",
    "kv_namespace": "wtransfer.connectors.hashing",
    "ScheduledRequest": "wtransfer.connectors.request",
    "SchedulerStep": "wtransfer.connectors.request",
    "KVConnectorOutput": "wtransfer.connectors.request",
    "OffloadingSpec": "wtransfer.specs.base",
    "OffloadingManager": "wtransfer.specs.base",
    "OffloadingHandler": "wtransfer.specs.base",
    "LoadStoreSpec": "wtransfer.specs.base",
    "TransferResult": "wtransfer.specs.base",
    "PrepareStoreOutput": "wtransfer.specs.base",
    "OffloadingEvent": "wtransfer.specs.base",
    "EvictionPolicy": "wtransfer.specs.policies",
    "LRUPolicy": "wtransfer.specs.policies",
    "ARCPolicy": "wtransfer.specs.policies",
    "register_policy": "wtransfer.specs.policies",
    # registry, functional API and hooks
    "get_class": "wtransfer.registry.registry",
    "list_components": "wtransfer.registry.registry",
    "refresh": "wtransfer.registry.registry",
    "ComponentInfo": "wtransfer.registry.registry",
    "ComponentRef": "wtransfer.registry.component",
    "hookimpl": "wtransfer.registry.hooks",
    "hookspec": "wtransfer.registry.hooks",
    # errors
    "WTransferError": "wtransfer.errors",
    "UnknownComponentError": "wtransfer.errors",
    "AmbiguousComponentError": "wtransfer.errors",
    "DuplicateComponentError": "wtransfer.errors",
    "DisabledComponentError": "wtransfer.errors",
    "ComponentLoadError": "wtransfer.errors",
    "InvalidComponentError": "wtransfer.errors",
    "TransferError": "wtransfer.errors",
    "TransferTimeoutError": "wtransfer.errors",
    "ManifestMismatchError": "wtransfer.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'wtransfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # let type checkers and IDEs see the lazy names
    from wtransfer.config import KVTransferConfig, ParallelConfig, WeightTransferConfig
    from wtransfer.connectors.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
    from wtransfer.connectors.request import KVConnectorOutput, KVRequest, ScheduledRequest, SchedulerStep
    from wtransfer.connectors.factory import KVConnectorFactory
    from wtransfer.engines.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferInitRequest,
        WeightTransferUpdateInfo,
        WeightTransferUpdateRequest,
    )
    from wtransfer.engines.client import WeightSyncClient
    from wtransfer.engines.factory import WeightTransferEngineFactory
    from wtransfer.engines.loader import module_loader
    from wtransfer.dtypes import dtype_name
    from wtransfer.engines.manifest import TensorEntry
    from wtransfer.engines.source import ModuleSource, TensorSource, WeightSource
    from wtransfer.engines.trainer import NoTrainerSideError, TrainerWeightTransferEngine, create_trainer
    from wtransfer.errors import (
        AmbiguousComponentError,
        ComponentLoadError,
        DisabledComponentError,
        DuplicateComponentError,
        InvalidComponentError,
        ManifestMismatchError,
        TransferError,
        TransferTimeoutError,
        UnknownComponentError,
        WTransferError,
    )
    from wtransfer.connectors.hashing import block_hashes, kv_namespace
    from wtransfer.kvcache import KV_LAYOUTS, KVCacheSpec, block_view
    from wtransfer.registry.component import ComponentRef
    from wtransfer.registry.hooks import hookimpl, hookspec
    from wtransfer.registry.registry import ComponentInfo, get_class, list_components, refresh
    from wtransfer.specs.base import (
        LoadStoreSpec,
        OffloadingEvent,
        OffloadingHandler,
        OffloadingManager,
        OffloadingSpec,
        PrepareStoreOutput,
        TransferResult,
    )
    from wtransfer.specs.factory import OffloadingSpecFactory
    from wtransfer.specs.policies import ARCPolicy, EvictionPolicy, LRUPolicy, register_policy

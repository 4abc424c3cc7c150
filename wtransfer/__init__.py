"""wtransfer: move model state between processes, with backends as entry-point plugins.

Every public name is imported on first access (PEP 562), so ``import wtransfer`` loads neither torch, pluggy,
importlib.metadata nor ``typing``. Plugin authors import from ``wtransfer.engines``, ``wtransfer.connectors`` and
``wtransfer.specs``; ``_``-modules are private.
"""

from wtransfer._lazy import lazy_exports

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (type checkers read it the same)

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # configs
    "WeightTransferConfig": "wtransfer.config",
    "ParallelConfig": "wtransfer.config",
    "KVTransferConfig": "wtransfer.config",
    # factories (the seed API)
    "WeightTransferEngineFactory": "wtransfer.engines._factory",
    "KVConnectorFactory": "wtransfer.connectors._factory",
    "OffloadingSpecFactory": "wtransfer.specs._factory",
    # weight transfer, worker side
    "WeightTransferEngine": "wtransfer.engines._base",
    "WeightTransferInitInfo": "wtransfer.engines._base",
    "WeightTransferUpdateInfo": "wtransfer.engines._base",
    "WeightTransferInitRequest": "wtransfer.engines._base",
    "WeightTransferUpdateRequest": "wtransfer.engines._base",
    "module_loader": "wtransfer.engines._loader",
    "served_dtypes": "wtransfer.engines._cast",
    # weight transfer, trainer side
    "create_trainer": "wtransfer.engines._trainer",
    "TrainerWeightTransferEngine": "wtransfer.engines._trainer",
    "NoTrainerSideError": "wtransfer.engines._trainer",
    "WeightSyncClient": "wtransfer.engines._client",
    "WeightSource": "wtransfer.engines._source",
    "ModuleSource": "wtransfer.engines._source",
    "TensorSource": "wtransfer.engines._source",
    "TensorEntry": "wtransfer.engines._manifest",
    "dtype_name": "wtransfer._dtypes",
    # KV connectors and offloading
    "KVCacheSpec": "wtransfer.kvcache",
    "KV_LAYOUTS": "wtransfer.kvcache",
    "block_view": "wtransfer.kvcache",
    "KVConnectorBase": "wtransfer.connectors._base",
    "KVConnectorRole": "wtransfer.connectors._base",
    "KVConnectorMetadata": "wtransfer.connectors._base",
    "KVRequest": "wtransfer.connectors._request",
    "block_hashes": "wtransfer.connectors._hashing",
    "kv_namespace": "wtransfer.connectors._hashing",
    "ScheduledRequest": "wtransfer.connectors._request",
    "SchedulerStep": "wtransfer.connectors._request",
    "KVConnectorOutput": "wtransfer.connectors._request",
    "OffloadingSpec": "wtransfer.specs._base",
    "OffloadingManager": "wtransfer.specs._base",
    "OffloadingHandler": "wtransfer.specs._base",
    "LoadStoreSpec": "wtransfer.specs._base",
    "TransferResult": "wtransfer.specs._base",
    "PrepareStoreOutput": "wtransfer.specs._base",
    "OffloadingEvent": "wtransfer.specs._base",
    "EvictionPolicy": "wtransfer.specs.policies",
    "LRUPolicy": "wtransfer.specs.policies",
    "ARCPolicy": "wtransfer.specs.policies",
    # registry, functional API and hooks
    "get_class": "wtransfer._registry.registry",
    "list_components": "wtransfer._registry.registry",
    "refresh": "wtransfer._registry.registry",
    "ComponentInfo": "wtransfer._registry.registry",
    "ComponentRef": "wtransfer._registry.component",
    "hookimpl": "wtransfer._registry.hooks",
    "hookspec": "wtransfer._registry.hooks",
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
    "WeightsTornError": "wtransfer.errors",
    "ManifestMismatchError": "wtransfer.errors",
    "InvalidOptionError": "wtransfer.errors",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # let type checkers and IDEs see the lazy names
    from wtransfer.config import KVTransferConfig, ParallelConfig, WeightTransferConfig
    from wtransfer.connectors._base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
    from wtransfer.connectors._request import KVConnectorOutput, KVRequest, ScheduledRequest, SchedulerStep
    from wtransfer.connectors._factory import KVConnectorFactory
    from wtransfer.engines._base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferInitRequest,
        WeightTransferUpdateInfo,
        WeightTransferUpdateRequest,
    )
    from wtransfer.engines._client import WeightSyncClient
    from wtransfer.engines._factory import WeightTransferEngineFactory
    from wtransfer.engines._loader import module_loader
    from wtransfer._dtypes import dtype_name
    from wtransfer.engines._manifest import TensorEntry
    from wtransfer.engines._source import ModuleSource, TensorSource, WeightSource
    from wtransfer.engines._trainer import NoTrainerSideError, TrainerWeightTransferEngine, create_trainer
    from wtransfer.errors import (
        AmbiguousComponentError,
        ComponentLoadError,
        DisabledComponentError,
        DuplicateComponentError,
        InvalidComponentError,
        InvalidOptionError,
        ManifestMismatchError,
        TransferError,
        TransferTimeoutError,
        UnknownComponentError,
        WTransferError,
    )
    from wtransfer.connectors._hashing import block_hashes, kv_namespace
    from wtransfer.kvcache import KV_LAYOUTS, KVCacheSpec, block_view
    from wtransfer._registry.component import ComponentRef
    from wtransfer._registry.hooks import hookimpl, hookspec
    from wtransfer._registry.registry import ComponentInfo, get_class, list_components, refresh
    from wtransfer.specs._base import (
        LoadStoreSpec,
        OffloadingEvent,
        OffloadingHandler,
        OffloadingManager,
        OffloadingSpec,
        PrepareStoreOutput,
        TransferResult,
    )
    from wtransfer.specs._factory import OffloadingSpecFactory
    from wtransfer.specs.policies import ARCPolicy, EvictionPolicy, LRUPolicy

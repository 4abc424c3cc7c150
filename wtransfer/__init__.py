"""wtransfer: move model state between processes, with backends as entry-point plugins.

Every public name is imported on first access (PEP 562), so ``import wtransfer`` loads neither torch, pluggy,
importlib.metadata nor ``typing``. Plugin authors import from ``wtransfer.engines``, ``wtransfer.connectors`` and
``wtransfer.specs``; ``_``-modules are private.
"""

from wtransfer._lazy import lazy_exports

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (type checkers read it the same)

__version__ = "0.1.0"

_EXPORTS: dict[str, tuple[str, ...]] = {  # module -> the public names it defines
    # configs
    "wtransfer.config": ("WeightTransferConfig", "ParallelConfig", "KVTransferConfig"),
    # factories (the seed API)
    "wtransfer.engines._factory": ("WeightTransferEngineFactory",),
    "wtransfer.connectors._factory": ("KVConnectorFactory",),
    "wtransfer.specs._factory": ("OffloadingSpecFactory",),
    # weight transfer, worker side
    "wtransfer.engines._base": ("WeightTransferEngine", "WeightTransferInitInfo", "WeightTransferUpdateInfo",
                                "WeightTransferInitRequest", "WeightTransferUpdateRequest"),
    "wtransfer.engines._loader": ("module_loader",),
    "wtransfer.engines._cast": ("served_dtypes",),
    # weight transfer, trainer side
    "wtransfer.engines._trainer": ("create_trainer", "TrainerWeightTransferEngine", "NoTrainerSideError"),
    "wtransfer.engines._client": ("WeightSyncClient",),
    "wtransfer.engines._source": ("WeightSource", "ModuleSource", "TensorSource"),
    "wtransfer.engines._manifest": ("TensorEntry",),
    "wtransfer._dtypes": ("dtype_name",),
    # KV connectors and offloading
    "wtransfer.kvcache": ("KVCacheSpec", "KV_LAYOUTS", "block_view"),
    "wtransfer.connectors._base": ("KVConnectorBase", "KVConnectorRole", "KVConnectorMetadata"),
    "wtransfer.connectors._request": ("KVRequest", "ScheduledRequest", "SchedulerStep", "KVConnectorOutput"),
    "wtransfer.connectors._hashing": ("block_hashes", "kv_namespace"),
    "wtransfer.specs._base": ("OffloadingSpec", "OffloadingManager", "OffloadingHandler", "LoadStoreSpec",
                              "TransferResult", "PrepareStoreOutput", "OffloadingEvent"),
    "wtransfer.specs.policies": ("EvictionPolicy", "LRUPolicy", "ARCPolicy"),
    # registry, functional API and hooks
    "wtransfer._registry.registry": ("get_class", "list_components", "refresh", "ComponentInfo"),
    "wtransfer._registry.component": ("ComponentRef",),
    "wtransfer._registry.hooks": ("hookimpl", "hookspec"),
    # errors
    "wtransfer.errors": ("WTransferError", "UnknownComponentError", "AmbiguousComponentError",
                         "DuplicateComponentError", "DisabledComponentError", "ComponentLoadError",
                         "InvalidComponentError", "TransferError", "TransferTimeoutError", "WeightsTornError",
                         "ManifestMismatchError", "InvalidOptionError"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # let type checkers and IDEs see the lazy names (a test keeps this equal to _EXPORTS)
    from wtransfer._dtypes import dtype_name
    from wtransfer._registry.component import ComponentRef
    from wtransfer._registry.hooks import hookimpl, hookspec
    from wtransfer._registry.registry import ComponentInfo, get_class, list_components, refresh
    from wtransfer.config import KVTransferConfig, ParallelConfig, WeightTransferConfig
    from wtransfer.connectors._base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
    from wtransfer.connectors._factory import KVConnectorFactory
    from wtransfer.connectors._hashing import block_hashes, kv_namespace
    from wtransfer.connectors._request import KVConnectorOutput, KVRequest, ScheduledRequest, SchedulerStep
    from wtransfer.engines._base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferInitRequest
    from wtransfer.engines._base import WeightTransferUpdateInfo, WeightTransferUpdateRequest
    from wtransfer.engines._cast import served_dtypes
    from wtransfer.engines._client import WeightSyncClient
    from wtransfer.engines._factory import WeightTransferEngineFactory
    from wtransfer.engines._loader import module_loader
    from wtransfer.engines._manifest import TensorEntry
    from wtransfer.engines._source import ModuleSource, TensorSource, WeightSource
    from wtransfer.engines._trainer import NoTrainerSideError, TrainerWeightTransferEngine, create_trainer
    from wtransfer.errors import AmbiguousComponentError, ComponentLoadError, DisabledComponentError
    from wtransfer.errors import DuplicateComponentError, InvalidComponentError, InvalidOptionError
    from wtransfer.errors import ManifestMismatchError, TransferError, TransferTimeoutError, UnknownComponentError
    from wtransfer.errors import WeightsTornError, WTransferError
    from wtransfer.kvcache import KV_LAYOUTS, KVCacheSpec, block_view
    from wtransfer.specs._base import LoadStoreSpec, OffloadingEvent, OffloadingHandler, OffloadingManager
    from wtransfer.specs._base import OffloadingSpec, PrepareStoreOutput, TransferResult
    from wtransfer.specs._factory import OffloadingSpecFactory
    from wtransfer.specs.policies import ARCPolicy, EvictionPolicy, LRUPolicy

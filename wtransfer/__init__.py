"""wtransfer: move model state between processes, with backends as entry-point plugins.

Every public name is imported on first access (PEP 562), so ``import wtransfer`` loads neither torch, pluggy,
importlib.metadata nor ``typing``. Plugin authors import from ``wtransfer.engines``, ``wtransfer.connectors`` and
``wtransfer.specs``; ``_``-modules and the folders inside ``wtransfer.engines`` are private.
"""

from wtransfer._lazy import lazy_exports

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (type checkers read it the same)

__version__ = "0.1.0"

_EXPORTS: dict[str, tuple[str, ...]] = {  # module -> the public names it defines
    # configs
    "wtransfer.config": ("WeightTransferConfig", "ParallelConfig", "KVTransferConfig"),
    # factories (the seed API)
    "wtransfer.engines.worker.factory": ("WeightTransferEngineFactory",),
    "wtransfer.connectors._factory": ("KVConnectorFactory",),
    "wtransfer.specs._factory": ("OffloadingSpecFactory",),
    # weight transfer, worker side
    "wtransfer.engines.worker.base": ("WeightTransferEngine", "WeightTransferInitInfo", "WeightTransferUpdateInfo",
                                "WeightTransferInitRequest", "WeightTransferUpdateRequest"),
    "wtransfer.engines.worker.loader": ("module_loader",),
    "wtransfer.engines.rounds.cast": ("served_dtypes",),
    # weight transfer, trainer side
    "wtransfer.engines.trainer.create": ("create_trainer", "NoTrainerSideError"),
    "wtransfer.engines.trainer.engine": ("TrainerWeightTransferEngine",),
    "wtransfer.engines.trainer.client": ("WeightSyncClient",),
    "wtransfer.engines.rounds.source": ("WeightSource", "ModuleSource", "TensorSource"),
    "wtransfer.engines.rounds.manifest": ("TensorEntry",),
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
    from wtransfer.engines.worker.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferInitRequest
    from wtransfer.engines.worker.base import WeightTransferUpdateInfo, WeightTransferUpdateRequest
    from wtransfer.engines.rounds.cast import served_dtypes
    from wtransfer.engines.trainer.client import WeightSyncClient
    from wtransfer.engines.worker.factory import WeightTransferEngineFactory
    from wtransfer.engines.worker.loader import module_loader
    from wtransfer.engines.rounds.manifest import TensorEntry
    from wtransfer.engines.rounds.source import ModuleSource, TensorSource, WeightSource
    from wtransfer.engines.trainer.create import NoTrainerSideError, create_trainer
    from wtransfer.engines.trainer.engine import TrainerWeightTransferEngine
    from wtransfer.errors import AmbiguousComponentError, ComponentLoadError, DisabledComponentError
    from wtransfer.errors import DuplicateComponentError, InvalidComponentError, InvalidOptionError
    from wtransfer.errors import ManifestMismatchError, TransferError, TransferTimeoutError, UnknownComponentError
    from wtransfer.errors import WeightsTornError, WTransferError
    from wtransfer.kvcache import KV_LAYOUTS, KVCacheSpec, block_view
    from wtransfer.specs._base import LoadStoreSpec, OffloadingEvent, OffloadingHandler, OffloadingManager
    from wtransfer.specs._base import OffloadingSpec, PrepareStoreOutput, TransferResult
    from wtransfer.specs._factory import OffloadingSpecFactory
    from wtransfer.specs.policies import ARCPolicy, EvictionPolicy, LRUPolicy

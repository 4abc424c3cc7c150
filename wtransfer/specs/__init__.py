"""The KV-offloading toolkit: everything a spec or eviction-policy author may import.

Base and data types (vLLM's names)
    ``OffloadingSpec``, ``OffloadingSpecOptions`` (the keys every spec takes; extend it), ``OffloadingManager``,
    ``OffloadingHandler``, ``LoadStoreSpec``, ``TransferResult``, ``PrepareStoreOutput``, ``OffloadingEvent``,
    ``KVCacheSpec``, ``block_view``; the media names ``DEVICE_MEDIUM`` and ``CPU_MEDIUM``.
Parts the built-in tier is made of
    ``BlockTableManager`` (a fixed table of slots, any eviction policy), ``BlockCopyHandler`` (copies block rows
    between two tensors on a thread), ``EvictionPolicy`` (base of the ``wtransfer.policies`` plugin kind),
    ``LRUPolicy``, ``ARCPolicy``, ``create_policy``.
Specs to derive from live in their own modules: ``CPUOffloadingSpec`` in :mod:`wtransfer.specs.cpu`.
    ``OffloadingSpecFactory`` is :mod:`wtransfer`'s.
"""

from wtransfer._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "OffloadingSpec": "wtransfer.specs._base",
    "OffloadingSpecOptions": "wtransfer.specs._base",
    "OffloadingManager": "wtransfer.specs._base",
    "OffloadingHandler": "wtransfer.specs._base",
    "LoadStoreSpec": "wtransfer.specs._base",
    "TransferResult": "wtransfer.specs._base",
    "PrepareStoreOutput": "wtransfer.specs._base",
    "OffloadingEvent": "wtransfer.specs._base",
    "DEVICE_MEDIUM": "wtransfer.specs._base",
    "CPU_MEDIUM": "wtransfer.specs._base",
    "KVCacheSpec": "wtransfer.kvcache",
    "block_view": "wtransfer.kvcache",
    "BlockTableManager": "wtransfer.specs._manager",
    "BlockCopyHandler": "wtransfer.specs.cpu",
    "EvictionPolicy": "wtransfer.specs.policies",
    "LRUPolicy": "wtransfer.specs.policies",
    "ARCPolicy": "wtransfer.specs.policies",
    "create_policy": "wtransfer.specs.policies",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

"""The KV-offloading toolkit: everything a spec or eviction-policy author may import (``_EXPORTS``).

Base and data types carry vLLM's names; extend ``OffloadingSpecOptions`` (the keys every spec takes). The built-in
tier is made of ``BlockTableManager`` (a fixed table of slots, any eviction policy) and ``BlockCopyHandler`` (copies
block rows between two tensors on a thread); ``EvictionPolicy`` is the base of the ``wtransfer.policies`` plugin
kind. Specs to derive from live in their own modules: ``CPUOffloadingSpec`` in :mod:`wtransfer.specs.cpu`.
``OffloadingSpecFactory`` is :mod:`wtransfer`'s.
"""

from wtransfer._lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {  # module -> the public names it defines
    "wtransfer.specs._base": ("OffloadingSpec", "OffloadingSpecOptions", "OffloadingManager", "OffloadingHandler",
                              "LoadStoreSpec", "TransferResult", "PrepareStoreOutput", "OffloadingEvent",
                              "DEVICE_MEDIUM", "CPU_MEDIUM"),
    "wtransfer.kvcache": ("KVCacheSpec", "block_view"),
    "wtransfer.specs._manager": ("BlockTableManager",),
    "wtransfer.specs.cpu": ("BlockCopyHandler",),
    "wtransfer.specs.policies": ("EvictionPolicy", "LRUPolicy", "ARCPolicy", "create_policy"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

"""The KV-connector toolkit: everything a connector author may import (``_EXPORTS``), and nothing else.

``block_view`` gives any layout's cache as ``[segments, blocks, elements]``; ``block_hashes`` are chained per-block
hashes rooted in ``kv_namespace`` (model fingerprint, layout, geometry). Connectors to derive from or compose live in
their own modules: ``StorageConnector`` in :mod:`wtransfer.connectors.storage`, ``MultiConnector`` in
:mod:`wtransfer.connectors.multi`, ``OffloadingConnector`` in :mod:`wtransfer.connectors.offloading`.
``KVConnectorFactory`` is :mod:`wtransfer`'s.
"""

from wtransfer._lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {  # module -> the public names it defines
    "wtransfer.connectors._base": ("KVConnectorBase", "KVConnectorRole", "KVConnectorMetadata"),
    "wtransfer.connectors._request": ("KVRequest", "ScheduledRequest", "SchedulerStep", "KVConnectorOutput",
                                      "full_block_range"),
    "wtransfer.connectors._hashing": ("block_hashes", "kv_namespace"),
    "wtransfer.kvcache": ("KVCacheSpec", "KV_LAYOUTS", "block_view"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

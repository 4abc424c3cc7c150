"""The KV-connector toolkit: everything a connector author may import, and nothing else.

Base and data types
    ``KVConnectorBase``, ``KVConnectorRole``, ``KVConnectorMetadata``, ``KVRequest``, ``ScheduledRequest``,
    ``SchedulerStep``, ``KVConnectorOutput``, ``KVCacheSpec``, ``KV_LAYOUTS``, ``block_view`` (any layout's cache as
    ``[segments, blocks, elements]``).
Block identity
    ``block_hashes`` (chained per-block hashes), ``kv_namespace`` (their root: model fingerprint, layout, geometry),
    ``full_block_range``.
Connectors to derive from or compose live in their own modules: ``StorageConnector`` in
    :mod:`wtransfer.connectors.storage`, ``MultiConnector`` in :mod:`wtransfer.connectors.multi`,
    ``OffloadingConnector`` in :mod:`wtransfer.connectors.offloading`. ``KVConnectorFactory`` is :mod:`wtransfer`'s.
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

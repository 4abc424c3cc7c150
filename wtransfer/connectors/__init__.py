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

_EXPORTS: dict[str, str] = {
    "KVConnectorBase": "wtransfer.connectors._base",
    "KVConnectorRole": "wtransfer.connectors._base",
    "KVConnectorMetadata": "wtransfer.connectors._base",
    "KVRequest": "wtransfer.connectors._request",
    "ScheduledRequest": "wtransfer.connectors._request",
    "SchedulerStep": "wtransfer.connectors._request",
    "KVConnectorOutput": "wtransfer.connectors._request",
    "full_block_range": "wtransfer.connectors._request",
    "block_hashes": "wtransfer.connectors._hashing",
    "kv_namespace": "wtransfer.connectors._hashing",
    "KVCacheSpec": "wtransfer.kvcache",
    "KV_LAYOUTS": "wtransfer.kvcache",
    "block_view": "wtransfer.kvcache",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

"""Block identity: chained sha256 prefix hashes, stable across processes and hosts.

A block's hash covers every token before it: ``hash_i = sha256(encode(hash_{i-1}, tokens of block i, extra keys))``.
The chain is rooted in a namespace digest of the model fingerprint and the KV layout (layer names, block size,
heads, head size, dtype, memory layout), so KV of another model or layout never matches, however the tokens agree.
The encoding is canonical (fixed-width little-endian integers, length prefixes, sorted-key JSON for extra keys),
with no Python ``hash()``: independent of ``PYTHONHASHSEED``, platform and interpreter.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wtransfer.kvcache import KVCacheSpec

HASH_SCHEME = "wtransfer-kv-block-v2"
"""Bumped whenever the encoding changes, so old stores stop matching instead of mismatching."""

_LENGTH = struct.Struct("<Q")


def _field(data: bytes) -> bytes:
    """A length-prefixed field: no two different field lists encode to the same bytes."""
    return _LENGTH.pack(len(data)) + data


def _canonical_json(value: Any) -> bytes:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"block hash extra keys must be JSON-safe (str, int, float, bool, None, lists, dicts); got {value!r}"
        ) from exc


def kv_namespace(spec: KVCacheSpec) -> str:
    """The root of every hash chain for ``spec``: hex sha256 of the model fingerprint and KV layout."""
    layout = {
        "scheme": HASH_SCHEME,
        "model_fingerprint": spec.model_fingerprint,
        "layer_names": list(spec.layer_names),
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": spec.dtype,
        "layout": spec.layout,
    }
    if spec.num_shards != 1:  # (absent for one shard: those namespaces stay what they were)
        layout["num_shards"] = spec.num_shards
    return hashlib.sha256(_canonical_json(layout)).hexdigest()


def hash_block(parent: str, token_ids: Sequence[int], extra_keys: Any = None) -> str:
    """Hex sha256 of one block given its parent's hash (or the namespace for the first block)."""
    try:
        tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise TypeError(f"token ids must be 64-bit integers; got {list(token_ids)[:8]}...") from exc
    digest = hashlib.sha256()
    digest.update(_field(bytes.fromhex(parent)))
    digest.update(_field(tokens))
    digest.update(_field(_canonical_json(extra_keys)))
    return digest.hexdigest()


def block_hashes(
    namespace: str,
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent_hashes: Sequence[str] = (),
    extra_keys: Any = None,
) -> list[str]:
    """Hashes of every full block of ``token_ids``, reusing ``parent_hashes`` already computed.

    After tokens were appended, pass the request's current hashes as ``parent_hashes``: only the new full blocks are
    hashed, and the whole list is returned. ``extra_keys`` (JSON-safe: a LoRA name, a cache salt) go into every block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    hashes = list(parent_hashes)
    num_full = len(token_ids) // block_size
    if len(hashes) > num_full:
        raise ValueError(
            f"{len(hashes)} parent hashes given for only {num_full} full blocks of {len(token_ids)} tokens"
        )
    parent = hashes[-1] if hashes else namespace
    for index in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[index * block_size : (index + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes


def request_block_hashes(spec: KVCacheSpec, token_ids: Sequence[int], *, extra_keys: Any = None) -> list[str]:
    """Convenience: the full-block hashes of ``token_ids`` for an engine described by ``spec``."""
    return block_hashes(kv_namespace(spec), token_ids, spec.block_size, extra_keys=extra_keys)

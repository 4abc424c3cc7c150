"""Block identity: chained, canonical, process- and seed-independent, isolated per model and layout."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct

import pytest

from wtransfer.connectors._hashing import block_hashes, hash_block, kv_namespace, request_block_hashes
from wtransfer.kvcache import KVCacheSpec
from wtransfer.testing.processes import run_python

SPEC = KVCacheSpec(
    ("layer.0", "layer.1"), block_size=4, num_kv_heads=2, head_size=8, dtype="bfloat16", model_fingerprint="model-a"
)
TOKENS = list(range(100, 118))  # 4 full blocks + 2 tokens


def test_one_hash_per_full_block_and_chained() -> None:
    hashes = request_block_hashes(SPEC, TOKENS)
    assert len(hashes) == 4
    assert len(set(hashes)) == 4
    root = kv_namespace(SPEC)
    assert hashes[0] == hash_block(root, TOKENS[:4])
    assert hashes[1] == hash_block(hashes[0], TOKENS[4:8])


def test_encoding_is_the_documented_canonical_one() -> None:
    """sha256 over length-prefixed (parent digest, little-endian int64 tokens, sorted-key JSON extras)."""
    parent = kv_namespace(SPEC)
    fields = [bytes.fromhex(parent), struct.pack("<4q", *TOKENS[:4]), b"null"]
    expected = hashlib.sha256(b"".join(struct.pack("<Q", len(f)) + f for f in fields)).hexdigest()
    assert hash_block(parent, TOKENS[:4]) == expected


def test_a_block_hash_depends_on_every_earlier_token() -> None:
    changed = list(TOKENS)
    changed[1] += 1
    a, b = request_block_hashes(SPEC, TOKENS), request_block_hashes(SPEC, changed)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_incremental_extension_matches_a_full_recompute() -> None:
    root = kv_namespace(SPEC)
    first = block_hashes(root, TOKENS[:9], 4)
    extended = block_hashes(root, TOKENS, 4, parent_hashes=first)
    assert extended == block_hashes(root, TOKENS, 4)
    with pytest.raises(ValueError, match="parent hashes"):
        block_hashes(root, TOKENS[:3], 4, parent_hashes=first)


def test_extra_keys_separate_otherwise_equal_blocks_and_must_be_json() -> None:
    root = kv_namespace(SPEC)
    plain = block_hashes(root, TOKENS, 4)
    salted = block_hashes(root, TOKENS, 4, extra_keys={"lora": "math", "salt": 1})
    assert not set(plain) & set(salted)
    assert salted == block_hashes(root, TOKENS, 4, extra_keys={"salt": 1, "lora": "math"})  # key order irrelevant
    with pytest.raises(TypeError, match="JSON-safe"):
        block_hashes(root, TOKENS, 4, extra_keys={"x": object()})


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "model-b"},
        {"dtype": "float16"},
        {"num_kv_heads": 4},
        {"head_size": 16},
        {"layer_names": ("layer.0", "layer.1", "layer.2")},
    ],
)
def test_another_model_or_layout_never_shares_a_hash(change: dict[str, object]) -> None:
    other = dataclasses.replace(SPEC, **change)
    assert kv_namespace(other) != kv_namespace(SPEC)
    assert not set(request_block_hashes(other, TOKENS)) & set(request_block_hashes(SPEC, TOKENS))


def test_same_hashes_in_another_process_with_another_hash_seed() -> None:
    code = f"""
        import json
        from wtransfer.kvcache import KVCacheSpec
        from wtransfer.connectors._hashing import request_block_hashes
        spec = KVCacheSpec.from_dict({json.dumps(SPEC.to_dict())})
        print(json.dumps(request_block_hashes(spec, {TOKENS!r}, extra_keys={{"b": [1, 2], "a": "x"}})))
    """
    here = request_block_hashes(SPEC, TOKENS, extra_keys={"a": "x", "b": [1, 2]})
    for seed in ("0", "12345"):
        proc = run_python(code, env={"PYTHONHASHSEED": seed}, timeout=60)
        assert json.loads(proc.stdout) == here

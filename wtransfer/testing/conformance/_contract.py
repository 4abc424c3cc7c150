"""Failures that explain themselves (which contract point, what was expected, what happened), and the cache the
connector and spec suites share."""

from __future__ import annotations

from typing import Any

import pytest

BLOCK_SIZE = 4
"""Tokens per block of the conformance engine's cache."""


class ContractViolation(AssertionError):
    """A plugin broke a point of its kind's contract."""


def require(condition: Any, point: str, expected: str, got: Any = None) -> None:
    """Fail with a message naming the contract ``point`` unless ``condition`` holds."""
    if not condition:
        message = f"contract point: {point}\n  expected: {expected}"
        if got is not None:
            message += f"\n  the plugin did: {got}"
        raise ContractViolation(message)


def layout_spec(kind: str, name: str, layout: str) -> Any:
    """The conformance engine's cache in ``layout``; skips the test if the ``kind`` component ``name`` (``"connectors"``
    or ``"specs"``) does not declare that layout."""
    from wtransfer import get_class
    from wtransfer.kvcache import KVCacheSpec

    if layout not in getattr(get_class(kind, name), "supported_layouts", ("wtransfer",)):
        pytest.skip(f"{kind.removesuffix('s')} {name!r} does not declare the {layout!r} layout")
    return KVCacheSpec(("layer.0", "layer.1"), block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8,
                       dtype="float32", model_fingerprint="conformance-model", layout=layout)

"""Dtype names shared by every component: torch's own names without the ``torch.`` prefix.

One table serves weight manifests, KV block files and offloading tiers, so "bfloat16" means the same on every wire.
torch is imported on first use; a dtype this torch lacks (the fnuz float8 types, say) is just unsupported.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool", "complex32", "complex64", "complex128",
)  # fmt: skip


@lru_cache(maxsize=1)
def _dtype_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    import torch

    by_name = {name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)}
    return by_name, {dtype: name for name, dtype in by_name.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = _dtype_tables()[1].get(dtype)
    if name is None:
        raise ValueError(f"dtype {dtype} cannot be transferred; supported: {', '.join(_dtype_tables()[0])}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name; ``ValueError`` naming the supported ones otherwise."""
    dtype = _dtype_tables()[0].get(name)
    if dtype is None:
        raise ValueError(f"unknown dtype name {name!r}; supported: {', '.join(_dtype_tables()[0])}")
    return dtype


@lru_cache(maxsize=1)
def supported_dtype_names() -> frozenset[str]:
    """Every dtype name this torch can put on a wire."""
    return frozenset(_dtype_tables()[0])

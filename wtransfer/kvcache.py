"""Engine-neutral descriptions of a paged KV cache, shared by connectors and offloading specs.

Plain dataclasses with no engine types, so any engine with a paged KV cache can
describe itself to any connector plugin, and so they serialise to JSON.
Per-layer cache layout: ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of an engine's KV cache and the identity of the model that filled it.

    ``dtype`` is a torch dtype name (``"bfloat16"``, ``"float32"``). ``model_fingerprint``
    identifies the weights: KV produced under another fingerprint or layout never matches.
    """

    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    model_fingerprint: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if not self.layer_names:
            raise ValueError("KVCacheSpec.layer_names must not be empty")
        for name in ("block_size", "num_kv_heads", "head_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be > 0, got {getattr(self, name)}")
        if self.dtype.startswith("torch."):
            object.__setattr__(self, "dtype", self.dtype.removeprefix("torch."))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layer_names"] = list(self.layer_names)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheSpec:
        return cls(**data)

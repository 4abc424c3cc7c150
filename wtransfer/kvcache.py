"""Engine-neutral descriptions of a paged KV cache, shared by connectors and offloading specs.

Plain JSON-serialisable dataclasses with no engine types, so any engine with a paged KV cache can describe itself
to any connector plugin. The per-layer memory layout (``KVCacheSpec.layout``) is part of the description, since a
connector that copies blocks must know where their bytes are. Known layouts (:data:`KV_LAYOUTS`):

``"wtransfer"``
    ``[2, num_blocks, block_size, num_kv_heads, head_size]``: keys then values (the tiny paged engine's). A block is
    two runs of bytes.
``"vllm-cpu"``
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``: vLLM's CPU attention cache. A block is one run of
    bytes.

Block-moving connectors treat a block as opaque bytes: :func:`block_view` gives every layer as
``[segments, num_blocks, elements]`` whatever the layout. The layout is part of every block hash's namespace, so KV
stored under one layout is never read as another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

KV_LAYOUTS: dict[str, str] = {
    "wtransfer": "[2, num_blocks, block_size, num_kv_heads, head_size]",
    "vllm-cpu": "[num_blocks, num_kv_heads, block_size, 2 * head_size]",
}
"""Layout name -> the per-layer tensor shape it names."""

DEFAULT_LAYOUT = "wtransfer"


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of an engine's KV cache and the identity of the model that filled it.

    ``dtype`` is a torch dtype name (``"bfloat16"``). ``model_fingerprint`` identifies the weights: KV produced under
    another fingerprint or ``layout`` (a key of :data:`KV_LAYOUTS`) never matches. ``shard`` of ``num_shards``: with
    tensor parallelism each worker holds part of each block (``num_kv_heads`` is its share); a block is whole only
    when every part is there. The scheduler side, holding no part, uses shard 0."""

    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    model_fingerprint: str
    layout: str = DEFAULT_LAYOUT
    shard: int = 0
    num_shards: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if not self.layer_names:
            raise ValueError("KVCacheSpec.layer_names must not be empty")
        for name in ("block_size", "num_kv_heads", "head_size", "num_shards"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"KVCacheSpec.shard must be in 0..{self.num_shards - 1}, got {self.shard}")
        if self.dtype.startswith("torch."):
            object.__setattr__(self, "dtype", self.dtype.removeprefix("torch."))
        if self.layout not in KV_LAYOUTS:
            raise ValueError(
                f"KVCacheSpec.layout {self.layout!r} is not a known layout; known: "
                + ", ".join(f"{name} {shape}" for name, shape in KV_LAYOUTS.items())
            )

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of one layer's cache tensor with ``num_blocks`` blocks, in this layout."""
        if self.layout == "vllm-cpu":
            return (num_blocks, self.num_kv_heads, self.block_size, 2 * self.head_size)
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of one layer, as its bytes lie in memory (``cache_shape`` without the block axis)."""
        shape = self.cache_shape(1)
        return shape[1:] if self.layout == "vllm-cpu" else (shape[0], *shape[2:])

    @property
    def block_segments(self) -> int:
        """How many separate runs of bytes one block of one layer is (2 for keys-then-values layouts)."""
        return 1 if self.layout == "vllm-cpu" else 2

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layer_names"] = list(self.layer_names)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheSpec:
        return cls(**data)


class KVComponent:
    """What a KV connector or offloading spec class declares (the base of both kinds' base classes): its factory
    checks the first two before creating one (:func:`check_layout`), and it parses its options against the others."""

    supported_layouts: ClassVar[tuple[str, ...]] = (DEFAULT_LAYOUT,)
    """KV cache layouts (:data:`KV_LAYOUTS`) it handles; the factory refuses others."""
    handles_parts: ClassVar[bool] = False
    """Whether it keeps tensor-parallel workers' parts of a block apart (``KVCacheSpec.shard``); the factories
    refuse an engine with ``num_shards > 1`` otherwise."""

    options_cls: ClassVar[type | None] = None
    """The dataclass (fields made with :func:`wtransfer.options.option`) declaring the accepted
    ``kv_connector_extra_config`` keys (a spec's subclasses ``OffloadingSpecOptions``). ``None`` (default): the
    dict is not checked, for components that read ``extra_config`` themselves; ``self.options`` is then that dict."""

    options_owner: ClassVar[str] = ""
    """How option errors name it ("storage connector"); default: its class name."""


def check_layout(spec: KVCacheSpec | None, component: type, what: str) -> None:
    """Refuse, before anything is created, a cache layout that ``component`` does not declare in
    ``supported_layouts`` (default only ``"wtransfer"``, so an older plugin never gets bytes it would misread)."""
    if spec is not None and spec.num_shards > 1 and not getattr(component, "handles_parts", False):
        raise ValueError(
            f"{what} {component.__name__} has not declared that it handles one part of each block "
            f"(this engine runs {spec.num_shards} tensor-parallel workers, each holding some of every block's "
            "heads): it would store or load every worker's part under one name. Declare handles_parts = True "
            "once it keeps the parts apart (KVCacheSpec.shard), or run it with tensor_parallel_size=1"
        )
    supported = tuple(getattr(component, "supported_layouts", (DEFAULT_LAYOUT,)))
    if spec is not None and spec.layout not in supported:
        raise ValueError(
            f"{what} {component.__name__} does not support the {spec.layout!r} KV cache layout "
            f"{KV_LAYOUTS[spec.layout]}; it supports {', '.join(repr(name) for name in supported)}. "
            "Pick a component that does, or declare the layout in its supported_layouts once it handles it"
        )


def block_view(spec: KVCacheSpec, name: str, cache: torch.Tensor, *, who: str, cpu_only: bool = True) -> torch.Tensor:
    """Layer ``name``'s cache as ``[segments, num_blocks, elements]`` (a view: no copy). ``ValueError`` naming ``who``,
    the layer, what it got and what the layout expects unless the tensor matches the spec, is contiguous, and is on
    the CPU (unless ``cpu_only`` is False)."""
    from wtransfer._dtypes import dtype_name

    axis = 0 if spec.layout == "vllm-cpu" else 1
    num_blocks = cache.shape[axis] if cache.dim() > axis else 0
    expected = spec.cache_shape(num_blocks)
    if tuple(cache.shape) != expected or dtype_name(cache.dtype) != spec.dtype:
        raise ValueError(
            f"{who}: KV cache of layer {name!r} is {list(cache.shape)} {dtype_name(cache.dtype)}; layout "
            f"{spec.layout!r} {KV_LAYOUTS[spec.layout]} expects {list(expected)} {spec.dtype}"
        )
    if (cpu_only and cache.device.type != "cpu") or not cache.is_contiguous():
        raise ValueError(
            f"{who}: KV cache of layer {name!r} must be a contiguous {'CPU ' if cpu_only else ''}tensor (got {cache.device}, "
            f"contiguous={cache.is_contiguous()}); blocks are copied as whole runs of bytes"
        )
    return cache.view(spec.block_segments, num_blocks, -1)

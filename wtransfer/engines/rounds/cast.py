"""The dtype a round carries each tensor in: the one the receiving model loads.

RL trainers often keep fp32 master weights while inference serves bf16. Each worker says at rendezvous
which dtypes its model loads (:class:`ServedDtypes`); the trainer casts each floating tensor that differs
on the rank that holds it, as its bytes are packed or written (never a copy of the model), so the wire
carries what is served. ``create_trainer(..., dtype=...)`` forces one dtype instead. Integer and bool
tensors are never cast; a cast rounds as ``tensor.to(dtype)`` does, as vLLM's loaders do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wtransfer._dtypes import dtype_name
from wtransfer.engines.rounds.manifest import TensorEntry
from wtransfer.errors import TransferError

if TYPE_CHECKING:
    import torch

FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})
"""The dtypes a round casts between. float8 needs scales a plain cast does not make: never cast."""


@dataclass(frozen=True)
class ServedDtypes:
    """The dtypes a worker's model loads: ``names`` per tensor, ``default`` for any other name."""

    default: str | None = None
    names: Mapping[str, str] = field(default_factory=dict)

    def dtype_for(self, name: str) -> str | None:
        return self.names.get(name, self.default)

    def to_dict(self) -> dict[str, Any]:
        return {"default": self.default, "names": dict(self.names)}

    @classmethod
    def from_dict(cls, data: Any) -> ServedDtypes:
        """Parse what a worker sent; ``ValueError`` on anything but names of floating dtypes."""
        if not isinstance(data, dict) or not isinstance(data.get("names", {}), dict):
            raise ValueError(f"served dtypes must be {{'default': dtype|None, 'names': {{name: dtype}}}}, got {data!r}")
        default, names = data.get("default"), data.get("names", {})
        for dtype in [default, *names.values()]:
            if dtype is not None and dtype not in FLOATING:
                raise ValueError(f"served dtype {dtype!r} is not one of {', '.join(sorted(FLOATING))}")
        return cls(default, dict(names))


def served_dtypes(model: Any, names: Mapping[str, str] | None = None) -> ServedDtypes:
    """What a worker's model loads, for its engine's ``served_dtypes``: from a ``torch.nn.Module``'s
    parameters, or one dtype (``torch.dtype`` or name) for every floating tensor but those in ``names``."""
    if isinstance(model, str) or not hasattr(model, "named_parameters"):
        name = model if isinstance(model, str) else dtype_name(model)
        kept = {n: d for n, d in (names or {}).items() if d in FLOATING}  # float8 and integers never cast
        return ServedDtypes(name if name in FLOATING else None, kept)
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    # its most common floating dtype as default, and every floating tensor of another dtype by name
    floating = {name: dtype for name, t in named if (dtype := dtype_name(t.dtype)) in FLOATING}
    counts = Counter(floating.values())
    default = max(counts, key=lambda d: counts[d]) if counts else None
    return ServedDtypes(default, {name: dtype for name, dtype in floating.items() if dtype != default})


def agreed(answers: Mapping[int, Any]) -> ServedDtypes | None:
    """The served dtypes every worker sent (rank -> dict or None); None if none sent any. Workers that
    disagree cannot share a wire dtype: the rendezvous fails naming both."""
    parsed = {rank: ServedDtypes.from_dict(data) for rank, data in sorted(answers.items()) if data is not None}
    if not parsed:
        return None
    (first_rank, first), *others = parsed.items()
    for rank, other in others:
        names = set(first.names) | set(other.names)
        differing = [n for n in sorted(names) if first.dtype_for(n) != other.dtype_for(n)]
        if first.default != other.default or differing:
            what = ", ".join(f"{n!r} ({first.dtype_for(n)} vs {other.dtype_for(n)})" for n in differing[:4]) or (
                f"floating tensors ({first.default} vs {other.default})")
            raise TransferError(f"workers {first_rank} and {rank} load different dtypes for {what}; one round "
                                f"cannot carry both: pass create_trainer(..., dtype=...)")
    return first


@dataclass(frozen=True)
class CastPlan:
    """What a trainer casts: to ``dtype`` if the user chose one, else to what the workers serve (rank 0
    sends it to the other ranks with each round, so they cast alike)."""

    served: ServedDtypes | None = None
    dtype: str | None = None

    def entries(self, entries: Iterable[TensorEntry]) -> tuple[TensorEntry, ...]:
        """The round's entries as they travel: floating tensors in the planned dtype, the rest as held."""
        out = []
        for entry in entries:
            target = self.dtype if self.dtype is not None else (
                self.served.dtype_for(entry.name) if self.served is not None else None)
            if target is not None and target != entry.dtype and entry.dtype in FLOATING and target in FLOATING:
                entry = TensorEntry(entry.name, target, entry.shape)
            out.append(entry)
        return tuple(out)

    def cast_count(self, entries: Iterable[TensorEntry]) -> int:
        """How many of the source's ``entries`` this plan casts."""
        held = list(entries)
        return sum(a.dtype != b.dtype for a, b in zip(held, self.entries(held)))

    def to_dict(self) -> dict[str, Any]:
        return {"served": None if self.served is None else self.served.to_dict(), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: Any) -> CastPlan:
        if data is None:
            return cls()
        served = data.get("served")
        return cls(None if served is None else ServedDtypes.from_dict(served), data.get("dtype"))


def check_dtype_option(value: Any) -> str | None:
    """``create_trainer(..., dtype=...)``: a floating dtype (name or ``torch.dtype``) or None."""
    if value is None:
        return None
    name = value if isinstance(value, str) else dtype_name(value)
    if name not in FLOATING:
        raise ValueError(f"create_trainer(): dtype={value!r} must be one of {', '.join(sorted(FLOATING))} (or None: "
                         f"the dtypes the workers load)")
    return name


def matches_dtype(tensor: torch.Tensor, entry: TensorEntry) -> bool:
    """Whether ``tensor`` can travel as ``entry`` says: in its own dtype, or a floating one cast."""
    held = dtype_name(tensor.dtype)
    return held == entry.dtype or (held in FLOATING and entry.dtype in FLOATING)


def wire_bytes(tensor: torch.Tensor, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
    """Bytes ``start:stop`` of ``tensor`` in ``dtype``: a view, or only those elements cast (the bounds fall on
    element boundaries: tensors start 64-byte aligned, buckets are multiples of 64)."""
    import torch

    from wtransfer.engines.rounds.manifest import resolved, tensor_bytes

    if tensor.dtype == dtype:
        return tensor_bytes(resolved(tensor))[start:stop]
    size = dtype.itemsize
    if start % size or stop % size:
        raise TransferError(f"internal error: bytes {start}:{stop} of a {dtype} tensor cut an element")
    flat = tensor.detach().reshape(-1)
    return flat[start // size : stop // size].to(dtype).view(torch.uint8)

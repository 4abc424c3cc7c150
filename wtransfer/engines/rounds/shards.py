"""Which bytes of a round each trainer rank holds, and writing them straight into place.

Each rank writes the part of every tensor it holds at that part's place (the staged round on ``shm``, a
bucket on ``gloo``), so the workers receive byte for byte what one unsharded sender would write, with no
gather. :func:`rank_parts` says what a rank's parts are; :func:`write_part` writes one into any byte range.

Every supported placement is the tensor seen as a ``(rows, width)`` matrix of which the rank holds columns
``first:end``: ``Shard(d)`` of shape ``(A0, .., An)`` has ``rows = A0*..*A(d-1)``, ``width = Ad*..*An``
(``Shard(0)`` is one contiguous run). ``Replicate`` mesh dimensions are sent by coordinate 0 only (one
HSDP replica). Two sharded tensor dimensions, ``Partial`` and strided shards are refused, naming the placement.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtransfer.engines.rounds.cast import matches_dtype, wire_bytes
from wtransfer.engines.rounds.manifest import TensorEntry
from wtransfer.engines.rounds.packing import copy_tensor
from wtransfer.errors import TransferError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LocalPart:
    """Columns ``first:end`` of a tensor seen as ``(rows, width)``; ``local`` is this rank's ``(rows, end - first)``."""

    rows: int
    width: int
    first: int
    end: int
    local: torch.Tensor
    wire: torch.dtype | None = None
    """The wire dtype when it is not ``local``'s: cast as written."""

    @property
    def wire_dtype(self) -> torch.dtype:
        return self.local.dtype if self.wire is None else self.wire


class UnsupportedPlacement(TransferError, ValueError):
    """A DTensor layout that ranks cannot write in place (the source's rank 0 can still gather it)."""


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s split of ``length`` into ``parts``: (start, size) of part ``index``."""
    per = -(-length // parts) if length else 0
    start = min(index * per, length)
    return start, max(0, min(per, length - start))


def local_part(name: str, tensor: Any, trainer_rank: int) -> LocalPart | None:
    """This rank's part of ``tensor``, or None when another rank sends it (a plain tensor: rank 0; a
    DTensor: the ranks of its first replica)."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        if trainer_rank != 0:
            return None
        value = tensor.detach()
        return LocalPart(1, value.numel(), 0, value.numel(), value.reshape(1, -1))
    from torch.distributed.tensor.placement_types import Replicate, Shard

    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this process is not in the tensor's mesh
        return None
    shape = list(tensor.shape)
    start, size = [0] * len(shape), list(shape)
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Replicate:
            if coordinate[mesh_dim] != 0:
                return None
            continue
        if type(placement) is not Shard:  # Partial, _StridedShard, anything newer
            raise UnsupportedPlacement(
                f"{name!r} has placements {tuple(placements)}: trainer ranks write only Shard(d) and Replicate "
                f"placements in place ({placement} is not one); wrap the ModuleSource in a WeightSource of "
                f"your own to have rank 0 gather and send every tensor instead"
            )
        dim = placement.dim % len(shape)
        offset, size[dim] = _chunk(size[dim], mesh.size(mesh_dim), coordinate[mesh_dim])
        start[dim] += offset
    if 0 in size:  # an empty shard: nothing to write (and its "cut" says nothing about the layout)
        return None
    cut = [d for d in range(len(shape)) if size[d] != shape[d]]
    if len(cut) > 1:
        raise UnsupportedPlacement(
            f"{name!r} has placements {tuple(placements)}, which shard tensor dimensions {cut}: trainer ranks "
            f"write parts sharded along one dimension only; wrap the ModuleSource in a WeightSource of your own "
            f"to have rank 0 gather and send every tensor instead"
        )
    local = tensor.to_local().detach()
    if list(local.shape) != size:
        raise TransferError(f"{name!r}: the local shard has shape {tuple(local.shape)}, but placements "
                            f"{tuple(placements)} of a {tuple(shape)} tensor give {tuple(size)} (uneven padding?)")
    if not shape:  # a 0-d tensor: one element
        return LocalPart(1, 1, 0, 1, local.reshape(1, 1))
    dim = cut[0] if cut else 0
    rows, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1 :])
    first, end = start[dim] * inner, (start[dim] + size[dim]) * inner
    return LocalPart(rows, shape[dim] * inner, first, end, local.contiguous().reshape(rows, end - first))


def rank_parts(named: Iterable[tuple[str, Any]], trainer_rank: int,
               entries: tuple[TensorEntry, ...] | None = None) -> list[LocalPart | None]:
    """This rank's part of every tensor, in source order. With ``entries`` each part is checked against its
    entry (name, dtype, size), so no byte can land at another tensor's offsets."""
    named = list(named)
    parts = [local_part(name, tensor, trainer_rank) for name, tensor in named]
    if entries is not None:
        if [name for name, _ in named] != [entry.name for entry in entries]:
            raise TransferError("the module's tensors are not the round's (names or order differ); pass the "
                                "same model on every trainer rank, and change nothing during a round")
        for index, (entry, part) in enumerate(zip(entries, parts)):
            if part is None:
                continue
            if not matches_dtype(part.local, entry) or part.rows * part.width != entry.numel:
                raise TransferError(f"{entry.name!r}: this rank holds {part.local.dtype} of a "
                                    f"{part.rows * part.width}-element tensor, the round sends {entry}")
            if part.local.dtype != entry.torch_dtype():
                parts[index] = dataclasses.replace(part, wire=entry.torch_dtype())
    return parts


def writes_shards_as_is(source: Any) -> bool:
    """Whether ranks may read ``source``'s shards themselves: a ``ModuleSource`` that overrides nothing it yields."""
    from wtransfer.engines.rounds.source import ModuleSource

    cls = type(source)
    return isinstance(source, ModuleSource) and all(
        getattr(cls, name) is getattr(ModuleSource, name) for name in ("metadata", "__iter__", "named_tensors"))


def part_span(start: int, stop: int, width: int, first: int, end: int) -> tuple[int, int]:
    """``(low, high)``: the part's bytes (rows of ``end - first``, back to back) in the tensor's bytes
    ``start:stop``; ``width``, ``first``, ``end`` are the part's byte geometry."""
    held = end - first

    def before(position: int) -> int:  # the part's bytes that come before this tensor byte
        row, column = divmod(position, width)
        return row * held + min(max(column - first, 0), held)

    return before(start), before(stop)


def place_part(dst: torch.Tensor, start: int, width: int, first: int, end: int, src: torch.Tensor) -> None:
    """Copy ``src`` (exactly the part's bytes falling in ``dst``, see :func:`part_span`) to its place in
    ``dst``, the tensor's bytes ``start:``; whole middle rows as one strided copy."""
    stop = start + dst.numel()
    if end <= first or stop <= start:
        return
    held = end - first
    low_in_part = part_span(start, stop, width, first, end)[0]

    def in_row(row: int) -> None:
        low, high = max(row * width + first, start), min(row * width + end, stop)
        if low < high:
            at = row * held + (low - row * width - first) - low_in_part
            copy_tensor(dst[low - start : high - start], src[at : at + high - low])

    first_row, last_row = start // width, (stop - 1) // width
    in_row(first_row)
    if last_row > first_row + 1:  # the rows in between are whole: one strided copy
        rows = last_row - first_row - 1
        block = dst[(first_row + 1) * width - start : last_row * width - start].view(rows, width)
        at = (first_row + 1) * held - low_in_part
        block[:, first:end].copy_(src[at : at + rows * held].view(rows, held))
    if last_row > first_row:
        in_row(last_row)


def part_range(part: LocalPart, low: int, high: int) -> torch.Tensor:
    """The part's bytes ``low:high`` in the wire dtype (a view of ``local``, or those elements cast)."""
    return wire_bytes(part.local, part.wire_dtype, low, high)


def write_part(dst: torch.Tensor, start: int, part: LocalPart) -> None:
    """Write the part's bytes that fall in ``dst``, the tensor's bytes ``start : start + dst.numel()``."""
    size = part.wire_dtype.itemsize  # the part's geometry in bytes, as the round carries it
    width, first, end = part.width * size, part.first * size, part.end * size
    low, high = part_span(start, start + dst.numel(), width, first, end)
    if low < high:
        place_part(dst, start, width, first, end, part_range(part, low, high))


def entries_digest(entries: Iterable[TensorEntry]) -> str:
    """A short name for a round's tensor list: every rank must plan the same buckets."""
    text = json.dumps([[e.name, e.dtype, list(e.shape)] for e in entries], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]

"""Where the trainer's weights come from: a re-iterable stream of ``(name, tensor)``.

A source describes a round (``metadata()``) before producing it, so the manifest goes out before
anything is materialised; tensors are then produced one at a time, in the same order, as they are packed.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from wtransfer.engines.rounds.manifest import TensorEntry, entry_for

if TYPE_CHECKING:
    import torch


class WeightSource(ABC):
    """Re-iterable weights: ``metadata()`` describes, ``__iter__`` yields in the same order."""

    @abstractmethod
    def metadata(self) -> list[TensorEntry]:
        """Name, dtype and shape of every tensor, without materialising any of them."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs in ``metadata()`` order; called once per round. A yielded tensor must not
        be overwritten during the round (engines may read it later): never yield one reused scratch buffer."""


def wrapped_sources(source: Any) -> Iterator[Any]:
    """``source`` and the sources it wraps (via ``inner`` or ``source``, at most 8 deep), outermost first."""
    for _ in range(8):
        if source is None:
            return
        yield source
        source = getattr(source, "inner", None) or getattr(source, "source", None)


GATHER_SLICE_BYTES = 4 << 20
"""Bytes gathered per collective when a row-sharded DTensor is assembled slice by slice."""


def _unwrap(tensor: torch.Tensor, keep: bool = True) -> torch.Tensor:
    """A plain local tensor: a DTensor-style sharded tensor is gathered into its whole value.

    Row-sharded tensors on a 1-D mesh (FSDP2's common layout) are gathered slice by slice, costing the
    tensor plus a few MiB (``full_tensor()`` over gloo briefly holds two whole copies); other layouts use
    ``full_tensor()``. With ``keep=False`` a row-sharded tensor is only taken part in.
    """
    placements = getattr(tensor, "placements", None)
    if placements is not None:
        gathered = gather_rows_in_slices(tensor, keep=keep)
        if gathered is not None:
            return gathered
    full = getattr(tensor, "full_tensor", None)
    value = full() if callable(full) else tensor
    return value.detach()


def gather_rows_in_slices(
    tensor: Any, slice_bytes: int = GATHER_SLICE_BYTES, keep: bool = True
) -> torch.Tensor | None:
    """The whole value of a DTensor sharded on dim 0 of a 1-D mesh, or None for any other layout. A
    collective: every rank of the mesh calls it in the same order. ``keep=False``: take part only."""
    import math

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.placement_types import Shard

    placements = tuple(tensor.placements)
    if tensor.device_mesh.ndim != 1 or len(placements) != 1 or placements[0] != Shard(0) or tensor.ndim == 0:
        return None
    group = tensor.device_mesh.get_group()
    world = dist.get_world_size(group)
    rows = tensor.shape[0]
    per_rank = -(-rows // world)  # torch.chunk: ceil(rows / world) rows per rank, the last ones shorter
    row_shape = tuple(tensor.shape[1:])
    with torch.no_grad():
        local = tensor.to_local().detach()
        out = torch.empty(tuple(tensor.shape) if keep else (0,), dtype=tensor.dtype, device=local.device)
        row_bytes = max(math.prod(row_shape) * tensor.element_size(), 1)
        step = max(1, min(per_rank, slice_bytes // (row_bytes * world)))
        mine = torch.zeros((step, *row_shape), dtype=tensor.dtype, device=local.device)
        everyone = torch.empty((world * step, *row_shape), dtype=tensor.dtype, device=local.device)
        for start in range(0, per_rank, step):
            count = min(step, per_rank - start)
            have = max(0, min(count, local.shape[0] - start))
            if have:
                mine[:have].copy_(local[start : start + have])
            dist.all_gather_into_tensor(everyone[: world * count], mine[:count], group=group)
            for rank in range(world if keep else 0):
                first = rank * per_rank + start
                valid = max(0, min(count, rows - first))
                if valid:
                    out[first : first + valid].copy_(everyone[rank * count : rank * count + valid])
    return out


class ModuleSource(WeightSource):
    """The named parameters of a ``torch.nn.Module`` (tied parameters are sent once);
    ``include_buffers=True`` also sends persistent buffers.

    Sharded parameters: with a ``sender_cls`` backend every rank sends its own shards from
    :meth:`named_tensors` (:mod:`wtransfer.engines.rounds.shards`), nothing gathered. Otherwise every rank iterates it in the same
    order, each parameter gathered only while sent (:func:`_unwrap`); rank 0 sends, the others drop it
    (:mod:`wtransfer.engines.trainer.sharded`).
    """

    def __init__(self, module: torch.nn.Module, *, include_buffers: bool = False) -> None:
        self.module = module
        self.include_buffers = include_buffers
        self._gathered = 0  # tensors of the current walk whose collectives are done

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors a walk sends, as the module holds them (sharded ones not gathered)."""
        # named_parameters() skips the aliases of a tied parameter: each storage is sent once.
        yield from self.module.named_parameters()
        if self.include_buffers:
            non_persistent = {
                f"{prefix}.{name}" if prefix else name
                for prefix, sub in self.module.named_modules()
                for name in getattr(sub, "_non_persistent_buffers_set", ())
            }
            for name, buffer in self.module.named_buffers():
                if name not in non_persistent:
                    yield name, buffer

    def metadata(self) -> list[TensorEntry]:
        return [entry_for(name, t) for name, t in self.named_tensors()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.begin_walk()
        for name, tensor in self.named_tensors():
            value = _unwrap(tensor)
            self._gathered += 1
            yield name, value

    def begin_walk(self) -> None:
        """A walk starts now (its reader may fail before it reads)."""
        self._gathered = 0

    def finish_walk(self) -> int:
        """Run the collectives of the current walk's remaining tensors, keeping none of them.

        For a sharded trainer's rank 0 whose walk died on its own: the other ranks wait in the next gather,
        and only taking part in every remaining one frees them. Row-sharded parameters are not assembled,
        so an out-of-memory error does not simply recur. Returns how many tensors that took.
        """
        finished = 0
        for _name, tensor in itertools.islice(self.named_tensors(), self._gathered, None):
            _unwrap(tensor, keep=False)
            self._gathered += 1
            finished += 1
        return finished


class TensorSource(WeightSource):
    """A mapping of name -> tensor (a state dict), sent in its iteration order."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metadata(self) -> list[TensorEntry]:
        return [entry_for(name, t) for name, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors.items():
            yield name, _unwrap(tensor)


class StreamSource(WeightSource):
    """A framework's one-pass ``(name, tensor)`` iterator, a new one each round (:meth:`feed` it before sending).

    RL frameworks hand over a generator per sync (TRL's ``send_weights(iterator)``, verl's
    ``send_weights(weights)``) and cannot say beforehand what it yields. The first round therefore holds its
    tensors to learn their names, dtypes and shapes (a whole copy of the model where the generator gathers
    shards), unless ``entries`` are given; later rounds stream, described by the round before, and a round
    whose tensors differ from that fails naming the tensor, before its commit.
    """

    def __init__(self) -> None:
        self.entries: list[TensorEntry] | None = None
        self._tensors: Iterator[tuple[str, torch.Tensor]] = iter(())

    def feed(self, tensors: Iterable[tuple[str, torch.Tensor]], entries: Iterable[TensorEntry] | None = None) -> None:
        """The next round's tensors; ``entries`` (in the same order) describe them if the framework knows."""
        if entries is not None:
            self.entries = list(entries)
        if self.entries is None:  # the first round: learn what the framework sends
            held = list(tensors)
            self.entries = [entry_for(name, tensor) for name, tensor in held]
            tensors = held
        self._tensors = iter(tensors)

    def metadata(self) -> list[TensorEntry]:
        if self.entries is None:
            raise RuntimeError("StreamSource: feed() the round's tensors before sending it")
        return list(self.entries)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors  # shared, so drain() walks what the round left

    def drain(self) -> None:
        """Walk what the round left of the iterator, keeping nothing: a framework's other ranks gather each
        tensor with it (a collective) and would wait forever for the rest. An iterator that fails stops it."""
        tensors, self._tensors = self._tensors, iter(())
        try:
            for _ in tensors:
                pass
        except Exception:
            pass  # the iterator itself failed: nothing more to walk


def as_source(source: Any) -> WeightSource:
    """Accept a WeightSource, a torch module or a name -> tensor mapping."""
    if isinstance(source, WeightSource):
        return source
    if isinstance(source, Mapping):
        return TensorSource(source)
    import torch

    if isinstance(source, torch.nn.Module):
        return ModuleSource(source)
    raise TypeError(
        f"source must be a WeightSource (e.g. ModuleSource(model)), a torch.nn.Module or a "
        f"name -> tensor mapping, got {type(source).__name__}"
    )

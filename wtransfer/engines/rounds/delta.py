"""Delta rounds: send only what changed since the version every worker committed, verified.

What is sent, when, and what a worker checks before applying it: docs/delta.md. The trainer's side is
:mod:`wtransfer.engines.trainer.delta_encoder`, the worker's :mod:`wtransfer.engines.rounds.delta_loader`; this module holds what both use. No large buffer is
allocated per round on either side, as first touches page-fault: walks use per-thread scratch, payload buffers
are kept across rounds, and the worker rebuilds straight where the commit reads.

Wire form (the manifest's ``delta`` key)::

    {"id": "<trainer token>:<version>", "base": "<id>" | null,
     "tensors": [[name, dtype, shape, "positions" | "xor-zstd", digest, base digest]
                 | [name, dtype, shape, "dense", null, null], ...],
     "unchanged": [[name, dtype, shape, digest], ...]}

one row per wire entry, in order; digests are XXH3-64 as 16 hex digits. A ``positions`` payload numbers elements in
blocks of 65536: one uint32 count of changed elements per block (padded to 8 bytes), then the K new values (in the
tensor's dtype), then their K uint16 positions within their blocks, block after block, in order. A ``xor-zstd``
payload is zstd-compressed (new bytes XOR base bytes), exactly the tensor's size once decompressed. Unchanged
tensors carry the base's digest, so a worker checks every tensor it keeps; a dense row names no digest (hashed
while sending) and is checked by the next delta round before anything is applied to it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from wtransfer.engines.rounds.manifest import (
    POSITION_BLOCK,
    TensorEntry,
    dtype_itemsize,
    position_blocks,
    positions_header_bytes,
    tensor_bytes,
)
from wtransfer.engines.rounds.kernels import compiled
from wtransfer.engines.rounds.packing import thread_pool

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 1024 * 1024
"""Walks take each tensor in chunks of at most this size, through one scratch buffer per thread, small
enough that the later steps on a chunk (count, hash, compress, copy) read it from the last-level cache."""

def digest(data: torch.Tensor) -> str:
    """XXH3-64 of a tensor's bytes, as 16 hex digits (a device tensor is copied to the host first)."""
    import xxhash

    if data.device.type != "cpu":
        data = data.cpu()
    flat = tensor_bytes(data)
    return _hex(xxhash.xxh3_64_intdigest(flat.numpy()), flat.numel())


def _bits(tensor: torch.Tensor) -> Any:
    """The tensor's bits as a flat integer array (two int64 per complex128); if contiguous, a view writing through."""
    import torch

    word = next(w for w in (8, 4, 2, 1) if tensor.element_size() % w == 0)
    return tensor_bytes(tensor).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[word]).numpy()


def _hex(value: int, nbytes: int) -> str:
    """A digest as the wire writes it: 16 hex digits (0 for a tensor of no bytes)."""
    return f"{value if nbytes else 0:016x}"


def _positions_parts(payload: torch.Tensor, target: TensorEntry, changed: int, dtype: Any,
                     words: int) -> tuple[Any, Any, Any]:
    """Views of a ``positions`` payload's parts: uint32 count per block (no padding), the ``changed`` new
    values (as :func:`_rows`) and their uint16 positions. The one place both sides read the layout from."""
    import numpy

    raw = tensor_bytes(payload).numpy()
    head = positions_header_bytes(target)
    middle = head + changed * dtype_itemsize(target.dtype)
    counts = raw[:head].view(numpy.uint32)[: position_blocks(target)]
    return counts, _rows(raw[head:middle].view(dtype), words), raw[middle:].view(numpy.uint16)


def _words(tensor: torch.Tensor, bits: Any) -> int:
    """Integers of :func:`_bits` per element of ``tensor``: 1, or 2 for complex128."""
    return max(1, tensor.element_size() // bits.itemsize)


def _rows(bits: Any, words: int) -> Any:
    """Bits indexed by element: flat, or rows of ``words`` integers (complex128) so positions pick whole elements."""
    return bits if words == 1 else bits.reshape(-1, words)


def _patched_spans(value_bits: Any, base_bits: Any, words: int, numel: int, counts: Any, lows: Any, values: Any,
                   elements: int) -> Iterator[Any]:
    """Write a ``positions`` payload's changes into ``value_bits``, a span of whole blocks (about ``elements``) at a
    time, after that span's bytes of ``base_bits`` (None: ``value_bits`` already holds the base); yields each span
    once written, so it can be hashed while cached. The payload's counts must add up to its values and its last
    block's positions lie within the tensor (checked by the caller)."""
    import numpy

    kernel = compiled() if words == 1 else None
    value_rows, base_rows = _rows(value_bits, words), None if base_bits is None else _rows(base_bits, words)
    ends = numpy.cumsum(counts, dtype=numpy.int64)
    span = max(POSITION_BLOCK, elements // POSITION_BLOCK * POSITION_BLOCK)
    for begin in range(0, numel, span):
        end = min(numel, begin + span)
        first, last = begin // POSITION_BLOCK, -(-end // POSITION_BLOCK)
        lo, hi = int(ends[first - 1]) if first else 0, int(ends[last - 1])
        out = value_rows[begin:end]
        if kernel is not None:  # copy and patch in one pass, block by block, in C
            kernel.place(out, None if base_rows is None else base_rows[begin:end], values[lo:hi], lows[lo:hi],
                         counts[first:last], value_bits.itemsize)
        else:
            if base_rows is not None:
                numpy.copyto(out, base_rows[begin:end])
            if hi > lo:
                starts = numpy.arange(first * POSITION_BLOCK - begin, last * POSITION_BLOCK - begin, POSITION_BLOCK)
                out[numpy.repeat(starts, counts[first:last]) + lows[lo:hi]] = values[lo:hi]
        yield out


class _Scratch(threading.local):
    """One chunk-sized scratch buffer per thread, allocated once and reused every round."""

    buffer: Any = None

    def get(self, dtype: Any, count: int) -> Any:
        """``count`` elements of numpy ``dtype`` (at most :data:`CHUNK_BYTES`), as a numpy array."""
        import numpy

        size = CHUNK_BYTES  # read per call: tests make it small
        if self.buffer is None or self.buffer.size < size:
            self.buffer = numpy.empty(size, dtype=numpy.uint8)
        return self.buffer[: count * numpy.dtype(dtype).itemsize].view(dtype)

    values_buffer: Any = None
    lows_buffer: Any = None

    def outputs(self, dtype: Any, count: int) -> tuple[Any, Any]:
        """Room for ``count`` changed elements of numpy ``dtype`` and their uint16 positions (a gathered chunk)."""
        import numpy

        size = count * numpy.dtype(dtype).itemsize
        if self.values_buffer is None or self.values_buffer.size < size:
            self.values_buffer = numpy.empty(max(size, CHUNK_BYTES), dtype=numpy.uint8)
            self.lows_buffer = numpy.empty(max(count, CHUNK_BYTES // 2), dtype=numpy.uint16)
        if self.lows_buffer.size < count:
            self.lows_buffer = numpy.empty(count, dtype=numpy.uint16)
        return self.values_buffer[:size].view(dtype), self.lows_buffer[:count]

    mask_buffer: Any = None

    def mask(self, count: int) -> Any:
        """``count`` booleans (at most :data:`CHUNK_BYTES`), as a numpy array."""
        import numpy

        if self.mask_buffer is None or self.mask_buffer.size < count:
            self.mask_buffer = numpy.empty(max(count, CHUNK_BYTES), dtype=numpy.bool_)
        return self.mask_buffer[:count]


_scratch = _Scratch()


def _pool() -> Any:
    """The threads delta rounds encode, rebuild and hash on, kept per process so their scratch buffers are
    touched once. XOR, zstd and XXH3 release the GIL."""
    return thread_pool("wtransfer-delta")

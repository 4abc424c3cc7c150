"""Delta rounds: send only what changed since the version every worker committed, verified.

Between two RL steps almost every bf16 element is bit-identical. With ``delta=True`` the
trainer keeps a host copy of the last version the workers committed (its *base*) and turns a
round into, per tensor:

- nothing, for a tensor whose bits did not change;
- ``positions``: the new values of its changed elements and their positions, when that is at
  most :data:`POSITIONS_AT_MOST` of the tensor (a few changed elements);
- ``xor-zstd``: the XOR of its bits with the base's, compressed with zstd (the XOR of a slightly
  changed tensor is mostly zero bytes), when that is at most :data:`SPARSE_AT_MOST` of it;
- ``dense``: the tensor itself, otherwise (and for every tensor of a full round).

It is a layer over every engine, not an engine: the round's wire manifest lists what moves (a
payload travels as a ``uint8`` tensor under the tensor's own name), and ``delta`` says what each
entry rebuilds. Engines move bytes as usual; on the worker, :class:`DeltaLoader` sits between the
engine and the commit layer, rebuilds each tensor sent as a payload on the worker's own committed
copy, checks it against the trainer's digest of the new value, and hands the whole tensor on, so
staging, the atomic commit and the model's loader see ordinary tensors. A tensor sent whole is
received as in any round, in place (``checksums=True`` checks its bytes on the way).

A worker applies a delta only onto the exact version it is against: it must have committed the
round named ``base`` (the id of the trainer's last committed round), and every tensor it keeps
or rebuilds from a payload must hash to the trainer's digest of its base; it checks both before
any byte moves. A worker that cannot (new, restarted, torn, a model changed behind wtransfer's
back, a loader that cannot show its tensors or needs every round whole) refuses the round
cleanly, and the trainer sends the round whole at once, in the same ``send_weights()`` call,
from its base (the source is walked once).

The round overlaps its own encoding: a first walk before the round reads each tensor beside its
base once (compare, hash old and new) and gathers the changed elements of a tensor that may
travel as ``positions`` as it goes, which fixes every encoding, payload size and digest; such a
tensor's base is updated from its own payload at once, and the work of the tensors sent whole
(updating the base, hashing it) runs on the encoding threads while the engine sends, a few
tensors ahead of it (:class:`DeltaRound`). Only a XOR is compressed before the round, in a
second walk (its size is not known until then). No large buffer is allocated per round on
either side: the trainer walks each tensor in chunks through one scratch buffer per thread, its
``positions`` payloads are written into buffers kept across rounds, and the worker writes each
rebuilt tensor straight where the round's commit reads it (the node's staging copy, or the model
itself when the round streams). Fresh memory is expensive (the first touch of every page
faults), and a round that allocated the model's size anew each time cost several times a dense
round.

Wire form (the manifest's ``delta`` key)::

    {"id": "<trainer token>:<version>", "base": "<id>" | null,
     "tensors": [[name, dtype, shape, "positions" | "xor-zstd", digest, base digest]
                 | [name, dtype, shape, "dense", null, null], ...],
     "unchanged": [[name, dtype, shape, digest], ...]}

one row per wire entry, in the same order; digests are XXH3-64 as 16 hex digits. A ``positions``
payload numbers the tensor's elements in blocks of 65536: one uint32 count of changed elements
per block (padded to 8 bytes), then the K new values (elements of the tensor's dtype), then
their K uint16 positions within their blocks, block after block, in order: two bytes a
position, for a tensor of any size. The
tensors left out are listed with the digest of the trainer's base, so a worker checks every
tensor it keeps, not only those that change. A dense row names no digest: the trainer need not
have hashed it before the round starts (its hashing overlaps the sending), the worker receives it
as any round's tensor, and the next delta round checks it before applying anything to it.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtransfer.engines._manifest import (
    DENSE,
    POSITIONS,
    XOR_ZSTD,
    DeltaPlan,
    DeltaTensor,
    Manifest,
    TensorEntry,
    dtype_itemsize,
    entry_for,
    POSITION_BLOCK,
    position_blocks,
    positions_header_bytes,
    positions_payload_bytes,
    tensor_bytes,
)
from wtransfer.engines._packing import note_written
from wtransfer.engines._source import WeightSource
from wtransfer.errors import ManifestMismatchError, TransferError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("wtransfer")

POSITIONS_AT_MOST = 1 / 16
"""A tensor travels as the positions and new values of its changed elements when that is at most
this fraction of its bytes (a bf16 tensor with up to about 3 % of its elements changed, at two
bytes a value and two a position). The first walk gathers them as it counts: no second walk."""

POSITIONS_AT_MOST_ON_FAST_LINKS = 0.25
""":data:`POSITIONS_AT_MOST` where the link is at least :data:`FAST_FOR_POSITIONS` (up to about
12 % of a bf16 tensor's elements): there ``positions``, more bytes than a compressed XOR but
gathered in the walk that counts, costs less time than compressing in a second walk."""

FAST_FOR_POSITIONS = 75e6
"""Bytes per second from which :data:`POSITIONS_AT_MOST_ON_FAST_LINKS` applies (0.6 Gbit/s: where
the extra wire bytes of ``positions`` would cost as long as compressing XORs did, estimated from
rounds of 5.8 % changed elements over 1 Gbit/s on a 2-core AMD EPYC; zstd's speed sets it)."""

XOR_PAYS_BELOW = 300e6
"""Bytes per second under which a XOR is compressed for a tensor too changed for ``positions``;
on a faster link such a tensor goes whole (compressing it took longer than sending it whole
over 10 Gbit/s on a 2-core AMD EPYC; 2.4 Gbit/s is a conservative guess below that, no link in
between was measured)."""

RATE_SAMPLE_BYTES = 64 << 20
"""A round that moved at least this many bytes measures the link (:meth:`DeltaEncoder.sent`)."""

SPARSE_AT_MOST = 0.25
"""A tensor travels as a compressed XOR only when that is at most this fraction of its bytes
(the trainer holds the compressed XORs until they are sent: at most this much of the model)."""

CHANGED_TO_TRY = 0.3
"""A chunk whose XOR has more than this fraction of elements changed ends the first walk: the
tensor goes dense (its XOR would not shrink below :data:`SPARSE_AT_MOST`, and compressing a dense
XOR costs more CPU than sending the tensor over any link but a slow one)."""

CHUNK_BYTES = 1024 * 1024
"""Every walk takes each tensor in chunks of (at most) this size, through one scratch buffer per
thread of :func:`_pool`: small enough that the steps after the first on a chunk (count, hash,
compress, copy) read it (new, base and XOR) from the last-level cache, not from memory."""

GLANCE_BYTES = 64 * 1024
"""Before walking a tensor whose walk may be left pending, this much of its start is XORed: if
more than :data:`CHANGED_TO_TRY` of it changed the tensor goes whole, and all of its walk runs
while the round is sent (as a chunk proving it dense would decide, sooner)."""

ZSTD_LEVEL = 1


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - a dependency of wtransfer
        raise TransferError("delta rounds need the 'zstandard' package (pip install zstandard)") from exc
    return zstandard


def digest(data: torch.Tensor) -> str:
    """XXH3-64 of a tensor's bytes, as 16 hex digits (a device tensor is copied to the host first)."""
    import xxhash

    if data.device.type != "cpu":
        data = data.cpu()
    flat = tensor_bytes(data)
    return _hex(xxhash.xxh3_64_intdigest(flat.numpy()), flat.numel())


def _bits(tensor: torch.Tensor) -> Any:
    """The tensor's bits as a flat numpy array of integers, XOR works on them: of its element
    size, or, for an element of 16 bytes (complex128), two 64-bit integers per element. A view
    of the tensor when it is contiguous (writes through it land in the tensor)."""
    import torch

    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    size = flat.element_size()
    word = next(w for w in (8, 4, 2, 1) if size % w == 0)
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[word]).numpy()


def _hex(value: int, nbytes: int) -> str:
    """A digest as the wire writes it: 16 hex digits (0 for a tensor of no bytes)."""
    return f"{value if nbytes else 0:016x}"


def _positions_parts(payload: torch.Tensor, target: TensorEntry, changed: int, dtype: Any, words: int) -> tuple[Any, Any]:
    """Views of a ``positions`` payload's parts after its block counts: the ``changed`` new values
    (rows of ``words`` integers of numpy ``dtype``) and their uint16 positions within their blocks."""
    import numpy

    raw = tensor_bytes(payload).numpy()
    head = positions_header_bytes(target)
    middle = head + changed * dtype_itemsize(target.dtype)
    return raw[head:middle].view(dtype).reshape(-1, words), raw[middle:].view(numpy.uint16)


def _position_spans(numel: int, counts: Any, lows: Any, elements: int) -> Iterator[tuple[int, int, Any, int, int]]:
    """A ``positions`` payload's positions span by span (whole blocks, about ``elements`` each):
    ``(begin, end, positions relative to begin, lo, hi)``, the span's values being ``values[lo:hi]``.
    Only a span's positions are ever made as int64, never the whole tensor's."""
    import numpy

    ends = numpy.cumsum(counts, dtype=numpy.int64)
    span = max(POSITION_BLOCK, elements // POSITION_BLOCK * POSITION_BLOCK)
    for begin in range(0, numel, span):
        end = min(numel, begin + span)
        first, last = begin // POSITION_BLOCK, -(-end // POSITION_BLOCK)
        lo, hi = int(ends[first - 1]) if first else 0, int(ends[last - 1])
        starts = numpy.arange(first * POSITION_BLOCK - begin, last * POSITION_BLOCK - begin, POSITION_BLOCK)
        yield begin, end, numpy.repeat(starts, counts[first:last]) + lows[lo:hi], lo, hi


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

    mask_buffer: Any = None

    def mask(self, count: int) -> Any:
        """``count`` booleans (at most a chunk's elements), as a numpy array."""
        import numpy

        if self.mask_buffer is None or self.mask_buffer.size < count:
            self.mask_buffer = numpy.empty(max(count, CHUNK_BYTES), dtype=numpy.bool_)
        return self.mask_buffer[:count]


_scratch = _Scratch()
_threads: list[Any] = []
_threads_lock = threading.Lock()
if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads: it makes its own
    os.register_at_fork(after_in_child=_threads.clear)


def _pool_size() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def _pool() -> Any:
    """The threads delta rounds encode, rebuild and hash on: one per core (at most 8), made once
    per process and kept, so their scratch buffers are touched once, not every round. XOR, zstd
    and XXH3 release the GIL."""
    from concurrent.futures import ThreadPoolExecutor

    with _threads_lock:
        if not _threads:
            _threads.append(ThreadPoolExecutor(_pool_size(), thread_name_prefix="wtransfer-delta"))
        return _threads[0]


# -- trainer side ---------------------------------------------------------------------------------
@dataclass
class DeltaStats:
    changed_elements: int = 0
    elements: int = 0
    unchanged_tensors: int = 0
    sparse_tensors: int = 0
    dense_tensors: int = 0


class DeltaRound(WeightSource):
    """One encoded round, as the engine reads it: the wire tensors, in order.

    A tensor may still be *pending* when the round starts: one sent whole (the rest of its walk:
    counting what changed, bringing the base up to the new value, hashing it). That work runs on the encoding threads a few
    tensors ahead of the engine, and the tensor is yielded once done. So the encoding overlaps
    the sending, instead of delaying the first byte by passes over the whole model.
    """

    def __init__(self, entries: list[TensorEntry], payloads: list[torch.Tensor], pending: list[_Encoded | None],
                 plan: DeltaPlan, items: list[_Encoded], finisher: _Finisher, whole: bool = False) -> None:
        self.entries, self.payloads, self.plan = entries, payloads, plan
        self._pending = pending
        """Per wire entry: the tensor to finish before it is read, or None."""
        self._items = items
        """Every tensor of the walk (unchanged ones too), in the walk's order."""
        self._finisher = finisher
        self._whole = whole

    @property
    def stats(self) -> DeltaStats:
        """What the round carries; the changed counts are final once every tensor was read or :meth:`finish`."""
        stats = DeltaStats()
        for item in self._items:
            stats.elements += item.target.numel
            stats.changed_elements += item.changed
            if self._whole or (item.row is not None and item.row.encoding == DENSE):
                stats.dense_tensors += 1
            elif item.row is None:
                stats.unchanged_tensors += 1
            else:
                stats.sparse_tensors += 1
        return stats

    def metadata(self) -> list[TensorEntry]:
        return list(self.entries)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for entry, payload, item in zip(list(self.entries), list(self.payloads), list(self._pending)):
            if item is not None:
                self._finisher.wait(item)
            yield entry.name, payload

    def finish(self) -> None:
        """Every pending tensor done: the base holds the whole round (before it is called committed)."""
        self._finisher.finish_all()

    def settle(self) -> None:
        """Once this returns no encoding thread writes the base for this round (what had not started is
        dropped): a round that failed leaves nothing running into the next one."""
        self._finisher.cancel()


class _Finisher:
    """Finishes a round's pending tensors on the encoding threads, in the order the engine reads
    them, at most one per thread plus one ahead of the tensor the engine waits for."""

    def __init__(self, items: list[_Encoded], record: Any) -> None:
        from concurrent.futures import Future

        self._items = items
        self._index = {id(item): i for i, item in enumerate(items)}
        self._futures: list[Future[None]] = []
        self._record = record
        self._lock = threading.Lock()
        self._cancelled = False

    def __contains__(self, item: _Encoded) -> bool:
        return id(item) in self._index

    def start(self, end: int) -> None:
        """Submit the pending tensors before index ``end`` (those not yet submitted)."""
        with self._lock:
            if self._cancelled:
                raise TransferError("delta round: its encoding was stopped (the round failed)")
            pool = _pool()
            while len(self._futures) < min(end, len(self._items)):
                self._futures.append(pool.submit(self._finish, self._items[len(self._futures)]))

    def _finish(self, item: _Encoded) -> None:
        item.finish()
        self._record(item)

    def wait(self, item: _Encoded) -> None:
        index = self._index[id(item)]
        self.start(index + _pool_size() + 1)
        self._futures[index].result()

    def finish_all(self) -> None:
        self.start(len(self._items))
        for future in self._futures:
            future.result()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            futures = list(self._futures)
        for future in futures:
            future.cancel()
            if not future.cancelled():
                future.exception()  # waits: it may be writing the base


def _keeps_its_tensors(source: Any) -> bool:
    """Whether every tensor ``source`` yields lives on after the walk moves past it (a module's
    parameters, a mapping's tensors): then holding a pending tensor until it is sent costs no
    memory. Any other source's tensors may be made as they are read, and are encoded at once."""
    from wtransfer.engines._source import ModuleSource, TensorSource

    kind = type(source)
    if isinstance(source, ModuleSource):
        return kind.__iter__ is ModuleSource.__iter__ and kind.named_tensors is ModuleSource.named_tensors
    return (isinstance(source, TensorSource) and kind.__iter__ is TensorSource.__iter__
            and type(source.tensors) is dict)


class DeltaEncoder:
    """The trainer's copy of the version its workers committed, and each round's encoding against it.

    Memory: one host copy of the model (the base) and the digest of each of its tensors, plus the
    compressed XORs of one round (each at most :data:`SPARSE_AT_MOST` of its tensor), the
    ``positions`` payload buffer of each tensor that ever travelled so (at most
    :data:`POSITIONS_AT_MOST_ON_FAST_LINKS` of it, kept across rounds; only the pages written are
    resident), while a tensor is walked the changes it gathers (at most its payload once more),
    and one :data:`CHUNK_BYTES` scratch buffer (and a chunk's booleans) per encoding thread. A
    device tensor is copied to the host
    as it is encoded (at most one per thread at a time). The base takes the new values as the
    round is encoded and sent (dense tensors are sent from it), so a round that fails leaves it
    ahead of the workers: it is then marked invalid and the next round is full.
    """

    def __init__(self) -> None:
        self._token = secrets.token_hex(8)
        self.base: dict[str, torch.Tensor] = {}
        self.digests: dict[str, str] = {}
        """XXH3-64 of each base tensor as it is now (kept as the base changes, never recomputed)."""
        self.base_id: str | None = None
        """The id of the last round every worker committed, which :attr:`base` holds; None: full next."""
        self._unsettled: _Finisher | None = None
        """The last round's pending work (not the round: its XORs are freed once it is sent)."""
        self._payloads: dict[str, torch.Tensor] = {}
        """Each tensor's ``positions`` payload buffer, kept across rounds: fresh memory costs a page
        fault per page on first touch, and a round would otherwise pay that for every payload."""
        self.link_bytes_per_s: float | None = None
        """How fast rounds cross the transport: the highest throughput (wire bytes over the round's
        seconds) of any round that moved at least :data:`RATE_SAMPLE_BYTES`; None until one did.
        Each is a lower bound (a round whose time went to encoding reads slow), so the highest
        counts. It sets which encodings pay (:func:`_choices`)."""

    def sent(self, wire_bytes: int, seconds: float) -> None:
        """A round moved ``wire_bytes`` in ``seconds``: the next rounds choose their encodings by it."""
        if wire_bytes >= RATE_SAMPLE_BYTES and seconds > 0:
            self.link_bytes_per_s = max(self.link_bytes_per_s or 0.0, wire_bytes / seconds)

    def encode(self, source: WeightSource, version: int) -> DeltaRound:
        """Walk ``source`` once; the round against :attr:`base` (a full one if it has none).

        Tensors are encoded on every core, at most one per core at a time, in the walk's order
        (the XOR, the compression and the hashing release the GIL): a source that makes each
        tensor as it yields it holds no more than that many at once. A tensor sent whole is left
        pending when the source keeps its tensors: the rest of its work runs as the round is sent
        (see :class:`DeltaRound`).
        """
        from concurrent.futures import Future

        if self._unsettled is not None:
            self._unsettled.cancel()  # a round abandoned by its caller: nothing of it may still write the base
        against = self.base_id
        self.base_id = None  # from here on the base holds this round's values, which no worker has yet
        keeps = _keeps_its_tensors(source)
        choices = _choices(self.link_bytes_per_s)
        encoded: list[_Encoded] = []
        pool, width = _pool(), _pool_size()
        in_flight: list[Future[_Encoded]] = []
        try:
            for name, tensor in source:
                new = tensor.detach()
                on_host = new.device.type == "cpu"
                if not on_host:
                    new = new.cpu()
                base, fresh = self._base_for(name, new)
                known = None if fresh else self.digests.get(name)
                defer = keeps and on_host and new.is_contiguous()
                in_flight.append(pool.submit(_encode_one, name, new, base, None if fresh else against, known, defer,
                                             self._room, choices))
                del tensor, new
                if len(in_flight) >= width:  # one tensor per core at a time
                    encoded.append(in_flight.pop(0).result())
            encoded += [future.result() for future in in_flight]
        finally:
            for future in in_flight:  # a walk that raised: no encoding may outlive the round
                future.cancel()
                if not future.cancelled():
                    future.exception()
        present = {item.target.name for item in encoded}
        for gone in [name for name in self.base if name not in present]:
            del self.base[gone]  # a tensor the model no longer has
            self.digests.pop(gone, None)
            self._payloads.pop(gone, None)
        entries, payloads, pending, rows, unchanged, kept_digests = [], [], [], [], [], []
        for item in encoded:
            if item.digest is not None:
                self.digests[item.target.name] = item.digest
            if item.row is None:
                unchanged.append(item.entry)
                kept_digests.append(item.digest)
                continue
            entries.append(item.entry)
            payloads.append(item.payload)
            pending.append(item if item.rest is not None else None)
            rows.append(item.row)
        finisher = _Finisher([item for item in encoded if item.rest is not None], self._record)
        finisher.start(width + 1)  # the first pending tensors, while the round's control messages go out
        plan = DeltaPlan(f"{self._token}:{version}", against, tuple(rows), tuple(unchanged), tuple(kept_digests))
        self._unsettled = finisher
        return DeltaRound(entries, payloads, pending, plan, encoded, finisher)

    def _room(self, name: str, size: int) -> torch.Tensor:
        """``size`` bytes of the payload buffer of ``name`` (made once, as large as a ``positions``
        payload of the tensor may be: only the pages written are ever resident)."""
        import torch

        buffer = self._payloads.get(name)
        if buffer is None or buffer.numel() < size:
            base = self.base[name]
            most = int(max(POSITIONS_AT_MOST, POSITIONS_AT_MOST_ON_FAST_LINKS) * base.numel() * base.element_size())
            buffer = self._payloads[name] = torch.empty(max(size, most), dtype=torch.uint8)
        return buffer[:size]

    def _record(self, item: _Encoded) -> None:
        assert item.digest is not None
        self.digests[item.target.name] = item.digest

    def whole(self, encoded: DeltaRound) -> DeltaRound:
        """The same round, every tensor whole, from the base (which holds its values, or will once
        its pending tensors are done): for workers that cannot apply the delta. Nothing is walked
        or hashed again."""
        finisher = encoded._finisher
        entries, payloads, pending, rows = [], [], [], []
        for item in encoded._items:
            base = self.base[item.target.name]
            target = entry_for(item.target.name, base)
            entries.append(target)
            payloads.append(base)
            pending.append(item if item in finisher else None)
            rows.append(DeltaTensor(target, DENSE, None))
        plan = DeltaPlan(encoded.plan.id, None, tuple(rows), ())
        return DeltaRound(entries, payloads, pending, plan, encoded._items, finisher, whole=True)

    def _base_for(self, name: str, new: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The base tensor of ``name`` (a new one, and True, if it had none of that dtype and shape)."""
        import torch

        base = self.base.get(name)
        if base is not None and base.dtype == new.dtype and base.shape == new.shape:
            return base, False
        base = self.base[name] = torch.empty_like(new, device="cpu", memory_format=torch.contiguous_format)
        return base, True

    def committed(self, encoded: DeltaRound) -> None:
        """Every worker committed the round: the base is what they hold (its pending tensors are
        finished first, for a caller whose engine did not read every tensor)."""
        encoded.finish()
        self.base_id = encoded.plan.id


@dataclass(frozen=True)
class _Choices:
    """Which payloads a round may use, by how fast its link is."""

    positions_at_most: float = POSITIONS_AT_MOST
    try_xor: bool = True


def _choices(link_bytes_per_s: float | None) -> _Choices:
    """On a link not yet measured, or a slow one: ``positions`` for a few changes, a compressed XOR
    for more. On a fast one ``positions`` goes further; on a very fast one (or shared memory) a
    tensor beyond it goes whole, as compressing would cost more than the wire saves."""
    if link_bytes_per_s is None:
        return _Choices()
    fast = link_bytes_per_s >= FAST_FOR_POSITIONS
    return _Choices(POSITIONS_AT_MOST_ON_FAST_LINKS if fast else POSITIONS_AT_MOST, link_bytes_per_s < XOR_PAYS_BELOW)


@dataclass
class _Encoded:
    """One tensor's part of a round: what travels (``row`` None: nothing, it did not change)."""

    entry: TensorEntry
    payload: Any
    row: DeltaTensor | None
    changed: int
    digest: str | None
    """The base's digest once this round's value is in it (None while the tensor is pending)."""
    rest: Any = None
    """A pending tensor's remaining work (:func:`_walk_rest`, for one sent whole), returning the
    elements it found changed and the base's digest; None once done."""

    @property
    def target(self) -> TensorEntry:
        """The model's tensor (``entry`` is what travels: a XOR's bytes, or the tensor itself)."""
        return self.entry if self.row is None else self.row.target

    def finish(self) -> None:
        if self.rest is not None:
            more, self.digest = self.rest()
            self.changed += more
            self.rest = None


def _changed_elements(fresh: Any, old: Any, words: int) -> tuple[Any, int]:
    """``fresh`` XOR ``old`` (into the thread's scratch) and how many elements differ (an element of
    ``words`` integers counts once)."""
    import numpy

    xor = _scratch.get(fresh.dtype, fresh.size)
    numpy.bitwise_xor(fresh, old, out=xor)
    return xor, int(numpy.count_nonzero(xor if words == 1 else xor.reshape(-1, words).any(axis=1)))


def _changed_where(fresh: Any, old: Any, words: int) -> Any:
    """The indices (within the chunk) of the elements in which ``fresh`` and ``old`` differ."""
    import numpy

    moved = numpy.not_equal(fresh, old, out=_scratch.mask(fresh.size))  # the bits compared as integers
    # nonzero() of booleans: ten times faster than of the integers (a XOR) themselves
    return numpy.flatnonzero(moved if words == 1 else moved.reshape(-1, words).any(axis=1))


def _walk_rest(new_bits: Any, base_bits: Any, start: int, step: int, words: int, hasher: Any,
               count: bool) -> tuple[int, str]:
    """A dense tensor's walk from element ``start`` on, chunk by chunk: count the changed elements
    (``count``; else none is counted here), copy the new bytes into the base, hash the base's new
    bytes while the chunk is in cache. Returns the elements counted and the digest of the whole
    base (``hasher`` has seen the chunks before ``start``)."""
    import numpy

    changed = 0
    for at in range(start, new_bits.size, step):
        fresh, old = new_bits[at : at + step], base_bits[at : at + step]
        if count:
            here = _changed_elements(fresh, old, words)[1]
            changed += here
            if here:
                numpy.copyto(old, fresh)
        else:
            numpy.copyto(old, fresh)
        hasher.update(old)
    return changed, _hex(hasher.intdigest(), base_bits.nbytes)


def _encode_one(name: str, new: torch.Tensor, base: torch.Tensor, against: str | None, known: str | None,
                defer: bool, room: Any, choices: _Choices = _Choices()) -> _Encoded:
    """Encode one tensor against its base, the base becoming the new value now or, for a pending
    tensor, as the round is sent (a helper thread).

    A first walk only reads: it compares each chunk with its base, counts the changed elements
    (gathering their positions and values while they may still fit a ``positions`` payload), and
    hashes the old bytes (which must be what the workers hold, ``known``) and the new ones. Then,
    by what changed:

    - nothing: the tensor stays out of the round;
    - few enough elements for ``positions`` (:data:`POSITIONS_AT_MOST`): the payload is written
      from what the walk gathered, and the base updated from the payload (its own decode);
    - more: a second walk compresses the XOR while it updates the base, the tensor going whole
      if that grows past :data:`SPARSE_AT_MOST`;
    - a chunk with more than :data:`CHANGED_TO_TRY` of it changed (or, first, a glance at the
      tensor's start), or no base to diff against: the tensor goes whole, the rest of its walk
      (count, update the base, hash) left to the round's sending with ``defer``.

    ``room(name, size)`` lends the payload buffer of a ``positions`` tensor (kept across rounds);
    ``choices`` moves the limits by the link's speed (:func:`_choices`).
    """
    import functools

    import numpy
    import torch
    import xxhash

    target = entry_for(name, new)
    new_bits, base_bits = _bits(new), _bits(base)
    words = max(1, new.element_size() // new_bits.itemsize)  # integers per element (2 for complex128)
    step = max(1, CHUNK_BYTES // new.element_size()) * words  # whole elements per chunk

    def pending(encoded: _Encoded) -> _Encoded:  # its rest runs as the round is sent, or now
        if not defer:
            encoded.finish()
        return encoded

    def whole(rest: Any, changed: int) -> _Encoded:
        return pending(_Encoded(target, base, DeltaTensor(target, DENSE, None), changed, None, rest))

    def walk_from_start(count: bool) -> Any:
        return functools.partial(_walk_rest, new_bits, base_bits, 0, step, words, xxhash.xxh3_64(), count)

    if against is None or known is None:  # no base to diff against: the tensor goes whole
        return whole(walk_from_start(False), target.numel)
    if defer:  # a glance first: a tensor changed all over goes whole without a chunk walked before the round
        glance = min(new_bits.size, max(1, min(GLANCE_BYTES, CHUNK_BYTES) // new.element_size()) * words)
        if _changed_elements(new_bits[:glance], base_bits[:glance], words)[1] > CHANGED_TO_TRY * (glance // words):
            return whole(walk_from_start(True), 0)
    changed = 0
    was, now = xxhash.xxh3_64(), xxhash.xxh3_64()
    most = choices.positions_at_most * target.nbytes  # the largest positions payload this tensor may take
    header, pair = positions_header_bytes(target), new.element_size() + 2
    counts = numpy.zeros(position_blocks(target), dtype=numpy.int64)
    found: list[tuple[Any, Any]] | None = [] if header + pair <= most else None  # (values, positions) per chunk
    for start in range(0, new_bits.size, step):  # the first walk reads only
        fresh, old = new_bits[start : start + step], base_bits[start : start + step]
        if found is None:
            here = _changed_elements(fresh, old, words)[1]
        else:  # also gather the positions and values: positions needs no second walk
            where = _changed_where(fresh, old, words)
            here = where.size
            if header + (changed + here) * pair > most:
                found = None  # too many for positions: only count from here on
            elif here:
                at = where + start // words
                found.append((fresh.reshape(-1, words)[where], at.astype(numpy.uint16)))
                first = (start // words) // POSITION_BLOCK
                blocks = numpy.bincount((at // POSITION_BLOCK) - first)
                counts[first : first + blocks.size] += blocks
        if here > CHANGED_TO_TRY * (fresh.size // words):
            return whole(walk_from_start(True), 0)  # nothing written yet: the whole walk counts again
        changed += here
        was.update(old)
        now.update(fresh)
    value = _hex(now.intdigest(), target.nbytes)
    if changed == 0:
        return _Encoded(target, None, None, 0, value)
    if _hex(was.intdigest(), target.nbytes) != known:  # changed behind the encoder's back:
        logger.warning("delta: the trainer's base of %r is not what the workers were sent; it goes whole", name)
        return whole(walk_from_start(False), changed)  # a payload against it would rebuild something else
    if found is not None:
        payload = room(name, positions_payload_bytes(target, changed))
        values, lows = _positions_parts(payload, target, changed, new_bits.dtype, words)
        counts_out = tensor_bytes(payload).numpy()[:header].view(numpy.uint32)
        counts_out[:] = 0
        counts_out[: counts.size] = counts
        numpy.concatenate([part[0] for part in found], out=values)
        numpy.concatenate([part[1] for part in found], out=lows)
        del found
        base_rows = base_bits.reshape(-1, words)
        for begin, end, positions, lo, hi in _position_spans(target.numel, counts, lows, step // words):
            base_rows[begin:end][positions] = values[lo:hi]  # the base becomes the new value: the payload's own decode
        return _Encoded(TensorEntry(name, "uint8", (payload.numel(),)), payload,
                        DeltaTensor(target, POSITIONS, value, known), changed, value)
    if not choices.try_xor:  # compressing would cost more than sending it whole
        return whole(walk_from_start(False), changed)
    limit = SPARSE_AT_MOST * target.nbytes
    compressor = _zstd().ZstdCompressor(level=ZSTD_LEVEL).compressobj()
    parts: list[bytes] = []
    size = 0
    hasher = xxhash.xxh3_64()
    for start in range(0, new_bits.size, step):  # the second walk: compress, update the base
        fresh, old = new_bits[start : start + step], base_bits[start : start + step]
        xor = _scratch.get(new_bits.dtype, fresh.size)
        numpy.bitwise_xor(fresh, old, out=xor)
        part = compressor.compress(xor)
        parts.append(part)
        size += len(part)
        numpy.copyto(old, fresh)
        hasher.update(old)  # the chunk is still in cache
        if size > limit:  # a XOR this large is no delta: the tensor goes whole (counted already)
            rest = functools.partial(_walk_rest, new_bits, base_bits, start + step, step, words, hasher, False)
            return whole(rest, changed)
    parts.append(compressor.flush())
    if size + len(parts[-1]) > limit:
        return _Encoded(target, base, DeltaTensor(target, DENSE, None), changed, value)
    blob = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
    wire = TensorEntry(name, "uint8", (blob.numel(),))
    return _Encoded(wire, blob, DeltaTensor(target, XOR_ZSTD, value, known), changed, value)


# -- worker side ----------------------------------------------------------------------------------
class DeltaLoader:
    """Between the engine and the commit layer: rebuilds each tensor sent as a payload and checks it.

    ``base_of(name)`` is the worker's committed tensor (the model's own through ``destination()``,
    read before the round writes it); ``holds`` the id of the round this worker last committed. A
    loader that needs every round whole takes a delta only if it says ``delta_ready`` (it loads
    the tensors a round leaves out from what its ``destination()`` shows, as the vLLM bridge does).
    """

    whole_round = False

    def __init__(self, inner: Any, real: Any, manifest: Manifest, holds: str | None) -> None:
        assert manifest.delta is not None
        self.inner = inner
        self.plan = manifest.delta
        self._manifest = manifest
        self._holds = holds
        self._base_of = getattr(real, "destination", None)
        self._needs_whole_rounds = (getattr(real, "whole_round", False) is True
                                    and getattr(real, "delta_ready", False) is not True)
        self._rows = {t.target.name: t for t in self.plan.tensors}
        _zstd()  # fails here, before the round, if the package is missing
        self.discards = getattr(inner, "discards", False) is True
        """A node's follower: the stager rebuilds and checks; this worker only checks its base."""
        self._validated = False

    def validate_manifest(self, manifest: Manifest) -> None:
        """Before any byte moves: this worker holds the base the round is against (or it is full)."""
        plan = self.plan
        if plan.base is not None:
            if self._holds != plan.base:
                raise ManifestMismatchError(
                    f"delta round against {plan.base}, but this worker holds "
                    f"{self._holds or 'no round of this trainer (new, restarted or torn)'}: a full round is needed")
            if not callable(self._base_of) or self._needs_whole_rounds:
                raise ManifestMismatchError(
                    "this worker's loader cannot apply a delta round (it shows no tensors through destination(), "
                    "or needs every round whole): a full round is needed")
            expected = [(row.target, row.base_digest) for row in plan.tensors if row.encoding != DENSE]
            expected += list(zip(plan.unchanged, plan.unchanged_digests))
            self._check_bases(expected)
        check = getattr(self.inner, "validate_manifest", None)
        if callable(check):
            check(plan.model_manifest(manifest))
        self._validated = True

    def _check_bases(self, expected: list[tuple[TensorEntry, str | None]]) -> None:
        """Every tensor the round keeps or XORs is, bit for bit, what the trainer diffs against."""
        bases = []
        for entry, _ in expected:
            base = self._base_of(entry.name)  # type: ignore[misc]
            if base is None or entry_for(entry.name, base) != entry:
                raise ManifestMismatchError(f"delta round: this worker has no {entry.name!r} as the trainer has it: "
                                            f"a full round is needed")
            if base.device.type != "cpu":
                raise ManifestMismatchError(f"delta round: {entry.name!r} is on {base.device}; deltas apply to models "
                                            f"in host memory only for now: a full round is needed")
            bases.append(base)
        held = list(_pool().map(digest, bases))
        for (entry, want), got in zip(expected, held):
            if got != want:
                raise ManifestMismatchError(
                    f"delta round: this worker's {entry.name!r} is not the version the trainer diffs against "
                    f"(changed outside wtransfer?): a full round is needed")

    def _require_validated(self) -> None:
        if self.plan.base is not None and not self._validated:  # an engine that skipped validate_manifest
            raise ManifestMismatchError(f"delta round {self.plan.id} arrived without its base checked (the engine "
                                        f"did not call validate_manifest): nothing was written")

    def destination(self, name: str) -> torch.Tensor | None:
        """Where a tensor that travels whole is received in place: the commit's own destination
        (the node's staging copy, or the model when the round streams), as in a round without
        deltas. A payload (``positions``, a XOR) has none: it is assembled apart and rebuilt from."""
        row, where = self._rows.get(name), getattr(self.inner, "destination", None)
        if row is None or row.encoding != DENSE or not callable(where) or self.discards:
            return None
        self._require_validated()
        return where(name)

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self._require_validated()
        if self.discards:
            return
        unlisted = [name for name, _ in weights if name not in self._rows]
        if unlisted:
            raise ManifestMismatchError(f"engine delivered {unlisted[0]!r}, which delta round {self.plan.id} does not list")
        # every payload rebuilt and checked on every core; the first failure (in order) is raised. A tensor
        # that travels whole is handed on as it came, like one received in place through destination()
        from concurrent.futures import wait

        pool = _pool()
        jobs = [pool.submit(self._checked, name, payload, row) if row.encoding != DENSE else None
                for name, payload in weights for row in (self._rows[name],)]
        wait([job for job in jobs if job is not None])  # none may still write once this call returns or raises
        self.inner([(name, payload) if job is None else job.result() for (name, payload), job in zip(weights, jobs)])

    def _checked(self, name: str, payload: torch.Tensor, row: DeltaTensor) -> tuple[str, torch.Tensor]:
        payload, got = (self._rebuild if row.encoding == XOR_ZSTD else self._place)(name, payload, row)
        if got != row.digest:
            raise TransferError(
                f"delta round: {name!r} rebuilt here differs from the trainer's new value (digest {got} != "
                f"{row.digest}); the round is not committed where the commit is atomic")
        return name, payload

    def _rebuild(self, name: str, payload: torch.Tensor, row: DeltaTensor) -> tuple[torch.Tensor, str]:
        """base XOR the decompressed bytes, written where the commit reads it (staging, or the model
        itself when the round streams), in chunks through one scratch buffer, each chunk hashed
        while it is still in cache; the rebuilt tensor and its digest."""
        import numpy
        import xxhash

        base = self._base_of(name)  # type: ignore[misc]
        value = self._destination(name, base)
        base_bits, value_bits = _bits(base), _bits(value)  # value is contiguous: a view
        step = max(1, CHUNK_BYTES // base_bits.itemsize)
        reader = _zstd().ZstdDecompressor().stream_reader(tensor_bytes(payload).numpy())  # one per thread
        hasher = xxhash.xxh3_64()
        for start in range(0, base_bits.size, step):
            xor = _scratch.get(base_bits.dtype, min(step, base_bits.size - start))
            want, got = xor.nbytes, 0
            view = memoryview(xor.view(numpy.uint8))
            while got < want:
                read = reader.readinto(view[got:])
                if read == 0:
                    break
                got += read
            if got != want:
                raise TransferError(f"delta round: {name!r} decompressed to fewer bytes than its {row.target.nbytes}")
            out = value_bits[start : start + xor.size]
            numpy.bitwise_xor(base_bits[start : start + xor.size], xor, out=out)
            hasher.update(out)
        if reader.read(1):
            raise TransferError(f"delta round: {name!r} decompressed to more bytes than its {row.target.nbytes}")
        note_written(value)  # through numpy, behind autograd's back
        return value, _hex(hasher.intdigest(), row.target.nbytes)

    def _place(self, name: str, payload: torch.Tensor, row: DeltaTensor) -> tuple[torch.Tensor, str]:
        """The base with the changed elements of a ``positions`` payload put in place, written where
        the commit reads it; the result and its digest. One pass, span by span: copy the base's
        span, put its changed elements in place, hash it while it is in cache. Counts that do not
        add up, or a position past the tensor's end, fail the round."""
        import numpy
        import xxhash

        base = self._base_of(name)  # type: ignore[misc]
        value = self._destination(name, base)
        value_bits, base_bits = _bits(value), _bits(base)  # value is contiguous: a view
        words = max(1, value.element_size() // value_bits.itemsize)
        target = row.target
        head, blocks = positions_header_bytes(target), position_blocks(target)
        changed = (payload.numel() - head) // (value.element_size() + 2)  # the manifest checked it divides
        counts = tensor_bytes(payload).numpy()[:head].view(numpy.uint32)[:blocks]
        values, lows = _positions_parts(payload, target, changed, value_bits.dtype, words)
        tail = target.numel - (blocks - 1) * POSITION_BLOCK  # elements in the last block
        if int(counts.sum(dtype=numpy.int64)) != changed or (changed and counts[-1] and int(
                lows[changed - int(counts[-1]):].max()) >= tail):
            raise TransferError(f"delta round: {name!r}'s positions payload does not fit its {target.numel} "
                                f"elements (block counts that do not add up to its values, or positions past its end)")
        value_rows, base_rows = value_bits.reshape(-1, words), base_bits.reshape(-1, words)
        copy = value.data_ptr() != base.data_ptr()
        hasher = xxhash.xxh3_64()
        step = max(1, CHUNK_BYTES // value.element_size())
        for begin, end, positions, lo, hi in _position_spans(target.numel, counts, lows, step):
            span = value_rows[begin:end]
            if copy:
                numpy.copyto(span, base_rows[begin:end])
            if hi > lo:
                span[positions] = values[lo:hi]
            hasher.update(span)
        note_written(value)  # through numpy, behind autograd's back
        return value, _hex(hasher.intdigest(), target.nbytes)

    def _destination(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """Where the rebuilt tensor goes: the commit's own destination when it has one of the right
        layout (staging; the model itself when streaming, where base and value are one tensor and
        the XOR is applied in place, element by element), else a new tensor. Always contiguous:
        the rebuild writes and hashes it through a view of its bytes."""
        import torch

        where = getattr(self.inner, "destination", None)
        target = where(name) if callable(where) else None
        if (target is not None and target.device.type == "cpu" and target.is_contiguous()
                and target.dtype == base.dtype and target.shape == base.shape
                and (target.data_ptr() == base.data_ptr() or not _overlaps(target, base))):
            return target
        return torch.empty_like(base, memory_format=torch.contiguous_format)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' bytes share memory."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()

"""The trainer's side of delta rounds (see :mod:`wtransfer.engines.rounds.delta`): its base, and each round's encoding."""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtransfer.engines.rounds import delta as _delta
from wtransfer.engines.rounds.delta import (
    _bits,
    _hex,
    _patched_spans,
    _pool,
    _positions_parts,
    _rows,
    _scratch,
    _words,
)
from wtransfer.engines.rounds.kernels import compiled
from wtransfer.engines.rounds.manifest import (
    resolved,
    DENSE,
    POSITION_BLOCK,
    POSITIONS,
    XOR_ZSTD,
    DeltaPlan,
    DeltaTensor,
    TensorEntry,
    dtype_name,
    entry_for,
    position_blocks,
    positions_header_bytes,
    positions_payload_bytes,
    tensor_bytes,
)
from wtransfer.engines.rounds.packing import pool_size
from wtransfer.engines.rounds.source import WeightSource
from wtransfer.errors import TransferError

if TYPE_CHECKING:
    import torch

    from wtransfer.engines.rounds.cast import CastPlan

logger = logging.getLogger("wtransfer")

POSITIONS_AT_MOST = 1 / 16
"""A changed tensor travels as ``positions`` when that payload is at most this fraction of its bytes (bf16: ~3 %)."""

POSITIONS_AT_MOST_ON_FAST_LINKS = 0.25
""":data:`POSITIONS_AT_MOST` on links of at least :data:`FAST_FOR_POSITIONS` (bf16: ~12 % changed)."""

FAST_FOR_POSITIONS = 75e6
"""Link bytes/s (0.6 Gbit/s) from which ``positions``, larger than a compressed XOR but gathered without compressing,
costs less time than compressing (zstd's speed sets it; estimated from measurements, likely conservative)."""

XOR_PAYS_BELOW = 300e6
"""Link bytes/s (2.4 Gbit/s) under which a tensor too changed for ``positions`` is sent as a compressed XOR;
above, compressing costs more than the wire saves and it goes whole (a conservative estimate)."""

RATE_SAMPLE_BYTES = 64 << 20
"""A round that moved at least this many bytes measures the link (:meth:`DeltaEncoder.sent`)."""

SPARSE_AT_MOST = 0.25
"""A compressed XOR is sent only if at most this fraction of its tensor's bytes (bounding the XORs held till sent)."""

CHANGED_TO_TRY = 0.3
"""A chunk with more than this fraction of elements changed ends the first walk: the tensor goes dense (its XOR
would not shrink below :data:`SPARSE_AT_MOST`, and compressing it costs more than sending it whole)."""

GLANCE_BYTES = 64 * 1024
"""Bytes at a deferrable tensor's start compared first: over :data:`CHANGED_TO_TRY` changed, it goes whole at once."""


@dataclass
class DeltaStats:
    changed_elements: int = 0
    elements: int = 0
    unchanged_tensors: int = 0
    sparse_tensors: int = 0
    dense_tensors: int = 0


class DeltaRound(WeightSource):
    """One encoded round, as the engine reads it: the wire tensors, in order. A tensor sent whole may still be
    *pending* (its copy into the base, hashed, and its count if it went whole part-way): that runs on the encoding
    threads a few tensors ahead of the engine, which gets it once done. ``positions`` payloads are gathered in the
    first walk, before the first byte: gathering them as the round is sent read the model and its base from memory
    a second time, and made rounds slower (docs/delta.md)."""

    def __init__(self, entries: list[TensorEntry], payloads: list[torch.Tensor], pending: list[_Encoded | None],
                 plan: DeltaPlan, items: list[_Encoded], finisher: _Finisher, whole: bool = False) -> None:
        self.entries, self.payloads, self.plan = entries, payloads, plan
        self._pending = pending
        """Per wire entry: the tensor to finish before it is read, or None."""
        self._items = items
        """Every tensor of the walk (unchanged ones too), in the source's order."""
        self._finisher = finisher
        self._whole = whole
        """Every tensor sent whole from the base (a refused delta round sent again)."""

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
        """Stop the round's encoding: on return no thread writes the base for it; nothing runs into the next round."""
        self._finisher.cancel()


class _Finisher:
    """Finishes pending tensors on the encoding threads in read order, at most one per thread plus one ahead."""

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
        self.start(index + pool_size() + 1)
        self._futures[index].result()

    def finish_all(self) -> None:
        self.start(len(self._items))
        for future in self._futures:
            future.result()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            futures = list(self._futures)
        _stop(futures)


def _stop(futures: list[Any]) -> None:
    """Cancel the encodings not yet started and wait for the others: on return none writes the base."""
    for future in futures:
        future.cancel()
        if not future.cancelled():
            future.exception()


def _largest_first(source: Any) -> list[tuple[int, tuple[str, torch.Tensor]]] | None:
    """A walk of a source holding plain tensors, each with its place in the source's order, largest first: encoded
    one per core, the largest last would leave the other cores idle while it runs alone (a model's output projection,
    often its largest tensor, comes last). None for a source holding other kinds (a sharded tensor is gathered as it
    is yielded: taking those out of order would hold them all at once)."""
    import torch

    held = source.named_tensors() if hasattr(source, "named_tensors") else source.tensors.items()
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for _, t in held):
        return None
    walk = list(enumerate(source))
    walk.sort(key=lambda item: item[1][1].nbytes, reverse=True)  # stable: ties in order
    return walk


def _keeps_its_tensors(source: Any) -> bool:
    """Whether ``source``'s tensors outlive the walk (a module's, a dict's): only then may one be left pending."""
    from wtransfer.engines.rounds.source import ModuleSource, TensorSource

    kind = type(source)
    if isinstance(source, ModuleSource):
        return kind.__iter__ is ModuleSource.__iter__ and kind.named_tensors is ModuleSource.named_tensors
    return (isinstance(source, TensorSource) and kind.__iter__ is TensorSource.__iter__
            and type(source.tensors) is dict)


class DeltaEncoder:
    """The trainer's copy of the version its workers committed, and each round's encoding against it. Memory: the
    base (a host copy of the model) and its digests; one round's XORs (each at most :data:`SPARSE_AT_MOST` of its
    tensor); a kept ``positions`` buffer per tensor ever sent so (only written pages resident), plus the changes
    gathered in its walk; per encoding thread a scratch chunk and one device tensor copied to host. The base takes
    the new values as the round is encoded and sent (dense tensors are sent from it), so a failed round leaves it
    ahead of the workers: it is marked invalid and the next round is full."""

    def __init__(self) -> None:
        self._token = secrets.token_hex(8)
        self.base: dict[str, torch.Tensor] = {}
        self.digests: dict[str, str] = {}
        """XXH3-64 of each base tensor, recorded as the base takes a round's values."""
        self.base_id: str | None = None
        """The id of the last round every worker committed, which :attr:`base` holds; None: full next."""
        self._unsettled: _Finisher | None = None
        """The last round's pending work (not the round: its XORs are freed once it is sent)."""
        self._payloads: dict[str, torch.Tensor] = {}
        """Each tensor's ``positions`` payload buffer, kept across rounds to avoid page faults on fresh memory."""
        self.link_bytes_per_s: float | None = None
        """Link speed (wire bytes/s): the highest of any round that moved at least :data:`RATE_SAMPLE_BYTES`
        (each is a lower bound: encoding time counts in); None until one did. Sets the encodings (:func:`_choices`)."""

    def sent(self, wire_bytes: int, seconds: float) -> None:
        """A round moved ``wire_bytes`` in ``seconds``: the next rounds choose their encodings by it."""
        if wire_bytes >= RATE_SAMPLE_BYTES and seconds > 0:
            self.link_bytes_per_s = max(self.link_bytes_per_s or 0.0, wire_bytes / seconds)

    def encode(self, source: WeightSource, version: int, cast: CastPlan | None = None) -> DeltaRound:
        """Walk ``source`` once; the round against :attr:`base` (a full one if it has none). With ``cast``, floating
        tensors are compared and kept in their wire dtype (the base is what workers hold). Tensors are encoded on every
        core, at most one per core at a time (a source making tensors as it yields holds no more than that many),
        largest first where the source holds them all (:func:`_largest_first`); the round keeps the source's order."""
        from concurrent.futures import FIRST_COMPLETED, Future, wait

        if self._unsettled is not None:
            self._unsettled.cancel()  # a round abandoned by its caller: nothing of it may still write the base
        against = self.base_id
        self.base_id = None  # from here on the base holds this round's values, which no worker has yet
        keeps = _keeps_its_tensors(source)
        choices = _choices(self.link_bytes_per_s)
        pool, width = _pool(), pool_size()
        submitted: dict[Future[_Encoded], int] = {}  # each tensor's encoding: its place in the source's order
        running: set[Future[_Encoded]] = set()
        wire = {} if cast is None else {e.name: e for e in cast.entries(source.metadata())}
        walk = _largest_first(source) if keeps else None
        try:
            for place, (name, tensor) in enumerate(source) if walk is None else walk:
                new = resolved(tensor.detach())  # a lazy conjugate view's values, not its memory
                on_host = new.device.type == "cpu"
                if not on_host:
                    new = new.cpu()
                entry = wire.get(name)
                cast_here = entry is not None and entry.dtype != dtype_name(new.dtype)
                if cast_here:
                    new = new.to(entry.torch_dtype())
                base, fresh = self._base_for(name, new)
                known = None if fresh else self.digests.get(name)
                defer = keeps and on_host and new.is_contiguous() and not cast_here
                future = pool.submit(_encode_one, name, new, base, None if fresh else against, known, defer,
                                     self._room, choices)
                submitted[future] = place
                running.add(future)
                del tensor, new
                if len(running) >= width:  # one tensor per core at a time; the next starts as soon as any ends
                    done, running = wait(running, return_when=FIRST_COMPLETED)  # (not the oldest: a large tensor
                    for future in sorted(done, key=submitted.__getitem__):  # would leave the other cores idle
                        future.result()  # behind it); a failure ends the walk now (of those done, the first in the
                        # source's order)
            encoded = [future.result() for future in sorted(submitted, key=submitted.__getitem__)]
        finally:
            _stop(list(submitted))  # a walk that raised: no encoding may outlive the round
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
        """``size`` bytes of the payload buffer of ``name`` (made once at the largest ``positions`` size)."""
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
        """The same round, every tensor whole from the base (its values once pending tensors are done), for
        workers that cannot apply the delta. Nothing is walked or hashed again."""
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

    def forget(self) -> None:
        """Drop the base (``delta="auto"`` chose dense rounds): its memory is freed; the next delta round is full."""
        if self._unsettled is not None:
            self._unsettled.cancel()
            self._unsettled = None
        self.base, self.digests, self._payloads, self.base_id = {}, {}, {}, None

    def committed(self, encoded: DeltaRound) -> None:
        """Every worker committed the round: the base is what they hold (pending tensors finished first)."""
        encoded.finish()
        self.base_id = encoded.plan.id


@dataclass(frozen=True)
class _Choices:
    """Which payloads a round may use, by how fast its link is."""

    positions_at_most: float = POSITIONS_AT_MOST
    try_xor: bool = True


def _choices(link_bytes_per_s: float | None) -> _Choices:
    """Unmeasured or slow link: ``positions`` for few changes, a compressed XOR for more. Fast: ``positions``
    goes further; very fast (or shared memory): beyond it a tensor goes whole."""
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
    """A pending tensor's remaining work (:func:`_walk_rest`) -> (more changed elements, base
    digest); None once done."""

    @property
    def target(self) -> TensorEntry:
        """The model's tensor (``entry`` is what travels: a payload, or the tensor itself)."""
        return self.entry if self.row is None else self.row.target

    def finish(self) -> None:
        if self.rest is not None:
            more, self.digest = self.rest()
            self.changed += more
            self.rest = None


def _changed_elements(fresh: Any, old: Any, words: int) -> int:
    """How many elements differ between ``fresh`` and ``old`` (an element of ``words`` integers counts once)."""
    import numpy

    xor = numpy.bitwise_xor(fresh, old, out=_scratch.get(fresh.dtype, fresh.size))
    return int(numpy.count_nonzero(xor if words == 1 else xor.reshape(-1, words).any(axis=1)))


def _changed_where(fresh: Any, old: Any, words: int) -> Any:
    """The indices (within the chunk) of the elements in which ``fresh`` and ``old`` differ."""
    import numpy

    moved = numpy.not_equal(fresh, old, out=_scratch.mask(fresh.size))  # the bits compared as integers
    # nonzero() of booleans: ten times faster than of the integers (a XOR) themselves
    return numpy.flatnonzero(moved if words == 1 else moved.reshape(-1, words).any(axis=1))


def _walk_rest(new_bits: Any, base_bits: Any, start: int, step: int, words: int, hasher: Any,
               count: bool) -> tuple[int, str]:
    """A dense tensor's walk from ``start``: count changes (if ``count``), copy the new bytes into the base and hash
    them while cached. Returns (counted, whole base's digest); ``hasher`` has seen the chunks before ``start``."""
    import numpy

    changed = 0
    for at in range(start, new_bits.size, step):
        fresh, old = new_bits[at : at + step], base_bits[at : at + step]
        if count:
            here = _changed_elements(fresh, old, words)
            changed += here
        if not count or here:
            numpy.copyto(old, fresh)
        hasher.update(old)
    return changed, _hex(hasher.intdigest(), base_bits.nbytes)


def _gather_chunk(fresh: Any, old: Any, start: int, words: int, found: list[tuple[Any, Any]], counts: Any) -> int:
    """Append a chunk's changes (new values, uint16 positions within their blocks) to ``found`` and add them to the
    per-block ``counts``; ``start`` is the chunk's first integer. Returns how many elements changed."""
    import numpy

    kernel = compiled()
    if kernel is not None and words == 1:  # one pass in C (the numpy path below takes three)
        values, lows = _scratch.outputs(fresh.dtype, fresh.size)
        here = kernel.gather(fresh, old, values, lows, counts, fresh.itemsize, start)
        if here:
            found.append((values[:here].copy(), lows[:here].copy()))
        return here
    where = _changed_where(fresh, old, words)
    if where.size:
        at = where + start // words
        found.append((_rows(fresh, words)[where], at.astype(numpy.uint16)))
        first, last = start // words // POSITION_BLOCK, int(at[-1]) // POSITION_BLOCK + 1
        edges = numpy.searchsorted(at, numpy.arange(first + 1, last) * POSITION_BLOCK)  # at is sorted
        counts[first:last] += numpy.diff(edges, prepend=0, append=at.size).astype(numpy.uint32)
    return int(where.size)


def _write_positions(payload: torch.Tensor, target: TensorEntry, changed: int, counts: Any,
                     found: list[tuple[Any, Any]], base_bits: Any, words: int, step: int) -> None:
    """Write a ``positions`` payload from what :func:`_gather_chunk` found, then decode it into the base (the base
    becomes the new value: the payload's own decode)."""
    import numpy

    counts_out, values, lows = _positions_parts(payload, target, changed, base_bits.dtype, words)
    counts_out[:] = counts
    tensor_bytes(payload).numpy()[counts_out.nbytes : positions_header_bytes(target)] = 0  # no stale padding
    numpy.concatenate([part[0] for part in found], out=values)
    numpy.concatenate([part[1] for part in found], out=lows)
    found.clear()
    for _ in _patched_spans(base_bits, None, words, target.numel, counts, lows, values, step // words):
        pass


def _encode_one(name: str, new: torch.Tensor, base: torch.Tensor, against: str | None, known: str | None,
                defer: bool, room: Any, choices: _Choices = _Choices()) -> _Encoded:
    """Encode one tensor against its base (on a helper thread); the base takes the new value now or, for a tensor
    sent whole with ``defer``, as the round is sent. A first walk only reads: it counts changed elements per chunk,
    hashes old bytes (which must match ``known``) and new, and gathers positions and values while they may fit
    ``positions``. Unchanged, the tensor stays out; few changes: ``positions``, decoded into the base at once; more,
    where XOR pays (``choices``): a second walk compresses the XOR while updating the base; otherwise (no base, a
    glance or chunk over :data:`CHANGED_TO_TRY`, a XOR over :data:`SPARSE_AT_MOST`): whole. ``room(name, size)``
    lends a ``positions`` payload buffer."""
    import functools

    import numpy
    import torch
    import xxhash
    import zstandard

    target = entry_for(name, new)
    new_bits, base_bits = _bits(new), _bits(base)
    words = _words(new, new_bits)
    step = max(1, _delta.CHUNK_BYTES // new.element_size()) * words  # whole elements per chunk

    def whole(changed: int, count: bool = False, rest: Any = None) -> _Encoded:
        """Sent whole; the rest of its walk (``rest``, else all of it) runs as the round is sent, or now."""
        rest = rest or functools.partial(_walk_rest, new_bits, base_bits, 0, step, words, xxhash.xxh3_64(), count)
        encoded = _Encoded(target, base, DeltaTensor(target, DENSE, None), changed, None, rest)
        if not defer:
            encoded.finish()
        return encoded

    if against is None or known is None:  # no base to diff against: the tensor goes whole
        return whole(target.numel)
    if defer:  # a glance first: a tensor changed all over goes whole without a chunk walked before the round
        glance = min(new_bits.size, max(1, min(GLANCE_BYTES, _delta.CHUNK_BYTES) // new.element_size()) * words)
        if _changed_elements(new_bits[:glance], base_bits[:glance], words) > CHANGED_TO_TRY * (glance // words):
            return whole(0, count=True)
    changed = 0
    was, now = xxhash.xxh3_64(), xxhash.xxh3_64()
    most = choices.positions_at_most * target.nbytes  # the largest positions payload this tensor may take
    # (values, positions) per chunk and changes per block, while the changes still fit a positions payload
    found: list[tuple[Any, Any]] | None = [] if positions_payload_bytes(target, 1) <= most else None
    counts = numpy.zeros(position_blocks(target), dtype=numpy.uint32) if found is not None else None
    too_many = CHANGED_TO_TRY * (min(step, new_bits.size) // words)  # of a whole chunk, even for a short last one
    for start in range(0, new_bits.size, step):  # the first walk reads only
        fresh, old = new_bits[start : start + step], base_bits[start : start + step]
        if found is None:
            here = _changed_elements(fresh, old, words)
        else:  # also gather the positions and values: positions needs no second walk of the model
            here = _gather_chunk(fresh, old, start, words, found, counts)
            if positions_payload_bytes(target, changed + here) > most:
                found = None  # too many for positions: only count from here on
        if here > too_many:
            return whole(0, count=True)  # nothing written yet: the whole walk counts again
        changed += here
        was.update(old)
        now.update(fresh)
    value = _hex(now.intdigest(), target.nbytes)
    if changed == 0:
        return _Encoded(target, None, None, 0, value)
    if _hex(was.intdigest(), target.nbytes) != known:  # changed behind the encoder's back:
        logger.warning("delta: the trainer's base of %r is not what the workers were sent; it goes whole", name)
        return whole(changed)  # a payload against it would rebuild something else
    if found is not None:  # every change gathered, and they fit positions
        payload = room(name, positions_payload_bytes(target, changed))
        _write_positions(payload, target, changed, counts, found, base_bits, words, step)
        wire = TensorEntry(name, "uint8", (payload.numel(),))
        return _Encoded(wire, payload, DeltaTensor(target, POSITIONS, value, known), changed, value)
    if not choices.try_xor:  # compressing would cost more than sending it whole
        return whole(changed)
    limit = SPARSE_AT_MOST * target.nbytes
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    parts: list[bytes] = []
    size = 0
    hasher = xxhash.xxh3_64()
    for start in range(0, new_bits.size, step):  # the second walk: compress, update the base
        fresh, old = new_bits[start : start + step], base_bits[start : start + step]
        xor = numpy.bitwise_xor(fresh, old, out=_scratch.get(new_bits.dtype, fresh.size))
        parts.append(compressor.compress(xor))
        size += len(parts[-1])
        numpy.copyto(old, fresh)
        hasher.update(old)  # the chunk is still in cache
        if size > limit:  # a XOR this large is no delta: the tensor goes whole (counted already)
            rest = functools.partial(_walk_rest, new_bits, base_bits, start + step, step, words, hasher, False)
            return whole(changed, rest=rest)
    parts.append(compressor.flush())
    if size + len(parts[-1]) > limit:
        return _Encoded(target, base, DeltaTensor(target, DENSE, None), changed, value)
    blob = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
    wire = TensorEntry(name, "uint8", (blob.numel(),))
    return _Encoded(wire, blob, DeltaTensor(target, XOR_ZSTD, value, known), changed, value)

"""Delta rounds: send only what changed since the version every worker committed, verified.

Between two RL steps almost every bf16 element is bit-identical. With ``delta=True`` the
trainer keeps a host copy of the last version the workers committed (its *base*) and turns a
round into:

- nothing, for a tensor whose bits did not change;
- ``xor-zstd``: the XOR of its bits with the base's, compressed with zstd (the XOR of a slightly
  changed tensor is mostly zero bytes), when that is under a quarter of the tensor;
- ``dense``: the tensor itself, otherwise (and for every tensor of a full round).

It is a layer over every engine, not an engine: the round's wire manifest lists what moves (a
compressed XOR travels as a ``uint8`` tensor under the tensor's own name), and ``delta`` says
what each entry rebuilds. Engines move bytes as usual; on the worker, :class:`DeltaLoader` sits
between the engine and the commit layer, rebuilds each changed tensor on the worker's own
committed copy, checks it against the trainer's digest of the new value, and hands the whole
tensor on, so staging, the atomic commit and the model's loader see ordinary tensors.

A worker applies a delta only onto the exact version it is against: it must have committed the
round named ``base`` (the id of the trainer's last committed round), and every tensor it keeps
or rebuilds from a XOR must hash to the trainer's digest of its base; it checks both before any
byte moves. A worker that cannot (new, restarted, torn, a model changed behind wtransfer's back,
a loader that cannot show its tensors or needs every round whole) refuses the round cleanly, and
the trainer sends the round whole at once, in the same ``send_weights()`` call, from its base
(the source is walked once).

No large buffer is allocated per round on either side: the trainer XORs, counts, compresses and
hashes each tensor in chunks through one scratch buffer per thread, and the worker decompresses
in chunks and writes the rebuilt tensor straight where the round's commit reads it (the node's
staging copy, or the model itself when the round streams). Fresh memory is expensive (the first
touch of every page faults), and a round that allocated the model's size anew each time cost
several times a dense round.

Wire form (the manifest's ``delta`` key)::

    {"id": "<trainer token>:<version>", "base": "<id>" | null,
     "tensors": [[name, dtype, shape, "xor-zstd" | "dense", digest, base digest | null], ...],
     "unchanged": [[name, dtype, shape, digest], ...]}

one row per wire entry, in the same order; digests are XXH3-64 as 16 hex digits. The tensors
left out are listed with the digest of the trainer's base, so a worker checks every tensor it
keeps, not only those that change.
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
    XOR_ZSTD,
    DeltaPlan,
    DeltaTensor,
    Manifest,
    TensorEntry,
    entry_for,
    tensor_bytes,
)
from wtransfer.engines._packing import copy_tensor, note_written
from wtransfer.engines._source import WeightSource
from wtransfer.errors import ManifestMismatchError, TransferError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("wtransfer")

SPARSE_AT_MOST = 0.25
"""A tensor travels as a compressed XOR only when that is at most this fraction of its bytes
(the trainer holds the compressed XORs until they are sent: at most this much of the model)."""

CHANGED_TO_TRY = 0.3
"""A chunk whose XOR has more than this fraction of elements changed stops the compression: the
tensor goes dense (its XOR would not shrink below :data:`SPARSE_AT_MOST`, and compressing a dense
XOR costs more CPU than sending the tensor over any link but a slow one)."""

CHUNK_BYTES = 1024 * 1024
"""The XOR, the compression and the hashing walk each tensor in chunks of (at most) this size,
through one scratch buffer per thread of :func:`_pool`: small enough that the passes after the
first read the chunk (new, base and XOR) from the last-level cache, not from memory."""

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
    """One encoded round, as the engine reads it: the wire tensors, in order."""

    def __init__(self, entries: list[TensorEntry], payloads: list[torch.Tensor], plan: DeltaPlan,
                 stats: DeltaStats) -> None:
        self.entries, self.payloads, self.plan, self.stats = entries, payloads, plan, stats

    def metadata(self) -> list[TensorEntry]:
        return list(self.entries)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter([(entry.name, payload) for entry, payload in zip(self.entries, self.payloads)])


class DeltaEncoder:
    """The trainer's copy of the version its workers committed, and each round's encoding against it.

    Memory: one host copy of the model (the base) and the digest of each of its tensors, plus the
    compressed XORs of one round (each at most :data:`SPARSE_AT_MOST` of its tensor) and one
    :data:`CHUNK_BYTES` scratch buffer per encoding thread. A device tensor is copied to the host
    as it is encoded (at most one per thread at a time). The base takes the new values as the
    round is encoded (dense tensors are sent from it), so a round that fails leaves it ahead of
    the workers: it is then marked invalid and the next round is full.
    """

    def __init__(self) -> None:
        self._token = secrets.token_hex(8)
        self.base: dict[str, torch.Tensor] = {}
        self.digests: dict[str, str] = {}
        """XXH3-64 of each base tensor as it is now (kept as the base changes, never recomputed)."""
        self.base_id: str | None = None
        """The id of the last round every worker committed, which :attr:`base` holds; None: full next."""
        self._order: list[str] = []

    def encode(self, source: WeightSource, version: int) -> DeltaRound:
        """Walk ``source`` once; the round against :attr:`base` (a full one if it has none).

        Tensors are encoded on every core, at most one per core at a time, in the walk's order
        (the XOR, the compression and the hashing release the GIL): a source that makes each
        tensor as it yields it holds no more than that many at once.
        """
        from concurrent.futures import Future

        against = self.base_id
        self.base_id = None  # from here on the base holds this round's values, which no worker has yet
        encoded: list[_Encoded] = []
        pool, width = _pool(), _pool_size()
        in_flight: list[Future[_Encoded]] = []
        try:
            for name, tensor in source:
                new = tensor.detach()
                if new.device.type != "cpu":
                    new = new.cpu()
                base, fresh = self._base_for(name, new)
                known = None if fresh else self.digests.get(name)
                in_flight.append(pool.submit(_encode_one, name, new, base, None if fresh else against, known))
                del tensor, new
                if len(in_flight) >= width:  # one tensor per core at a time
                    encoded.append(in_flight.pop(0).result())
            encoded += [future.result() for future in in_flight]
        finally:
            for future in in_flight:  # a walk that raised: no encoding may outlive the round
                future.cancel()
                if not future.cancelled():
                    future.exception()
        self._order = [item.target.name for item in encoded]
        present = set(self._order)
        for gone in [name for name in self.base if name not in present]:
            del self.base[gone]  # a tensor the model no longer has
            self.digests.pop(gone, None)
        stats = DeltaStats()
        entries, payloads, rows, unchanged, kept_digests = [], [], [], [], []
        for item in encoded:
            target = item.target
            self.digests[target.name] = item.digest
            stats.elements += target.numel
            stats.changed_elements += item.changed
            if item.row is None:
                stats.unchanged_tensors += 1
                unchanged.append(item.entry)
                kept_digests.append(item.digest)
                continue
            if item.row.encoding == DENSE:
                stats.dense_tensors += 1
            else:
                stats.sparse_tensors += 1
            entries.append(item.entry)
            payloads.append(item.payload)
            rows.append(item.row)
        plan = DeltaPlan(f"{self._token}:{version}", against, tuple(rows), tuple(unchanged), tuple(kept_digests))
        return DeltaRound(entries, payloads, plan, stats)

    def whole(self, encoded: DeltaRound) -> DeltaRound:
        """The same round, every tensor whole, from the base (which holds its values): for workers
        that cannot apply the delta. Nothing is walked or hashed again."""
        entries, payloads, rows = [], [], []
        for name in self._order:
            base = self.base[name]
            target = entry_for(name, base)
            entries.append(target)
            payloads.append(base)
            rows.append(DeltaTensor(target, DENSE, self.digests[name]))
        plan = DeltaPlan(encoded.plan.id, None, tuple(rows), ())
        stats = DeltaStats(encoded.stats.changed_elements, encoded.stats.elements, 0, 0, len(rows))
        return DeltaRound(entries, payloads, plan, stats)

    def _base_for(self, name: str, new: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The base tensor of ``name`` (a new one, and True, if it had none of that dtype and shape)."""
        import torch

        base = self.base.get(name)
        if base is not None and base.dtype == new.dtype and base.shape == new.shape:
            return base, False
        base = self.base[name] = torch.empty_like(new, device="cpu", memory_format=torch.contiguous_format)
        return base, True

    def committed(self, plan: DeltaPlan) -> None:
        """Every worker committed the round: the base is what they hold."""
        self.base_id = plan.id


@dataclass
class _Encoded:
    """One tensor's part of a round: what travels (``row`` None: nothing, it did not change)."""

    entry: TensorEntry
    payload: Any
    row: DeltaTensor | None
    changed: int
    digest: str
    """The base's digest once this round's value is in it."""

    @property
    def target(self) -> TensorEntry:
        """The model's tensor (``entry`` is what travels: a XOR's bytes, or the tensor itself)."""
        return self.entry if self.row is None else self.row.target


def _encode_one(name: str, new: torch.Tensor, base: torch.Tensor, against: str | None, known: str | None) -> _Encoded:
    """Encode one tensor against its base, then make the base the new value (a helper thread).

    One pass in chunks: XOR into the thread's scratch, count the changed elements, hash the old
    bytes and compress the XOR (both only while a XOR is still possible: the old bytes' digest
    must be what the workers hold, ``known``), copy the changed chunk into the base, hash the
    base's new bytes.
    """
    import numpy
    import torch
    import xxhash

    target = entry_for(name, new)
    if against is None or known is None:  # no base to diff against: the tensor goes whole
        copy_tensor(base, new)
        value = digest(base)
        return _Encoded(target, base, DeltaTensor(target, DENSE, value), target.numel, value)
    new_bits, base_bits = _bits(new), _bits(base)
    words = max(1, new.element_size() // new_bits.itemsize)  # integers per element (2 for complex128)
    step = max(1, CHUNK_BYTES // new.element_size()) * words  # whole elements per chunk
    limit = SPARSE_AT_MOST * target.nbytes
    compressor = _zstd().ZstdCompressor(level=ZSTD_LEVEL).compressobj()
    parts: list[bytes] | None = []
    size = changed = 0
    hasher, was = xxhash.xxh3_64(), xxhash.xxh3_64()
    for start in range(0, new_bits.size, step):  # numpy: XOR and count are each one SIMD pass
        fresh, old = new_bits[start : start + step], base_bits[start : start + step]
        xor = _scratch.get(new_bits.dtype, fresh.size)
        numpy.bitwise_xor(fresh, old, out=xor)
        if parts is not None:  # the old bytes' digest matters only for a XOR (read from cache)
            was.update(old)
        here = int(numpy.count_nonzero(xor if words == 1 else xor.reshape(-1, words).any(axis=1)))
        changed += here
        if here > CHANGED_TO_TRY * (xor.size // words):
            parts = None
        if parts is not None:
            part = compressor.compress(xor)
            parts.append(part)
            size += len(part)
            if size > limit:
                parts = None  # a XOR this large is no delta: the tensor goes dense
        if here:
            numpy.copyto(old, fresh)
        hasher.update(old)  # the chunk is still in cache
    value = _hex(hasher.intdigest(), target.nbytes)
    if changed == 0:
        return _Encoded(target, None, None, 0, value)
    if parts is not None and _hex(was.intdigest(), target.nbytes) != known:  # changed behind the encoder's back:
        logger.warning("delta: the trainer's base of %r is not what the workers were sent; it goes whole", name)
        parts = None  # a XOR against it would rebuild something else on the workers
    if parts is not None:
        parts.append(compressor.flush())
        if size + len(parts[-1]) <= limit:
            blob = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
            wire = TensorEntry(name, "uint8", (blob.numel(),))
            return _Encoded(wire, blob, DeltaTensor(target, XOR_ZSTD, value, known), changed, value)
    return _Encoded(target, base, DeltaTensor(target, DENSE, value), changed, value)


# -- worker side ----------------------------------------------------------------------------------
class DeltaLoader:
    """Between the engine and the commit layer: rebuilds each changed tensor and checks it.

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
            expected = [(row.target, row.base_digest) for row in plan.tensors if row.encoding == XOR_ZSTD]
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

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self.plan.base is not None and not self._validated:  # an engine that skipped validate_manifest
            raise ManifestMismatchError(f"delta round {self.plan.id} arrived without its base checked (the engine "
                                        f"did not call validate_manifest): nothing was written")
        if self.discards:
            return
        unlisted = [name for name, _ in weights if name not in self._rows]
        if unlisted:
            raise ManifestMismatchError(f"engine delivered {unlisted[0]!r}, which delta round {self.plan.id} does not list")
        # every tensor rebuilt and checked on every core; the first failure (in order) is raised
        from concurrent.futures import wait

        pool = _pool()
        jobs = [pool.submit(self._checked, name, payload, self._rows[name]) for name, payload in weights]
        wait(jobs)  # none may still write once this call returns or raises
        self.inner([job.result() for job in jobs])

    def _checked(self, name: str, payload: torch.Tensor, row: DeltaTensor) -> tuple[str, torch.Tensor]:
        if row.encoding == XOR_ZSTD:
            payload, got = self._rebuild(name, payload, row)
        else:
            got = digest(payload)
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

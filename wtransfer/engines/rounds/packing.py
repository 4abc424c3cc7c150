"""Bucket packing: how a round's tensors are laid out as raw bytes in fixed-size buckets.

Both sides compute the same plan from the manifest and ``bucket_bytes``, so only "bucket k is in
buffer s" travels at run time. Tensors are packed whole and 64-byte aligned (viewable in place); one
larger than a bucket is split over consecutive buckets and reassembled, straight into the loader's
destination when it offers one.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtransfer.engines.channel.protocol import ALIGN, check_bucket_bytes
from wtransfer.engines.rounds.cast import wire_bytes
from wtransfer.engines.rounds.kernels import copy_out
from wtransfer.engines.rounds.manifest import Manifest, TensorEntry, entry_for, is_lazy, resolved, tensor_bytes
from wtransfer.errors import ManifestMismatchError, TransferError

if TYPE_CHECKING:
    import torch

    from wtransfer.engines.rounds.digests import RoundDigests

LoadWeights = Callable[[list[tuple[str, "torch.Tensor"]]], None]
"""Called incrementally with batches of ``(name, tensor)``; tensors are only valid during the call."""

logger = logging.getLogger("wtransfer")


@dataclass(frozen=True)
class Piece:
    """A run of one tensor's bytes placed in a bucket."""

    index: int  # position of the tensor in the manifest
    start: int  # first byte within the tensor
    offset: int  # first byte within the bucket
    length: int
    whole: bool  # the piece is the entire tensor


@dataclass(frozen=True)
class Bucket:
    index: int
    nbytes: int  # bytes used, <= bucket_bytes
    pieces: tuple[Piece, ...]
    direct: bool = False  # one piece of a large tensor, which transports may move in place


def align(value: int) -> int:
    """Where the next whole tensor may start."""
    return (value + ALIGN - 1) // ALIGN * ALIGN


_last_plans: dict[tuple[int, int | None], tuple[tuple[TensorEntry, ...], tuple[Bucket, ...]]] = {}
"""Per geometry, the last entries planned and their plan: every round of a trainer (and of its workers) plans the
same tensors again, and comparing them took 0.3 ms where planning them took 3.7 ms (290 tensors, 2-core AMD EPYC)."""


def plan_buckets(
    entries: tuple[TensorEntry, ...], bucket_bytes: int, direct_min_bytes: int | None = None
) -> list[Bucket]:
    """Greedy layout: whole tensors while they fit, oversize ones split over fresh buckets.

    With ``direct_min_bytes``, every tensor at least that large gets buckets of its own (``direct``), which
    a transport that moves tensors in place skips packing. The bucket being filled stays open across
    direct ones, so small tensors share full buckets (a collective has a fixed cost per call); it is
    sent after those direct buckets, so :class:`Packer` holds the small tensors it passes until then.
    """
    check_bucket_bytes(bucket_bytes)
    geometry = (bucket_bytes, direct_min_bytes)
    last = _last_plans.get(geometry)
    if last is not None and last[0] == entries:
        return list(last[1])
    buckets = _plan(entries, bucket_bytes, direct_min_bytes)
    _last_plans[geometry] = (tuple(entries), tuple(buckets))
    return buckets


def _plan(entries: tuple[TensorEntry, ...], bucket_bytes: int, direct_min_bytes: int | None) -> list[Bucket]:
    """:func:`plan_buckets`'s layout, made anew."""
    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    used = 0

    def flush() -> None:
        nonlocal pieces, used
        if pieces:
            buckets.append(Bucket(len(buckets), used, tuple(pieces)))
        pieces, used = [], 0

    for index, entry in enumerate(entries):
        nbytes = entry.nbytes
        if direct_min_bytes is not None and nbytes >= max(direct_min_bytes, 1):
            for start in range(0, nbytes, bucket_bytes):  # the open bucket stays open
                length = min(bucket_bytes, nbytes - start)
                piece = Piece(index, start, 0, length, length == nbytes)
                buckets.append(Bucket(len(buckets), length, (piece,), direct=True))
            continue
        if nbytes <= bucket_bytes:
            start = align(used)
            if start + nbytes > bucket_bytes:
                flush()
                start = 0
            pieces.append(Piece(index, 0, start, nbytes, True))
            used = start + nbytes
            continue
        flush()
        done = 0
        while nbytes - done > bucket_bytes:
            pieces.append(Piece(index, done, 0, bucket_bytes, False))
            used = bucket_bytes
            flush()
            done += bucket_bytes
        pieces.append(Piece(index, done, 0, nbytes - done, False))
        used = nbytes - done
    flush()
    return buckets


_SERIAL_NUMEL = 32768
"""torch's intra-op grain size: smaller copies never use more than one thread."""


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, as one single-threaded memcpy when both are contiguous CPU tensors.

    Copies are memory-bound: torch's intra-op threads only add synchronisation and compete with the other
    side of the pipeline. Anything else (strides, devices, casts, lazy views) goes to ``copy_``.
    """
    views = _byte_views(dst, src)
    if views is None:
        dst.copy_(src)
        return
    import numpy

    numpy.copyto(*views)
    note_written(dst)


def host_bytes(tensor: torch.Tensor) -> Any:
    """A contiguous CPU tensor's bytes as a flat numpy ``uint8`` array sharing its memory, else None.

    Made once per tensor (or buffer) and round, then sliced per piece: a numpy slice costs a fraction of a
    microsecond, a torch view and its conversion several, and a streamed round pays them per bucket."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or is_lazy(tensor):
        return None
    return tensor_bytes(tensor).numpy()


def _byte_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[Any, Any] | None:
    """``dst``'s and ``src``'s bytes (:func:`host_bytes`) when a plain memcpy copies one into the other and is worth
    it (one dtype and shape, at least ``_SERIAL_NUMEL`` elements: torch copies smaller ones on one thread anyway)."""
    if src.numel() < _SERIAL_NUMEL or dst.dtype != src.dtype or dst.shape != src.shape:
        return None
    target, source = host_bytes(dst), host_bytes(src)
    return None if target is None or source is None else (target, source)


_pools: dict[str, Any] = {}
_pools_lock = threading.Lock()
if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads: it makes its own
    os.register_at_fork(after_in_child=_pools.clear)


def pool_size() -> int:
    """Threads in each of :func:`thread_pool`'s pools: one per core this process may use, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 8))


def thread_pool(name: str) -> Any:
    """This process's pool of threads named ``name``, made on first use. Each user has its own (copies, delta
    rounds), so a job that copies never waits behind the jobs of the pool it runs on."""
    from concurrent.futures import ThreadPoolExecutor

    with _pools_lock:
        if name not in _pools:
            _pools[name] = ThreadPoolExecutor(pool_size(), thread_name_prefix=name)
        return _pools[name]


PARALLEL_CHUNK = 32 << 20
"""Bytes per job of :class:`ParallelCopier`: large enough to amortise a job, small enough to spread a tensor."""

class ParallelCopier:
    """Copies spread over up to 8 threads in ``PARALLEL_CHUNK`` jobs; :meth:`finish` waits for them.

    For copies nothing else runs beside (an atomic round's staging write and commit), where one thread
    leaves bandwidth idle; streamed buckets overlap the other side and stay on one thread. Their
    destinations are not read again soon: the jobs copy past the caches (:func:`copy_out`). Non-memcpy
    copies (casts, strides) run at once. ``limit_bytes``: at most that many bytes in flight.
    """

    def __init__(self, limit_bytes: int | None = None) -> None:
        from collections import deque

        self._limit = limit_bytes
        self._jobs: deque[tuple[Any, int]] = deque()
        self._held = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        views = _byte_views(dst, src)
        if views is None:
            dst.copy_(src)  # what copy_tensor does for these, without checking them again
            return
        (target, source), pool = views, thread_pool("wtransfer-copy")
        for at in range(0, len(target), PARALLEL_CHUNK):
            job = pool.submit(copy_out, target[at : at + PARALLEL_CHUNK], source[at : at + PARALLEL_CHUNK])
            size = min(PARALLEL_CHUNK, len(target) - at)
            self._jobs.append((job, size))
            self._held += size
            while self._limit is not None and self._held > self._limit:
                self._wait_oldest()
        note_written(dst)

    def _wait_oldest(self) -> None:
        job, size = self._jobs.popleft()
        self._held -= size
        job.result()  # a copy releases the GIL while it runs (numpy's, and stream_copy)

    def finish(self) -> None:
        """Wait for every copy (none still writes once this returns or raises); the first error raises."""
        error: BaseException | None = None
        while self._jobs:
            try:
                self._wait_oldest()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error


def copy_parallel(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every ``dst.copy_(src)`` of ``pairs``, on several cores (see :class:`ParallelCopier`)."""
    copier = ParallelCopier()
    try:
        for dst, src in pairs:
            copier.copy(dst, src)
    finally:
        copier.finish()


def note_written(tensor: torch.Tensor) -> None:
    """Bump autograd's version counter after a write through numpy, as ``copy_`` would, so a graph that
    saved the old values refuses them: parameters, frozen ones and buffers alike (inference tensors have none)."""
    import torch

    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None and not tensor.is_inference():
        bump(tensor)


def typed_view(data: torch.Tensor, piece: Piece, entry: TensorEntry) -> torch.Tensor:
    """The bucket bytes of a whole piece, viewed as the tensor (no copy)."""
    raw = data[piece.offset : piece.offset + piece.length]
    return raw.view(entry.torch_dtype()).view(entry.shape)


def delivered_target(targets: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, where: str) -> torch.Tensor:
    """Where a tensor delivered to ``load_weights`` goes: ``targets[name]``, which must have its shape and dtype
    (else :class:`ManifestMismatchError`, naming ``where`` the targets come from)."""
    target = targets.get(name)
    if target is None:
        raise ManifestMismatchError(f"{name!r} was delivered, but {where} has no such tensor")
    if target.shape != tensor.shape or target.dtype != tensor.dtype:
        raise ManifestMismatchError(f"{name!r}: delivered {tensor.dtype} {list(tensor.shape)}, {where} has "
                                    f"{target.dtype} {list(target.shape)}")
    return target


def readable_as_is(tensor: torch.Tensor, entry: TensorEntry, device: torch.device) -> bool:
    """Whether ``tensor``'s memory holds ``entry``'s wire bytes as they are (contiguous, of its dtype, on
    ``device``): such a tensor is read in place instead of packed, or lives in a staged copy (shm's
    ``share_source``)."""
    return (tensor.is_contiguous() and tensor.device == device and tensor.dtype == entry.torch_dtype()
            and not is_lazy(tensor))


class Packer:
    """Trainer side: copies the source's tensors into bucket buffers, in plan order.

    The source is consumed lazily, so a sharded tensor is materialised only while packed. Small tensors
    passed on the way to a direct bucket are held until their bucket is packed (see :func:`plan_buckets`).
    """

    def __init__(self, manifest: Manifest, tensors: Iterator[tuple[str, torch.Tensor]],
                 digests: RoundDigests | None = None, source_entries: tuple[TensorEntry, ...] | None = None) -> None:
        self._entries = manifest.entries
        self._source_entries = manifest.entries if source_entries is None else source_entries
        """What the source holds: a tensor whose entry has another dtype is cast as packed."""
        self.digests = digests
        """With checksums: every packed byte is hashed into its tensor's digest (on a helper thread)."""
        self._tensors = tensors
        self._index = -1
        self._tensor: torch.Tensor | None = None
        self._flat: torch.Tensor | None = None
        self._held: dict[int, torch.Tensor] = {}  # passed, for a bucket not packed yet
        self._target = -1  # the last tensor asked for (others passed on the way are held)
        self._bytes_of = -1  # the tensor whose wire bytes ``_bytes`` holds (None: it must be cast or gathered)
        self._bytes: Any = None

    def _whole_tensor(self, index: int) -> torch.Tensor:
        """Tensor ``index``: from the source, or held since it was passed."""
        if index >= self._index:
            return self._advance_to(index)
        held = self._held.pop(index, None)
        if held is None:
            raise TransferError(f"internal error: {self._entries[index].name!r} was passed but not held")
        return held

    def _advance_to(self, index: int) -> torch.Tensor:
        while self._index < index:
            if self._tensor is not None and self._index != self._target:
                self._held[self._index] = self._tensor  # passed: a later packed bucket needs it
            try:
                name, tensor = next(self._tensors)
            except StopIteration:
                raise TransferError(
                    f"the weight source ended after {self._index + 1} tensors but its metadata "
                    f"listed {len(self._entries)}; a source must yield what metadata() describes"
                ) from None
            self._index += 1
            expected = self._source_entries[self._index]
            got = entry_for(name, tensor)
            if got != expected:
                raise TransferError(
                    f"the weight source yielded {got} where its metadata promised {expected}; "
                    f"do not change the model between metadata() and iteration"
                )
            self._tensor, self._flat = tensor, None
            self._bytes_of, self._bytes = -1, None  # held no longer than its tensor
        assert self._tensor is not None
        self._target = index
        return self._tensor

    def pack(self, bucket: Bucket, data: torch.Tensor, buffer: int = -1, out: Any = None) -> list[torch.Tensor]:
        """Fill ``data`` (a uint8 buffer of at least ``bucket.nbytes``) with the bucket's bytes.

        Returns the source tensors read, to keep alive while async copies (a GPU stream) are in flight.
        With digests, ``data`` is hashed later: fence ``buffer`` before writing into it again. ``out``:
        ``host_bytes(data)``, from a caller that keeps one per buffer (else it is made here, per bucket).
        """
        import numpy

        read: list[torch.Tensor] = []
        if out is None and data.device.type == "cpu":
            out = host_bytes(data)
        for piece in bucket.pieces:
            tensor = self._whole_tensor(piece.index) if piece.whole else self._advance_to(piece.index)
            if piece.length == 0:
                continue
            entry = self._entries[piece.index]
            source = self._wire_bytes(piece.index, tensor, entry) if out is not None else None
            if source is not None:  # a plain memcpy, its views made once per tensor
                numpy.copyto(out[piece.offset : piece.offset + piece.length],
                             source[piece.start : piece.start + piece.length])
                read.append(tensor)
            elif piece.whole:
                # copy_ reads any strides/storage offset directly (no temporary for views), and casts.
                copy_tensor(typed_view(data, piece, entry), tensor)
                read.append(tensor)
            elif tensor.dtype != entry.torch_dtype():  # cast: only this piece's elements
                cast = wire_bytes(tensor, entry.torch_dtype(), piece.start, piece.start + piece.length)
                copy_tensor(data[piece.offset : piece.offset + piece.length], cast)
                read.append(cast)
            else:
                if self._flat is None:
                    self._flat = tensor_bytes(resolved(tensor))  # a copy if not contiguous, or a lazy view
                copy_tensor(
                    data[piece.offset : piece.offset + piece.length],
                    self._flat[piece.start : piece.start + piece.length],
                )
                read.append(self._flat)
        if self.digests is not None:
            self.digests.update_pieces(bucket.pieces, data, buffer)
        return read

    def _wire_bytes(self, index: int, tensor: torch.Tensor, entry: TensorEntry) -> Any:
        """Tensor ``index``'s bytes as a numpy array if its memory holds the wire bytes as they are (else None)."""
        if index != self._bytes_of:
            self._bytes_of = index
            self._bytes = host_bytes(tensor) if tensor.dtype == entry.torch_dtype() else None
        return self._bytes

    def pack_staged(self, pieces: list[Piece], data: torch.Tensor, limit_bytes: int = 256 << 20,
                    tick: Callable[[], None] | None = None) -> None:
        """Write whole tensors at their places in a staged round's ``data`` on several cores, holding at most
        ``limit_bytes`` of the source; ``tick()`` after each tensor."""
        copier = ParallelCopier(limit_bytes)
        try:
            for piece in pieces:
                tensor = self._advance_to(piece.index)
                if piece.length:
                    entry = self._entries[piece.index]
                    target = typed_view(data, piece, entry)
                    if tensor.data_ptr() != target.data_ptr() or not readable_as_is(tensor, entry, data.device):
                        copier.copy(target, tensor)  # else it lives there already (shm's share_source)
                if tick is not None:
                    tick()
        finally:
            copier.finish()
        if self.digests is not None:
            self.digests.update_pieces(pieces, data)

    def direct_bytes(self, bucket: Bucket, device: torch.device) -> torch.Tensor | None:
        """A direct bucket's bytes read in place from the source tensor (None: pack it instead)."""
        if not bucket.direct:
            return None
        piece = bucket.pieces[0]
        tensor = self._advance_to(piece.index)
        if not readable_as_is(tensor, self._entries[piece.index], device):
            return None
        view = tensor_bytes(tensor)[piece.start : piece.start + piece.length]
        if self.digests is not None:
            self.digests.update(piece.index, view)
        return view

    def drain(self) -> None:
        """After the last bucket: the source must not hold more tensors than announced."""
        if self._entries:
            self._advance_to(len(self._entries) - 1)
        if next(self._tensors, None) is not None:
            raise TransferError(
                f"the weight source yielded more than the {len(self._entries)} tensors its metadata listed"
            )
        if self._held:
            names = [self._entries[i].name for i in sorted(self._held)]
            raise TransferError(f"internal error: tensors passed but never packed: {names[:5]}")


@dataclass
class _Split:
    """A tensor split over buckets, being assembled on a worker."""

    into: torch.Tensor
    """Its bytes (uint8): the loader's destination, written in place, or a temporary handed to the loader whole."""
    raw: Any
    """``into`` as numpy when on the host (one copy per chunk, past the caches: :func:`copy_out`), else None."""
    in_place: bool
    """``into`` is the loader's destination: nothing is left to hand over."""


class Unpacker:
    """Worker side: turns received buckets back into tensors and hands them to ``load_weights``.

    A tensor the loader names a destination for (``load_weights.destination(name)``: contiguous, of the tensor's dtype
    and shape) is written straight into it and never reaches ``load_weights``: a split one piece by piece (on any
    device), a whole one when the destination is on the host. Host copies go past the caches (:func:`copy_out`):
    nothing reads them back soon. The others go to ``load_weights``: whole ones as views of the bucket (valid during
    the call only), split ones assembled in a temporary. For a loader that ``discards`` (an atomic round's follower)
    nothing is assembled; arrivals are only counted.
    """

    def __init__(self, manifest: Manifest, load_weights: LoadWeights, digests: RoundDigests | None = None) -> None:
        self._manifest = manifest
        self.digests = digests
        """With checksums: every byte received is hashed into its tensor's digest (see :meth:`verify`)."""
        self._load = load_weights
        self._destination: Callable[[str], torch.Tensor | None] | None = getattr(
            load_weights, "destination", None
        )
        self._splits: dict[int, _Split] = {}  # index -> a split tensor being assembled
        self._discard = getattr(load_weights, "discards", False) is True
        self.delivered = 0

    def _in_place(self, entry: TensorEntry) -> torch.Tensor | None:
        """The loader's destination for ``entry`` if its bytes can be written there as they arrive."""
        target = self._destination(entry.name) if self._destination is not None else None
        if target is None or not target.is_contiguous() or is_lazy(target) or entry_for(entry.name, target) != entry:
            return None  # a lazy view takes a copy_ instead
        return target

    def direct_target(self, bucket: Bucket) -> torch.Tensor | None:
        """Where a direct bucket can be received in place: its slice of the loader's destination."""
        if not bucket.direct or self._discard:
            return None
        piece = bucket.pieces[0]
        target = self._in_place(self._manifest.entries[piece.index])
        return None if target is None else tensor_bytes(target)[piece.start : piece.start + piece.length]

    def received_in_place(self, bucket: Bucket) -> None:
        """A direct bucket landed in its destination: account for it (and hash it)."""
        piece = bucket.pieces[0]
        entry = self._manifest.entries[piece.index]
        if self.digests is not None and self._destination is not None:
            target = self._destination(entry.name)
            if target is not None:
                self.digests.update(piece.index, tensor_bytes(target)[piece.start : piece.start + piece.length])
        if piece.start + piece.length == entry.nbytes:
            self.delivered += 1

    def tensor_targets(self) -> list[torch.Tensor] | None:
        """Every tensor's bytes in the loader's destination, in manifest order, for engines that write
        pieces from several senders in place. All or none (None), so a split tensor is never half placed."""
        if self._destination is None or self._discard:
            return None
        targets = []
        for entry in self._manifest.entries:
            target = self._in_place(entry)
            if target is None:
                return None
            targets.append(tensor_bytes(target))
        return targets

    def placed(self, bucket: Bucket) -> None:
        """Every byte of ``bucket`` was written into :meth:`tensor_targets`: account for it."""
        entries = self._manifest.entries
        self.delivered += sum(1 for p in bucket.pieces if p.whole or p.start + p.length == entries[p.index].nbytes)

    def unpack(self, bucket: Bucket, data: torch.Tensor, buffer: int = -1, raw: Any = None) -> None:
        """Hand the bucket's tensors on. With digests, fence ``buffer`` before it is written again. ``raw``:
        ``host_bytes(data)`` (or of the buffer ``data`` begins), from a caller that keeps one per buffer."""
        if self.digests is not None:  # a discarding follower hashes too: every worker verifies
            self.digests.update_pieces(bucket.pieces, data, buffer)
        if self._discard:
            self.placed(bucket)  # nothing kept: arrivals only counted
            return
        batch: list[tuple[str, torch.Tensor]] = []
        if raw is None and data.device.type == "cpu":
            raw = host_bytes(data)
        for piece in bucket.pieces:
            entry = self._manifest.entries[piece.index]
            if piece.whole and raw is not None and piece.length and self._copied_in_place(piece, entry, raw):
                continue
            if piece.whole:
                if piece.length == 0:
                    import torch

                    tensor = torch.empty(entry.shape, dtype=entry.torch_dtype(), device=data.device)
                else:
                    tensor = typed_view(data, piece, entry)
                batch.append((entry.name, tensor))
                continue
            finished = self._unpack_split(piece, entry, data, raw)
            if finished is not None:
                batch.append((entry.name, finished))
        if batch:
            self._load(batch)
        self.delivered += len(batch)

    def _copied_in_place(self, piece: Piece, entry: TensorEntry, raw: Any) -> bool:
        """Copy a whole tensor from the bucket's bytes (``raw``) straight into the loader's destination, as a split
        tensor's pieces are; False where it has none on the host (the tensor then goes to ``load_weights``)."""
        target = self._in_place(entry)
        into = host_bytes(target) if target is not None else None
        if into is None:
            return False
        note_written(target)  # written through numpy: autograd hears it as after copy_
        copy_out(into, raw[piece.offset : piece.offset + piece.length])
        self.delivered += 1
        return True

    def _unpack_split(self, piece: Piece, entry: TensorEntry, data: torch.Tensor, raw: Any) -> torch.Tensor | None:
        """Copy one chunk (``raw``: ``data`` as numpy, if on the host); return the assembled tensor when it still
        needs ``load_weights``."""
        index = piece.index
        if piece.start == 0:
            target = self._in_place(entry)
            if target is not None:
                note_written(target)  # written through numpy from now on: autograd hears it as after copy_
                into = tensor_bytes(target)
            else:
                import torch

                into = torch.empty(entry.nbytes, dtype=torch.uint8, device=data.device)
            self._splits[index] = _Split(into, host_bytes(into) if raw is not None else None, target is not None)
        split = self._splits.get(index)
        if split is None:
            raise TransferError(f"received a middle chunk of {entry.name!r} without its start")
        if split.raw is not None:  # one copy past the caches, its views made once per tensor
            copy_out(split.raw[piece.start : piece.start + piece.length], raw[piece.offset : piece.offset + piece.length])
        else:
            copy_tensor(split.into[piece.start : piece.start + piece.length],
                        data[piece.offset : piece.offset + piece.length])
        if piece.start + piece.length != entry.nbytes:
            return None
        del self._splits[index]
        if split.in_place:
            self.delivered += 1
            return None
        return split.into.view(entry.torch_dtype()).view(entry.shape)

    def finish(self) -> None:
        """After the last bucket: every tensor of the manifest must have been delivered."""
        expected = len(self._manifest.entries)
        if self.delivered != expected or self._splits:
            raise TransferError(
                f"round incomplete: {self.delivered} of {expected} tensors delivered"
            )

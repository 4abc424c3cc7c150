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
round named ``base`` (the id of the trainer's last committed round) and the bytes it holds for
every tensor the round rebuilds from a XOR must hash to the trainer's base digests; it checks
both before any byte moves. A worker that cannot (new, restarted, torn, a model changed behind
wtransfer's back, a loader that cannot show its tensors) refuses the round cleanly, and the
trainer sends a full round at once, in the same ``send_weights()`` call.

Wire form (the manifest's ``delta`` key)::

    {"id": "<trainer token>:<version>", "base": "<id>" | null,
     "tensors": [[name, dtype, shape, "xor-zstd" | "dense", digest, base digest | null], ...],
     "unchanged": [[name, dtype, shape], ...]}

one row per wire entry, in the same order; digests are XXH3-64 as 16 hex digits. The tensors
left out are listed, so a worker's loader still checks the whole model against the round.
"""

from __future__ import annotations

import secrets
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
from wtransfer.engines._source import WeightSource
from wtransfer.errors import ManifestMismatchError, TransferError

if TYPE_CHECKING:
    import torch

SPARSE_AT_MOST = 0.25
"""A tensor travels as a compressed XOR only when that is at most this fraction of its bytes
(the trainer holds the compressed XORs until they are sent: at most this much of the model)."""

CHANGED_TO_TRY = 0.3
"""Above this fraction of changed elements the XOR is not compressed at all (it would not
shrink below :data:`SPARSE_AT_MOST`): the tensor goes dense, at the cost of one comparison."""

ZSTD_LEVEL = 1


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - a dependency of wtransfer
        raise TransferError("delta rounds need the 'zstandard' package (pip install zstandard)") from exc
    return zstandard


def digest(data: torch.Tensor) -> str:
    """XXH3-64 of a tensor's bytes, as 16 hex digits."""
    import xxhash

    flat = tensor_bytes(data)
    return f"{xxhash.xxh3_64_intdigest(flat.numpy()) if flat.numel() else 0:016x}"


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its element size, flat: XOR works on them."""
    import torch

    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size())
    return flat.view(as_int) if as_int is not None else flat.view(torch.uint8)


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

    Memory: one host copy of the model (the base), plus the compressed XORs of one round (each
    at most :data:`SPARSE_AT_MOST` of its tensor) and one tensor's XOR at a time. The base takes
    the new values as the round is encoded (dense tensors are sent from it), so a round that
    fails leaves it ahead of the workers: it is then marked invalid and the next round is full.
    """

    def __init__(self) -> None:
        self._token = secrets.token_hex(8)
        self.base: dict[str, torch.Tensor] = {}
        self.base_id: str | None = None
        """The id of the last round every worker committed, which :attr:`base` holds; None: full next."""

    def encode(self, source: WeightSource, version: int, full: bool = False) -> DeltaRound:
        """Walk ``source`` once; the round against :attr:`base` (a full one if it has none, or ``full``).

        Tensors are encoded on every core (XOR, zstd and XXH3 release the GIL), at most one per
        core at a time, in the walk's order: a source that makes each tensor as it yields it
        holds no more than that many at once.
        """
        import os
        from concurrent.futures import Future, ThreadPoolExecutor

        against = None if full else self.base_id
        self.base_id = None  # from here on the base holds this round's values, which no worker has yet
        stats = DeltaStats()
        encoded: list[_Encoded] = []
        seen: set[str] = set()
        workers = max(1, min(os.cpu_count() or 1, 8))
        in_flight: list[Future[_Encoded]] = []
        with ThreadPoolExecutor(workers, thread_name_prefix="wtransfer-delta") as pool:
            for name, tensor in source:
                seen.add(name)
                new = tensor.detach()
                if new.device.type != "cpu":
                    new = new.cpu()
                base, fresh = self._base_for(name, new)
                in_flight.append(pool.submit(_encode_one, name, new, base, None if fresh else against))
                del tensor, new
                if len(in_flight) >= workers:  # one tensor per core at a time
                    encoded.append(in_flight.pop(0).result())
            encoded += [future.result() for future in in_flight]
        for gone in [name for name in self.base if name not in seen]:
            del self.base[gone]  # a tensor the model no longer has
        entries, payloads, rows, unchanged = [], [], [], []
        for item in encoded:
            stats.elements += item.row.target.numel if item.row is not None else item.entry.numel
            stats.changed_elements += item.changed
            if item.row is None:
                stats.unchanged_tensors += 1
                unchanged.append(item.entry)
                continue
            if item.row.encoding == DENSE:
                stats.dense_tensors += 1
            else:
                stats.sparse_tensors += 1
            entries.append(item.entry)
            payloads.append(item.payload)
            rows.append(item.row)
        plan = DeltaPlan(f"{self._token}:{version}", against, tuple(rows), tuple(unchanged))
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


def _encode_one(name: str, new: torch.Tensor, base: torch.Tensor, against: str | None) -> _Encoded:
    """Encode one tensor against its base, then make the base the new value (a helper thread)."""
    import torch

    target = entry_for(name, new)
    if against is None:  # no base to diff against: the tensor goes whole
        base.copy_(new)
        return _Encoded(target, base, DeltaTensor(target, DENSE, digest(base)), target.numel)
    xor = torch.bitwise_xor(_bits(new), _bits(base))
    changed = int(torch.count_nonzero(xor))
    if changed == 0:
        return _Encoded(target, None, None, 0)
    blob = None
    if changed <= CHANGED_TO_TRY * target.numel:
        packed = _zstd().ZstdCompressor(level=ZSTD_LEVEL).compress(tensor_bytes(xor).numpy())
        if len(packed) <= SPARSE_AT_MOST * target.nbytes:
            blob = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
    del xor
    old_digest = digest(base) if blob is not None else None
    base.copy_(new)
    if blob is None:
        return _Encoded(target, base, DeltaTensor(target, DENSE, digest(base)), changed)
    wire = TensorEntry(name, "uint8", (blob.numel(),))
    return _Encoded(wire, blob, DeltaTensor(target, XOR_ZSTD, digest(base), old_digest), changed)


# -- worker side ----------------------------------------------------------------------------------
class DeltaLoader:
    """Between the engine and the commit layer: rebuilds each changed tensor and checks it.

    ``base_of(name)`` is the worker's committed tensor (the model's own, read before the round
    writes it); ``holds`` the id of the round this worker last committed.
    """

    whole_round = False

    def __init__(self, inner: Any, real: Any, manifest: Manifest, holds: str | None) -> None:
        assert manifest.delta is not None
        self.inner = inner
        self.plan = manifest.delta
        self._manifest = manifest
        self._holds = holds
        self._base_of = getattr(real, "destination", None)
        self._rows = {t.target.name: t for t in self.plan.tensors}
        self._decompressor = _zstd().ZstdDecompressor()
        self.discards = getattr(inner, "discards", False) is True
        """A node's follower: the stager rebuilds and checks; this worker only checks its base."""

    def validate_manifest(self, manifest: Manifest) -> None:
        """Before any byte moves: this worker holds the base the round is against (or it is full)."""
        plan = self.plan
        sparse = [t for t in plan.tensors if t.encoding == XOR_ZSTD]
        if plan.base is not None or sparse:
            if plan.base is None or self._holds != plan.base:
                raise ManifestMismatchError(
                    f"delta round against {plan.base}, but this worker holds "
                    f"{self._holds or 'no round of this trainer (new, restarted or torn)'}: a full round is needed")
            if not callable(self._base_of):
                raise ManifestMismatchError("this worker's loader cannot show its tensors (no destination()), so it "
                                            "cannot apply a delta round: a full round is needed")
            for row in sparse:
                base = self._base_of(row.target.name)
                if base is None or entry_for(row.target.name, base) != row.target:
                    raise ManifestMismatchError(f"delta round: this worker has no {row.target.name!r} as the trainer "
                                                f"has it: a full round is needed")
                if digest(base) != row.base_digest:
                    raise ManifestMismatchError(
                        f"delta round: this worker's {row.target.name!r} is not the version the trainer diffs against "
                        f"(changed outside wtransfer?): a full round is needed")
        check = getattr(self.inner, "validate_manifest", None)
        if callable(check):
            check(plan.model_manifest(manifest))

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        import torch

        if self.discards:
            return
        rebuilt = []
        for name, payload in weights:
            row = self._rows.get(name)
            if row is None:
                raise ManifestMismatchError(f"engine delivered {name!r}, which delta round {self.plan.id} does not list")
            if row.encoding == XOR_ZSTD:
                base = self._base_of(name)  # type: ignore[misc]
                raw = self._decompressor.decompress(tensor_bytes(payload).numpy().tobytes(),
                                                    max_output_size=row.target.nbytes)
                if len(raw) != row.target.nbytes:
                    raise TransferError(f"delta round: {name!r} decompressed to {len(raw)} bytes, not "
                                        f"{row.target.nbytes}")
                xor = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                value = torch.empty_like(base, memory_format=torch.contiguous_format)
                torch.bitwise_xor(_bits(base), xor.view(_bits(base).dtype), out=_bits(value))
                payload = value
            if digest(payload) != row.digest:
                raise TransferError(
                    f"delta round: {name!r} rebuilt here differs from the trainer's new value (digest "
                    f"{digest(payload)} != {row.digest}); the round is not committed where the commit is atomic")
            rebuilt.append((name, payload))
        self.inner(rebuilt)

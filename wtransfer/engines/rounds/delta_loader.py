"""The worker's side of delta rounds (see :mod:`wtransfer.engines.rounds.delta`): rebuild each changed tensor, check it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wtransfer.engines.rounds import delta as _delta
from wtransfer.engines.rounds.delta import (
    _bits,
    _hex,
    _patched_spans,
    _pool,
    _positions_parts,
    _scratch,
    _words,
    digest,
)
from wtransfer.engines.rounds.manifest import (
    DENSE,
    POSITION_BLOCK,
    STARTUP_IDENTITY,
    XOR_ZSTD,
    DeltaTensor,
    Manifest,
    TensorEntry,
    entry_for,
    position_blocks,
    positions_header_bytes,
    tensor_bytes,
)
from wtransfer.engines.rounds.packing import note_written
from wtransfer.errors import ManifestMismatchError, TransferError

if TYPE_CHECKING:
    import torch


class DeltaLoader:
    """Between the engine and the commit layer: rebuilds each tensor sent as a payload and checks it. The base
    is the real loader's ``destination(name)`` (read before the round writes it); ``holds`` is the id of the round this
    worker last committed. A loader needing whole rounds takes a delta only if it says ``delta_ready`` (it loads the
    tensors a round leaves out from what ``destination()`` shows)."""

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
        self.discards = getattr(inner, "discards", False) is True
        """A node's follower: the stager rebuilds and checks; this worker only checks its base."""
        self._validated = False
        self._rejection: ManifestMismatchError | None = None

    def validate_manifest(self, manifest: Manifest) -> None:
        """Before any byte moves: this worker holds the round's base (if any). Checked once; later calls agree."""
        if self._rejection is None and not self._validated:
            try:
                self._validate(manifest)
            except ManifestMismatchError as exc:
                self._rejection = exc
        self._require_validated()

    def _validate(self, manifest: Manifest) -> None:
        plan = self.plan
        if plan.base is not None:
            if self._holds != plan.base:
                raise ManifestMismatchError(
                    f"delta round against {plan.base}, but this worker holds "
                    f"{self._holds if self._holds not in (None, STARTUP_IDENTITY) else 'no round of this trainer (new, restarted or torn)'}: a full round is needed")
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
        """Every tensor the round keeps or rebuilds is, bit for bit, what the trainer diffs against."""
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
        if self._rejection is not None:
            raise ManifestMismatchError(str(self._rejection))
        refuse = getattr(self.inner, "refuse_if_rejected", None)
        if callable(refuse):  # the framework's own verdict (a label that does not go up), or a round that ended
            refuse()
        if self.plan.base is not None and not self._validated:  # an engine that skipped validate_manifest
            raise ManifestMismatchError(f"delta round {self.plan.id} arrived without its base checked (the engine "
                                        f"did not call validate_manifest): nothing was written")

    def destination(self, name: str) -> torch.Tensor | None:
        """A dense tensor is received in place at the commit's own destination; a payload has none."""
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
            raise ManifestMismatchError(f"{unlisted[0]!r} was delivered, but delta round {self.plan.id} does not list it")
        # payloads rebuilt and checked on every core, first failure (in order) raised; dense tensors pass as they came
        from concurrent.futures import wait

        pool = _pool()
        # a device payload (NCCL) is copied to host here, on the engine's current stream, before its buffer is reused
        jobs = [pool.submit(self._checked, name, payload if payload.device.type == "cpu" else payload.cpu(), row)
                if row.encoding != DENSE else None
                for name, payload in weights for row in (self._rows[name],)]
        wait([job for job in jobs if job is not None])  # none may still write once this call returns or raises
        self.inner([(name, payload) if job is None else job.result() for (name, payload), job in zip(weights, jobs)])

    def _checked(self, name: str, payload: torch.Tensor, row: DeltaTensor) -> tuple[str, torch.Tensor]:
        """Rebuild ``name`` from its base where the commit reads it (:meth:`_destination`) and check its digest."""
        base = self._base_of(name)  # type: ignore[misc]
        value = self._destination(name, base)
        got = (self._rebuild if row.encoding == XOR_ZSTD else self._place)(name, payload, row, base, value)
        note_written(value)  # through numpy, behind autograd's back
        if got != row.digest:
            raise TransferError(
                f"delta round: {name!r} rebuilt here differs from the trainer's new value (digest {got} != "
                f"{row.digest}); the round is not committed where the commit is atomic")
        return name, value

    def _rebuild(self, name: str, payload: torch.Tensor, row: DeltaTensor, base: torch.Tensor,
                 value: torch.Tensor) -> str:
        """Write a ``xor-zstd`` tensor (base XOR decompressed payload) into ``value``, chunk by chunk through one
        scratch buffer, hashed while cached; returns its digest. A wrong size fails the round."""
        import numpy
        import xxhash
        import zstandard

        base_bits, value_bits = _bits(base), _bits(value)  # value is contiguous: a view
        step = max(1, _delta.CHUNK_BYTES // base_bits.itemsize)
        reader = zstandard.ZstdDecompressor().stream_reader(tensor_bytes(payload).numpy())  # one per thread
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
        return _hex(hasher.intdigest(), row.target.nbytes)

    def _place(self, name: str, payload: torch.Tensor, row: DeltaTensor, base: torch.Tensor,
               value: torch.Tensor) -> str:
        """Write a ``positions`` tensor into ``value`` in one pass per span (copy the base, patch, hash while
        cached); returns its digest. Bad block counts or a position past the end fail the round."""
        import numpy
        import xxhash

        value_bits, base_bits = _bits(value), _bits(base)  # value is contiguous: a view
        words = _words(value, value_bits)
        target = row.target
        head, blocks = positions_header_bytes(target), position_blocks(target)
        changed = (payload.numel() - head) // (value.element_size() + 2)  # the manifest checked it divides
        counts, values, lows = _positions_parts(payload, target, changed, value_bits.dtype, words)
        tail = target.numel - (blocks - 1) * POSITION_BLOCK  # elements in the last block
        if int(counts.sum(dtype=numpy.int64)) != changed or (changed and counts[-1] and int(
                lows[changed - int(counts[-1]):].max()) >= tail):
            raise TransferError(f"delta round: {name!r}'s positions payload does not fit its {target.numel} "
                                f"elements (block counts that do not add up to its values, or positions past its end)")
        copy = value.data_ptr() != base.data_ptr()
        hasher = xxhash.xxh3_64()
        step = max(1, _delta.CHUNK_BYTES // value.element_size())
        for span in _patched_spans(value_bits, base_bits if copy else None, words, target.numel, counts, lows, values,
                                   step):
            hasher.update(span)
        return _hex(hasher.intdigest(), target.nbytes)

    def _destination(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """Where the rebuilt tensor goes: the commit's destination if of the same layout (streaming: the base
        itself, rebuilt in place element-wise), else a new tensor; always contiguous (written through a byte view)."""
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

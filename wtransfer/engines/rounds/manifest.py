"""The update manifest: which tensors a round carries, as a JSON-safe dict.

Both sides derive a round's byte layout (:mod:`wtransfer.engines.rounds.packing`) from the manifest and the bucket size alone, so
they always agree on it; nothing but this dict and raw bytes crosses the process boundary.

Wire form::

    {"format": 2, "version": 7,
     "tensors": [["model.embed.weight", "bfloat16", [151936, 896]], ...],
     "digests": "xxh3_64" | None,
     "commit": {"mode": "atomic", "key": "9f0c...", "timeout_s": 300.0} | None,
     "delta": None,
     "partial": true,            # partial rounds only
     "base": "<identity>"}       # what the trainer believes every worker holds, where it knows

A delta round (see :mod:`wtransfer.engines.rounds.delta`) is format 5 and says in ``delta`` what each wire tensor rebuilds.
``digests``: the trainer sends per-tensor digests after the data (:mod:`wtransfer.engines.rounds.digests`), checked by every worker
before the round can commit. ``commit``: how workers apply the round (:mod:`wtransfer.engines.rounds.commit`); ``key`` names the
trainer, so its workers on one node share one staged copy. A manifest without ``commit`` is streamed.
``base``: the content identity (:func:`identity_after`) the round applies on top of; a worker holding anything
else takes the round only if it carries every tensor of its model (always needed by a partial round).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

from wtransfer._dtypes import dtype_from_name, dtype_name, supported_dtype_names

if TYPE_CHECKING:
    import torch

MANIFEST_FORMAT = 2
"""Every round's format but a delta round's."""
DELTA_MANIFEST_FORMAT = 5
"""A delta round's format, so a worker that cannot decode it refuses the round instead of loading
payload bytes as tensors."""
DIGEST_ALGORITHMS = ("xxh3_64",)

XOR_ZSTD, POSITIONS, DENSE = "xor-zstd", "positions", "dense"
DELTA_ENCODINGS = (XOR_ZSTD, POSITIONS, DENSE)
"""How a delta round's wire tensor rebuilds its tensor: a compressed XOR with the base, changed elements'
positions and values, or whole."""


POSITION_BLOCK = 1 << 16
"""A ``positions`` payload numbers elements in blocks of this many, so a position is 16 bits within its
block (a count per block says where each block's positions end)."""


def position_blocks(target: TensorEntry) -> int:
    """How many :data:`POSITION_BLOCK` blocks a ``positions`` payload counts for ``target``."""
    return -(-target.numel // POSITION_BLOCK)


def positions_header_bytes(target: TensorEntry) -> int:
    """One uint32 count per block, padded to 8 bytes so the values after it are aligned."""
    return 8 * -(-position_blocks(target) // 2)


def positions_payload_bytes(target: TensorEntry, changed: int) -> int:
    """A ``positions`` payload's size: block counts, ``changed`` values, their uint16 positions."""
    return positions_header_bytes(target) + changed * (dtype_itemsize(target.dtype) + 2)


COMMIT_MODES = ("atomic", "streaming")
"""How a round reaches the model: staged then committed everywhere, or written as it arrives."""
IN_FLIGHT_MODES = ("recompute", "keep", "drain")
"""What a serving engine does with the requests running when a round commits (see ``create_trainer``)."""


@dataclass(frozen=True)
class CommitPlan:
    """How workers apply one round: the trainer's choice, the same for every worker."""

    mode: str
    key: str
    """The trainer's staging key: its workers on one node share one staged copy under it."""
    timeout_s: float
    """How long a worker waits for its node's staged copy once its own receive ended."""
    in_flight: str = "recompute"
    """What a serving engine does with the requests running at the commit (engines serving nothing ignore it)."""

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "key": self.key, "timeout_s": self.timeout_s, "in_flight": self.in_flight}

    @classmethod
    def from_dict(cls, data: Any) -> CommitPlan:
        if not isinstance(data, dict):
            raise ValueError(f"manifest 'commit' must be null or a dict, got {type(data).__name__}")
        mode, key, timeout_s = data.get("mode"), data.get("key"), data.get("timeout_s")
        if mode not in COMMIT_MODES:
            raise ValueError(f"manifest commit mode {mode!r} is not one of {', '.join(COMMIT_MODES)}")
        key = staging_key(key)
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise ValueError(f"manifest commit timeout_s must be a positive number, got {timeout_s!r}")
        in_flight = data.get("in_flight", "recompute")  # absent from an older trainer's manifest
        if in_flight not in IN_FLIGHT_MODES:
            raise ValueError(f"manifest commit in_flight {in_flight!r} is not one of {', '.join(IN_FLIGHT_MODES)}")
        return cls(mode, key, float(timeout_s), in_flight)


def staging_key(key: Any) -> str:
    """``key`` if it may name a trainer's node staging (it becomes part of a socket's name), else ``ValueError``."""
    if not isinstance(key, str) or not key or not all(c.isalnum() or c in "-_" for c in key):
        raise ValueError(f"a commit (staging) key must be a non-empty [A-Za-z0-9_-] string, got {key!r}")
    return key


@lru_cache(maxsize=None)
def dtype_itemsize(name: str) -> int:
    import torch

    return torch.empty((), dtype=dtype_from_name(name)).element_size()


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a round: what the receiver will rebuild from raw bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:  # cached: a ring round asks once per piece
        return self.numel * dtype_itemsize(self.dtype)

    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@dataclass(frozen=True)
class DeltaTensor:
    """What one wire entry of a delta round rebuilds on the worker."""

    target: TensorEntry
    encoding: str
    digest: str | None
    """XXH3-64 of the new value: the worker checks the tensor it rebuilt from a payload. None for a dense
    tensor (checked against the base before the next delta round applies anything to it)."""
    base_digest: str | None = None
    """``xor-zstd``, ``positions``: XXH3-64 of the base's bytes the payload applies to."""

    def to_list(self) -> list[Any]:
        t = self.target
        return [t.name, t.dtype, list(t.shape), self.encoding, self.digest, self.base_digest]


@dataclass(frozen=True)
class DeltaPlan:
    """The manifest's ``delta`` key: what the round's wire entries rebuild, and against what."""

    id: str
    base: str | None
    tensors: tuple[DeltaTensor, ...]
    unchanged: tuple[TensorEntry, ...]
    """The model's tensors the round does not carry: the worker keeps its own."""
    unchanged_digests: tuple[str, ...] = ()
    """XXH3-64 of each unchanged tensor in the trainer's base: a worker checks its copy before any byte moves."""

    @property
    def model_bytes(self) -> int:
        return sum(t.target.nbytes for t in self.tensors) + sum(e.nbytes for e in self.unchanged)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "base": self.base, "tensors": [t.to_list() for t in self.tensors],
                "unchanged": [[e.name, e.dtype, list(e.shape), d] for e, d in zip(self.unchanged, self.unchanged_digests)]}

    @classmethod
    def from_dict(cls, data: Any, wire: tuple[TensorEntry, ...]) -> DeltaPlan:
        if not isinstance(data, dict):
            raise ValueError(f"manifest 'delta' must be null or a dict, got {type(data).__name__}")
        ident, base, rows, unchanged = data.get("id"), data.get("base"), data.get("tensors"), data.get("unchanged")
        if not isinstance(ident, str) or not ident or not (base is None or isinstance(base, str)):
            raise ValueError(f"manifest delta 'id' must be a string and 'base' a string or null, got {ident!r}, {base!r}")
        if not isinstance(unchanged, list) or not all(
                isinstance(item, list) and len(item) == 4 and _is_digest(item[3]) for item in unchanged):
            raise ValueError("manifest delta 'unchanged' must be a list of [name, dtype, shape, digest]")
        kept = tuple(_parse_entry(index, item[:3]) for index, item in enumerate(unchanged))
        if kept and base is None:
            raise ValueError("manifest delta: a full round ('base' null) leaves no tensor unchanged")
        if not isinstance(rows, list) or len(rows) != len(wire):
            raise ValueError(f"manifest delta 'tensors' must list one row per wire tensor ({len(wire)})")
        tensors = []
        for index, (row, entry) in enumerate(zip(rows, wire)):
            if not (isinstance(row, list) and len(row) == 6):
                raise ValueError(f"manifest delta row #{index} must be [name, dtype, shape, encoding, digest, base]")
            target = _parse_entry(index, row[:3])
            encoding, new, old = row[3:]
            if (encoding not in DELTA_ENCODINGS or not (_is_digest(new) or (new is None and encoding == DENSE))
                    or not (old is None or _is_digest(old))):
                raise ValueError(f"manifest delta row {target.name!r}: bad encoding or digests {row[3:]!r}")
            if target.name != entry.name:
                raise ValueError(f"manifest delta row #{index} is {target.name!r}, the wire tensor {entry.name!r}")
            if encoding == DENSE and target != entry:
                raise ValueError(f"manifest delta row {target.name!r}: a dense tensor travels as itself")
            if encoding != DENSE and (entry.dtype != "uint8" or len(entry.shape) != 1 or old is None or base is None):
                raise ValueError(f"manifest delta row {target.name!r}: a {encoding} payload travels as uint8 bytes, "
                                 f"with a base digest, in a round against a base")
            if encoding == POSITIONS and (entry.nbytes < positions_header_bytes(target) or (
                    entry.nbytes - positions_header_bytes(target)) % (dtype_itemsize(target.dtype) + 2)):
                raise ValueError(f"manifest delta row {target.name!r}: a positions payload of {entry.nbytes} bytes is "
                                 f"not its block counts and a whole number of (value, position) pairs")
            tensors.append(DeltaTensor(target, encoding, new, old))
        names = [t.target.name for t in tensors] + [e.name for e in kept]
        if len(set(names)) != len(names):
            raise ValueError("manifest delta names a tensor twice (carried and unchanged)")
        return cls(ident, base, tuple(tensors), kept, tuple(item[3] for item in unchanged))

    def target_manifest(self, manifest: Manifest) -> Manifest:
        """The round as the model sees it: the tensors it rebuilds, whole (staging is sized by it)."""
        return replace(manifest, entries=tuple(t.target for t in self.tensors), delta=None)

    def model_manifest(self, manifest: Manifest) -> Manifest:
        """Every tensor of the model, carried or not: what a loader checks the round against."""
        return replace(manifest, entries=tuple(t.target for t in self.tensors) + self.unchanged, delta=None)


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


@dataclass(frozen=True)
class Manifest:
    """The tensors of one update round, in sending order."""

    entries: tuple[TensorEntry, ...]
    version: int
    checksums: tuple[int, ...] | None = None
    """On a worker, after the round: every tensor's verified digest. Never on the wire."""
    commit: CommitPlan | None = None
    digests: str | None = None
    """The algorithm of the digests the trainer sends after the data, or None (no checksums)."""
    delta: DeltaPlan | None = None
    """A delta round: what each wire tensor rebuilds, and against which committed round."""
    partial: bool = False
    """A round may carry any subset of the tensors (the rest keep their committed values; none is missing)."""
    base: str | None = None
    """The content identity the round applies on top of (None: the trainer does not know one). A worker holding
    anything else takes the round only if it carries every tensor of the worker's model."""

    @property
    def total_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT if self.delta is None else DELTA_MANIFEST_FORMAT,
            "version": self.version,
            "tensors": [[e.name, e.dtype, list(e.shape)] for e in self.entries],
            "digests": self.digests,
            "commit": self.commit.to_dict() if self.commit is not None else None,
            "delta": self.delta.to_dict() if self.delta is not None else None,
            **({"partial": True} if self.partial else {}),
            **({"base": self.base} if self.base is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Validate a wire manifest; ``ValueError`` says exactly which part is malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"manifest must be a dict, got {type(data).__name__}")
        if data.get("format") not in (MANIFEST_FORMAT, DELTA_MANIFEST_FORMAT):
            raise ValueError(
                f"manifest format {data.get('format')!r} is not supported (this wtransfer speaks "
                f"formats {MANIFEST_FORMAT} and {DELTA_MANIFEST_FORMAT}); use the same wtransfer version on trainer "
                f"and workers"
            )
        if (data.get("format") == DELTA_MANIFEST_FORMAT) != (data.get("delta") is not None):
            raise ValueError(f"manifest format {DELTA_MANIFEST_FORMAT} is a delta round's, and only it has 'delta'")
        version = data.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"manifest 'version' must be a non-negative int, got {version!r}")
        tensors = data.get("tensors")
        if not isinstance(tensors, list):
            raise ValueError("manifest 'tensors' must be a list of [name, dtype, shape]")
        entries = tuple(_parse_entry(i, item) for i, item in enumerate(tensors))
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"manifest names tensors more than once: {', '.join(dupes)}")
        digests = data.get("digests")
        if digests is not None and digests not in DIGEST_ALGORITHMS:
            raise ValueError(f"manifest 'digests' must be null or one of {DIGEST_ALGORITHMS}, got {digests!r}")
        commit = data.get("commit")
        delta = data.get("delta")
        partial = data.get("partial", False)
        if not isinstance(partial, bool):
            raise ValueError(f"manifest 'partial' must be a bool, got {partial!r}")
        base = data.get("base")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"manifest 'base' must be null or a content identity string, got {base!r}")
        return cls(entries, version, None, CommitPlan.from_dict(commit) if commit is not None else None, digests,
                   DeltaPlan.from_dict(delta, entries) if delta is not None else None, partial, base)


def _parse_entry(index: int, item: Any) -> TensorEntry:
    if not (isinstance(item, list) and len(item) == 3):
        raise ValueError(f"manifest tensor #{index} must be [name, dtype, shape], got {item!r}")
    name, dtype, shape = item
    if not isinstance(name, str) or not name:
        raise ValueError(f"manifest tensor #{index} has an invalid name {name!r}")
    if not isinstance(dtype, str) or dtype not in supported_dtype_names():
        raise ValueError(f"manifest tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(f"manifest tensor {name!r} has an invalid shape {shape!r}")
    return TensorEntry(name, dtype, tuple(shape))


def entry_for(name: str, tensor: torch.Tensor) -> TensorEntry:
    return TensorEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def build_manifest(
    entries: Iterable[TensorEntry],
    version: int,
    digests: str | None = None,
    commit: CommitPlan | None = None,
    delta: DeltaPlan | None = None,
    partial: bool = False,
    base: str | None = None,
) -> Manifest:
    return Manifest(tuple(entries), version, None, commit, digests, delta, partial, base)


STARTUP_IDENTITY = "startup"
"""The content identity of a worker's start-up weights (a fresh or restarted worker, before any round)."""


def identity_after(manifest: Manifest) -> str | None:
    """The content identity a model holds once ``manifest``'s round committed, computed alike by the trainer
    and every worker: it names one state forever and changes whenever any tensor does.

    A whole round: its trainer's key and its version (a trainer never sends two rounds under one version, and
    versions only go up). A delta round: its id (it rebuilds every tensor). A partial round: chained from the
    identity it applied on top of, so two histories never share one. None: not a wtransfer trainer's round.
    """
    if manifest.delta is not None:
        return manifest.delta.id
    if manifest.commit is None:
        return None
    name = f"{manifest.commit.key}:{manifest.version}"
    if not manifest.partial:
        return name
    import hashlib

    return hashlib.blake2b(f"{manifest.base}|{name}".encode(), digest_size=16).hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's bytes (copying only if it is not contiguous). A lazy conjugate or negative
    view raises (torch refuses its byte view), so a write through this is never lost in a copy: readers pass
    :func:`resolved` tensors."""
    import torch

    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8)


def is_lazy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a lazy conjugate or negative view: its memory holds other values than it reads."""
    return tensor.is_conj() or tensor.is_neg()


def resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its values in its memory: a lazy conjugate or negative view (``z.conj()``) as a copy, any
    other tensor itself."""
    return tensor.resolve_conj().resolve_neg()


def tensor_checksum(tensor: torch.Tensor) -> int:
    """CRC32 of a tensor's raw bytes: detects any corruption, bit for bit."""
    data = tensor_bytes(resolved(tensor.cpu() if tensor.device.type != "cpu" else tensor))
    if data.numel() == 0:
        return 0
    return zlib.crc32(data.numpy())

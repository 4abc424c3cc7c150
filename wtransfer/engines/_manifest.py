"""The update manifest: which tensors a round carries, as a JSON-safe dict.

Trainer and workers derive the byte layout of a round (see ``packing``) from the
manifest and the trainer's bucket size alone, so both sides always agree on the
wire geometry; nothing but this dict and raw bytes crosses the process boundary.

Wire form::

    {"format": 1, "version": 7,
     "tensors": [["model.embed.weight", "bfloat16", [151936, 896]], ...],
     "digests": "xxh3_64" | None,
     "commit": {"mode": "atomic", "key": "9f0c...", "timeout_s": 300.0} | None}

``digests`` says the trainer hashes every tensor as it sends it and sends the digests after
the data (see ``_digests``): workers hash what they receive and compare before the round can
commit. A worker that verified a round keeps the digests on its parsed manifest (``checksums``):
the round's content, by value.

``commit`` says how workers apply the round (see ``_commit``): ``atomic`` stages it in
host memory and loads it into the model only at ``finish_weight_update``, after every
worker received it whole; ``streaming`` writes into the model as bytes arrive. ``key``
names the trainer, so its workers on one node share one staged copy. A manifest without
it (a trainer that predates commit modes) is streamed, as such trainers always were.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from wtransfer._dtypes import dtype_from_name, dtype_name, supported_dtype_names

if TYPE_CHECKING:
    import torch

MANIFEST_FORMAT = 2
"""2: per-tensor digests travel after the data (``digests``), no longer CRC32s in the manifest."""
DIGEST_ALGORITHMS = ("xxh3_64",)

COMMIT_MODES = ("atomic", "streaming")
"""How a round reaches the model: staged then committed everywhere, or written as it arrives."""


@dataclass(frozen=True)
class CommitPlan:
    """How workers apply one round: the trainer's choice, the same for every worker."""

    mode: str
    key: str
    """The trainer's staging key: its workers on one node share one staged copy under it."""
    timeout_s: float
    """How long a worker waits for its node's staged copy once its own receive ended."""

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "key": self.key, "timeout_s": self.timeout_s}

    @classmethod
    def from_dict(cls, data: Any) -> CommitPlan:
        if not isinstance(data, dict):
            raise ValueError(f"manifest 'commit' must be null or a dict, got {type(data).__name__}")
        mode, key, timeout_s = data.get("mode"), data.get("key"), data.get("timeout_s")
        if mode not in COMMIT_MODES:
            raise ValueError(f"manifest commit mode {mode!r} is not one of {', '.join(COMMIT_MODES)}")
        if not isinstance(key, str) or not key or not all(c.isalnum() or c in "-_" for c in key):
            raise ValueError(f"manifest commit key {key!r} must be a non-empty [A-Za-z0-9_-] string")
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise ValueError(f"manifest commit timeout_s must be a positive number, got {timeout_s!r}")
        return cls(mode, key, float(timeout_s))



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

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)

    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@dataclass(frozen=True)
class Manifest:
    """The tensors of one update round, in sending order."""

    entries: tuple[TensorEntry, ...]
    version: int
    checksums: tuple[int, ...] | None = None
    """On a worker, after the round: every tensor's digest, sent by the trainer and verified here.
    Never on the wire (the trainer computes them while sending)."""
    commit: CommitPlan | None = None
    digests: str | None = None
    """The algorithm of the digests the trainer sends after the data, or None (no checksums)."""

    @property
    def total_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "tensors": [[e.name, e.dtype, list(e.shape)] for e in self.entries],
            "digests": self.digests,
            "commit": self.commit.to_dict() if self.commit is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Validate a wire manifest; ``ValueError`` says exactly which part is malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"manifest must be a dict, got {type(data).__name__}")
        if data.get("format") != MANIFEST_FORMAT:
            raise ValueError(
                f"manifest format {data.get('format')!r} is not supported (this wtransfer speaks "
                f"format {MANIFEST_FORMAT}); use the same wtransfer version on trainer and workers"
            )
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
        return cls(entries, version, None, CommitPlan.from_dict(commit) if commit is not None else None, digests)


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
) -> Manifest:
    return Manifest(tuple(entries), version, None, commit, digests)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's bytes (copying only if it is not contiguous)."""
    import torch

    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8)


def tensor_checksum(tensor: torch.Tensor) -> int:
    """CRC32 of a tensor's raw bytes: detects any corruption, bit for bit."""
    data = tensor_bytes(tensor.cpu() if tensor.device.type != "cpu" else tensor)
    if data.numel() == 0:
        return 0
    return zlib.crc32(data.numpy())

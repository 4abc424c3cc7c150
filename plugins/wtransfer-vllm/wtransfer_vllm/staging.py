"""A whole round lands in one reusable staging buffer before vLLM's model sees any of it.

Why stage: vLLM's layerwise reload keeps the tensors passed to ``load_weights`` until a
layer has all of its weights (so views of a transport buffer would be overwritten before
they are read), and a round that dies half-way must leave the model exactly as it was. So
the engine writes the round into this buffer (in place, through ``destination()``, where
the transport can), and only a complete round is loaded into the model.

The buffer is allocated on the first round and reused while rounds keep the same layout
(never a fresh allocation per round: page faults cost more than the copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wtransfer import ManifestMismatchError

from wtransfer_vllm.checkpoint import CheckpointTensor, check_round

if TYPE_CHECKING:
    import torch

ALIGN = 64


def _lay_out_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Each tensor's offset in the buffer (64-byte aligned, so any dtype's view is) and the total."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += (size + ALIGN - 1) // ALIGN * ALIGN
    return offsets, total


class StagingLoader:
    """The ``load_weights`` a wtransfer engine fills: validates, then copies into staging."""

    def __init__(self, expected: dict[str, CheckpointTensor] | None, model_dtype: str, device: Any) -> None:
        self.expected = expected
        self.model_dtype = model_dtype
        self.device = device
        self._buffer: torch.Tensor | None = None
        self._layout: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
        self._views: dict[str, torch.Tensor] = {}  # in manifest order

    @property
    def staged_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def reserve(self) -> None:
        """Allocate and touch the buffer for a checkpoint-sized round now (at init), so the
        first round pays no allocation and no page faults (~2 s per GB on a small host)."""
        if self.expected is None or self._buffer is not None:
            return
        import torch

        from wtransfer import TensorEntry

        _, total = _lay_out_offsets([TensorEntry(n, t.dtype, t.shape).nbytes for n, t in self.expected.items()])
        self._buffer = torch.zeros(total, dtype=torch.uint8, device=self.device)

    def validate_manifest(self, manifest: Any) -> None:
        """Refuse a round vLLM cannot load, before any byte moves; then lay out staging."""
        entries = tuple((e.name, e.dtype, tuple(e.shape)) for e in manifest.entries)
        problems = check_round(list(entries), self.expected, self.model_dtype)
        if problems:
            raise ManifestMismatchError(
                f"update manifest (version {manifest.version}) cannot be loaded into this vLLM model; "
                f"nothing was written. {len(problems)} problem(s): " + "; ".join(problems)
            )
        if entries != self._layout:
            self._lay_out(manifest.entries)
            self._layout = entries

    def _lay_out(self, entries: Any) -> None:
        import torch

        offsets, total = _lay_out_offsets([entry.nbytes for entry in entries])
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = None  # drop the old one first: never hold two
            self._buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        self._views = {}
        for entry, offset in zip(entries, offsets):
            raw = self._buffer[offset : offset + entry.nbytes]
            self._views[entry.name] = raw.view(entry.torch_dtype()).view(entry.shape)

    def destination(self, name: str) -> torch.Tensor | None:
        """Where ``name`` is staged: engines receive large tensors straight into it."""
        return self._views.get(name)

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            target = self._views.get(name)
            if target is None:
                raise ManifestMismatchError(f"tensor {name!r} was not in the validated manifest")
            if target.data_ptr() != tensor.data_ptr():
                target.copy_(tensor)

    def staged(self) -> list[tuple[str, torch.Tensor]]:
        """The round's tensors in manifest order, as views of the staging buffer."""
        return list(self._views.items())

    def release(self) -> None:
        """Free the staging buffer (the next round allocates it again)."""
        self._buffer = None
        self._views = {}
        self._layout = ()

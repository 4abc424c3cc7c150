"""``module_loader``: a ready ``load_weights`` for plain torch modules.

It copies in place under ``no_grad``, so tied weights stay tied and anything holding a parameter's storage
(an optimizer, a CUDA graph) sees the update. ``validate_manifest`` runs before anything is written: a
manifest that does not fit is rejected with every mismatch listed, the model untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wtransfer.engines.rounds.manifest import Manifest, dtype_name
from wtransfer.engines.rounds.packing import PARALLEL_CHUNK, copy_parallel, copy_tensor, delivered_target
from wtransfer.errors import ManifestMismatchError

if TYPE_CHECKING:
    import torch


class ModuleLoader:
    """Callable ``load_weights`` writing into a module's parameters and buffers in place."""

    def __init__(self, module: torch.nn.Module, *, strict: bool = True) -> None:
        self.module = module
        self.strict = strict
        # Every alias of a tied parameter resolves to the same tensor.
        self._targets: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
        self._targets.update(module.named_buffers(remove_duplicate=False))
        self._parameters: dict[str, torch.Tensor] = dict(module.named_parameters())
        self._buffers = [b for _, b in module.named_buffers()]

    def validate_manifest(self, manifest: Manifest) -> None:
        """Raise :class:`ManifestMismatchError` naming every mismatch, grouped by cause; write nothing."""
        problems: list[tuple[str, str | None]] = []
        todo: list[str] = []
        model = type(self.module).__name__
        covered: set[int] = set()
        for entry in manifest.entries:
            target = self._targets.get(entry.name)
            if target is None:
                problems.append((f"unknown tensor, not a parameter or buffer of {model}", entry.name))
                todo.append(f"send the names {model}.named_parameters() gives (the trainer's model must be the same class)")
                continue
            covered.add(id(target))
            if tuple(target.shape) != entry.shape:
                problems.append((f"shape {list(entry.shape)} != model {list(target.shape)}", entry.name))
                todo.append("build the trainer's model and the worker's from the same config")
            if dtype_name(target.dtype) != entry.dtype:
                problems.append((f"dtype {entry.dtype} != model {dtype_name(target.dtype)}", entry.name))
                todo.append("leave create_trainer's dtype= unset: the trainer then casts each tensor to the dtype "
                            "the workers load")
        if self.strict and not manifest.partial:  # a partial round leaves the others as committed
            for name, p in self._parameters.items():
                if id(p) not in covered:
                    problems.append(("missing parameters (strict=True)", name))
                    todo.append("send every parameter, or create_trainer(..., partial=True) to keep the ones a "
                                "round leaves out")
        if problems:
            raise ManifestMismatchError.listing(
                f"update manifest (version {manifest.version}) does not match {model}", problems, todo)

    def covers(self, manifest: Manifest) -> bool:
        """Whether the round writes every parameter of the module (whatever ``strict`` says): a worker that holds
        other weights than a partial round's base may then take it, since nothing of before is kept."""
        written = {id(target) for entry in manifest.entries if (target := self._targets.get(entry.name)) is not None}
        needed = list(self._parameters.values())
        if any(id(buffer) in written for buffer in self._buffers):  # a round that sends buffers sends them all
            needed += self._buffers
        return all(id(t) in written for t in needed)

    def destination(self, name: str) -> torch.Tensor | None:
        """The tensor ``name`` is written into: engines copy every tensor they can straight there (whole ones from a
        host buffer, split ones piece by piece), and call the loader with the rest."""
        return self._targets.get(name)

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        import torch

        pairs = []
        where = f"the {type(self.module).__name__} model"
        for name, tensor in weights:  # every tensor checked before any is written
            pairs.append((delivered_target(self._targets, name, tensor, where), tensor))
        with torch.no_grad():
            if sum(t.numel() * t.element_size() for _, t in pairs) >= 2 * PARALLEL_CHUNK:
                copy_parallel(pairs)  # a whole staged round at commit: nothing else runs beside it
            else:
                for target, tensor in pairs:
                    copy_tensor(target, tensor)


def module_loader(module: torch.nn.Module, *, strict: bool = True) -> ModuleLoader:
    """A ``load_weights`` callable for ``module`` (see :class:`ModuleLoader`)."""
    return ModuleLoader(module, strict=strict)

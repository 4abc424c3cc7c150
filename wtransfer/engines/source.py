"""Where the trainer's weights come from: a re-iterable stream of ``(name, tensor)``.

A source describes a round before producing it (``metadata()``), so the manifest can be
sent to the workers while nothing has been materialised yet; tensors are then produced
one at a time, in the same order, while they are packed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from wtransfer.engines.manifest import TensorEntry, dtype_name

if TYPE_CHECKING:
    import torch


class WeightSource(ABC):
    """Re-iterable weights: ``metadata()`` describes, ``__iter__`` yields in the same order."""

    @abstractmethod
    def metadata(self) -> list[TensorEntry]:
        """Name, dtype and shape of every tensor, without materialising any of them."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs in ``metadata()`` order; called once per round.

        A yielded tensor must not be overwritten during the round: engines read some after
        later ones were yielded (in-place broadcasts still in flight, small tensors held for
        a bucket they share). Yield a new tensor each time, never one reused scratch buffer.
        """


def _unwrap(tensor: torch.Tensor) -> torch.Tensor:
    """A plain local tensor: DTensor-style sharded tensors are gathered (``full_tensor()``)."""
    full = getattr(tensor, "full_tensor", None)
    value = full() if callable(full) else tensor
    return value.detach()


class ModuleSource(WeightSource):
    """The named parameters of a ``torch.nn.Module`` (tied parameters are sent once).

    Sharded (DTensor-style) parameters are gathered with ``full_tensor()`` only while
    they are being sent; ``include_buffers=True`` also sends persistent buffers.
    """

    def __init__(self, module: torch.nn.Module, *, include_buffers: bool = False) -> None:
        self.module = module
        self.include_buffers = include_buffers

    def _named(self) -> Iterator[tuple[str, torch.Tensor]]:
        # named_parameters() skips the aliases of a tied parameter: each storage is sent once.
        yield from self.module.named_parameters()
        if self.include_buffers:
            non_persistent = {
                f"{prefix}.{name}" if prefix else name
                for prefix, sub in self.module.named_modules()
                for name in getattr(sub, "_non_persistent_buffers_set", ())
            }
            for name, buffer in self.module.named_buffers():
                if name not in non_persistent:
                    yield name, buffer

    def metadata(self) -> list[TensorEntry]:
        return [TensorEntry(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in self._named()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._named():
            yield name, _unwrap(tensor)


class TensorSource(WeightSource):
    """A mapping of name -> tensor (a state dict), sent in its iteration order."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metadata(self) -> list[TensorEntry]:
        return [TensorEntry(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors.items():
            yield name, _unwrap(tensor)

"""wtransfer's trainer side in vLLM's ``WeightTransferTrainerFactory``.

vLLM's trainer factory dispatches on ``init_info.backend``, a class attribute of a
``TrainerInitInfo`` subclass, and calls ``engine_cls.trainer_init(init_info, client=,
source=)``. :func:`trainer_init_info` builds that object for any wtransfer engine name;
the engine it yields is a thin vLLM ``TrainerWeightTransferEngine`` over
``wtransfer.create_trainer``. ``wtransfer.create_trainer`` itself takes the same names
and vLLM's clients directly; this module is for code written against vLLM's factory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from functools import lru_cache
from typing import Any, ClassVar

import wtransfer
from vllm.distributed.weight_transfer.base import TrainerInitInfo
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine as VLLMTrainerEngine

from wtransfer_vllm.adapters import adapter_classes
from wtransfer_vllm.vllm_internals import module_source_module


@dataclasses.dataclass
class WTransferTrainerInitInfo(TrainerInitInfo):
    """vLLM trainer init info for a wtransfer engine: wtransfer's ``init_info`` dict as is."""

    backend: ClassVar[str] = "wtransfer"
    init_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # create_trainer options
    sharded: bool = False
    """Every trainer rank calls ``trainer_init`` (FSDP2 / DTensor): rank 0 runs the round, and every
    rank sends its own shards (vLLM's ``ModuleSource``), or rank 0 gathers and sends (any other source)."""


@lru_cache(maxsize=None)
def _info_class(backend: str) -> type[WTransferTrainerInitInfo]:
    return dataclasses.dataclass(
        type(f"WTransferTrainerInitInfo[{backend}]", (WTransferTrainerInitInfo,), {"backend": backend})
    )


def trainer_init_info(
    backend: str, *, rank: int = 0, checksums: bool = False, sharded: bool = False, commit: str = "atomic",
    dtype: Any = None, partial: bool = False, in_flight: str = "recompute", **init_info: Any,
) -> WTransferTrainerInitInfo:
    """``TrainerInitInfo`` for ``WeightTransferTrainerFactory.trainer_init``.

    ``backend`` is the name as registered in vLLM (``"shm"``, ``"wtransfer:gloo"``...);
    ``init_info`` keys are the wtransfer trainer's (``world_size``, ``timeout_s``, ...).
    A sharded trainer calls ``trainer_init`` on every rank with ``rank=R, sharded=True`` and
    the same source; ``send_weights()`` then runs on every rank (rank 0 drives the round). ``commit`` is
    ``create_trainer``'s (inside vLLM rounds are always staged on the host and loaded at commit).
    Floating tensors travel in vLLM's model dtype (fp32 masters are cast by the rank that holds
    them), or in ``dtype`` when given. ``in_flight`` is ``create_trainer``'s: what vLLM does with
    the requests running when a round commits.
    """
    options = {"checksums": checksums, "commit": commit, "in_flight": in_flight,
               **({"dtype": dtype} if dtype is not None else {}), **({"partial": True} if partial else {})}
    return _info_class(backend)(rank=rank, init_info=init_info, options=options, sharded=sharded)


class _VLLMSource(wtransfer.WeightSource):
    """A vLLM ``WeightSource`` (``metadata()`` of ParamMeta, then ``(name, tensor)``) as wtransfer's."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def metadata(self) -> list[Any]:
        return [wtransfer.TensorEntry(m.name, wtransfer.dtype_name(m.dtype), tuple(m.shape)) for m in self.source.metadata()]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.source)


def _as_wtransfer_source(source: Any) -> wtransfer.WeightSource:
    """vLLM's own ``ModuleSource`` sends a module's named parameters as they are, as wtransfer's
    does: that one is used instead, so the ranks of a sharded trainer write their own shards (no
    gathers). Any other vLLM source (it may rename or convert) is wrapped, and rank 0 gathers."""
    module = module_source_module(source)  # None for any other source: it is wrapped
    if module is not None:
        return wtransfer.ModuleSource(module)
    return _VLLMSource(source)


class WTransferTrainerAdapter(VLLMTrainerEngine):
    """vLLM's trainer engine interface over a wtransfer trainer (rank 0 drives the round; with a
    sharded trainer every other rank holds a participant, which sends its own shards with vLLM's
    ``ModuleSource`` on a backend that has senders, and runs rank 0's gathers otherwise)."""

    wtransfer_backend: ClassVar[str] = ""
    init_info_cls = WTransferTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> WTransferTrainerAdapter:
        sharded = bool(getattr(init_info, "sharded", False))
        if not init_info.is_sender and not sharded:
            raise ValueError(
                f"trainer rank {init_info.rank} is not the sender: for a sharded trainer build every rank's "
                f"init info with trainer_init_info(..., rank=R, sharded=True); otherwise call trainer_init "
                f"on rank 0 only"
            )
        if source is None:
            raise ValueError(f"{cls.wtransfer_backend} needs a source: the weights sent every round")
        if not isinstance(source, wtransfer.WeightSource) and hasattr(source, "metadata"):
            source = _as_wtransfer_source(source)
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.trainer = wtransfer.create_trainer(
            cls.wtransfer_backend, client=client if init_info.is_sender else None, source=source,
            init_info=init_info.init_info if init_info.is_sender else None,
            rank=init_info.rank if sharded else None, **init_info.options,
        )
        return self

    def send_weights(self, weight_version: str | None = None) -> dict[str, Any]:  # type: ignore[override]
        return self.trainer.send_weights(weight_version)

    def shutdown(self) -> None:
        self.trainer.shutdown()


__getattr__ = adapter_classes(WTransferTrainerAdapter, __name__)

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


@dataclasses.dataclass
class WTransferTrainerInitInfo(TrainerInitInfo):
    """vLLM trainer init info for a wtransfer engine: wtransfer's ``init_info`` dict as is."""

    backend: ClassVar[str] = "wtransfer"
    init_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # create_trainer options


@lru_cache(maxsize=None)
def _info_class(backend: str) -> type[WTransferTrainerInitInfo]:
    return dataclasses.dataclass(
        type(f"WTransferTrainerInitInfo[{backend}]", (WTransferTrainerInitInfo,), {"backend": backend})
    )


def trainer_init_info(backend: str, *, rank: int = 0, checksums: bool = False, **init_info: Any) -> WTransferTrainerInitInfo:
    """``TrainerInitInfo`` for ``WeightTransferTrainerFactory.trainer_init``.

    ``backend`` is the name as registered in vLLM (``"shm"``, ``"wtransfer:gloo"``...);
    ``init_info`` keys are the wtransfer trainer's (``world_size``, ``timeout_s``, ...).
    """
    return _info_class(backend)(rank=rank, init_info=init_info, options={"checksums": checksums})


class _VLLMSource(wtransfer.WeightSource):
    """A vLLM ``WeightSource`` (``metadata()`` of ParamMeta, then ``(name, tensor)``) as wtransfer's."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def metadata(self) -> list[Any]:
        return [wtransfer.TensorEntry(m.name, wtransfer.dtype_name(m.dtype), tuple(m.shape)) for m in self.source.metadata()]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.source)


class WTransferTrainerAdapter(VLLMTrainerEngine):
    """vLLM's trainer engine interface over a wtransfer trainer (rank 0 sends)."""

    wtransfer_backend: ClassVar[str] = ""
    init_info_cls = WTransferTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> WTransferTrainerAdapter:
        if not init_info.is_sender:
            raise ValueError(
                "wtransfer engines send from one trainer process (rank 0); gather the weights "
                "there (a sharded source is gathered with full_tensor()) and call trainer_init on it only"
            )
        if source is None:
            raise ValueError(f"{cls.wtransfer_backend} needs a source: the weights sent every round")
        if not isinstance(source, wtransfer.WeightSource) and hasattr(source, "metadata"):
            source = _VLLMSource(source)
        self = cls(client=client, source=source)
        self.trainer = wtransfer.create_trainer(
            cls.wtransfer_backend, client=client, source=source, init_info=init_info.init_info, **init_info.options
        )
        return self

    def send_weights(self, weight_version: str | None = None) -> dict[str, Any]:  # type: ignore[override]
        return self.trainer.send_weights(weight_version)

    def shutdown(self) -> None:
        self.trainer.shutdown()


__getattr__ = adapter_classes(WTransferTrainerAdapter, __name__)

"""A worker engine that receives nothing: enough to show discovery, creation and hooks."""

from __future__ import annotations

from dataclasses import dataclass

from wtransfer.engines.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo


@dataclass
class ExampleInitInfo(WeightTransferInitInfo):
    greeting: str = "hello"


@dataclass
class ExampleUpdateInfo(WeightTransferUpdateInfo):
    names: list[str] | None = None


class ExampleEngine(WeightTransferEngine[ExampleInitInfo, ExampleUpdateInfo]):
    """Example engine shipped by the wtransfer-example distribution."""

    init_info_cls = ExampleInitInfo
    update_info_cls = ExampleUpdateInfo

    def init_transfer_engine(self, init_info: ExampleInitInfo) -> None:
        self.greeting = init_info.greeting

    def receive_weights(self, update_info, load_weights) -> None:
        load_weights([])

    def shutdown(self) -> None:
        pass

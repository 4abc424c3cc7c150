"""A fleet hands each instance a round's label by the rule a trainer uses for one client (no vLLM needed)."""

from __future__ import annotations

from typing import Any

from wtransfer_vllm import FleetClient


class Recorder:
    """A client that records what its commit was given."""

    def __init__(self) -> None:
        self.finished: list[tuple[Any, ...]] = []

    def start_weight_update(self) -> None:
        pass


class Named(Recorder):
    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.finished.append((weight_version,))


class Forwarding(Recorder):  # a wrapper that passes everything on, as a proxy client does
    def finish_weight_update(self, *args: Any) -> None:
        self.finished.append(args)


class Unlabelled(Recorder):  # an older client: no label
    def finish_weight_update(self) -> None:
        self.finished.append(())


class KeywordOnly(Recorder):  # takes a label by keyword only: the trainer passes it positionally, so not at all
    def finish_weight_update(self, *, weight_version: str | None = None) -> None:
        self.finished.append(("keyword", weight_version))


class LabelSecond(Recorder):  # a label after another parameter would land in that one
    def finish_weight_update(self, timeout: float = 30.0, weight_version: str | None = None) -> None:
        self.finished.append((timeout, weight_version))


def test_each_instance_gets_the_label_as_it_would_alone() -> None:
    named, forwarding, unlabelled, keyword, second = Named(), Forwarding(), Unlabelled(), KeywordOnly(), LabelSecond()
    FleetClient([named, forwarding, unlabelled, keyword, second]).finish_weight_update("7")
    assert named.finished == [("7",)]
    assert forwarding.finished == [("7",)]  # a fleet used to drop it here
    assert unlabelled.finished == [()]
    assert keyword.finished == [("keyword", None)]  # called without it, never with a misplaced one
    assert second.finished == [(30.0, None)]

"""Where a round's time goes: seconds summed per named phase.

A trainer fills one :class:`Phases` per round (``stats["phases"]``) and every worker one per round
(``WeightTransferEngine.round_seconds``). The phases of a side overlap nothing on that side, except where
a name says it holds others (the trainer's ``send`` holds its ``pack`` and ``wait``); the two sides run
at once, so a trainer's ``wait`` is mostly a worker's ``receive``. ``wtransfer bench`` prints them beside
each path's floor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Phases:
    """Seconds per phase of one round; a phase entered many times (once per bucket) adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def to_dict(self) -> dict[str, float]:
        return dict(self.seconds)

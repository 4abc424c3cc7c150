"""Where a round's time goes: seconds summed per named phase.

A trainer fills one :class:`Phases` per round (``stats["phases"]``) and every worker one per round
(``WeightTransferEngine.round_seconds``). The phases of a side overlap nothing on that side, except where
a name says it holds others (the trainer's ``send`` holds its ``pack`` and ``wait``); the two sides run
at once, so a trainer's ``wait`` is mostly a worker's ``receive``. ``wtransfer bench`` prints them beside
each path's floor.
"""

from __future__ import annotations

import time
from typing import Any


class Phases:
    """Seconds per phase of one round; a phase entered many times (once per bucket) adds up.

    ``with phases("pack"):`` times its block. Not a ``contextlib.contextmanager``: a ring round enters up to two
    phases per bucket, and a generator took about twice as long as this (3.4 µs a phase, 2-core AMD EPYC)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> _Timed:
        return _Timed(self.seconds, name)

    def to_dict(self) -> dict[str, float]:
        return dict(self.seconds)


class _Timed:
    """One timed block of :class:`Phases`."""

    __slots__ = ("seconds", "name", "started")

    def __init__(self, seconds: dict[str, float], name: str) -> None:
        self.seconds, self.name, self.started = seconds, name, 0.0

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.seconds[self.name] = self.seconds.get(self.name, 0.0) + time.perf_counter() - self.started

"""The ``init_info`` every trainer takes (:class:`TrainerInitOptions`), and the range check backends share."""

from __future__ import annotations

import dataclasses

from wtransfer.engines.channel.protocol import MIB, check_bucket_bytes
from wtransfer.options import option


def at_least(name: str, value: float, minimum: float) -> None:
    """Range check for an option whose type ``parse_options`` already checked."""
    if value < minimum:
        raise ValueError(f"{name!r} must be >= {minimum:g}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TrainerInitOptions:
    """The ``init_info`` every trainer takes, and its defaults: the one place they come from.

    A backend with keys or defaults of its own subclasses its parent trainer's options class and names
    the subclass as its ``init_options_cls`` (one that does not extend the parent's is refused). A default
    is changed by redeclaring the field (the doc is kept when left out)::

        @dataclass(frozen=True)
        class SmallRingInitOptions(SharedMemoryInitOptions):
            num_buffers: int = option(3)
    """

    world_size: int = option(
        doc="the trainer plus every worker process, e.g. 1 + number of workers (at least 2)"
    )
    timeout_s: float = option(300.0, doc="seconds any one wait (rendezvous, a round's step) may take")
    bucket_bytes: int = option(
        32 * MIB, doc="bytes per bucket and per buffer: a multiple of 64, at least 4096"
    )
    num_buffers: int = option(2, doc="buffers in flight: packing one overlaps moving the others")

    def __post_init__(self) -> None:
        at_least("world_size", self.world_size, 2)
        if self.timeout_s <= 0:
            raise ValueError(f"'timeout_s' must be a positive number, got {self.timeout_s!r}")
        check_bucket_bytes(self.bucket_bytes)
        at_least("num_buffers", self.num_buffers, 1)

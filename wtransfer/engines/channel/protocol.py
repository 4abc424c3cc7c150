"""The trainer/worker wire protocol shared by the built-in engines: one module both sides import.

The trainer and worker sides never import each other; what they must agree on lives here.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

from wtransfer.errors import TransferError

PROTOCOL_VERSION = 9
"""Bumped whenever the wire protocol changes; workers and other trainer ranks refuse other versions."""

MIB = 1 << 20
"""One mebibyte: the unit of every buffer size in wtransfer."""

ALIGN = 64
"""Every tensor starts at a multiple of this many bytes inside a bucket."""

MIN_BUCKET_BYTES = 4096


class RoundCalledOff(TransferError):
    """Worker side: another worker rejected the round before any byte moved; the engine stays joined."""


def check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    """``value`` is a true int (not a bool) of at least ``minimum``; the message names ``owner``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}: {name!r} must be an int >= {minimum}, got {value!r}")


def check_timeout(owner: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}: 'timeout_s' must be a positive number, got {value!r}")


def check_protocol(owner: str, version: Any) -> None:
    """Refuse a trainer that speaks another protocol version, naming both."""
    if version != PROTOCOL_VERSION:
        raise ValueError(
            f"{owner}: the trainer speaks protocol {version!r} but this worker speaks "
            f"{PROTOCOL_VERSION}; install the same wtransfer version on both sides"
        )


def check_bucket_bytes(bucket_bytes: Any) -> int:
    """A bucket size both sides accept: an int, a multiple of :data:`ALIGN`, at least 4096."""
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool):
        raise ValueError(f"bucket_bytes must be an int, got {bucket_bytes!r}")
    if bucket_bytes < MIN_BUCKET_BYTES or bucket_bytes % ALIGN:
        raise ValueError(
            f"bucket_bytes must be a multiple of {ALIGN} and at least {MIN_BUCKET_BYTES}, got {bucket_bytes}"
        )
    return bucket_bytes


def check_wire_info(owner: str, info: Any) -> None:
    """The fields every built-in engine's init info carries (``protocol_version``, ``world_size``,
    ``num_buffers``, ``rank_offset``, ``timeout_s``, ``bucket_bytes``), as read from the trainer's JSON."""
    check_protocol(owner, info.protocol_version)
    check_int(owner, "world_size", info.world_size, 2)
    check_int(owner, "num_buffers", info.num_buffers, 1)
    check_int(owner, "rank_offset", info.rank_offset, 0)
    check_timeout(owner, info.timeout_s)
    try:
        check_bucket_bytes(info.bucket_bytes)
    except ValueError as exc:
        raise ValueError(f"{owner}: {exc}") from None


def check_announced(info: Any, announced: Any, fields: tuple[str, ...]) -> None:
    """Refuse, by name, init info whose ``fields`` differ from what the trainer announced at the handshake: a
    control plane that altered them (``bucket_bytes`` of a TiB) would have this worker size its buffers unlike the
    trainer's, and fail late or not at all."""
    if not isinstance(announced, dict):
        raise TransferError("the trainer announced no wire parameters at the handshake; run the same wtransfer "
                            "version on trainer and workers")
    differ = [f"{name}={getattr(info, name)!r} (the trainer's: {announced.get(name)!r})"
              for name in fields if getattr(info, name) != announced.get(name)]
    if differ:
        raise TransferError(f"this worker's init_info is not the one its trainer made: {', '.join(differ)}; "
                            f"pass the trainer's init_info to every worker unchanged")


class ManifestRejected(TransferError):
    """A worker refused the round's manifest; every side stopped before data moved."""


_gc_lock = threading.Lock()
_gc_pauses = 0
"""Rounds in :func:`gc_paused` now, on any thread of this process."""
_gc_was_enabled = False
"""Whether the GC was enabled when the first of them began."""


def _gc_after_fork() -> None:
    """A child forked during a round runs none of it: it starts with no pause, a free lock and the GC as it was."""
    global _gc_lock, _gc_pauses
    _gc_lock = threading.Lock()
    if _gc_pauses and _gc_was_enabled:
        gc.enable()
    _gc_pauses = 0


os.register_at_fork(after_in_child=_gc_after_fork)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Keep the cyclic GC out of a round: a full collection mid-round walks the whole heap and stalls the
    pipeline. Rounds on several threads of one process (a trainer beside in-process workers) pause it together:
    it comes back when the last one ends, and only if it was enabled when the first began."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()

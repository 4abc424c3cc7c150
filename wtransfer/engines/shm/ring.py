"""What the ``shm`` transport's processes share besides rank 0's round logic (:mod:`wtransfer.engines.shm.trainer`).

The ring, joining rank 0 (workers and other trainer ranks alike), and :class:`SharedMemorySender`,
another trainer rank writing its own shards into the staged segment.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from wtransfer.engines.channel.control import ControlChannel, PeerClosedError, connect
from wtransfer.engines.channel.protocol import PROTOCOL_VERSION
from wtransfer.engines.rounds.cast import CastPlan
from wtransfer.engines.rounds.part_streams import layout_rows
from wtransfer.engines.rounds.shards import entries_digest, rank_parts, write_part, writes_shards_as_is
from wtransfer.engines.rounds.staging import SharedSegment, staging_offsets
from wtransfer.errors import TransferError


class SharedRing(SharedSegment):
    """A pre-faulted mapped segment as ``num_buffers`` uint8 tensors of ``bucket_bytes``; read-only on workers."""

    def __init__(self, fd: int, bucket_bytes: int, num_buffers: int, writable: bool = True) -> None:
        super().__init__(fd, bucket_bytes * num_buffers, writable)
        self.slots = [self.data[i * bucket_bytes : (i + 1) * bucket_bytes] for i in range(num_buffers)]

    def close(self) -> None:
        self.slots = []
        super().close()


def join_trainer(address: str, hello: dict[str, Any], timeout_s: float, who: str,
                 peer: str = "the shm trainer") -> tuple[ControlChannel, dict[str, Any], list[int]]:
    """Say ``hello`` to rank 0; its reply and the descriptors that came with it (the caller's to close).
    A ``hello`` carrying an ``error`` tells rank 0 why this process cannot join, then raises it here."""
    channel = connect(address, timeout_s, peer)
    try:
        channel.send(hello, timeout=timeout_s)
        if hello.get("error"):
            raise TransferError(str(hello["error"]))
        reply = channel.recv(timeout_s)
        fds = channel.take_fds()
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise TransferError(f"{peer} refused {who}: {reply.get('error')}")
    except BaseException:
        channel.close()
        raise
    return channel, reply, fds


def send_best_effort(channel: ControlChannel, message: dict[str, Any]) -> None:
    """Send within a second, or not at all: a peer that is gone or stuck need not hear it."""
    with contextlib.suppress(TransferError):
        channel.send(message, timeout=1.0)


class TrainerAborted(TransferError):
    """The trainer called the round off (another worker failed or rejected it)."""


class SharedMemorySender:
    """Another rank of a sharded ``shm`` trainer: writes its own shards into rank 0's staged segment. Rank 0
    checks the ranks' ``layout`` tiles the round and says ``go`` once the workers accepted; then ``written``."""

    def __init__(self, info: dict[str, Any], trainer_rank: int, source: Any, timeout_s: float) -> None:
        self.rank = trainer_rank
        self.source = source
        self.timeout_s = timeout_s
        problem = None
        if not writes_shards_as_is(source):
            problem = (f"its source is a {type(source).__name__}, not a ModuleSource (rank 0's is): pass the "
                       f"same kind of source on every trainer rank")
        elif info.get("protocol_version") != PROTOCOL_VERSION:
            problem = f"protocol {info.get('protocol_version')!r} != {PROTOCOL_VERSION} (another wtransfer version)"
        hello = {"op": "sender", "rank": trainer_rank, "token": info["token"], "error": problem}
        channel, _, fds = join_trainer(str(info["address"]), hello, timeout_s, "this rank", peer="trainer rank 0")
        for fd in fds:
            os.close(fd)
        try:
            channel.send({"op": "ready"}, timeout=timeout_s)
        except BaseException:
            channel.close()
            raise
        self._channel: ControlChannel | None = channel
        self._segment: SharedSegment | None = None

    def _next(self, attempt: int, wait: float) -> dict[str, Any]:
        """Rank 0's next message about round ``attempt`` (an earlier round's are skipped); an abort raises."""
        assert self._channel is not None
        while True:
            message = self._channel.recv(wait)
            if message.get("attempt") != attempt:  # an earlier, failed round's; its segment is rank 0's still
                if message.get("op") == "go":
                    self._segment = SharedSegment.handed_over(self._segment, self._channel.take_fds(),
                                                              int(message["size"]), writable=True)
                continue
            if message.get("op") == "abort":
                raise TrainerAborted(f"trainer rank 0 aborted the round: {message.get('reason')}")
            return message

    def serve_round(self, attempt: int, cast: CastPlan | None = None) -> tuple[int, int]:
        """Write this rank's shards of one round; returns (tensors, bytes) held here.

        Each wait is bounded by ``2 * timeout_s + 30`` (rank 0 waits at most ``timeout_s`` for the workers);
        rank 0 dying or aborting raises at once. A long write sends ``progress`` every ``timeout_s / 4`` so a
        slow rank is not taken for a dead one.
        """
        if self._channel is None:
            raise TransferError(f"trainer rank {self.rank}: this sender was closed")
        channel, wait = self._channel, 2 * self.timeout_s + 30
        try:
            message = self._next(attempt, wait)
            if message.get("op") != "round":
                raise TransferError(f"protocol violation: expected a round from trainer rank 0, got {message!r}")
            entries = (cast or CastPlan()).entries(self.source.metadata())  # as rank 0 casts them
            if entries_digest(entries) != message.get("digest"):
                raise TransferError("this rank's model lists other tensors (names, dtypes or shapes) than trainer "
                                    "rank 0's; every rank must pass the same model")
            parts = rank_parts(self.source.named_tensors(), self.rank, entries)
            channel.send({"op": "layout", "rows": layout_rows(parts), "attempt": attempt}, timeout=self.timeout_s)
            go = self._next(attempt, wait)
            if go.get("op") != "go":
                raise TransferError(f"protocol violation: expected the go from trainer rank 0, got {go!r}")
            # a new segment comes with the first round's go, or one that had to grow
            self._segment = SharedSegment.handed_over(self._segment, channel.take_fds(), int(go["size"]), writable=True)
            if self._segment is None:
                raise TransferError("protocol violation: rank 0 said go without its segment")
            offsets, total = staging_offsets(entries)
            if total > self._segment.size:
                raise TransferError(f"rank 0's segment of {self._segment.size} bytes is too small for a {total}-byte round")
            told = time.monotonic()
            for entry, offset, part in zip(entries, offsets, parts):
                if part is not None and entry.nbytes:
                    if time.monotonic() - told > self.timeout_s / 4:  # a long write: rank 0 hears it goes on
                        channel.send({"op": "progress", "attempt": attempt}, timeout=self.timeout_s)
                        told = time.monotonic()
                    write_part(self._segment.data[offset : offset + entry.nbytes], 0, part)
            channel.send({"op": "written", "attempt": attempt}, timeout=self.timeout_s)
        except (PeerClosedError, TrainerAborted):
            raise
        except BaseException as exc:
            # rank 0 learns at once instead of waiting for this rank's next answer
            send_best_effort(channel, {"op": "fail", "error": f"{type(exc).__name__}: {exc}", "attempt": attempt})
            raise
        held = [p for p in parts if p is not None]
        return len(held), sum(p.local.numel() * p.wire_dtype.itemsize for p in held)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

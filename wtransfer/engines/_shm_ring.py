"""The ``shm`` ring as every process maps it, and the other trainer ranks' side of a sharded round.

The ring is one anonymous shared-memory segment seen as ``num_buffers`` buffers of
``bucket_bytes``: the trainer writes buckets into it, workers read them in place, and the other
ranks of a sharded trainer write their own shards into it at their offsets
(:class:`SharedMemorySender`). Rank 0 (:mod:`wtransfer.engines.shm`) runs every round.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import TYPE_CHECKING, Any

from wtransfer.engines._cast import CastPlan
from wtransfer.engines._control import ControlChannel, PeerClosedError, connect
from wtransfer.engines._packing import plan_buckets
from wtransfer.engines._protocol import PROTOCOL_VERSION
from wtransfer.engines._part_streams import layout_rows
from wtransfer.engines._shards import entries_digest, rank_parts, write_bucket, writes_shards_as_is
from wtransfer.engines._shm_links import Inbox, check_masks, take_link
from wtransfer.errors import TransferError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("wtransfer")


class SharedRing:
    """A mapped segment viewed as ``num_buffers`` uint8 tensors of ``bucket_bytes`` each."""

    def __init__(self, fd: int, bucket_bytes: int, num_buffers: int, populate: bool) -> None:
        import torch

        size = bucket_bytes * num_buffers
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self._map: mmap.mmap | None = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self.slots: list[torch.Tensor] = [whole[i * bucket_bytes : (i + 1) * bucket_bytes] for i in range(num_buffers)]

    def touch(self) -> None:
        """Fault every page in now, so no round ever pays first-touch page faults."""
        for slot in self.slots:
            slot.fill_(0)

    def close(self) -> None:
        self.slots = []
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a caller still holds a view; the GC unmaps it later
                logger.debug("shm ring still referenced at shutdown; unmapped when released")
            self._map = None


def join_ring(address: str, hello: dict[str, Any], bucket_bytes: int, num_buffers: int, timeout_s: float,
              who: str, peer: str = "the shm trainer") -> tuple[ControlChannel, SharedRing]:
    """Join rank 0's ring: say ``hello``, map the descriptor it answers with, say ``ready``.

    How a worker and another trainer rank both join. A ``hello`` carrying an ``error`` tells rank 0
    why this process cannot join (so it stops waiting for it) and raises that error here.
    """
    channel = connect(address, timeout_s, peer)
    ring = None
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
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise TransferError(f"expected one shared-memory descriptor from the trainer, got {len(fds)}")
        try:
            ring = SharedRing(fds[0], bucket_bytes, num_buffers, populate=True)
        finally:
            os.close(fds[0])
        channel.send({"op": "ready"}, timeout=timeout_s)
    except BaseException:
        channel.close()
        if ring is not None:
            ring.close()
        raise
    return channel, ring


class TrainerAborted(TransferError):
    """The trainer called the round off (another worker failed or rejected it)."""


class SharedMemorySender:
    """Another rank of a sharded ``shm`` trainer: maps rank 0's ring and writes its own shards into it.

    Rank 0 keeps the control plane: it starts each round, checks that the ranks' shards tile it,
    says which ranks write each bucket, aborts and ends it. The buckets themselves are handed
    over directly (:mod:`._shm_links`): this rank writes its bytes of a bucket once every worker
    released the bucket that buffer held (and, with checksums, rank 0 hashed it: its ``free``),
    and tells every worker it did (and rank 0, with checksums). Nothing is gathered; every byte
    is written once, by the rank that holds it.
    """

    def __init__(self, info: dict[str, Any], trainer_rank: int, source: Any, timeout_s: float) -> None:
        self.rank = trainer_rank
        self.source = source
        self.timeout_s = timeout_s
        self.bucket_bytes = int(info["bucket_bytes"])
        problem = None
        if not writes_shards_as_is(source):
            problem = (f"its source is a {type(source).__name__}, not a ModuleSource (rank 0's is): pass the "
                       f"same kind of source on every trainer rank")
        elif info.get("protocol_version") != PROTOCOL_VERSION:
            problem = f"protocol {info.get('protocol_version')!r} != {PROTOCOL_VERSION} (another wtransfer version)"
        hello = {"op": "sender", "rank": trainer_rank, "token": info["token"], "error": problem}
        self._channel: ControlChannel | None
        self._ring: SharedRing | None
        self._channel, self._ring = join_ring(str(info["address"]), hello, self.bucket_bytes, int(info["num_buffers"]),
                                              timeout_s, "this rank", peer="trainer rank 0")
        self._links: dict[int, ControlChannel] = {}  # worker rank -> our link to it

    def _control(self, message: dict[str, Any], attempt: int) -> dict[str, Any] | None:
        """Rank 0's ``message`` about round ``attempt``, or None for one to skip: a link (taken),
        a tick (rank 0 is still sending, only not asking this rank for anything), or what an
        earlier, failed round left in the socket. An abort raises."""
        if message.get("op") == "link":
            assert self._channel is not None
            take_link(self._channel, message, "worker", "shm worker rank", self._links)
            return None
        if message.get("attempt") != attempt or message.get("op") == "tick":
            return None
        if message.get("op") == "abort":
            raise TrainerAborted(f"trainer rank 0 aborted the round: {message.get('reason')}")
        return message

    def _next(self, attempt: int, wait: float) -> dict[str, Any]:
        """Rank 0's next message about round ``attempt`` (see :meth:`_control`)."""
        assert self._channel is not None
        while (message := self._control(self._channel.recv(wait), attempt)) is None:
            pass
        return message

    def serve_round(self, attempt: int, cast: CastPlan | None = None) -> tuple[int, int]:
        """Write this rank's shards into every bucket it holds bytes of; returns (tensors, bytes) held here.

        Each wait is bounded: rank 0 waits at most ``timeout_s`` for the workers between two
        buckets, and a rank it has not told anything in ``timeout_s / 2`` gets a ``tick``, so a
        healthy round never leaves this rank without a message for ``2 * timeout_s + 30`` (it
        may hold no byte of a long run of buckets). A closed socket (rank 0 or a worker died) or
        an abort raises at once.
        """
        if self._channel is None or self._ring is None:
            raise TransferError(f"trainer rank {self.rank}: this sender was closed")
        channel, wait = self._channel, 2 * self.timeout_s + 30
        inbox = None
        try:
            message = self._next(attempt, wait)
            if message.get("op") != "round":
                raise TransferError(f"protocol violation: expected a round from trainer rank 0, got {message!r}")
            entries = (cast or CastPlan()).entries(self.source.metadata())  # as rank 0 casts them
            if entries_digest(entries) != message.get("digest"):
                raise TransferError("this rank's model lists other tensors (names, dtypes or shapes) than trainer "
                                    "rank 0's; every rank must pass the same model")
            buckets = plan_buckets(entries, self.bucket_bytes)
            parts = rank_parts(self.source.named_tensors(), self.rank, entries)
            # what this rank holds of every tensor (gloo's layout words): rank 0 checks that the ranks
            # tile every tensor and tells everyone which ranks write each bucket
            channel.send({"op": "layout", "rows": layout_rows(parts), "attempt": attempt}, timeout=self.timeout_s)
            go = self._next(attempt, wait)
            if go.get("op") != "go":
                raise TransferError(f"protocol violation: expected the go from trainer rank 0, got {go!r}")
            masks = check_masks(go.get("masks"), len(buckets))
            version, readers = go.get("version"), len(self._links) + (1 if go.get("digests") else 0)
            inbox = Inbox({0: channel, **self._links})
            freed = [0] * len(buckets)  # readers (workers; rank 0 with checksums) done with each bucket
            buffers = len(self._ring.slots)
            for bucket in buckets:
                if not masks[bucket.index] >> self.rank & 1:
                    continue
                while bucket.index >= buffers and freed[bucket.index - buffers] < readers:
                    self._heard(inbox, attempt, version, freed, wait, f"waiting for buffer {bucket.index % buffers}")
                write_bucket(bucket, self._ring.slots[bucket.index % buffers], entries, parts)
                for link in self._links.values():
                    link.send({"op": "written", "index": bucket.index, "version": version}, timeout=self.timeout_s)
                if go.get("digests"):  # rank 0 hashes every bucket once it is whole
                    channel.send({"op": "written", "index": bucket.index, "attempt": attempt}, timeout=self.timeout_s)
            # Every byte of this rank is in: only rank 0's word counts now (a worker that leaves after
            # loading everything is rank 0's to judge; a release still in flight is skipped next round).
            # Rank 0's words the inbox already read come first (an abort among them).
            queued = [m for m in (self._control(m, attempt) for m in inbox.take_queued(0)) if m is not None]
            while not any(m.get("op") == "end" for m in queued):
                if any(m.get("op") != "free" for m in queued):
                    raise TransferError(f"protocol violation: unexpected message from trainer rank 0: {queued!r}")
                queued = [self._next(attempt, wait)]
        except (PeerClosedError, TrainerAborted):
            raise
        except BaseException as exc:
            try:  # rank 0 learns at once instead of waiting for this rank's next answer
                channel.send({"op": "fail", "error": f"{type(exc).__name__}: {exc}", "attempt": attempt}, timeout=1.0)
            except TransferError:
                pass
            raise
        finally:
            if inbox is not None:
                inbox.close()
        held = [p for p in parts if p is not None]
        return len(held), sum(p.local.numel() * p.wire_dtype.itemsize for p in held)

    def _heard(self, inbox: Inbox, attempt: int, version: Any, freed: list[int], wait: float, what: str) -> None:
        """Take one message: a reader done with a bucket (counted in ``freed``), or rank 0's word."""
        rank, message = inbox.next(wait, what)
        op, index = message.get("op"), message.get("index")
        if rank == 0:
            message = self._control(message, attempt)  # type: ignore[assignment]
            if message is None:
                return
            op = message.get("op")
            if op != "free":
                raise TransferError(f"protocol violation: unexpected message from trainer rank 0: {message!r}")
        elif op != "release":
            raise TransferError(f"protocol violation: shm worker rank {rank} sent {message!r}")
        elif message.get("version") != version:
            return  # an earlier round's, ended before this rank read it
        if type(index) is not int or not 0 <= index < len(freed):
            raise TransferError(f"protocol violation: no bucket {index!r} in this round")
        freed[index] += 1

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links = {}
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._ring is not None:
            self._ring.close()
            self._ring = None

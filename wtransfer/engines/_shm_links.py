"""Direct links between a sharded ``shm`` trainer's ranks and the workers.

In a sharded round every byte is written by the rank that holds it, and a bucket is read once
every rank holding bytes of it wrote them. Relayed through rank 0, each such bucket cost two
extra wake-ups of rank 0 (the order to write, the news that it was written), and on a host with
fewer cores than busy processes each of them waits for a core the writer and the worker are
using. So each other rank and each worker share a socket pair of their own, made by rank 0 and
handed to both ends over their control sockets (``SCM_RIGHTS``: nothing to connect to, nothing
another process could join): a writer tells the workers directly that its part of a bucket is
in the ring, and a worker tells the writers of the bucket that reuses a buffer directly that it
is free. Rank 0 stays the control plane: it starts, checks, aborts and ends every round.

This module holds what the three sides share: making and taking links, the writers of every
bucket as one integer (bit ``r``: trainer rank ``r`` writes bytes of it) and :class:`Inbox`,
one bounded wait over several sockets.
"""

from __future__ import annotations

import selectors
import socket
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from wtransfer.engines._control import ControlChannel
from wtransfer.errors import TransferError, TransferTimeoutError


def ranks_in(mask: int) -> Iterator[int]:
    """The trainer ranks whose bits are set in ``mask``, lowest first."""
    rank = 0
    while mask:
        if mask & 1:
            yield rank
        mask >>= 1
        rank += 1


def hand_out_links(senders: dict[int, ControlChannel], workers: dict[int, ControlChannel], timeout: float) -> None:
    """Rank 0: one socket pair per (other trainer rank, worker), one end to each, over their
    control sockets; rank 0 keeps neither end. Each end comes in a message of its own."""
    for rank, sender in senders.items():
        for worker, channel in workers.items():
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sender.send({"op": "link", "worker": worker}, fds=[mine.fileno()], timeout=timeout)
                channel.send({"op": "link", "sender": rank}, fds=[theirs.fileno()], timeout=timeout)
            finally:
                mine.close()
                theirs.close()


def take_link(channel: ControlChannel, message: dict[str, Any], field: str, peer: str,
              links: dict[int, ControlChannel]) -> None:
    """Keep the link that came with ``message`` (a ``link`` message just read from ``channel``)
    in ``links``, under the rank its ``field`` names (``peer``: what that rank is, for errors);
    a link that rank had before is closed."""
    rank = message.get(field)
    if type(rank) is not int or rank < 1:
        raise TransferError(f"protocol violation: a link to {peer} {rank!r}")
    if rank in links:
        links.pop(rank).close()
    links[rank] = ControlChannel(socket.socket(fileno=channel.take_fd()), f"{peer} {rank}")


class Inbox:
    """The next message from any of several channels, each wait bounded.

    Keys name the channels (a rank); messages of one channel come in the order they were sent.
    A channel whose peer closed raises :class:`~wtransfer.engines._control.PeerClosedError`
    naming that peer.
    """

    def __init__(self, channels: dict[int, ControlChannel]) -> None:
        self._channels = channels
        self._selector = selectors.DefaultSelector()
        for key, channel in channels.items():
            self._selector.register(channel, selectors.EVENT_READ, key)
        self._ready: deque[tuple[int, dict[str, Any]]] = deque()

    def next(self, timeout: float, what: str) -> tuple[int, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while not self._ready:
            for key, channel in self._channels.items():  # read together with an earlier message
                self._ready.extend((key, message) for message in channel.pending())
            if self._ready:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeoutError(f"no message within {timeout:g} s while {what}")
            for key, _ in self._selector.select(remaining):
                self._ready.extend((key.data, message) for message in key.fileobj.read_ready())  # type: ignore[union-attr]
        return self._ready.popleft()

    def take_queued(self, key: int) -> list[dict[str, Any]]:
        """The messages of channel ``key`` already read here and not handed out yet (the channel
        itself no longer has them): for a caller that goes on reading that channel directly."""
        mine = [message for k, message in self._ready if k == key]
        self._ready = deque((k, message) for k, message in self._ready if k != key)
        return mine

    def close(self) -> None:
        self._selector.close()


def check_masks(masks: Any, buckets: int, ranks: Iterable[int] | None = None) -> list[int]:
    """The writers of every bucket, as rank 0 sent them: one integer per bucket (0 for a bucket of
    empty tensors only), naming only ``ranks`` if given (those a worker can hear from)."""
    if not isinstance(masks, list) or len(masks) != buckets or not all(type(m) is int and m >= 0 for m in masks):
        raise TransferError(f"protocol violation: expected the writers of {buckets} buckets, got {str(masks)[:200]}")
    if ranks is not None:
        known = sum(1 << rank for rank in ranks)
        if any(m & ~known for m in masks):
            raise TransferError(f"protocol violation: a bucket written by a trainer rank this worker has no link "
                                f"to (it has links to {sorted(ranks_in(known))})")
    return masks

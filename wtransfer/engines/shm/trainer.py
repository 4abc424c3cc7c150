"""The trainer side of ``shm``: rank 0 owns the ring and the staged segment, admits workers and other trainer ranks,
and drives each round (see :mod:`wtransfer.engines.shm`)."""

from __future__ import annotations

import logging
import os
import secrets
import select
import selectors
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wtransfer.engines.channel.control import MAX_FRAME, STRANGER_FRAME, ControlChannel, Listener, PeerClosedError
from wtransfer.engines.channel.protocol import MIB, PROTOCOL_VERSION, ManifestRejected
from wtransfer.engines.rounds.manifest import Manifest
from wtransfer.engines.rounds.packing import Bucket, Piece, readable_as_is, typed_view
from wtransfer.engines.rounds.shards import writes_shards_as_is
from wtransfer.engines.rounds.staging import SharedSegment, create_memfd, read_only_fd
from wtransfer.engines.shm.ring import SharedMemorySender, SharedRing, send_best_effort
from wtransfer.engines.shm.round import TrainerRound
from wtransfer.engines.trainer.client import ClientCall
from wtransfer.engines.trainer.engine import TrainerWeightTransferEngine
from wtransfer.engines.trainer.options import TrainerInitOptions
from wtransfer.errors import TransferError, TransferTimeoutError
from wtransfer.options import option

logger = logging.getLogger("wtransfer")


def _within(tensor: Any, start: int, size: int) -> bool:
    """Whether ``tensor``'s memory begins in the ``size`` bytes at address ``start``."""
    return start <= tensor.data_ptr() < start + size


def _return_freed_memory() -> None:
    """Best effort: glibc keeps freed heap pages (small and mid-sized tensors) in the process; hand them back to
    the system now, so the trainer's memory shrinks by the copy it no longer holds."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _owns_storage(tensor: Any) -> bool:
    """Whether ``tensor`` is the whole of its storage: rebinding a view (a flat buffer's slice, a tensor sharing its
    storage) would cut it off from what else uses that storage. Pinned memory keeps its pinning."""
    return (tensor._base is None and tensor.storage_offset() == 0 and not tensor.is_pinned()
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


@dataclass(eq=False)  # one copy is itself only: removed from a list by identity
class _SharedCopy:
    """``share_source``: a staged segment the source's tensors were moved into. The trainer never unmaps it; its
    mapping goes with its last view."""

    layout: tuple[Any, ...]  # the round's entries, in order: the segment is reused only for the same layout
    start: int  # the segment's address and size
    size: int
    mapping: Any  # a weak reference to the segment's mapping (gone with the last tensor viewing it)
    tensors: list[Any] = field(default_factory=list)  # weak references to the tensors moved in, wherever they went

    def holds(self, tensor: Any) -> bool:
        """Whether ``tensor`` views this copy, while it is still mapped."""
        return self.mapping() is not None and _within(tensor, self.start, self.size)


@dataclass(frozen=True)
class SharedMemoryInitOptions(TrainerInitOptions):
    """Trainer ``init_info`` of ``shm``: a small ring (16 MiB) that stays in the last-level cache, so workers
    read what the trainer just wrote without both copies competing for DRAM bandwidth. Staged rounds use
    no ring: ``bucket_bytes`` and ``num_buffers`` apply to streaming and delta rounds.
    """

    bucket_bytes: int = option(4 * MIB)
    num_buffers: int = option(4)
    share_source: bool = option(False, doc=(
        "after the first atomic round, the source module's CPU tensors that travel as they are (no cast, each "
        "its own storage) live in the node's staged copy and train there: later rounds copy nothing on the "
        "trainer, which frees its own copy (an unsharded trainer with a plain ModuleSource; do not update the "
        "model while send_weights() runs)"))


class SharedMemoryTrainer(TrainerWeightTransferEngine):
    """Trainer side of ``shm``: owns the control socket and the ring or the staged segment."""

    backend = "shm"
    init_options_cls = SharedMemoryInitOptions
    sender_cls = SharedMemorySender  # a sharded trainer's other ranks write their own shards into the segment

    @property
    def uses_ring(self) -> bool:
        """Streaming rounds of one sender, and delta rounds, go through the ring; the rest are staged whole."""
        return self.delta is not None or self._streams

    @property
    def _streams(self) -> bool:
        return self.commit == "streaming" and not self.parallel_senders

    @property
    def stages_dense_rounds(self) -> bool:
        """Dense rounds are staged whole: atomic ones, also those ``delta="auto"`` chooses (its deltas use the ring)."""
        return not self._streams and (self.delta is None or self.delta_choice is not None)

    def prepare_workers(self) -> dict[str, Any]:
        self._listener: Listener | None = Listener(f"wtransfer-shm-{os.getpid()}-{secrets.token_hex(8)}")
        self._channels: dict[int, ControlChannel] = {}
        self._token = secrets.token_hex(16)
        self._ring: SharedRing | None = None
        self._ring_fd: int | None = None  # read-only, for the workers; closed once they all mapped it
        if self.uses_ring:
            fd = create_memfd(self.bucket_bytes * self.num_buffers, "wtransfer-shm")
            self._ring = SharedRing(fd, self.bucket_bytes, self.num_buffers)  # takes fd
            self._ring_fd = read_only_fd(fd)
        self._segment: SharedSegment | None = None
        self._shared: _SharedCopy | None = None  # share_source: _segment, once the source's tensors live there
        # every shared copy still mapped, _shared included: kept across reconnect(), where the source's tensors stay
        # in the last one and the next round moves them into the new segment
        self._copies: list[_SharedCopy] = getattr(self, "_copies", [])
        self._handed: dict[int, int] = {}  # peer (worker rank; -trainer rank) -> inode of the segment it maps
        self._selector = selectors.DefaultSelector()
        self._senders: dict[int, ControlChannel] = {}  # the other trainer ranks (parallel senders)
        self._announced = {"world_size": self.world_size, "bucket_bytes": self.bucket_bytes,
                           "num_buffers": self.num_buffers}
        return {
            "address": self._listener.address,
            "token": self._token,
            **self._announced,
            "rank_offset": 1,
            "timeout_s": self.timeout_s,
            "protocol_version": PROTOCOL_VERSION,
        }

    @property
    def shared_tensors(self) -> int:
        """``share_source``: how many of the source's tensors were moved into the current staged copy."""
        shared = getattr(self, "_shared", None)
        return len(shared.tensors) if shared is not None else 0

    @property
    def staged_bytes(self) -> int:
        """The staged segment's size (0 for a ring trainer): the node's one host copy of a round."""
        segment = getattr(self, "_segment", None)
        return segment.size if segment is not None else 0

    def connected(self) -> None:
        """A staged trainer allocates its pre-faulted segment now, so no round pays page faults (a source
        that cannot list its tensors before its first round gets it then)."""
        size = self.whole_round_bytes() if self.stages_dense_rounds else None
        if size is not None:
            self._segment_for(size)

    def _share_source(self, manifest: Manifest, pieces: list[Piece], segment: SharedSegment) -> None:
        """``share_source``: the module's tensors just written into ``segment`` become views of it, so the next
        rounds find them in place (``Packer.pack_staged`` copies nothing there). Only tensors that travel as the
        module holds them (same dtype and shape, contiguous, on the CPU) move; the others are copied each round."""
        if not writes_shards_as_is(self.source) or self.sharded:
            return  # a subclass may yield other values than the tensors it holds: those must not be rebound
        import torch

        entries = {entry.name: (piece, entry) for piece, entry in zip(pieces, manifest.entries)}
        cpu = torch.device("cpu")
        rebound = 0
        # before any rebinding: this segment is never unmapped now
        copy = _SharedCopy(tuple(manifest.entries), segment.data.data_ptr(), segment.size, weakref.ref(segment._map))
        self._copies = [earlier for earlier in self._copies  # one record per mapping: rounds reuse the segment
                        if earlier.mapping() is not None and earlier.mapping() is not segment._map] + [copy]
        self._shared = copy
        with torch.no_grad():
            for name, tensor in self.source.named_tensors():
                piece, entry = entries.get(name, (None, None))
                if entry is None or not piece.length or getattr(tensor, "placements", None) is not None \
                        or tuple(tensor.shape) != tuple(entry.shape) or not readable_as_is(tensor, entry, cpu):
                    continue
                view = typed_view(segment.data, piece, entry)
                if tensor.data_ptr() != view.data_ptr():
                    if not _owns_storage(tensor) and not any(shared.holds(tensor) for shared in self._copies):
                        continue  # a view of someone's buffer; one of a shared copy moves on
                    tensor.data = view  # the same values: the round just wrote them there
                    rebound += 1
                copy.tensors.append(weakref.ref(tensor))
        if rebound:
            _return_freed_memory()  # the module's own copy of those tensors is free now

    def _source_in_place(self, entries: list[Any], pieces: list[Piece]) -> bool:
        """Whether every source tensor that lives in the shared segment is at its own place there. One that moved
        (parameters swapped, ``.data`` reassigned) would be written over by another tensor's bytes."""
        shared = self._shared
        assert shared is not None
        at = {entry.name: shared.start + piece.offset for entry, piece in zip(entries, pieces)}
        return all(tensor.data_ptr() == at.get(name) and tensor.is_contiguous()
                   for name, tensor in self.source.named_tensors() if _within(tensor, shared.start, shared.size))

    def round_failed(self) -> None:
        """``share_source``: the tensors moved into the staged copy go back to the trainer's own memory (those the
        module holds now, and those it held, wherever they went since), and the next round gets a fresh segment: a
        worker whose commit outlived the failed round may still read this one while the model trains on."""
        segment, copy = self._segment, self._shared
        if copy is None or segment is None:
            return
        import torch

        shared = [tensor for ref in copy.tensors if (tensor := ref()) is not None]
        shared += [tensor for _, tensor in self.source.named_tensors()]
        self._segment, self._shared = None, None  # never reused
        self._copies.remove(copy)
        try:
            with torch.no_grad():
                for tensor in shared:
                    if _within(tensor, copy.start, copy.size):
                        tensor.data = tensor.data.clone()
        finally:
            segment.close(release=False)

    def _segment_for(self, size: int, entries: list[Any] | None = None,
                     pieces: list[Piece] | None = None) -> SharedSegment:
        """The staged round's segment, at least ``size`` bytes (reused; replaced when too small). With
        ``share_source``, a segment holding the module's tensors is reused only for the same layout (``entries``
        at ``pieces``): another layout would write other tensors over them."""
        if self._shared is not None and entries is not None and pieces is not None \
                and self._segment is not None and (
                    tuple(entries) != self._shared.layout or not self._source_in_place(entries, pieces)):
            self._segment.close(release=False)  # the module's tensors keep its pages; they are copied from now on
            self._segment, self._shared = None, None
        if self._segment is None or self._segment.size < size:
            if self._segment is not None:
                self._segment.close(release=self._shared is None)
                self._segment, self._shared = None, None
            self._segment = SharedSegment.create(size)
            logger.debug("shm trainer: %d-byte staged segment", size)
        return self._segment

    def _segment_fds(self, peer: int, writable: bool) -> list[int]:
        """The segment's descriptor for ``peer`` if it does not map this one yet (read-only for a worker)."""
        assert self._segment is not None
        if self._handed.get(peer) == self._segment.inode:
            return []
        self._handed[peer] = self._segment.inode
        return [os.dup(self._segment.fd) if writable else read_only_fd(self._segment.fd)]

    # -- rendezvous ------------------------------------------------------------------------
    def wait_for_workers(self, call: ClientCall) -> None:
        assert self._listener is not None
        pending: dict[int, ControlChannel] = {}  # fileno -> channel not yet identified
        ready: set[int] = set()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        deadline = time.monotonic() + self.timeout_s
        try:
            while len(ready) < self.num_workers:
                call.raise_if_failed()
                self.check_shortfall(call, ready)
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, self.world_size)) - ready)
                    raise TransferTimeoutError(
                        f"shm rendezvous: worker rank(s) {missing} did not join within {self.timeout_s:g} s"
                    )
                for key, _ in self._selector.select(0.05):
                    if key.fileobj is self._listener:
                        conn = self._listener.accept()  # None: another user's process, refused
                        if conn is not None:
                            channel = ControlChannel(conn, "an unidentified shm peer", max_frame=STRANGER_FRAME)
                            pending[channel.fileno()] = channel
                            self._selector.register(channel, selectors.EVENT_READ, None)
                        continue
                    channel = key.fileobj  # type: ignore[assignment]
                    try:
                        messages = channel.read_ready()
                    except TransferError as exc:  # closed, or garbage
                        if channel in self._channels.values():
                            raise
                        self._drop(channel, pending, None if isinstance(exc, PeerClosedError) else str(exc))
                        continue
                    for message in messages:
                        problem = self._handshake(channel, message, pending, ready)
                        if problem is not None:
                            self._drop(channel, pending, problem)
                            break
        finally:
            for key in list(self._selector.get_map().values()):
                self._selector.unregister(key.fileobj)
            for channel in pending.values():
                channel.close()
        for rank, channel in self._channels.items():  # from now on, events carry the rank
            self._selector.register(channel, selectors.EVENT_READ, rank)
        if self._ring_fd is not None:  # every worker maps the ring now
            os.close(self._ring_fd)
            self._ring_fd = None
        if not self.parallel_senders:  # no one else joins
            self._close_listener()

    def _drop(self, channel: ControlChannel, pending: dict[int, ControlChannel], problem: str | None) -> None:
        """An unidentified peer leaves the rendezvous (logged when it misbehaved); the round goes on."""
        if problem is not None:
            logger.warning("shm rendezvous: dropped a connection that is not one of this round's workers: %s", problem)
        self._selector.unregister(channel)
        pending.pop(channel.fileno(), None)
        channel.close()

    def _handshake(
        self, channel: ControlChannel, message: dict[str, Any], pending: dict[int, ControlChannel], ready: set[int]
    ) -> str | None:
        """Take one rendezvous message; returns a problem to drop an unidentified peer (which never aborts)."""
        op = message.get("op")
        if op == "hello":
            rank = message.get("rank")
            problem = None
            if message.get("token") != self._token:
                problem = "wrong token (init_info from another trainer?)"
            elif message.get("protocol_version") != PROTOCOL_VERSION:
                problem = f"protocol {message.get('protocol_version')!r} != {PROTOCOL_VERSION}"
            elif not isinstance(rank, int) or not 0 < rank < self.world_size:
                problem = f"rank {rank!r} outside 1..{self.world_size - 1}"
            elif rank in self._channels:
                problem = f"rank {rank} joined twice; check every worker's ParallelConfig"
            if problem is not None:
                send_best_effort(channel, {"ok": False, "error": problem})  # a misconfigured worker learns why
                return problem
            channel.peer = f"shm worker rank {rank}"
            channel.max_frame = MAX_FRAME
            ring = [self._ring_fd] if self._ring_fd is not None else []
            channel.send({"ok": True, "ring": bool(ring), "wire": self._announced}, fds=ring, timeout=self.timeout_s)
            pending.pop(channel.fileno())
            self._channels[rank] = channel
        elif op == "refused" and channel in self._channels.values():
            raise TransferError(f"{channel.peer} refused to join: {str(message.get('error'))[:2000]}")
        elif op == "ready" and channel in self._channels.values():
            rank = next(r for r, c in self._channels.items() if c is channel)
            self.served_answers[rank], self.held_answers[rank] = message.get("served_dtypes"), message.get("holds")
            ready.add(rank)
        elif channel in self._channels.values():
            raise TransferError(f"unexpected message from {channel.peer} during shm rendezvous: {str(message)[:200]}")
        else:
            return f"unexpected message {str(message)[:200]}"
        return None

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # -- the other trainer ranks of a sharded trainer ----------------------------------------------
    def open_senders(self) -> dict[str, Any]:
        assert self._listener is not None
        self._sender_token = secrets.token_hex(16)
        return {"address": self._listener.address, "token": self._sender_token, "protocol_version": PROTOCOL_VERSION}

    def wait_for_senders(self, ranks: list[int]) -> None:
        """Every other trainer rank joins; it writes its own shards into the staged segment from now on."""
        assert self._listener is not None
        deadline = time.monotonic() + self.timeout_s
        try:
            while len(self._senders) < len(ranks):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(ranks) - set(self._senders))
                    raise TransferTimeoutError(f"shm trainer: trainer rank(s) {missing} did not join within "
                                               f"{self.timeout_s:g} s")
                readable, _, _ = select.select([self._listener], [], [], min(remaining, 0.5))
                if not readable:
                    continue
                conn = self._listener.accept()  # None: another user's process, refused
                if conn is None:
                    continue
                channel = ControlChannel(conn, "an unidentified trainer rank", max_frame=STRANGER_FRAME)
                try:
                    hello = channel.recv(min(max(deadline - time.monotonic(), 0.1), 5.0))
                except TransferError as exc:
                    logger.warning("shm trainer: dropped a connection that did not say hello: %s", exc)
                    channel.close()
                    continue
                if hello.get("token") != self._sender_token:  # not one of ours: it cannot fail the connect
                    logger.warning("shm trainer: dropped a connection without this trainer's sender token")
                    channel.close()
                    continue
                channel.max_frame = MAX_FRAME
                try:
                    rank = hello.get("rank")
                    if hello.get("error"):
                        raise TransferError(f"trainer rank {rank} cannot write its shards: {hello['error']}")
                    if hello.get("op") != "sender":
                        raise TransferError(f"trainer rank {rank!r} sent {hello.get('op')!r} instead of 'sender'")
                    if rank not in ranks or rank in self._senders:
                        raise TransferError(f"trainer rank {rank!r} is not expected (or joined twice)")
                    channel.peer = f"trainer rank {rank}"
                    channel.send({"ok": True}, timeout=self.timeout_s)
                    if channel.recv(max(deadline - time.monotonic(), 0.1)).get("op") != "ready":
                        raise TransferError(f"trainer rank {rank} could not join")
                except BaseException as exc:
                    send_best_effort(channel, {"ok": False, "error": str(exc)})
                    channel.close()
                    raise
                self._senders[rank] = channel
        finally:
            self._close_listener()
        for rank, channel in self._senders.items():
            self._selector.register(channel, selectors.EVENT_READ, -rank)  # negative: a trainer rank

    # -- one round ----------------------------------------------------------------------------
    def send_round(self, manifest: Manifest, buckets: list[Bucket], call: ClientCall) -> None:
        try:
            TrainerRound(self, manifest, call).run(buckets)
        except ManifestRejected:
            raise  # the workers that accepted were already told
        except BaseException as exc:
            self._abort(f"{type(exc).__name__}: {exc}")
            raise

    def tell_workers(self, message: dict[str, Any], version: int, fds: Callable[[int], list[int]] | None = None) -> None:
        """Send ``message`` to every worker (with ``fds(rank)``, if given); one that died fails the round."""
        self._tell(self._channels, self._json(message), fds, "shm worker rank", f"round {version}")

    def tell_bucket(self, index: int, slot: int, version: int) -> None:
        """Tell every worker that bucket ``index`` of round ``version`` is in ring buffer ``slot`` (a binary word:
        it goes once per bucket)."""
        def word(channel: ControlChannel, _fds: list[int]) -> None:
            channel.send_word("bucket", index, slot, timeout=self.timeout_s)

        self._tell(self._channels, word, None, "shm worker rank", f"round {version}")

    def tell_senders(self, message: dict[str, Any], fds: Callable[[int], list[int]] | None = None) -> None:
        """Send ``message`` to the other trainer ranks (it names this attempt: a sender skips stale ones)."""
        message["attempt"] = self._attempt
        self._tell(self._senders, self._json(message), fds, "trainer rank", "the round")

    def _json(self, message: dict[str, Any]) -> Callable[[ControlChannel, list[int]], None]:
        """A send of ``message`` as a JSON frame, with the descriptors handed to it."""
        def send(channel: ControlChannel, handed: list[int]) -> None:
            channel.send(message, fds=handed, timeout=self.timeout_s)

        return send

    def _tell(self, peers: dict[int, ControlChannel], send: Callable[[ControlChannel, list[int]], None],
              fds: Callable[[int], list[int]] | None, who: str, during: str) -> None:
        """``send(channel, descriptors)`` to every peer, with ``fds(rank)`` (closed here once sent)."""
        for rank, channel in peers.items():
            handed = fds(rank) if fds is not None else []
            try:
                send(channel, handed)
            except PeerClosedError as exc:
                raise TransferError(f"{who} {rank} died during {during}: {exc}") from exc
            finally:
                for fd in handed:  # the peer has its own copy now
                    os.close(fd)

    def stop_senders(self, reason: str) -> None:
        """Best effort: the other trainer ranks drop this round."""
        for channel in self._senders.values():
            send_best_effort(channel, {"op": "abort", "reason": reason, "attempt": self._attempt})

    def _abort(self, reason: str, only: list[int] | None = None, clean: bool = False) -> None:
        """Best effort: tell the other trainer ranks, then live workers, to drop the round. ``clean``: no
        byte moved (a rejection), so workers stay connected for the next round."""
        self.stop_senders(reason)
        for rank, channel in self._channels.items():
            if only is None or rank in only:
                send_best_effort(channel, {"op": "abort", "reason": reason, "clean": clean})

    def release(self) -> None:
        for channel in [*getattr(self, "_channels", {}).values(), *getattr(self, "_senders", {}).values()]:
            channel.close()
        self._channels, self._senders = {}, {}
        if getattr(self, "_listener", None) is not None:
            self._close_listener()
        if getattr(self, "_ring_fd", None) is not None:
            os.close(self._ring_fd)  # type: ignore[arg-type]
            self._ring_fd = None
        if getattr(self, "_ring", None) is not None:
            self._ring.close()
            self._ring = None
        if getattr(self, "_segment", None) is not None:  # the source's tensors may live there (share_source)
            self._segment.close(release=getattr(self, "_shared", None) is None)
            self._segment = None
        self._handed = {}
        if getattr(self, "_selector", None) is not None:
            self._selector.close()
            self._selector = None

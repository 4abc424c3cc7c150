"""One round on ``shm``'s rank 0 (:class:`TrainerRound`): the workers' verdicts on the manifest, the bytes (staged
whole in the node's segment, or bucket by bucket through the ring), then every worker's ``loaded``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from wtransfer.engines.channel.control import PeerClosedError
from wtransfer.engines.channel.protocol import ManifestRejected
from wtransfer.engines.rounds.digests import round_digests
from wtransfer.engines.rounds.manifest import Manifest
from wtransfer.engines.rounds.packing import Bucket, Packer, Piece, host_bytes
from wtransfer.engines.rounds.part_streams import RankLayout, check_tiling, layout_rows
from wtransfer.engines.rounds.shards import entries_digest, rank_parts, write_part
from wtransfer.engines.rounds.staging import SharedSegment, staging_offsets
from wtransfer.engines.trainer.client import ClientCall
from wtransfer.errors import TransferError, TransferTimeoutError


def segment_pieces(manifest: Manifest) -> tuple[list[Piece], int]:
    """Every tensor of a staged round as one piece at its offset in the segment (``staging_offsets``), and the
    segment's size."""
    offsets, size = staging_offsets(manifest.entries)
    return [Piece(index, 0, offset, entry.nbytes, True)
            for index, (entry, offset) in enumerate(zip(manifest.entries, offsets))], size


class TrainerRound:
    """One round on rank 0: the workers' verdicts, the bytes (staged or ring), every worker's ``loaded``."""

    def __init__(self, trainer: Any, manifest: Manifest, call: ClientCall) -> None:
        """``trainer``: the :class:`~wtransfer.engines.shm.trainer.SharedMemoryTrainer` (not imported here: that
        module imports this one)."""
        self.trainer, self.manifest, self.call = trainer, manifest, call
        self.answers: dict[int, str | None] = {}  # worker rank -> None (accepted) or the rejection
        self.loaded: set[int] = set()
        self.released: list[set[int]] = []  # ring: the workers still reading each buffer
        self.slot_of: dict[int, int] = {}
        self.layouts: dict[int, RankLayout] = {}  # sharded: trainer rank -> what it holds of every tensor
        self.written: set[int] = set()  # sharded: the other ranks that wrote their shards
        self.progress = 0  # sharded: words from ranks still writing

    def handle(self, rank: int, message: dict[str, Any]) -> None:
        op, version = message.get("op"), self.manifest.version
        if rank < 0:  # another trainer rank
            if message.get("attempt") != self.trainer._attempt:
                return  # left over from an earlier round that ended before this rank's answer was read
            if op == "layout" and isinstance(message.get("rows"), list):
                if len(message["rows"]) != 3 * len(self.manifest.entries):
                    raise TransferError(f"trainer rank {-rank} sent a layout of {len(message['rows'])} words for "
                                        f"{len(self.manifest.entries)} tensors")
                self.layouts[-rank] = RankLayout(self.manifest.entries, [int(word) for word in message["rows"]])
            elif op == "written":
                self.written.add(-rank)
            elif op == "progress":  # the workers wait for the staged round too: they hear it goes on
                self.progress += 1
                self.trainer.tell_workers({"op": "progress"}, self.manifest.version)
            elif op == "fail":
                raise TransferError(f"trainer rank {-rank} failed writing its shards of round {version}: "
                                    f"{message.get('error')}")
            else:
                raise TransferError(f"unexpected message from trainer rank {-rank}: {message!r}")
        elif op == "accept":
            self.answers[rank] = None
        elif op == "reject":
            self.answers[rank] = str(message.get("error"))
        elif op == "release" and message.get("index") in self.slot_of:
            self.released[self.slot_of[message["index"]]].discard(rank)
        elif op == "loaded":
            self.loaded.add(rank)
        elif op == "fail":
            raise TransferError(f"shm worker rank {rank} failed round {version}: {message.get('error')}")
        else:
            raise TransferError(f"unexpected message from shm worker rank {rank}: {message!r}")

    def pump(self, done: Callable[[], bool], what: str) -> None:
        """Dispatch the peers' messages until ``done()``; bounded by ``timeout_s`` since the last change of
        ``progress``, aborted by client failure."""
        trainer = self.trainer
        deadline, seen = time.monotonic() + trainer.timeout_s, self.progress
        for rank, channel in [*trainer._channels.items(), *((-r, c) for r, c in trainer._senders.items())]:
            for message in channel.pending():  # messages that arrived together with earlier ones
                self.handle(rank, message)
        while not done():
            if self.call.error is not None:
                # A worker answers before it raises, so its message is here already: it may end the wait cleanly.
                self._dispatch(0.0, what)
                if done():
                    return
                self.call.raise_if_failed()
            if self.progress != seen:
                seen, deadline = self.progress, time.monotonic() + trainer.timeout_s
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeoutError(f"shm trainer: {what} took longer than {trainer.timeout_s:g} s")
            self._dispatch(min(remaining, 0.05), what)

    def _dispatch(self, wait: float, what: str) -> None:
        """Handle every message that arrives within ``wait`` seconds (0: only those already here)."""
        for key, _ in self.trainer._selector.select(wait):
            rank = key.data
            try:
                messages = key.fileobj.read_ready()  # type: ignore[union-attr]
            except PeerClosedError as exc:
                peer = f"shm worker rank {rank}" if rank > 0 else f"trainer rank {-rank}"
                raise TransferError(f"{peer} died or disconnected while {what}: {exc}") from exc
            for message in messages:
                self.handle(rank, message)

    def run(self, buckets: list[Bucket]) -> None:
        trainer, manifest = self.trainer, self.manifest
        senders = trainer._senders
        if senders:  # they plan the round while the workers check the manifest
            trainer.tell_senders({"op": "round", "digest": entries_digest(manifest.entries)})
        with trainer.phases("wait"):
            self.pump(lambda: len(self.answers) == trainer.num_workers, "waiting for workers to accept the manifest")
        rejected = {rank: reason for rank, reason in self.answers.items() if reason is not None}
        if rejected:
            reasons = "; ".join(f"rank {rank}: {reason}" for rank, reason in sorted(rejected.items()))
            trainer._abort(f"a worker rejected the manifest ({reasons})",
                           only=[r for r in self.answers if r not in rejected], clean=True)
            raise ManifestRejected(f"round {manifest.version} rejected: {reasons}")
        if manifest.delta is not None or not trainer.stages_dense_rounds:
            self._through_ring(buckets)
        else:
            self._staged()
        with trainer.phases("wait"):
            self.pump(lambda: len(self.loaded) == trainer.num_workers, "waiting for workers to load the round")

    def _staged(self) -> None:
        """Write the whole round into the segment (each trainer rank its own shards), then hand it over."""
        trainer, manifest = self.trainer, self.manifest
        pieces, size = segment_pieces(manifest)
        segment = trainer._segment_for(size, manifest.entries, pieces)
        with round_digests(len(manifest.entries), manifest.digests) as digests:
            if trainer._senders:
                self._write_sharded(segment, pieces)
                if digests is not None:  # the ranks wrote disjoint parts: the round is hashed once whole
                    digests.update_pieces(pieces, segment.data)
            else:
                packer = Packer(manifest, iter(trainer.source), digests, trainer.source_entries)
                told = [time.monotonic()]

                def tick() -> None:  # a write longer than timeout_s / 4: the workers hear it goes on
                    if time.monotonic() - told[0] > trainer.timeout_s / 4:
                        trainer.tell_workers({"op": "progress"}, manifest.version)
                        told[0] = time.monotonic()

                with trainer.phases("pack"):
                    packer.pack_staged(pieces, segment.data, tick=tick)
                    packer.drain()
                if trainer.init_options.share_source:
                    trainer._share_source(manifest, pieces, segment)
            values = digests.digests() if digests is not None else None
        trainer.tell_workers({"op": "staged", "size": segment.size, "digests": values}, manifest.version,
                             fds=lambda rank: trainer._segment_fds(rank, writable=False))

    def _write_sharded(self, segment: SharedSegment, pieces: list[Piece]) -> None:
        """Every trainer rank writes its parts into the segment, once they are checked to tile the round."""
        trainer, manifest = self.trainer, self.manifest
        parts = rank_parts(trainer.source.named_tensors(), 0, manifest.entries)  # type: ignore[attr-defined]
        self.layouts[0] = RankLayout(manifest.entries, layout_rows(parts))
        with trainer.phases("wait"):
            self.pump(lambda: len(self.layouts) == 1 + len(trainer._senders),
                      "waiting for the other trainer ranks' layouts")
        try:
            check_tiling([self.layouts[rank] for rank in sorted(self.layouts)])
        except TransferError as exc:
            raise TransferError(f"the trainer ranks' shards do not tile the round: {exc}; every rank must "
                                f"shard the same model the same way (device mesh, placements)") from exc
        trainer.tell_senders({"op": "go", "size": segment.size},
                             fds=lambda rank: trainer._segment_fds(-rank, writable=True))
        with trainer.phases("pack"):
            for piece, part in zip(pieces, parts):
                if part is not None and piece.length:
                    write_part(segment.data[piece.offset : piece.offset + piece.length], 0, part)
        with trainer.phases("wait"):
            self.pump(lambda: len(self.written) == len(trainer._senders), "waiting for the other trainer ranks' shards")

    def _through_ring(self, buckets: list[Bucket]) -> None:
        """Pack bucket after bucket into the ring's buffers, each once every worker released it."""
        trainer, manifest = self.trainer, self.manifest
        ring = trainer._ring
        assert ring is not None
        self.released = [set() for _ in ring.slots]
        with round_digests(len(manifest.entries), manifest.digests) as digests:
            if not buckets:  # the workers wait for a word either way: a call-off, or this
                trainer.tell_workers({"op": "empty"}, manifest.version)
            packer = Packer(manifest, iter(trainer.source), digests, trainer.source_entries)
            outs = [host_bytes(slot) for slot in ring.slots]
            for bucket in buckets:
                slot = bucket.index % len(ring.slots)
                if self.released[slot]:
                    with trainer.phases("wait"):
                        self.pump(lambda: not self.released[slot], f"waiting for workers to release buffer {slot}")
                self.slot_of[bucket.index] = slot
                if digests is not None:
                    digests.fence(slot)  # the bucket this buffer held last is hashed
                with trainer.phases("pack"):
                    packer.pack(bucket, ring.slots[slot], slot, outs[slot])
                self.released[slot] = set(trainer._channels)
                trainer.tell_bucket(bucket.index, slot, manifest.version)
            with trainer.phases("pack"):
                packer.drain()
            if digests is not None:  # the workers compare them with their own before the round can commit
                trainer.tell_workers({"op": "digests", "values": digests.digests()}, manifest.version)

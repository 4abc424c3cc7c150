"""The worker side of ``shm``: joins the trainer's socket, maps its memory read-only, loads or adopts each round."""


from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from wtransfer.engines.channel.control import ControlChannel, PeerClosedError
from wtransfer.engines.channel.protocol import (
    PROTOCOL_VERSION,
    RoundCalledOff,
    check_announced,
    check_wire_info,
    gc_paused,
)
from wtransfer.engines.rounds.commit import adopt_staged
from wtransfer.engines.rounds.digests import RoundDigests, check, round_digests
from wtransfer.engines.rounds.manifest import Manifest
from wtransfer.engines.rounds.packing import Unpacker, host_bytes, plan_buckets, tensor_bytes
from wtransfer.engines.rounds.staging import SharedSegment
from wtransfer.engines.shm.ring import SharedRing, TrainerAborted, join_trainer, send_best_effort
from wtransfer.engines.shm.trainer import SharedMemoryTrainer
from wtransfer.engines.worker.base import LoadWeights, WeightTransferEngine, WeightTransferInitInfo
from wtransfer.engines.worker.helpers import (
    BufferBudgetOptions,
    ManifestUpdateInfo,
    check_buffer_budget,
    global_rank,
)
from wtransfer.errors import ManifestMismatchError, TransferError

logger = logging.getLogger("wtransfer")


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """What a worker needs to join: the trainer's socket, its secret and the wire parameters."""

    address: str
    token: str
    world_size: int
    bucket_bytes: int
    num_buffers: int
    rank_offset: int = 1
    timeout_s: float = 300.0
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        owner = "SharedMemoryInitInfo"
        check_wire_info(owner, self)
        if not isinstance(self.address, str) or not self.address:
            raise ValueError(f"{owner}: 'address' must be a non-empty string, got {self.address!r}")
        if not isinstance(self.token, str) or not self.token:
            raise ValueError(f"{owner}: 'token' must be a non-empty string")


ANNOUNCED = ("world_size", "bucket_bytes", "num_buffers")
"""The init info fields a worker checks against what its trainer announced when it joined."""


class SharedMemoryWeightTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, ManifestUpdateInfo]):
    """Worker side of ``shm``: maps the trainer's memory read-only and loads (or adopts) rounds from it.
    Options: ``max_buffer_bytes`` refuses larger rings at init."""

    options_cls = BufferBudgetOptions
    init_info_cls = SharedMemoryInitInfo
    update_info_cls = ManifestUpdateInfo
    trainer_cls = SharedMemoryTrainer

    def __init__(self, config: Any, parallel_config: Any = None) -> None:
        super().__init__(config, parallel_config)
        self._channel: ControlChannel | None = None
        self._ring: SharedRing | None = None
        self._staged: SharedSegment | None = None  # the trainer's staged round, mapped read-only
        self._info: SharedMemoryInitInfo | None = None
        self.rank: int | None = None

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        if self._channel is not None:  # re-joining (a new trainer after a failed round): start clean
            self.shutdown()
        check_buffer_budget(self, init_info.bucket_bytes, init_info.num_buffers)
        self.rank = global_rank(self, init_info.rank_offset, init_info.world_size)
        hello = {"op": "hello", "rank": self.rank, "token": init_info.token, "protocol_version": PROTOCOL_VERSION}
        channel, reply, fds = join_trainer(init_info.address, hello, init_info.timeout_s, f"worker rank {self.rank}")
        try:
            try:
                check_announced(init_info, reply.get("wire"), ANNOUNCED)
            except TransferError as exc:
                send_best_effort(channel, {"op": "refused", "error": str(exc)})  # the trainer says why, not "closed"
                raise
            if reply.get("ring"):
                if len(fds) != 1:
                    raise TransferError(f"expected the ring's descriptor from the shm trainer, got {len(fds)}")
                self._ring = SharedRing(fds.pop(), init_info.bucket_bytes, init_info.num_buffers, writable=False)
            # What it loads comes once the trainer knows it (a served dtype per tensor can be long; a stranger's
            # first frame may not be)
            channel.send({"op": "ready", "holds": self.held_weights(),
                          "served_dtypes": None if self.served_dtypes is None else self.served_dtypes.to_dict()},
                         timeout=init_info.timeout_s)
        except BaseException:
            channel.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        self._channel, self._info = channel, init_info
        logger.debug("shm worker rank %d joined (ring: %s)", self.rank, self._ring is not None)

    def receive_weights(self, update_info: ManifestUpdateInfo, load_weights: LoadWeights) -> None:
        with gc_paused():
            self._receive(update_info, load_weights)

    def _receive(self, update_info: ManifestUpdateInfo, load_weights: LoadWeights) -> None:
        if self._channel is None or self._info is None:
            raise TransferError(
                "receive_weights() without a trainer: call init_transfer_engine() first (again after shutdown() "
                "or after a round failed because the trainer died or aborted)"
            )
        channel, info, manifest = self._channel, self._info, update_info.parsed
        try:
            self.validate_round()
        except ManifestMismatchError as exc:
            channel.send({"op": "reject", "version": manifest.version, "error": str(exc)}, timeout=info.timeout_s)
            raise
        channel.send({"op": "accept", "version": manifest.version}, timeout=info.timeout_s)
        try:
            message = self._next(manifest, info.timeout_s)
            if message.get("op") == "staged":
                verified = self._load_staged(message, manifest, load_weights)
            else:
                verified = self._load_ring(message, manifest, load_weights)
            if verified is not None:  # the round's content, verified here: for whoever names the weights
                update_info.parsed = dataclasses.replace(manifest, checksums=tuple(verified))
            channel.send({"op": "loaded"}, timeout=info.timeout_s)
        except RoundCalledOff:
            raise  # the trainer knows; this worker stays connected for the next round
        except (PeerClosedError, TrainerAborted) as exc:
            # That trainer will never send again: drop its socket and memory now (a mapping keeps it alive). Not
            # shutdown(): the engine is not shut down (the framework would report the round as cut short by one).
            self._leave()
            raise TransferError(f"round {manifest.version} failed on worker rank {self.rank}: {exc}") from exc
        except BaseException as exc:
            # tell the trainer at once instead of letting it wait for the timeout
            send_best_effort(channel, {"op": "fail", "error": f"{type(exc).__name__}: {exc}"})
            raise

    def _next(self, manifest: Manifest, timeout: float) -> dict[str, Any]:
        """The trainer's next word about this round; an abort raises."""
        assert self._channel is not None
        while (message := self._channel.recv(timeout)).get("op") == "progress":
            pass  # a sharded trainer's rank still writes its shards: each word restarts the wait
        if message.get("op") == "abort":
            if message.get("clean"):  # another worker rejected it: nothing moved, the trainer stays usable
                raise RoundCalledOff(f"round {manifest.version} called off before any byte moved: {message.get('reason')}")
            raise TrainerAborted(f"the trainer aborted round {manifest.version}: {message.get('reason')}")
        return message

    def _load_staged(self, message: dict[str, Any], manifest: Manifest, load_weights: LoadWeights) -> list[int] | None:
        """Check the staged round, then adopt it or hand its tensors to ``load_weights``."""
        assert self._channel is not None
        # a new segment comes with the first staged round, or one that had to grow
        self._staged = SharedSegment.handed_over(self._staged, self._channel.take_fds(), int(message["size"]),
                                                 writable=False)
        if self._staged is None:
            raise TransferError("protocol violation: a staged round without the trainer's segment")
        views = self._staged.views(manifest)
        verified = None
        if message.get("digests") is not None:
            with RoundDigests(len(manifest.entries)) as digests:
                for index, view in enumerate(views.values()):
                    digests.update(index, tensor_bytes(view))
                verified = digests.digests()
            check([entry.name for entry in manifest.entries], message["digests"], verified)
        if not adopt_staged(self, load_weights, views):
            load_weights(list(views.items()))
        return verified

    def _load_ring(self, message: dict[str, Any], manifest: Manifest, load_weights: LoadWeights) -> list[int] | None:
        """Bucket after bucket through the ring, each released once loaded."""
        assert self._channel is not None and self._info is not None
        if self._ring is None:
            raise TransferError(f"protocol violation: a ring round from a trainer that gave this worker no ring: {message!r}")
        buckets = plan_buckets(manifest.entries, self._info.bucket_bytes)
        with round_digests(len(manifest.entries), manifest.digests) as digests:
            unpacker = Unpacker(manifest, load_weights, digests)
            raws = [host_bytes(slot) for slot in self._ring.slots]
            if not buckets and message.get("op") != "empty":
                raise TransferError(f"protocol violation: expected the 'empty' word of a round with no bucket, got {message!r}")
            for position, bucket in enumerate(buckets):
                if position:  # the first bucket's word is the one that started the round
                    message = self._next(manifest, self._info.timeout_s)
                if message.get("op") != "bucket" or message.get("index") != bucket.index:
                    raise TransferError(f"protocol violation: expected bucket {bucket.index}, got {message!r}")
                slot = message["slot"]
                unpacker.unpack(bucket, self._ring.slots[slot][: bucket.nbytes], slot, raws[slot])
                if digests is not None:
                    digests.fence(slot)  # hashed before the trainer may write there again
                self._channel.send_word("release", bucket.index, slot, timeout=self._info.timeout_s)
            verified = None
            if digests is not None:
                message = self._next(manifest, self._info.timeout_s)
                if message.get("op") != "digests" or not isinstance(message.get("values"), list):
                    raise TransferError(f"protocol violation: expected the round's digests, got {message!r}")
                verified = digests.digests()
                check([entry.name for entry in manifest.entries], message["values"], verified)
            unpacker.finish()
            return verified

    def shutdown(self) -> None:
        self._leave()

    def _leave(self) -> None:
        """Let go of the trainer: its socket, ring and staged round."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        for memory in (self._ring, self._staged):
            if memory is not None:
                memory.close()
        self._ring = self._staged = None

"""The worker side of a torch.distributed engine (gloo, NCCL): joins the trainer's groups at
``init_transfer_engine``, then votes on, receives and checks every round (see :mod:`wtransfer.engines.torch_distributed.backend`)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any, ClassVar

from wtransfer.engines.channel.protocol import RoundCalledOff, check_announced, gc_paused
from wtransfer.engines.channel.rendezvous import RendezvousClient, local_address_for, store
from wtransfer.engines.rounds.commit import reserve_staging
from wtransfer.engines.rounds.digests import RoundDigests, check, from_words, round_digests
from wtransfer.engines.rounds.manifest import Manifest, staging_key
from wtransfer.engines.rounds.packing import Bucket, Unpacker, plan_buckets
from wtransfer.engines.torch_distributed.backend import DIGESTS, REJECTED, TorchDistributedBackend
from wtransfer.engines.torch_distributed.options import ANNOUNCED, GlooOptions, TorchDistributedInitInfo
from wtransfer.engines.worker.base import LoadWeights, WeightTransferEngine
from wtransfer.engines.worker.helpers import ManifestUpdateInfo, check_buffer_budget, global_rank
from wtransfer.errors import ManifestMismatchError, TransferError

if TYPE_CHECKING:
    import torch

    from wtransfer.engines.rounds.part_streams import RankLayout

logger = logging.getLogger("wtransfer")

MAX_TENSORS = 10_000_000
"""More tensors than this in a sending rank's layout header is not a layout (a worker refuses to size one)."""


class TorchDistributedWeightTransferEngine(
    TorchDistributedBackend, WeightTransferEngine[TorchDistributedInitInfo, ManifestUpdateInfo]
):
    """Worker side: joins the trainer's side group and receives broadcast buckets. Options (:class:`GlooOptions`):
    ``max_buffer_bytes`` refuses larger rings at init; ``local_address`` or ``interface`` pick the gloo address."""

    options_cls: ClassVar[type | None] = GlooOptions
    init_info_cls = TorchDistributedInitInfo
    update_info_cls = ManifestUpdateInfo

    def __init__(self, config: Any, parallel_config: Any = None) -> None:
        super().__init__(config, parallel_config)
        self._groups: list[Any] = []
        self._store: Any = None
        self._kv: Any = None
        self._buffers: list[torch.Tensor] = []
        self._scratch: list[torch.Tensor] = []  # per buffer: parts of several senders, before placing
        self._info: TorchDistributedInitInfo | None = None
        self._broken: str | None = None
        self.rank: int | None = None

    def init_transfer_engine(self, init_info: TorchDistributedInitInfo) -> None:
        from torch.distributed import PrefixStore

        if self._groups:  # re-joining (e.g. after a failed round): start clean
            self.shutdown()
        check_buffer_budget(self, init_info.bucket_bytes, init_info.num_buffers)
        self.rank = global_rank(self, init_info.rank_offset, init_info.world_size)
        address, port = init_info.master_address, init_info.master_port
        self.choose_local_address(self.options, lambda: local_address_for(address, port))
        client = RendezvousClient.connect(address, port, init_info.token, init_info.timeout_s)
        try:
            # keep the Python store referenced: torch calls into it while the groups live
            self._kv = store(client, init_info.timeout_s)
            prefixed = PrefixStore(init_info.group_name, self._kv)
            check_announced(init_info, json.loads(prefixed.get("wire")), ANNOUNCED)
            served = None if self.served_dtypes is None else self.served_dtypes.to_dict()
            prefixed.set(f"joined/{self.rank}", json.dumps({"served_dtypes": served, "holds": self.held_weights()}))
            buffers = self.allocate(init_info.bucket_bytes, init_info.num_buffers)
            groups = self.make_groups(
                prefixed, self.rank, init_info.world_size, init_info.timeout_s, init_info.channels
            )
            # the other trainer ranks of a trainer whose every rank sends: groups of their own
            sender_groups = [
                self.make_groups(PrefixStore(f"sender{sender}/", prefixed), self.rank, init_info.world_size,
                                 init_info.timeout_s, init_info.channels)
                for sender in range(1, init_info.senders)
            ]
        except (RuntimeError, TransferError) as exc:
            client.close()
            self._kv = None
            raise TransferError(
                f"joining the {self.distributed_backend} group at {address}:{port} as rank {self.rank} "
                f"(local address {self.local_interface or self.local_address or 'from GLOO_SOCKET_IFNAME'}) "
                f"failed: {exc}"
            ) from exc
        self._store, self._groups, self._buffers, self._info = client, groups, buffers, init_info
        self._sender_groups = sender_groups
        self._broken = None
        logger.debug("%s worker rank %d joined the group at %s:%d", self.distributed_backend, self.rank, address, port)
        self._prepare_staging(prefixed)

    def _prepare_staging(self, prefixed: Any) -> None:
        """An atomic trainer said how large its rounds are staged: this node's stager makes that copy now,
        every page faulted in, so the first round runs as fast as the next. Best effort: else the first
        round makes it."""
        try:
            if not prefixed.check(["staging"]):  # a streaming trainer's workers stage nothing
                return
            hint = json.loads(prefixed.get("staging"))
            reserve_staging(self, staging_key(hint["key"]), int(hint["bytes"]))
        except Exception as exc:  # a store error, no memory for the copy yet: the first round tries again
            logger.warning("%s worker rank %s: the node's staged copy is made at the first round instead (%s: %s)",
                           self.distributed_backend, self.rank, type(exc).__name__, exc)

    def receive_weights(self, update_info: ManifestUpdateInfo, load_weights: LoadWeights) -> None:
        with gc_paused():
            self._receive(update_info, load_weights)

    def _receive(self, update_info: ManifestUpdateInfo, load_weights: LoadWeights) -> None:
        import torch

        if self._broken is not None:
            raise TransferError(
                f"this worker's {self.distributed_backend} engine is unusable after a failed round "
                f"({self._broken}); call init_transfer_engine() again with a new trainer's init info"
            )
        if not self._groups or self._info is None:
            raise TransferError("receive_weights() before init_transfer_engine() (or after shutdown())")
        info, manifest = self._info, update_info.parsed
        rejection: TransferError | None = None
        try:
            self.validate_round()
        except ManifestMismatchError as exc:
            rejection = exc
        layouts = None
        # the vote's MAX: whether any worker refuses, and (every worker alike) whether the round is hashed
        verdict = torch.tensor([(REJECTED if rejection else 0) | (DIGESTS if manifest.digests else 0)],
                               dtype=torch.int32, device=self.device())
        try:
            if info.senders > 1:
                layouts, problem = self._receive_layouts(manifest)
                if problem is not None and rejection is None:
                    rejection = TransferError(f"round {manifest.version} refused: {problem}")
                    verdict.bitwise_or_(REJECTED)
            self.wait(self.allreduce_max(self._groups[0], verdict), "the manifest vote", info.timeout_s)
            for sender in range(1, info.senders):  # every other sender learns the verdict too
                self.wait(self.allreduce_max(self.group_for(0, sender), verdict), "the manifest vote", info.timeout_s)
        except TransferError as exc:
            self._leave_group(str(exc))
            raise
        if rejection is not None:
            raise rejection
        if int(verdict.item()) & REJECTED:
            raise RoundCalledOff(
                f"round {manifest.version} aborted before any byte moved: another worker rejected the manifest"
            )
        try:
            verified = self._receive_buckets(manifest, load_weights, layouts)
        except BaseException as exc:
            self._leave_group(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"round {manifest.version} failed on worker rank {self.rank}: {exc}") from exc
        if verified is not None:  # the round's content, verified here: for whoever names the weights
            update_info.parsed = dataclasses.replace(manifest, checksums=verified)

    def _leave_group(self, reason: str) -> None:
        """After a failed round: drop the group now so the trainer's pending collectives fail at once."""
        self._close(failed=True)  # nothing outlives the round
        self._broken = reason

    def _receive_layouts(self, manifest: Manifest) -> tuple[list[RankLayout] | None, str | None]:
        """Every sending trainer rank's layout; and why the round cannot go on, if it cannot."""
        import torch

        from wtransfer.engines.rounds.part_streams import HEADER_WORDS, RankLayout, check_tiling, header

        assert self._info is not None
        senders, timeout_s = range(self._info.senders), self._info.timeout_s
        heads = [torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.device()) for _ in senders]
        for sender, work in [(r, self.broadcast(self.group_for(0, r), heads[r])) for r in senders]:
            self.wait(work, f"trainer rank {sender}'s layout", timeout_s)
        counts = [int(head[1]) for head in heads]
        if any(not 0 <= count <= MAX_TENSORS for count in counts):
            raise TransferError(f"trainer ranks announce {counts} tensors: not a wtransfer layout")
        tables = [torch.zeros(3 * count + 1, dtype=torch.int64, device=self.device()) for count in counts]
        for sender, work in [(r, self.broadcast(self.group_for(0, r), tables[r])) for r in senders]:
            self.wait(work, f"trainer rank {sender}'s layout", timeout_s)
        expected = header(manifest.entries)
        for sender, head in enumerate(heads):
            words = head.tolist()
            if words[0] != expected[0]:
                return None, f"trainer rank {sender} speaks protocol {words[0]}, this worker {expected[0]}"
            if words != expected:
                return None, (f"trainer rank {sender} sends another tensor list (names, dtypes or shapes) than "
                              f"the manifest; every trainer rank must pass the same model")
        try:
            layouts = [RankLayout(manifest.entries, table.tolist()) for table in tables]
            check_tiling(layouts)
        except TransferError as exc:
            return None, str(exc)
        return layouts, None

    def _receive_buckets(self, manifest: Manifest, load_weights: LoadWeights,
                         layouts: list[RankLayout] | None = None) -> tuple[int, ...] | None:
        """Receive and unpack every bucket; with digests, verify them and return every tensor's."""
        assert self._info is not None
        buckets = plan_buckets(manifest.entries, self._info.bucket_bytes, self._info.direct_min_bytes)
        senders = 1 if layouts is None else len(layouts)
        # parts: one digest per (sending rank, tensor); else the Unpacker hashes whole tensors
        with round_digests(senders * len(manifest.entries), manifest.digests) as digests:
            unpacker = Unpacker(manifest, load_weights, digests if layouts is None else None)
            works: dict[int, Any] = {}  # bucket -> (work, received in place), or its senders' works
            try:
                if layouts is None:
                    self._receive_into(buckets, unpacker, works, digests)
                else:
                    self._receive_parts(buckets, unpacker, layouts, works, digests)
                self.synchronize(self._info.timeout_s)
                verified = None if digests is None else self._verify_digests(manifest, digests, layouts)
            finally:
                works.clear()  # a failure's traceback must not keep the collectives (and the group) alive
        unpacker.finish()
        return verified

    def _verify_digests(self, manifest: Manifest, digests: RoundDigests,
                        layouts: list[RankLayout] | None) -> tuple[int, ...]:
        """Each sending rank's digests (sent after its data) against ours; every tensor's digest."""
        import torch

        from wtransfer.engines.rounds.digests import combine

        assert self._info is not None
        count, names = len(manifest.entries), [entry.name for entry in manifest.entries]
        sent: list[int] = []
        for sender in range(1 if layouts is None else len(layouts)):
            words = torch.zeros(count + 1, dtype=torch.int64, device=self.device())
            self.wait(self.broadcast(self.group_for(0, sender), words), f"trainer rank {sender}'s digests",
                      self._info.timeout_s)
            sent += from_words(words.tolist()[:count])
        received = digests.digests()
        check(names * (len(sent) // max(count, 1)), sent, received)
        if layouts is None:
            return tuple(received)
        combined = []
        for index in range(count):  # a tensor sent in parts: its ranks' digests, in rank order
            held = [received[rank * count + index] for rank, layout in enumerate(layouts)
                    if layout.geometry[index] is not None]
            combined.append(combine(held) if held else received[index])
        return tuple(combined)

    def _receive_into(self, buckets: list[Bucket], unpacker: Unpacker, works: dict[int, tuple[Any, bool]],
                      digests: RoundDigests | None) -> None:
        assert self._info is not None
        count = len(self._buffers)

        def post(index: int) -> None:
            if index < len(buckets):
                target = unpacker.direct_target(buckets[index])
                if target is not None and not self.accepts_in_place(target):
                    target = None
                in_place = target is not None
                if target is None:
                    if digests is not None:
                        digests.fence(index % count)  # the last bucket of this buffer is hashed
                    target = self._buffers[index % count][: buckets[index].nbytes]
                works[index] = (self.broadcast(self.group_for(index), target), in_place)

        for index in range(min(count, len(buckets))):
            post(index)
        for bucket in buckets:
            self.wait(works[bucket.index][0], f"receiving bucket {bucket.index}", self._info.timeout_s)
            in_place = works.pop(bucket.index)[1]
            if in_place:
                unpacker.received_in_place(bucket)
            else:
                slot = bucket.index % count
                with self.slot_stream(slot):
                    unpacker.unpack(bucket, self._buffers[slot][: bucket.nbytes], slot)
            post(bucket.index + count)

    def _receive_parts(self, buckets: list[Bucket], unpacker: Unpacker, layouts: list[RankLayout],
                       works: dict[int, Any], digests: RoundDigests | None) -> None:
        """Every sending rank's bytes of each bucket: in place where contiguous, else through scratch. They go
        straight to the loader's destinations when it offers all of them; else they assemble the bucket."""
        from wtransfer.engines.rounds.part_streams import hash_runs, in_place, place_runs, receive_plan, scratch_bytes

        assert self._info is not None
        count, timeout_s, tensors = len(self._buffers), self._info.timeout_s, len(layouts[0].entries)
        plans = [receive_plan(layouts, bucket) for bucket in buckets]  # who sends what, where: once a round
        targets = unpacker.tensor_targets()
        if targets and not all(self.accepts_in_place(target) for target in targets if target.numel()):
            targets = None
        needed = scratch_bytes(plans)
        if needed and (not self._scratch or self._scratch[0].numel() < needed):
            self._scratch = self.allocate(needed, count)

        def post(index: int) -> None:
            if index >= len(buckets):
                return
            if digests is not None:
                digests.fence(index % count)  # the last bucket of this buffer (and its scratch) is hashed
            data, at, pending = self._buffers[index % count], 0, []
            for sender, runs, offset in plans[index]:
                nbytes = sum(run.nbytes for run in runs)
                if offset is not None:
                    target = in_place(runs, offset, data, targets)
                else:
                    target = self._scratch[index % count][at : at + nbytes]
                    at += nbytes
                pending.append((self.broadcast(self.group_for(index, sender), target), target, runs,
                                offset is None, sender))
            works[index] = pending

        for index in range(min(count, len(buckets))):
            post(index)
        for bucket in buckets:
            slot = bucket.index % count
            data = self._buffers[slot]
            for at in range(len(works[bucket.index])):  # no local names for works: a traceback would keep them
                self.wait(works[bucket.index][at][0],
                          f"receiving trainer rank {works[bucket.index][at][4]}'s part of bucket {bucket.index}",
                          timeout_s)
            for _work, received, runs, scattered, sender in works.pop(bucket.index):
                if digests is not None:
                    hash_runs(digests, runs, received, slot, sender * tensors)
                if scattered:
                    place_runs(runs, received, data, targets)
            _work = None
            if targets is not None:
                unpacker.placed(bucket)
            else:
                unpacker.unpack(bucket, data[: bucket.nbytes])
            post(bucket.index + count)

    def shutdown(self) -> None:
        self._close(failed=False)

    def _close(self, failed: bool) -> None:
        if self._store is not None:
            self._store.close()
        self._store = self._kv = None
        self._buffers = self._scratch = []
        self._info = None
        self.release_own_groups(failed)

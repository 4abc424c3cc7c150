"""The trainer side of a torch.distributed engine (gloo, NCCL): rank 0 hosts the rendezvous, waits for
every worker, then broadcasts every round's packed buckets (see :mod:`wtransfer.engines.torch_distributed.backend`)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, ClassVar

from wtransfer.engines.channel.protocol import PROTOCOL_VERSION, ManifestRejected
from wtransfer.engines.channel.rendezvous import WILDCARD_ADDRESSES, RendezvousServer, new_token, store
from wtransfer.engines.rounds.digests import round_digests
from wtransfer.engines.rounds.manifest import Manifest
from wtransfer.engines.rounds.packing import Bucket, Packer, plan_buckets
from wtransfer.engines.rounds.shards import rank_parts
from wtransfer.engines.torch_distributed.backend import REJECTED
from wtransfer.engines.torch_distributed.options import ANNOUNCED, TorchDistributedInitOptions
from wtransfer.engines.torch_distributed.sender import TorchDistributedSending
from wtransfer.engines.trainer.client import ClientCall
from wtransfer.engines.trainer.engine import TrainerWeightTransferEngine
from wtransfer.engines.trainer.options import TrainerInitOptions
from wtransfer.errors import TransferError, TransferTimeoutError

logger = logging.getLogger("wtransfer")


class TorchDistributedTrainer(TorchDistributedSending, TrainerWeightTransferEngine):
    """Trainer side (rank 0): hosts the store, then broadcasts packed buckets."""

    backend = "gloo"
    init_options_cls: ClassVar[type[TrainerInitOptions]] = TorchDistributedInitOptions

    def prepare_workers(self) -> dict[str, Any]:
        from torch.distributed import PrefixStore

        options: TorchDistributedInitOptions = self.init_options
        address, port = options.master_address, options.master_port
        listen = options.listen_address or address
        if listen in WILDCARD_ADDRESSES:
            logger.warning("%s trainer: the rendezvous listens on every interface (listen_address=%r)", self.backend, listen)
        # Port 0: the server binds a free port itself and we publish what it got (no race).
        self._server: Any = RendezvousServer(listen, port, new_token(), self.timeout_s)
        bound = self._server.address
        self.choose_local_address(self.init_options, lambda: None if bound in WILDCARD_ADDRESSES else bound)
        self._group_name = f"wtransfer/{self.backend}/"
        # keep the Python store referenced: torch calls into it while the groups live
        self._kv = store(self._server.table, self.timeout_s)
        self._prefixed: Any = PrefixStore(self._group_name, self._kv)
        self._groups: list[Any] = []
        self._buffers = self.allocate(self.bucket_bytes, self.num_buffers)
        self._worker_info: dict[str, Any] = {
            "master_address": address,
            "master_port": self._server.port,
            "token": self._server.token,
            "world_size": self.world_size,
            "group_name": self._group_name,
            "bucket_bytes": self.bucket_bytes,
            "num_buffers": self.num_buffers,
            "rank_offset": 1,
            "timeout_s": self.timeout_s,
            "direct_min_bytes": self.direct_min_bytes,
            "channels": self.channels,
            "senders": 1 + len(self.agreement.others) if self.parallel_senders and self.agreement else 1,
            "protocol_version": PROTOCOL_VERSION,
        }
        self._prefixed.set("wire", json.dumps({name: self._worker_info[name] for name in ANNOUNCED}))
        return self._worker_info

    def _parse_init_info(self, info: dict[str, Any]) -> TrainerInitOptions:
        # A sharded source gathers a tensor when it is read: an in-place send would keep up to
        # num_buffers whole parameters alive while in flight. Pack everything unless asked.
        if self.sharded and "direct_min_bytes" not in info:
            info = {**info, "direct_min_bytes": None}
        return super()._parse_init_info(info)

    @property
    def direct_min_bytes(self) -> int | None:
        return self.init_options.direct_min_bytes

    @property
    def channels(self) -> int:
        return self.init_options.channels

    def plan(self, manifest: Manifest) -> list[Bucket]:
        return plan_buckets(manifest.entries, self.bucket_bytes, self.direct_min_bytes)

    STALL_GRACE_S: ClassVar[float] = 10.0
    """How long the rendezvous waits for one more worker once some joined and the rest went quiet."""

    def wait_for_workers(self, call: ClientCall) -> None:
        ranks = range(1, self.world_size)
        deadline = time.monotonic() + self.timeout_s
        joined: set[int] = set()
        last_join = time.monotonic()
        # Every worker's key first, so a failing client call or a too-large world_size is noticed at
        # once instead of blocking in the group constructor until its timeout.
        while True:
            now_joined = {rank for rank in ranks if self._prefixed.check([f"joined/{rank}"])}
            if now_joined != joined:
                joined, last_join = now_joined, time.monotonic()
            if len(joined) == len(ranks):
                break
            call.raise_if_failed()
            self.check_shortfall(call, joined)
            self.check_stalled(joined, time.monotonic() - last_join)
            if time.monotonic() > deadline:
                missing = [str(rank) for rank in ranks if rank not in joined]
                raise TransferTimeoutError(
                    f"{self.backend} rendezvous: worker rank(s) {', '.join(missing)} did not join "
                    f"within {self.timeout_s:g} s"
                )
            time.sleep(0.01)
        for rank in ranks:  # what each worker's model loads (an older worker wrote "1")
            said = self._prefixed.get(f"joined/{rank}").decode()
            joined = json.loads(said) if said.startswith("{") else {}
            self.served_answers[rank], self.held_answers[rank] = joined.get("served_dtypes"), joined.get("holds")
        if self.commit == "atomic":  # each worker reads it once the groups stand: its node's stager pre-faults the copy
            try:
                self.settle_cast()
                size = self.whole_round_bytes()
            except Exception:  # workers that disagree on dtypes: the rendezvous says so once the groups stand
                size = None
            if size is not None:
                self._prefixed.set("staging", json.dumps({"key": self._staging_key, "bytes": size}))
        try:
            self._groups = self.make_groups(self._prefixed, 0, self.world_size, self.timeout_s, self.channels)
        except RuntimeError as exc:
            raise TransferError(f"creating the {self.backend} group failed: {exc}") from exc

    def check_stalled(self, joined: set[int], quiet_s: float) -> None:
        """Fail fast when some workers joined and no other came for ``STALL_GRACE_S``: workers' inits run
        at once, so a long silence means ``world_size`` counts workers that do not exist."""
        grace = min(self.STALL_GRACE_S, self.timeout_s)
        if joined and quiet_s >= grace:
            missing = [rank for rank in range(1, self.world_size) if rank not in joined]
            raise TransferError(
                f"{self.backend} rendezvous: init_info world_size={self.world_size} expects {self.num_workers} "
                f"worker(s), but {len(joined)} joined (rank(s) {sorted(joined)}) and no other in {grace:g} s "
                f"(missing rank(s) {missing}); world_size counts the trainer plus every worker process the "
                f"client drives, and the client must start every worker's init_weight_transfer_engine at once"
            )

    def send_round(self, manifest: Manifest, buckets: list[Bucket], call: ClientCall) -> None:
        import torch

        # slot -> (work, tensor it reads); holding the tensor keeps an in-place source alive
        works: list[tuple[Any, Any] | None] = [None] * len(self._buffers)
        try:
            if self.parallel_senders:  # every trainer rank sends its own parts, rank 0 too
                parts = rank_parts(self.source.named_tensors(), 0, manifest.entries)  # type: ignore[attr-defined]
                accepted = self.send_own_parts(manifest.entries, parts, buckets, works, self.timeout_s, call)
            else:
                verdict = torch.zeros(1, dtype=torch.int32, device=self.device())
                with self.phases("wait"):
                    self.wait(self.allreduce_max(self._groups[0], verdict), "the manifest vote", self.timeout_s, call)
                accepted = not int(verdict.item()) & REJECTED
                if accepted:
                    self._broadcast_buckets(manifest, buckets, works, call)
            if not accepted:
                raise ManifestRejected(f"round {manifest.version} rejected by a worker")
        except ManifestRejected:
            raise  # a clean stop: every side is past the vote, and the groups stay usable
        except BaseException:
            works.clear()
            self.release_own_groups(failed=True)  # the workers' pending receives fail now, not at their timeout
            raise
        finally:
            works.clear()  # a failure's traceback must not keep the collectives (and the group) alive

    def _broadcast_buckets(self, manifest: Manifest, buckets: list[Bucket],
                           works: list[tuple[Any, Any] | None], call: ClientCall) -> None:
        with round_digests(len(manifest.entries), manifest.digests) as digests:
            packer = Packer(manifest, iter(self.source), digests, self.source_entries)
            for bucket in buckets:
                slot = bucket.index % len(self._buffers)
                if works[slot] is not None:  # no local names for works: a traceback would keep them
                    with self.phases("wait"):
                        self.wait(works[slot][0], f"broadcasting bucket {bucket.index - len(works)}",
                                  self.timeout_s, call)
                    works[slot] = None
                view = packer.direct_bytes(bucket, self.device())
                if view is None:
                    view = self._buffers[slot][: bucket.nbytes]
                    if digests is not None:
                        digests.fence(slot)
                    with self.slot_stream(slot), self.phases("pack"):
                        read = packer.pack(bucket, view, slot)
                    self.packed_from(slot, read)
                works[slot] = (self.broadcast(self.group_for(bucket.index), view), view)
            with self.phases("pack"):
                packer.drain()
            with self.phases("wait"):
                self.finish_sends(works, self.timeout_s, digests, call)

    # -- the other trainer ranks of a sharded trainer (TorchDistributedSender) ----------------------
    senders_join_with_workers = True  # their groups include the workers, who build them at init

    def open_senders(self) -> dict[str, Any]:
        """What every other trainer rank joins the workers' groups with: the workers' own init info."""
        return dict(self._worker_info)

    def wait_for_senders(self, ranks: list[int]) -> None:
        """Nothing left to wait for: the workers' init returned, so every rank's groups are built."""

    def release(self) -> None:
        self._prefixed = None
        if getattr(self, "_server", None) is not None:
            self._server.close()
        self._server = self._kv = None
        self._buffers = []
        self.release_own_groups(failed=False)

"""The send path of a torch.distributed trainer's ranks: rank 0 (:mod:`wtransfer.engines.torch_distributed.trainer`) and every other
sending rank of a sharded trainer (:class:`TorchDistributedSender`, its parts via :mod:`wtransfer.engines.rounds.part_streams`) end a
round alike (last buckets, then digests)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wtransfer.engines.channel.protocol import RoundCalledOff
from wtransfer.engines.channel.rendezvous import RendezvousClient, local_address_for, store
from wtransfer.engines.rounds.cast import CastPlan
from wtransfer.engines.rounds.digests import RoundDigests, as_words, round_digests
from wtransfer.engines.rounds.packing import Bucket, plan_buckets
from wtransfer.engines.rounds.phases import Phases
from wtransfer.engines.rounds.shards import LocalPart, rank_parts, writes_shards_as_is
from wtransfer.engines.torch_distributed.backend import DIGESTS, REJECTED, TorchDistributedBackend
from wtransfer.engines.torch_distributed.options import TorchDistributedInitInfo
from wtransfer.errors import TransferError

if TYPE_CHECKING:
    from wtransfer.engines.rounds.manifest import TensorEntry
    from wtransfer.engines.trainer.client import ClientCall

SENDER_CONNECT_RETRY_S = 2.0
"""How long another trainer rank retries reaching rank 0's rendezvous, which already listens."""


class TorchDistributedSending(TorchDistributedBackend):
    """What every sending trainer rank runs; mixed into the trainer (rank 0) and :class:`TorchDistributedSender`."""

    phases: Phases
    """Where this rank's current round spends its time (its ``pack`` and ``wait`` are recorded here)."""

    # -- a sharded trainer's ranks each sending their own parts (see rounds/part_streams) ------
    def send_own_parts(self, entries: tuple[TensorEntry, ...], parts: list[LocalPart | None], buckets: list[Bucket],
                       works: list[tuple[Any, Any] | None], timeout_s: float, call: ClientCall | None = None) -> bool:
        """This trainer rank's side of a round, on its first channel: its layout (header, rows plus one word
        so never empty), the manifest vote, then its bytes of every bucket. False: refused, nothing moved."""
        import torch

        from wtransfer.engines.rounds.part_streams import RankLayout, hash_runs, header, layout_rows, pack_runs

        device, rows = self.device(), layout_rows(parts)
        words = [torch.tensor(header(entries), dtype=torch.int64, device=device),
                 torch.tensor([*rows, 0], dtype=torch.int64, device=device)]
        posted = [self.broadcast(self._groups[0], tensor) for tensor in words]
        try:
            with self.phases("wait"):
                for index in range(len(posted)):  # no local names for works: a traceback would keep them
                    self.wait(posted[index], "sending this trainer rank's layout", timeout_s, call)
        finally:
            posted.clear()
        verdict = torch.zeros(1, dtype=torch.int32, device=device)
        with self.phases("wait"):
            self.wait(self.allreduce_max(self._groups[0], verdict), "the manifest vote", timeout_s, call)
        if int(verdict.item()) & REJECTED:
            return False
        with round_digests(len(entries), bool(int(verdict.item()) & DIGESTS)) as digests:
            layout, sent = RankLayout(entries, rows), 0
            for bucket in buckets:  # this rank's bytes of each, from num_buffers buffers (hashed, digests last)
                runs = layout.runs(bucket)
                if not runs:
                    continue
                slot = sent % len(works)
                sent += 1
                if works[slot] is not None:  # no local names for works: a traceback would keep them
                    with self.phases("wait"):
                        self.wait(works[slot][0], f"sending bucket {bucket.index}'s predecessor in buffer {slot}",
                                  timeout_s, call)
                    works[slot] = None
                if digests is not None:
                    digests.fence(slot)
                with self.phases("pack"):  # hashing included, as rank 0's packer does
                    view = pack_runs(runs, parts, self._buffers[slot])
                    if digests is not None:
                        hash_runs(digests, runs, view, slot)
                works[slot] = (self.broadcast(self.group_for(bucket.index), view), view)
            with self.phases("wait"):
                self.finish_sends(works, timeout_s, digests, call)
        return True

    def finish_sends(self, works: list[tuple[Any, Any] | None], timeout_s: float,
                     digests: RoundDigests | None = None, call: ClientCall | None = None) -> None:
        """Wait for the last buckets; then, with digests, send them (on the first channel). ``call``: rank 0's
        client call, watched while waiting."""
        for slot in range(len(works)):
            if works[slot] is not None:
                self.wait(works[slot][0], f"sending the last buckets (buffer {slot})", timeout_s, call)
                works[slot] = None
        self.synchronize(timeout_s)
        if digests is not None:
            import torch

            # one word more than the digests: a round of no tensors still broadcasts a non-empty tensor
            words = torch.tensor([*as_words(digests.digests()), 0], dtype=torch.int64, device=self.device())
            self.wait(self.broadcast(self._groups[0], words), "sending the round's digests", timeout_s, call)


class TorchDistributedSender(TorchDistributedSending):
    """Another rank of a sharded trainer: sends its own parts of every bucket on groups of its own (as their
    rank 0). Failing, it drops its groups, so the workers' receives (and rank 0's round) fail at once."""

    def __init__(self, info: dict[str, Any], trainer_rank: int, source: Any, timeout_s: float) -> None:
        from torch.distributed import PrefixStore

        if not writes_shards_as_is(source):
            raise TransferError(f"its source is a {type(source).__name__}, not a ModuleSource (rank 0's is): pass "
                                f"the same kind of source on every trainer rank")
        self.info = TorchDistributedInitInfo(**info)
        self.rank, self.source, self.timeout_s = trainer_rank, source, self.info.timeout_s
        self.phases = Phases()
        address, port = self.info.master_address, self.info.master_port
        self.choose_local_address(None, lambda: local_address_for(address, port))
        # rank 0 listened before it told this rank to join: a refused connection means it closed
        self._client: Any = RendezvousClient.connect(address, port, self.info.token, self.info.timeout_s,
                                                     retry_s=SENDER_CONNECT_RETRY_S)
        try:
            self._kv = store(self._client, self.info.timeout_s)  # torch calls into it while the groups live
            prefixed = PrefixStore(f"sender{trainer_rank}/", PrefixStore(self.info.group_name, self._kv))
            self._buffers = self.allocate(self.info.bucket_bytes, self.info.num_buffers)
            self._groups = self.make_groups(prefixed, 0, self.info.world_size, self.info.timeout_s, self.info.channels)
        except BaseException:
            self.close()
            raise

    def serve_round(self, attempt: int, cast: CastPlan | None = None) -> tuple[int, int]:
        """Send this rank's part of round ``attempt``; returns (tensors, bytes) held here."""
        if not self._groups:
            raise TransferError(f"trainer rank {self.rank}: this sender was closed (or failed a round)")
        works: list[tuple[Any, Any] | None] = [None] * len(self._buffers)
        self.phases = Phases()
        try:
            entries = (cast or CastPlan()).entries(self.source.metadata())  # as rank 0 casts them
            parts = rank_parts(self.source.named_tensors(), self.rank, entries)
            buckets = plan_buckets(entries, self.info.bucket_bytes, self.info.direct_min_bytes)
            if not self.send_own_parts(entries, parts, buckets, works, self.timeout_s):
                raise RoundCalledOff("the workers refused the round before any byte moved (trainer rank 0 "
                                     "says why)")  # every side is past the vote: the groups stay in step
        except RoundCalledOff:
            raise
        except BaseException:
            works.clear()
            self.release_own_groups(failed=True)  # the workers' receives fail now, not at their timeout
            raise
        finally:
            works.clear()
        held = [p for p in parts if p is not None]
        return len(held), sum(p.local.numel() * p.wire_dtype.itemsize for p in held)

    def close(self) -> None:
        self.release_own_groups(failed=False)
        self._buffers = []
        if getattr(self, "_client", None) is not None:
            self._client.close()
        self._client = self._kv = None

"""Packed broadcast over a private ``torch.distributed`` process group (gloo here, NCCL in its plugin).

The group is built from the trainer's authenticated rendezvous store
(:mod:`wtransfer.engines._rendezvous`: one listening address, a token-proving handshake;
torch's ``TCPStore`` would answer anyone on every interface) + ``PrefixStore`` + the
backend's ``ProcessGroup`` class directly: the default process group is never created,
required or touched, so it coexists with whatever groups the trainer already runs. Ranks:
the trainer is 0, workers take ``data_parallel_index * world_size + rank + rank_offset``
(the seed's rule). The trainer's store binds port 0 when asked, and publishes the port it
got: no race.

Each round starts with a one-integer all-reduce: every worker says whether its loader
accepts the manifest, so a rejection stops everybody before any data moves. Buckets are
then broadcast asynchronously from ``num_buffers`` reusable buffers: packing (trainer) and
unpacking (workers) of one bucket overlap the transport of the next.

Buckets go round-robin over ``channels`` groups with the same members. Gloo moves each
group's data through one socket serviced by one I/O thread, which a single stream keeps
busy at a few GB/s; two groups move data in parallel (measured here: 1.1-1.3x one group,
and more than one flat broadcast). Both sides derive everything from the bucket index,
so no extra message is needed.

Backend specifics sit behind the small methods of :class:`TorchDistributedBackend`
(``device``, ``make_process_group``, ``allocate``, ``slot_stream``, ``packed_from``,
``accepts_in_place``, ``synchronize``, ``release_groups``, ``host_waits`` and
``transport_timeout_s``) so a plugin for another backend only overrides those.

This module is the family's base, what every side shares: the per-backend hooks, the groups
(built by every member in the same order, one per channel), the collectives they run and the
manifest vote's bits; the overview above is here because every side runs it. The sides live in :mod:`._td_worker`, :mod:`._td_trainer` and :mod:`._td_sender` (the
trainer ranks' send path); their options in :mod:`._td_options`; the gloo device's address in
:mod:`._gloo_address`; how a collective is waited for in :mod:`._collective_waits`.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
from typing import TYPE_CHECKING, Any

from wtransfer.engines._collective_waits import CollectiveWaits
from wtransfer.engines._gloo_address import LocalAddressChoice

if TYPE_CHECKING:
    import torch

REJECTED, DIGESTS = 1, 2
"""The manifest vote's bits: a worker refuses the round; the round is hashed (the other sending
trainer ranks learn it here: they do not see the manifest)."""


class TorchDistributedBackend(LocalAddressChoice, CollectiveWaits):
    """The per-backend pieces; gloo by default. Mixed into both the worker and trainer classes."""

    distributed_backend = "gloo"

    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def make_process_group(self, store: Any, rank: int, size: int, timeout_s: float) -> Any:
        from torch._C._distributed_c10d import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        options._devices = [self.gloo_device()]
        return ProcessGroupGloo(store, rank, size, options)

    def make_groups(self, store: Any, rank: int, size: int, timeout_s: float, channels: int) -> list[Any]:
        """One group per channel, each under its own key prefix; every member builds them in order."""
        from torch.distributed import PrefixStore

        transport_timeout_s = self.transport_timeout_s(timeout_s)
        return [
            self.make_process_group(PrefixStore(f"channel{index}/", store), rank, size, transport_timeout_s)
            for index in range(channels)
        ]

    def allocate(self, nbytes: int, count: int) -> list[torch.Tensor]:
        """``count`` reusable, pre-touched byte buffers (once per engine, never per round)."""
        import torch

        return [torch.zeros(nbytes, dtype=torch.uint8, device=self.device()) for _ in range(count)]

    def synchronize(self, timeout_s: float) -> None:
        """End of a round's data movement: wait, at most ``timeout_s``, for the device (a GPU
        sync; nothing on CPU). Raises :class:`TransferTimeoutError` when the device is not done."""

    def slot_stream(self, slot: int) -> contextlib.AbstractContextManager[None]:
        """Where packing/unpacking of buffer ``slot`` runs. On CPU, inline; a GPU backend runs
        each buffer on its own stream and makes the transport wait for it."""
        return contextlib.nullcontext()

    _groups: list[Any]
    _sender_groups: list[list[Any]] = []
    """Workers of a trainer whose every rank sends: the groups with trainer ranks 1, 2, ..."""

    def group_for(self, bucket_index: int, sender: int = 0) -> Any:
        """The channel a bucket travels on: round-robin by index, so both sides agree unasked."""
        groups = self._groups if sender == 0 else self._sender_groups[sender - 1]
        return groups[bucket_index % len(groups)]

    def packed_from(self, slot: int, tensors: list[torch.Tensor]) -> None:
        """Called after packing buffer ``slot`` from ``tensors`` (trainer side). On CPU the copies
        are done; a GPU backend marks the tensors as used by the slot's stream, so their memory
        is not reused before that stream has read them."""

    def accepts_in_place(self, tensor: torch.Tensor) -> bool:
        """Whether the transport can write straight into ``tensor`` (it must be on our device)."""
        return tensor.device == self.device()

    # -- collective helpers ------------------------------------------------------------------
    @staticmethod
    def broadcast(group: Any, tensor: torch.Tensor) -> Any:
        from torch._C._distributed_c10d import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        return group.broadcast([tensor], options)

    @staticmethod
    def allreduce_max(group: Any, tensor: torch.Tensor) -> Any:
        from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

        options = AllreduceOptions()
        options.reduceOp = ReduceOp.MAX
        return group.allreduce([tensor], options)

    def release_own_groups(self, failed: bool) -> None:
        """Drop this side's groups (``_groups``) and release them: after a failed round at once, so
        every peer waiting in a collective fails with "connection closed"."""
        groups, self._groups = getattr(self, "_groups", None) or [], []
        groups += [group for channels in self._sender_groups for group in channels]
        self._sender_groups = []
        if groups:
            self.release_groups(groups, failed)

    def release_groups(self, groups: list[Any], failed: bool) -> None:
        """Let go of this side's groups (the caller has dropped every other reference).

        Destroying a gloo group closes its connections, so peers still waiting in a
        collective fail at once ("connection closed") instead of at their timeout;
        ``abort()``/``shutdown()`` do not do that. Collect now so it happens immediately.
        A GPU backend aborts its communicators first when ``failed``: a collective still
        queued on the device would otherwise never end.
        """
        groups.clear()
        gc.collect()

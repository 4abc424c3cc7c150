"""Packed broadcast over a private ``torch.distributed`` process group (gloo here, NCCL in its plugin).

The group is built from the trainer's authenticated rendezvous store (:mod:`wtransfer.engines.channel.rendezvous`) +
``PrefixStore`` + the backend's ``ProcessGroup`` class directly: the default process group is never
created or touched, so it coexists with the trainer's own groups. Ranks: the trainer is 0, workers take
``data_parallel_index * world_size + rank + rank_offset`` (the seed's rule).

Each round starts with a one-integer all-reduce (the manifest vote), so a rejection stops everybody
before any data moves. Buckets are then broadcast asynchronously from ``num_buffers`` reusable buffers,
packing/unpacking one overlapping the transport of the next, round-robin over ``channels`` groups with
the same members (a gloo group moves data through one socket and one I/O thread; several run in
parallel). Both sides derive everything from the bucket index.

Backend specifics sit behind the small methods of :class:`TorchDistributedBackend` (``device``,
``make_process_group``, ``allocate``, ``slot_stream``, ``packed_from``, ``accepts_in_place``,
``synchronize``, ``release_groups``, ``host_waits``, ``transport_timeout_s``): a plugin overrides those.
The sides live in :mod:`wtransfer.engines.torch_distributed.worker`, :mod:`wtransfer.engines.torch_distributed.trainer` and :mod:`wtransfer.engines.torch_distributed.sender`; options in
:mod:`wtransfer.engines.torch_distributed.options`; the gloo address in :mod:`wtransfer.engines.torch_distributed.gloo_address`; waits in :mod:`wtransfer.engines.torch_distributed.waits`.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import threading
from typing import TYPE_CHECKING, Any

from wtransfer.engines.torch_distributed.gloo_address import LocalAddressChoice
from wtransfer.engines.torch_distributed.waits import CollectiveWaits

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("wtransfer")

RELEASE_WAIT_S = 2.0
"""How long a failed round waits for its groups to close before it raises (see ``release_groups``)."""

REJECTED, DIGESTS = 1, 2
"""The manifest vote's bits: a worker refuses; the round is hashed (other sending ranks learn it only here)."""


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
        """End of a round's data movement: wait at most ``timeout_s`` for the device (nothing on CPU);
        raises :class:`TransferTimeoutError` if it is not done."""

    def slot_stream(self, slot: int) -> contextlib.AbstractContextManager[None]:
        """Where packing/unpacking of buffer ``slot`` runs: inline on CPU; a GPU backend's per-buffer stream."""
        return contextlib.nullcontext()

    _groups: list[Any]
    _sender_groups: list[list[Any]] = []
    """Workers of a trainer whose every rank sends: the groups with trainer ranks 1, 2, ..."""

    def group_for(self, bucket_index: int, sender: int = 0) -> Any:
        """The channel a bucket travels on: round-robin by index, so both sides agree unasked."""
        groups = self._groups if sender == 0 else self._sender_groups[sender - 1]
        return groups[bucket_index % len(groups)]

    def packed_from(self, slot: int, tensors: list[torch.Tensor]) -> None:
        """After packing buffer ``slot`` from ``tensors``: a GPU backend marks them used by the slot's stream,
        so their memory is not reused before it read them (nothing on CPU)."""

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
        """Let go of this side's groups (the caller dropped every other reference).

        Destroying a gloo group (collected now) closes its connections, so waiting peers fail at once;
        ``abort()``/``shutdown()`` do not. A GPU backend aborts its communicators first when ``failed``:
        a collective queued on the device would otherwise never end.

        Where ``host_waits`` (gloo), after a failed round the destruction runs on a thread of its own,
        waited for at most ``RELEASE_WAIT_S``: gloo's destructor waits for the group's operations in
        flight, and a send to a peer that stopped reading (hung, or its sockets held by a child process)
        ends only at the group's timeout. The round's error then reaches the caller, and those
        connections close when that send ends (a process exiting before then skips the destructor).
        """
        if not (failed and groups and self.host_waits):
            _destroy(groups)
            return
        held = groups[:]
        groups.clear()
        closing = threading.Thread(target=_destroy, args=(held,), name="wtransfer-release-groups", daemon=True)
        closing.start()
        closing.join(RELEASE_WAIT_S)
        if closing.is_alive():
            logger.warning("%s: the failed round's groups are still closing (a send waits on a peer that "
                           "stopped reading); their connections close when it times out", type(self).__name__)


def _destroy(groups: list[Any]) -> None:
    """Drop the last references to ``groups`` (their destructors run here, however long they wait)."""
    groups.clear()
    gc.collect()

"""Packed broadcast over a private ``torch.distributed`` process group (gloo here, NCCL in its plugin).

The group is built from the trainer's authenticated rendezvous store
(:mod:`wtransfer.engines._rendezvous`: one listening address, a token-proving handshake;
torch's ``TCPStore`` would answer anyone on every interface) + ``PrefixStore`` + the
backend's ``ProcessGroup`` class directly: the default process group is never created,
required or touched, so it coexists with whatever groups the trainer already runs. Ranks:
the trainer is 0, workers take ``data_parallel_index * world_size + rank + rank_offset``
(the seed's rule). The trainer's store binds port 0 when asked, and publishes the port it
got: no race.

Across hosts each gloo rank advertises the local address on the route to the trainer
(workers) or the address it listens on (trainer), not what its host name resolves to
(127.0.0.1 on many hosts); ``local_address`` or ``interface`` (worker options, trainer
``init_info``) or ``GLOO_SOCKET_IFNAME`` choose by hand.

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from wtransfer.engines._base import LoadWeights, WeightTransferEngine, WeightTransferInitInfo
from wtransfer.engines._loader import validate_with_loader
from wtransfer.engines._manifest import Manifest, TensorEntry
from wtransfer.engines._digests import RoundDigests, as_words, check, from_words
from wtransfer.engines._packing import Bucket, Packer, Unpacker, plan_buckets
from wtransfer.engines._shards import LocalPart, rank_parts, writes_shards_as_is
from wtransfer.engines._protocol import (
    MIB,
    PROTOCOL_VERSION,
    ManifestRejected,
    RoundCalledOff,
    check_bucket_bytes,
    check_int,
    check_protocol,
    check_timeout,
    gc_paused,
)
from wtransfer.engines._rendezvous import (
    WILDCARD_ADDRESSES,
    RendezvousClient,
    RendezvousServer,
    local_address_for,
    new_token,
    store,
)
from wtransfer.engines._trainer import ClientCall, TrainerInitOptions, TrainerWeightTransferEngine, at_least
from wtransfer.engines._worker import (
    BufferBudgetOptions,
    ManifestUpdateInfo,
    check_buffer_budget,
    global_rank,
)
from wtransfer.options import option, option_value
from wtransfer.errors import ManifestMismatchError, TransferError, TransferTimeoutError

if TYPE_CHECKING:
    import torch

    from wtransfer.engines._part_streams import RankLayout

logger = logging.getLogger("wtransfer")

_POLL_S = 0.0005
WATCHDOG_MARGIN_S = 60.0
"""Without ``host_waits``, a group's own timeout exceeds ``timeout_s`` by this much at least
(or by ``timeout_s``): wtransfer's deadline, which aborts the group, always comes first."""


@dataclass
class TorchDistributedInitInfo(WeightTransferInitInfo):
    """Where the trainer's store listens, the group's name and the trainer's wire parameters."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    bucket_bytes: int
    num_buffers: int
    rank_offset: int = 1
    timeout_s: float = 300.0
    direct_min_bytes: int | None = None
    """Tensors at least this large are broadcast in place (no packing); None packs everything."""
    channels: int = 1
    """Process groups the buckets are spread over (round-robin by bucket index)."""
    senders: int = 1
    """Trainer ranks that send (a sharded trainer whose every rank sends its own shards): ranks
    ``1..senders-1`` each have groups of their own with the workers."""
    token: str = ""
    """The rendezvous secret: only a holder may read or write the group's keys."""
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_protocol(owner, self.protocol_version)
        if self.direct_min_bytes is not None:
            check_int(owner, "direct_min_bytes", self.direct_min_bytes, 1)
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError(f"{owner}: 'master_address' must be a host name or address, got {self.master_address!r}")
        check_int(owner, "master_port", self.master_port, 1)
        check_int(owner, "world_size", self.world_size, 2)
        check_int(owner, "num_buffers", self.num_buffers, 1)
        check_int(owner, "rank_offset", self.rank_offset, 0)
        check_channels(owner, self.channels)
        check_int(owner, "senders", self.senders, 1)
        check_timeout(owner, self.timeout_s)
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ValueError(f"{owner}: 'group_name' must be a non-empty string")
        if not isinstance(self.token, str) or len(self.token) < 16:
            raise ValueError(f"{owner}: 'token' (the rendezvous secret from the trainer) is missing or too short")
        try:
            check_bucket_bytes(self.bucket_bytes)
        except ValueError as exc:
            raise ValueError(f"{owner}: {exc}") from None


MAX_CHANNELS = 8
SENDER_CONNECT_RETRY_S = 2.0
"""How long another trainer rank retries reaching rank 0's rendezvous, which already listens."""
REJECTED, DIGESTS = 1, 2
"""The manifest vote's bits: a worker refuses the round; the round is hashed (the other sending
trainer ranks learn it here: they do not see the manifest)."""
MAX_TENSORS = 10_000_000
"""More tensors than this in a sending rank's layout header is not a layout (a worker refuses to size one)."""


def check_channels(owner: str, channels: Any) -> None:
    check_int(owner, "channels", channels, 1)
    if channels > MAX_CHANNELS:
        raise ValueError(
            f"{owner}: 'channels' must be at most {MAX_CHANNELS} (each is a process group), got {channels}"
        )


def check_local_address(owner: str, local_address: Any, interface: Any) -> None:
    """A user's ``local_address``/``interface``: non-empty strings, and not both."""
    for key, value in (("local_address", local_address), ("interface", interface)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{owner}{key!r} must be a non-empty string, got {value!r}")
    if local_address and interface:
        raise ValueError(f"{owner}give 'local_address' or 'interface', not both")


@dataclass(frozen=True)
class TorchDistributedOptions(BufferBudgetOptions):
    """Worker options shared by every torch.distributed backend (gloo, NCCL)."""


@dataclass(frozen=True)
class GlooOptions(TorchDistributedOptions):
    """Worker options of ``gloo``: which local address this worker's gloo device uses."""

    local_address: str | None = option(
        None, doc="address this worker binds and advertises (default: its address on the route to the trainer)"
    )
    interface: str | None = option(None, doc="or a network interface name whose address is used (e.g. eth1)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_local_address("", self.local_address, self.interface)


@dataclass(frozen=True)
class TorchDistributedInitOptions(TrainerInitOptions):
    """Trainer ``init_info`` shared by every torch.distributed backend (gloo, NCCL)."""

    master_address: str = option(
        "127.0.0.1", doc="trainer's address the workers reach; the rendezvous listens there only"
    )
    master_port: int = option(0, doc="rendezvous port; 0 picks a free one and tells the workers")
    listen_address: str | None = option(
        None, doc="address the rendezvous binds, if not master_address (e.g. behind NAT)"
    )
    direct_min_bytes: int | None = option(
        2 * MIB, doc="tensors at least this large are sent in place, unpacked; None packs everything"
    )
    channels: int = option(2, doc=f"process groups the buckets are spread over (1..{MAX_CHANNELS})")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.master_address:
            raise ValueError("'master_address' must be a host name or address, got ''")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"'master_port' must be 0 (pick a free port) or a port number, got {self.master_port}")
        if self.direct_min_bytes is not None:
            at_least("direct_min_bytes", self.direct_min_bytes, 1)
        at_least("channels", self.channels, 1)
        if self.channels > MAX_CHANNELS:
            raise ValueError(f"'channels' must be at most {MAX_CHANNELS} (each is a process group), got {self.channels}")


@dataclass(frozen=True)
class GlooInitOptions(TorchDistributedInitOptions):
    """Trainer ``init_info`` of ``gloo``: adds the trainer's own gloo address."""

    # 8 x 16 MiB: as much memory as 4 x 32 MiB, but enough collectives in flight to keep
    # both channels busy (each gloo group runs its collectives on two threads).
    bucket_bytes: int = option(16 * MIB)
    num_buffers: int = option(8)
    local_address: str | None = option(
        None, doc="address the trainer's gloo device binds and advertises (default: where the rendezvous listens)"
    )
    interface: str | None = option(None, doc="or a network interface name whose address is used (e.g. eth1)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_local_address("", self.local_address, self.interface)


class TorchDistributedBackend:
    """The per-backend pieces; gloo by default. Mixed into both the worker and trainer classes."""

    distributed_backend = "gloo"
    local_address: str | None = None
    """The address this rank's gloo device binds and advertises (set before groups are made)."""
    local_interface: str | None = None
    """Or a network interface name, when the user named one."""

    host_waits: ClassVar[bool] = True
    """Whether ``Work.wait()`` blocks this host until the collective is done, bounded by the
    group's own timeout (gloo). NCCL's only orders CUDA streams and its timeout is enforced by a
    watchdog that kills the process: such a backend sets this to False, and wtransfer then polls
    ``is_completed()`` against its own deadline and aborts the group when it passes."""

    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def transport_timeout_s(self, timeout_s: float) -> float:
        """The timeout the process group itself gets. Where the transport's timeout is what ends
        a wait (``host_waits``: gloo), ``timeout_s``; otherwise past wtransfer's own deadline (which
        aborts the group first), so a watchdog acting on the group's timeout never acts."""
        return timeout_s if self.host_waits else timeout_s + max(WATCHDOG_MARGIN_S, timeout_s)

    def make_process_group(self, store: Any, rank: int, size: int, timeout_s: float) -> Any:
        from torch._C._distributed_c10d import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        options._devices = [self.gloo_device()]
        return ProcessGroupGloo(store, rank, size, options)

    def gloo_device(self) -> Any:
        """The user's ``interface`` or ``local_address``, else ``GLOO_SOCKET_IFNAME``, else the
        automatically chosen address (see the module docstring)."""
        from torch._C._distributed_c10d import ProcessGroupGloo

        if self.local_interface:
            return ProcessGroupGloo.create_device(interface=self.local_interface)
        if self.local_address and not self._address_from_env():
            return ProcessGroupGloo.create_device(hostname=self.local_address)
        return ProcessGroupGloo.create_default_device()

    _address_chosen_by_user = False

    def _address_from_env(self) -> bool:
        """Whether ``GLOO_SOCKET_IFNAME`` decides (set, and the user named no address here)."""
        return bool(os.environ.get("GLOO_SOCKET_IFNAME")) and not self._address_chosen_by_user

    def choose_local_address(self, options: Any, automatic: Callable[[], str | None]) -> None:
        """Apply a user's ``local_address``/``interface`` option, else ``automatic()``.

        ``options`` is parsed options (a backend that declares neither field, like NCCL,
        reads as None) or, from older callers, a plain dict.
        """
        address, interface = option_value(options, "local_address"), option_value(options, "interface")
        check_local_address(f"{type(self).__name__}: ", address, interface)
        self._address_chosen_by_user = bool(address or interface)
        self.local_interface = interface
        self.local_address = address or (None if interface or self._address_from_env() else automatic())

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

    # -- a sharded trainer's ranks each sending their own parts (see _part_streams) --------------
    def send_own_parts(self, entries: tuple[TensorEntry, ...], parts: list[LocalPart | None], buckets: list[Bucket],
                       works: list[tuple[Any, Any] | None], timeout_s: float, call: ClientCall | None = None) -> bool:
        """This trainer rank's side of a round: its layout, the manifest vote, then its bytes of every
        bucket (hashed when the workers say the round is). False: the workers refused it, nothing moved.

        The layout and the vote go on this rank's first channel: its header, its rows (one extra
        word, so never empty), and the vote, in which it learns every worker's verdict."""
        import torch

        from wtransfer.engines._part_streams import RankLayout, header, layout_rows

        device, rows = self.device(), layout_rows(parts)
        words = [torch.tensor(header(entries), dtype=torch.int64, device=device),
                 torch.tensor([*rows, 0], dtype=torch.int64, device=device)]
        for work in [self.broadcast(self._groups[0], tensor) for tensor in words]:
            self.wait(work, "sending this trainer rank's layout", timeout_s, call)
        verdict = torch.zeros(1, dtype=torch.int32, device=device)
        self.wait(self.allreduce_max(self._groups[0], verdict), "the manifest vote", timeout_s, call)
        if int(verdict.item()) & REJECTED:
            return False
        digests = RoundDigests(len(entries)) if int(verdict.item()) & DIGESTS else None
        try:
            self._stream_parts(buckets, RankLayout(entries, rows), parts, works, timeout_s, digests)
        finally:
            if digests is not None:
                digests.close()
        return True

    def _stream_parts(self, buckets: list[Bucket], layout: RankLayout, parts: list[LocalPart | None],
                      works: list[tuple[Any, Any] | None], timeout_s: float, digests: RoundDigests | None) -> None:
        """Broadcast this rank's bytes of every bucket, in bucket order, from ``num_buffers`` buffers;
        with ``digests``, hash each tensor's part as it goes and send the digests last."""
        from wtransfer.engines._part_streams import hash_runs, pack_runs

        sent = 0
        for bucket in buckets:
            runs = layout.runs(bucket)
            if not runs:
                continue
            slot = sent % len(works)
            sent += 1
            if works[slot] is not None:  # no local names for works: a traceback would keep them
                self.wait(works[slot][0], f"sending bucket {bucket.index}'s predecessor in buffer {slot}", timeout_s)
                works[slot] = None
            if digests is not None:
                digests.fence(slot)
            view = pack_runs(runs, parts, self._buffers[slot])
            if digests is not None:
                hash_runs(digests, runs, view, slot)
            works[slot] = (self.broadcast(self.group_for(bucket.index), view), view)
        self.finish_sends(works, timeout_s, digests)

    def finish_sends(self, works: list[tuple[Any, Any] | None], timeout_s: float,
                     digests: RoundDigests | None = None) -> None:
        """Wait for the last buckets; then, with digests, send them (on the first channel)."""
        for slot in range(len(works)):
            if works[slot] is not None:
                self.wait(works[slot][0], f"sending the last buckets (buffer {slot})", timeout_s)
                works[slot] = None
        self.synchronize(timeout_s)
        if digests is not None:
            import torch

            # one word more than the digests: a round of no tensors still broadcasts a non-empty tensor
            words = torch.tensor([*as_words(digests.digests()), 0], dtype=torch.int64, device=self.device())
            self.wait(self.broadcast(self._groups[0], words), "sending the round's digests", timeout_s)

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

    def wait(self, work: Any, what: str, timeout_s: float, call: ClientCall | None = None) -> None:
        """Wait for an async collective, at most ``timeout_s``.

        With ``call`` (the manifest vote, before any worker is known to be in the round) the
        wait polls, so a failed client call stops it at once. Data waits block where the
        transport's wait blocks the host and ends at the group's timeout (gloo): by then every
        worker is in the round, and a worker that fails drops its group, which fails our
        pending collectives immediately ("connection closed"). Where it does not
        (``host_waits = False``), they poll against ``timeout_s`` too.
        """
        deadline = time.monotonic() + timeout_s
        try:
            if call is None and self.host_waits:
                work.wait()
                return
            while not work.is_completed():
                if call is not None:
                    call.raise_if_failed()
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(f"{what} did not complete within {timeout_s:g} s")
                time.sleep(_POLL_S)
            # "Completed" includes failed, and a group that does not tear the process down on
            # errors (NCCL with async error handling off) returns from wait() without raising.
            # (gloo's wait() raises: it is not asked, Work.exception() warns of its deprecation.)
            exception = None if self.host_waits else getattr(work, "exception", None)
            error = exception() if callable(exception) else None
            if error is not None:
                raise TransferError(f"{what} failed: {error} (a peer died, stalled or disconnected)")
            work.wait()
        except TransferError:
            work = None  # noqa: F841 - the traceback keeps this frame: let the group go
            raise
        except RuntimeError as exc:  # gloo reports dead peers and its own timeouts as RuntimeError
            work = None  # noqa: F841
            # gloo words its timeouts both "Timed out ..." and "Application timeout caused pair closure"
            message = str(exc).lower()
            kind = TransferTimeoutError if "timed out" in message or "timeout" in message else TransferError
            raise kind(f"{what} failed: {exc} (a peer died, stalled or disconnected)") from exc


class TorchDistributedWeightTransferEngine(
    TorchDistributedBackend, WeightTransferEngine[TorchDistributedInitInfo, ManifestUpdateInfo]
):
    """Worker side: joins the trainer's side group and receives broadcast buckets.

    ``WeightTransferConfig.options``: ``max_buffer_bytes`` refuses larger buffer rings at init;
    ``local_address`` or ``interface`` choose this worker's gloo address (see :class:`GlooOptions`).
    """

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
            prefixed.set(f"joined/{self.rank}", "1")
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
            validate_with_loader(load_weights, manifest)
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
        """After a failed round: drop the group now, so the trainer's pending collectives fail
        at once instead of at their timeout. A new ``init_transfer_engine()`` joins a fresh one."""
        self._close(failed=True)  # the group, its rendezvous connection and the buffers: nothing outlives the round
        self._broken = reason

    def _receive_layouts(self, manifest: Manifest) -> tuple[list[RankLayout] | None, str | None]:
        """Every sending trainer rank's layout; and why the round cannot go on, if it cannot."""
        import torch

        from wtransfer.engines._part_streams import HEADER_WORDS, RankLayout, check_tiling, header

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
        digests = RoundDigests(senders * len(manifest.entries)) if manifest.digests else None
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
            if digests is not None:
                digests.close()
        unpacker.finish()
        return verified

    def _verify_digests(self, manifest: Manifest, digests: RoundDigests,
                        layouts: list[RankLayout] | None) -> tuple[int, ...]:
        """Each sending rank's digests (sent after its data) against ours; every tensor's digest."""
        import torch

        from wtransfer.engines._digests import combine

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
        """Every sending rank's bytes of each bucket: in place where they are contiguous there,
        else through this buffer's scratch, placed row by row. Where the loader offers every
        tensor's destination (staging, a module), the bytes go there directly; otherwise they
        assemble the bucket, which then unpacks as usual (one copy more of every byte)."""
        from wtransfer.engines._part_streams import hash_runs, in_place, place_runs, receive_plan, scratch_bytes

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


class TorchDistributedTrainer(TorchDistributedBackend, TrainerWeightTransferEngine):
    """Trainer side (rank 0): hosts the store, then broadcasts packed buckets."""

    backend = "gloo"
    init_options_cls: ClassVar[type[TrainerInitOptions]] = GlooInitOptions

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
        # Wait for every worker's key first, so a failing client call (or a world_size larger
        # than the workers the client drives) is noticed at once instead of blocking inside
        # the group constructor until its timeout.
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
        try:
            self._groups = self.make_groups(self._prefixed, 0, self.world_size, self.timeout_s, self.channels)
        except RuntimeError as exc:
            raise TransferError(f"creating the {self.backend} group failed: {exc}") from exc

    def check_stalled(self, joined: set[int], quiet_s: float) -> None:
        """Fail fast when some workers joined and no other came for ``STALL_GRACE_S``.

        A client must start every worker's init at once (each blocks in the group until all
        are in), so workers join within moments of each other; a long silence after the first
        means ``world_size`` counts workers that do not exist (or that never got the call).
        """
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
                self.wait(self.allreduce_max(self._groups[0], verdict), "the manifest vote", self.timeout_s, call)
                accepted = not int(verdict.item()) & REJECTED
                if accepted:
                    self._broadcast_buckets(manifest, buckets, call, works)
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


    def _broadcast_buckets(self, manifest: Manifest, buckets: list[Bucket], call: ClientCall,
                           works: list[tuple[Any, Any] | None]) -> None:
        digests = RoundDigests(len(manifest.entries)) if manifest.digests else None
        try:
            self._pack_and_broadcast(manifest, buckets, works, digests)
        finally:
            if digests is not None:
                digests.close()

    def _pack_and_broadcast(self, manifest: Manifest, buckets: list[Bucket], works: list[tuple[Any, Any] | None],
                            digests: RoundDigests | None) -> None:
        packer = Packer(manifest, iter(self.source), digests)
        device = self.device()
        for bucket in buckets:
            slot = bucket.index % len(self._buffers)
            if works[slot] is not None:  # no local names for works: a traceback would keep them
                self.wait(works[slot][0], f"broadcasting bucket {bucket.index - len(works)}", self.timeout_s)
                works[slot] = None
            view = packer.direct_bytes(bucket, device)
            if view is None:
                view = self._buffers[slot][: bucket.nbytes]
                if digests is not None:
                    digests.fence(slot)
                with self.slot_stream(slot):
                    read = packer.pack(bucket, view, slot)
                self.packed_from(slot, read)
            works[slot] = (self.broadcast(self.group_for(bucket.index), view), view)
        packer.drain()
        self.finish_sends(works, self.timeout_s, digests)

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


class TorchDistributedSender(TorchDistributedBackend):
    """Another rank of a sharded trainer: sends its own parts of every bucket on groups of its own.

    It joins rank 0's rendezvous with the workers' init info while the workers join (they build a
    group set with each sending rank), and is rank 0 of its groups. Each round it announces its
    layout, learns the workers' verdict in the manifest vote, and streams its bytes
    (:mod:`wtransfer.engines._part_streams`). Failing, it drops its groups: the workers' receives
    fail at once, they leave every group, and rank 0's round fails with them.
    """

    def __init__(self, info: dict[str, Any], trainer_rank: int, source: Any, timeout_s: float) -> None:
        from torch.distributed import PrefixStore

        if not writes_shards_as_is(source):
            raise TransferError(f"its source is a {type(source).__name__}, not a ModuleSource (rank 0's is): pass "
                                f"the same kind of source on every trainer rank")
        self.info = TorchDistributedInitInfo(**info)
        self.rank, self.source, self.timeout_s = trainer_rank, source, self.info.timeout_s
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

    def serve_round(self, attempt: int) -> tuple[int, int]:
        """Send this rank's part of round ``attempt``; returns (tensors, bytes) held here."""
        if not self._groups:
            raise TransferError(f"trainer rank {self.rank}: this sender was closed (or failed a round)")
        works: list[tuple[Any, Any] | None] = [None] * len(self._buffers)
        try:
            entries = tuple(self.source.metadata())
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
        return len(held), sum(p.local.numel() * p.local.element_size() for p in held)

    def close(self) -> None:
        self.release_own_groups(failed=False)
        self._buffers = []
        if getattr(self, "_client", None) is not None:
            self._client.close()
        self._client = self._kv = None

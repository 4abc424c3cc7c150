"""What configures a torch.distributed engine (gloo, NCCL): the worker's options, the
trainer's ``init_info``, and the init info the trainer hands its workers.

Each is checked where it is built, before any rendezvous or group exists; a plugin for another backend
(NCCL) derives its own options from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from wtransfer.engines.channel.protocol import MIB, PROTOCOL_VERSION, check_int, check_wire_info
from wtransfer.engines.torch_distributed.gloo_address import check_local_address
from wtransfer.engines.trainer.options import TrainerInitOptions, at_least
from wtransfer.engines.worker.base import WeightTransferInitInfo
from wtransfer.engines.worker.helpers import BufferBudgetOptions
from wtransfer.options import option

MAX_CHANNELS = 8


def check_channels(prefix: str, channels: int) -> None:
    """At most ``MAX_CHANNELS`` channels (callers check the lower bound); ``prefix`` names the owner."""
    if channels > MAX_CHANNELS:
        raise ValueError(
            f"{prefix}'channels' must be at most {MAX_CHANNELS} (each is a process group), got {channels}"
        )


ANNOUNCED = ("world_size", "bucket_bytes", "num_buffers", "direct_min_bytes", "channels", "senders")
"""The init info fields a worker checks against what its trainer announced in the rendezvous (key ``wire``)."""


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
    """Trainer ranks that send; ranks ``1..senders-1`` each have groups of their own with the workers."""
    token: str = ""
    """The rendezvous secret: only a holder may read or write the group's keys."""
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_wire_info(owner, self)
        if self.direct_min_bytes is not None:
            check_int(owner, "direct_min_bytes", self.direct_min_bytes, 1)
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError(f"{owner}: 'master_address' must be a host name or address, got {self.master_address!r}")
        check_int(owner, "master_port", self.master_port, 1)
        check_int(owner, "channels", self.channels, 1)
        check_channels(f"{owner}: ", self.channels)
        check_int(owner, "senders", self.senders, 1)
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ValueError(f"{owner}: 'group_name' must be a non-empty string")
        if not isinstance(self.token, str) or len(self.token) < 16:
            raise ValueError(f"{owner}: 'token' (the rendezvous secret from the trainer) is missing or too short")


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
    # 8 x 16 MiB: enough collectives in flight to keep both channels busy.
    bucket_bytes: int = option(16 * MIB)
    num_buffers: int = option(8)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.master_address:
            raise ValueError("'master_address' must be a host name or address, got ''")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"'master_port' must be 0 (pick a free port) or a port number, got {self.master_port}")
        if self.direct_min_bytes is not None:
            at_least("direct_min_bytes", self.direct_min_bytes, 1)
        at_least("channels", self.channels, 1)
        check_channels("", self.channels)


@dataclass(frozen=True)
class GlooInitOptions(TorchDistributedInitOptions):
    """Trainer ``init_info`` of ``gloo``: adds the trainer's own gloo address."""

    local_address: str | None = option(
        None, doc="address the trainer's gloo device binds and advertises (default: where the rendezvous listens)"
    )
    interface: str | None = option(None, doc="or a network interface name whose address is used (e.g. eth1)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_local_address("", self.local_address, self.interface)

"""Plain configuration dataclasses, name-for-name with vLLM's; they import nothing heavy, so a control plane can
build and serialise them without torch."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class WeightTransferConfig:
    """Which weight-transfer engine a worker uses.

    ``backend`` is a bare (``"shm"``) or qualified (``"wtransfer-nccl:nccl"``) name. ``module_path`` is the seed
    fallback: when ``backend`` is not a known name, the class called ``backend`` is imported from that module."""

    backend: str = "shm"
    module_path: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParallelConfig:
    """Where one worker process sits: its rank inside its data-parallel replica."""

    rank: int = 0
    world_size: int = 1
    data_parallel_index: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"ParallelConfig.world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ParallelConfig.rank must be in [0, {self.world_size}), got {self.rank}")
        if self.data_parallel_index < 0:
            raise ValueError(f"ParallelConfig.data_parallel_index must be >= 0, got {self.data_parallel_index}")


@dataclass
class KVTransferConfig:
    """Which KV connector an engine uses and how it is configured (vLLM's names).

    ``kv_connector_extra_config`` carries connector and spec options; ``kv_connector_module_path`` is the seed
    fallback for connectors not installed as plugins."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"KVTransferConfig.kv_role must be one of {', '.join(KV_ROLES)}; got {self.kv_role!r}")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe copy, for sending to another process."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVTransferConfig:
        return cls(**data)

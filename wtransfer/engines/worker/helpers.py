"""Worker-side helpers shared by the built-in engines (and reusable by plugins).

The manifest update info, the seed's rank rule, and refusing wire parameters at init rather than mid-round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wtransfer.engines.rounds.manifest import Manifest
from wtransfer.engines.worker.base import WeightTransferEngine, WeightTransferUpdateInfo
from wtransfer.options import option, option_value


@dataclass(frozen=True)
class BufferBudgetOptions:
    """Worker options every built-in engine takes: the most buffer memory a trainer may ask for."""

    max_buffer_bytes: int | None = option(
        None, doc="refuse at init a trainer asking for more buffer bytes (bucket_bytes x num_buffers); None: no limit"
    )

    def __post_init__(self) -> None:
        if self.max_buffer_bytes is not None and self.max_buffer_bytes < 1:
            raise ValueError(f"'max_buffer_bytes' must be a positive number of bytes (or None: no limit), got "
                             f"{self.max_buffer_bytes}")


@dataclass
class ManifestUpdateInfo(WeightTransferUpdateInfo):
    """Per-round info shared by the built-in engines: the manifest as its JSON dict."""

    manifest: dict[str, Any]
    parsed: Manifest = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.parsed = Manifest.from_dict(self.manifest)


def global_rank(engine: WeightTransferEngine, rank_offset: int, world_size: int) -> int:
    """The seed's rank rule: ``dp_index * tp_world_size + rank + rank_offset``, range-checked."""
    parallel = engine.parallel_config
    rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + rank_offset
    if not 0 < rank < world_size:
        raise ValueError(
            f"{type(engine).__name__}: this worker's rank {rank} (data_parallel_index "
            f"{parallel.data_parallel_index} x world_size {parallel.world_size} + rank {parallel.rank} "
            f"+ rank_offset {rank_offset}) is outside 1..{world_size - 1}; check the trainer's "
            f"'world_size' (trainer + every worker process) and each worker's ParallelConfig"
        )
    return rank


def check_buffer_budget(engine: WeightTransferEngine, bucket_bytes: int, num_buffers: int) -> None:
    """Refuse at init (never mid-transfer) more buffer memory than ``max_buffer_bytes`` allows (read from the
    raw ``config.options`` when the engine declares no ``options_cls``)."""
    limit = option_value(getattr(engine, "options", engine.config.options), "max_buffer_bytes")
    if limit is not None and bucket_bytes * num_buffers > int(limit):
        raise ValueError(
            f"{type(engine).__name__}: the trainer asks for {num_buffers} x {bucket_bytes} bytes of "
            f"buffers, over this worker's max_buffer_bytes={int(limit)}; lower the trainer's "
            f"bucket_bytes/num_buffers or raise the worker's limit"
        )


__all__ = ["BufferBudgetOptions", "ManifestUpdateInfo", "check_buffer_budget", "global_rank"]

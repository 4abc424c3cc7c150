"""The KV offloading contract: a spec, its scheduler-side manager and its worker-side handlers.

* the **manager** (scheduler side) is pure bookkeeping: which block hashes the tier holds, where, which are pinned
  by loads or in flight, and which to evict to make room;
* the **handlers** (worker side) move bytes between the engine's paged KV cache and the tier, asynchronously, and
  report when each job is done.

Only small dataclasses with ``to_dict``/``from_dict`` travel between the halves, so they can sit in different
processes without pickle. No torch at top level: the registry imports this module to check plugin classes.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtransfer import options as _options
from wtransfer.kvcache import KVComponent
from wtransfer.options import option

if TYPE_CHECKING:
    import torch

    from wtransfer.config import KVTransferConfig
    from wtransfer.kvcache import KVCacheSpec

BlockHash = Hashable
"""Whatever the connector uses to name a block's content (chained hashes: bytes, int or str)."""

DEVICE_MEDIUM = "device"
"""The engine's own paged KV cache, wherever it lives (a GPU, or plain CPU tensors)."""
CPU_MEDIUM = "cpu"
"""A tier in host memory."""


@dataclass(frozen=True)
class LoadStoreSpec:
    """Where some blocks live on one medium: block ids in transfer order.

    On the device medium the ids are engine blocks; with an offloaded block of ``k`` engine blocks, each run of
    ``k`` consecutive ids forms one offloaded block. A load may give fewer engine blocks than its offloaded blocks
    cover (by less than ``k``): the engine already holds the leading part of the first one, so handlers skip that
    many leading engine blocks of the source."""

    medium: str
    block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        ids = tuple(int(i) for i in self.block_ids)
        if any(i < 0 for i in ids):
            raise ValueError(f"LoadStoreSpec block ids must be >= 0, got {ids}")
        object.__setattr__(self, "block_ids", ids)

    def __len__(self) -> int:
        return len(self.block_ids)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form, for sending from the scheduler to a worker process."""
        return {"medium": self.medium, "block_ids": list(self.block_ids)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadStoreSpec:
        return cls(medium=str(data["medium"]), block_ids=tuple(data["block_ids"]))


TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]
"""``(source, destination)`` of one transfer job."""


@dataclass(frozen=True)
class TransferResult:
    """How one transfer job ended. ``error`` says why when ``success`` is false."""

    job_id: int
    success: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class PrepareStoreOutput:
    """What ``prepare_store`` decided: the blocks to write, where, and what was evicted for them.

    ``block_hashes_to_store`` excludes blocks already stored or in flight (it may be empty);
    ``store_spec.block_ids[i]`` is the tier slot of ``block_hashes_to_store[i]``."""

    block_hashes_to_store: tuple[BlockHash, ...]
    store_spec: LoadStoreSpec
    block_hashes_evicted: tuple[BlockHash, ...] = ()


def _json_hash(block_hash: BlockHash) -> Any:
    if isinstance(block_hash, (bytes, bytearray)):
        return bytes(block_hash).hex()
    if isinstance(block_hash, (int, str)):
        return block_hash
    return str(block_hash)


@dataclass(frozen=True)
class OffloadingEvent:
    """Blocks that became available in (or were removed from) a tier, for external KV indexers."""

    block_hashes: tuple[BlockHash, ...]
    block_size: int
    medium: str
    removed: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: bytes hashes become hex strings."""
        return {
            "block_hashes": [_json_hash(h) for h in self.block_hashes],
            "block_size": self.block_size,
            "medium": self.medium,
            "removed": self.removed,
        }


class OffloadingManager(ABC):
    """Scheduler-side bookkeeping of one tier: no bytes move here.

    The call protocol, per block: ``prepare_store`` -> (worker writes) -> ``complete_store``;
    ``lookup`` -> ``prepare_load`` (pins) -> (worker reads) -> ``complete_load`` (unpins).
    Pinned and in-flight blocks are never evicted; a failed store frees its slot."""

    @abstractmethod
    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        """Length of the leading run of ``block_hashes`` that is stored and ready to load."""

    @abstractmethod
    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        """Pin the blocks (they cannot be evicted until ``complete_load``) and say where they are."""

    @abstractmethod
    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Record one use of the blocks (the eviction policy's signal); unknown hashes are ignored."""

    @abstractmethod
    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        """Unpin blocks pinned by ``prepare_load``."""

    @abstractmethod
    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """Reserve slots for the blocks not yet held, evicting if needed; ``None`` (and nothing changed) when room
        cannot be made without evicting pinned or in-flight blocks."""

    @abstractmethod
    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Mark prepared blocks ready (``success``), or free their slots (failure: not reported stored)."""

    def take_events(self) -> list[OffloadingEvent]:
        """Drain stored / removed events since the last call (default: this manager emits none)."""
        return []


class OffloadingHandler(ABC):
    """Worker-side mover of blocks between two media; ``transfer_async`` must return promptly and copy elsewhere (a
    thread, a CUDA stream, a remote call)."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Start copying ``spec = (source, destination)``; ``False`` if the job was not accepted."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Results of jobs that ended since the last call (each job is reported once)."""

    @abstractmethod
    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until every job in ``job_ids`` has ended (results stay for ``get_finished``)."""

    def cancel(self, job_ids: Iterable[int]) -> bool:
        """Stop ``job_ids`` so that none of them writes anything once this returns (each still ends in
        ``get_finished``: as failed, or as done if its last write came first); False if this tier cannot promise
        that (the default). The connector cancels a load that
        missed its deadline: the engine then recomputes into those blocks or gives them to other requests."""
        return False

    def shutdown(self) -> None:  # noqa: B027 - optional hook, most handlers need it
        """Stop background work and release resources; the default has nothing to release."""


@dataclass(frozen=True)
class SpecChoiceOptions:
    """Which spec to create: the only ``kv_connector_extra_config`` keys the offloading connector itself reads."""

    spec_name: str = option("cpu", doc="which offloading spec to create (a registered name)")
    spec_module_path: str | None = option(None, doc="module to import the spec_name class from, if not registered")


@dataclass(frozen=True)
class OffloadingSpecOptions(SpecChoiceOptions):
    """The ``kv_connector_extra_config`` keys every spec takes: which spec, and the offloaded block size. A spec's
    ``options_cls`` subclasses this, so the offloading connector's one dict is checked once, every valid key named."""

    block_size: int | None = option(
        None, doc="tokens per offloaded block, a multiple of the engine's block size (default: the engine's)"
    )
    transfer_timeout_s: float = option(
        60.0, doc="seconds the connector waits for the tier's jobs: a load past it is recomputed, a store past it "
        "fails, and no load goes to a tier while one it gave up on is unfinished"
    )

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"kv_connector_extra_config['block_size'] must be > 0, got {self.block_size!r}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"kv_connector_extra_config['transfer_timeout_s'] must be > 0 seconds, "
                             f"got {self.transfer_timeout_s!r}")


_BASE_KEYS = frozenset(f.name for f in dataclasses.fields(OffloadingSpecOptions))


class OffloadingSpec(KVComponent, ABC):
    """Base class of KV offloading specs: where evicted KV blocks go, and how.

    Declare options (``config.kv_connector_extra_config``) in ``options_cls``, a subclass of
    :class:`OffloadingSpecOptions`, and read the parsed ``self.options``; what else a spec class declares:
    :class:`~wtransfer.kvcache.KVComponent`. ``block_size`` there is the offloaded block size in tokens, a multiple
    of the engine's (default: the engine's).
    """

    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec | None = None) -> None:
        self.config = config
        self.kv_cache_spec = kv_cache_spec
        self.extra_config: dict[str, Any] = dict(config.kv_connector_extra_config)
        self.options: Any = self.parse_options(self.extra_config)
        """The parsed ``options_cls`` instance (or a copy of the dict as given, if undeclared)."""
        self.engine_block_size: int | None = kv_cache_spec.block_size if kv_cache_spec else None
        self.offloaded_block_size: int | None = self._offloaded_block_size()

    @classmethod
    def _owner(cls) -> str:
        return cls.options_owner or f"offloading spec {cls.__name__}"

    @classmethod
    def parse_options(cls, raw: Mapping[str, Any] | None) -> Any:
        """Check ``kv_connector_extra_config`` against ``options_cls`` once, at creation: a misspelled key fails as
        unknown, with a "did you mean". Keys of :class:`OffloadingSpecOptions` that ``options_cls`` does not declare
        are left to the factory and this class."""
        if cls.options_cls is None:
            return dict(raw or {})
        declared = {f.name for f in dataclasses.fields(cls.options_cls)}
        own = {key: value for key, value in (raw or {}).items() if key in declared or key not in _BASE_KEYS}
        return _options.parse_options(cls.options_cls, own, owner=cls._owner(), where="kv_connector_extra_config")

    def _offloaded_block_size(self) -> int | None:
        base = self.options
        if not isinstance(base, OffloadingSpecOptions):  # undeclared, or declared without the base keys
            raw = {key: value for key, value in self.extra_config.items() if key in _BASE_KEYS}
            base = _options.parse_options(
                OffloadingSpecOptions, raw, owner=self._owner(), where="kv_connector_extra_config"
            )
        size = base.block_size
        if size is None:
            return self.engine_block_size
        if self.engine_block_size is not None and size % self.engine_block_size:
            nearest = self.engine_block_size * max(1, size // self.engine_block_size)
            raise ValueError(
                f"kv_connector_extra_config['block_size'] ({size}) must be a multiple of the engine's "
                f"block size ({self.engine_block_size}); try {nearest}"
            )
        return size

    @property
    def block_size_factor(self) -> int:
        """How many engine blocks make one offloaded block."""
        if self.engine_block_size is None or self.offloaded_block_size is None:
            raise ValueError(f"{type(self).__name__} was created without a KVCacheSpec; pass one to create_spec")
        return self.offloaded_block_size // self.engine_block_size

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release what ``get_handlers`` created (threads, buffers); idempotent. Default: nothing."""

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager (one per spec instance; repeated calls return the same one)."""

    @abstractmethod
    def get_handlers(
        self, kv_caches: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, str, OffloadingHandler]]:
        """Worker side: yield ``(source medium, destination medium, handler)`` for each direction."""


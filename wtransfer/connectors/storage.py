"""``storage``: KV blocks saved to and loaded from a directory (local or shared filesystem).

Options: :class:`StorageOptions` (and the table in docs/kv-connectors.md). Blocks live at
``<path>/<namespace[:16]>/<hash>.safetensors``, one safetensors file per block (see
:mod:`wtransfer.connectors._blockfile`); with tensor parallelism one file per worker's part,
``<hash>.<part>of<parts>.safetensors``, and a block is stored only when every part is. Past ``capacity_bytes``,
whichever process sharing the store notices evicts (:mod:`wtransfer.connectors._budget`). A save that would exceed
``max_pending_save_bytes`` is dropped (``saves_dropped_backlog``) and recomputed by a later request: nothing waits on
slow storage. Loads still running after ``io_timeout_s`` count as failed (``get_block_ids_with_load_errors``: vLLM
recomputes them or fails the request, per its ``kv_load_failure_policy``) and never write into the cache afterwards.

Matching is per block: if the first ``k`` blocks after a request's local hits are stored and valid, it gets
``k * block_size`` tokens. Truncated, corrupt or foreign-layout files are misses: logged, counted in
:meth:`StorageConnector.get_kv_connector_stats`, moved aside (``.corrupt``) so a later save replaces them, never
copied into the cache. A block failing its checksum at load time is reported as a load error and recomputed.

``kv_role``: ``kv_producer`` only saves, ``kv_consumer`` only loads, ``kv_both`` does both.

A stored block is always the KV its hash names: ``wait_for_save`` copies each new block out of the cache before it
returns (vLLM may then reuse the block) and only the file write runs in the background. A finished request is
reported done (``get_finished``) once its files are written, so the next request finds them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from wtransfer.connectors._base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from wtransfer.connectors._budget import IN_USE_PREFIX, IN_USE_REFRESH_S, StoreBudget, filesystem_share
from wtransfer.connectors._blockfile import (
    CORRUPT_SUFFIX,
    BlockFileError,
    BlockLayout,
    check_header,
    read_block_file,
    write_block_file,
)
from wtransfer.connectors._request import full_block_range
from wtransfer.kvcache import KV_LAYOUTS, block_view
from wtransfer.options import option

if TYPE_CHECKING:
    import numpy as np
    import torch

    from wtransfer.config import KVTransferConfig
    from wtransfer.connectors._request import KVRequest, SchedulerStep
    from wtransfer.kvcache import KVCacheSpec

logger = logging.getLogger("wtransfer")


LAST_USE_REFRESH_S = 1.0
"""A lookup hit marks a block file used only if its last use is older than this (seconds): no write per lookup."""


class _DefaultCapacity(int):
    """The default ``capacity_bytes``, told apart from the same number given explicitly: it shrinks to a quarter
    of the store's filesystem where that is less."""


DEFAULT_CAPACITY = _DefaultCapacity(64 << 30)


@dataclass(frozen=True)
class StorageOptions:
    """``kv_connector_extra_config`` of the storage connector (see the module docstring)."""

    path: str = option(doc="directory that holds the blocks (local or shared filesystem)")
    io_threads: int = option(2, doc="threads that read and write block files")
    fsync: bool = option(False, doc="fsync each block file before renaming it into place (survives power loss)")
    io_timeout_s: float = option(60.0, doc="seconds the worker waits for a step's loads; later ones count as failed")
    capacity_bytes: int | None = option(
        DEFAULT_CAPACITY, doc="most bytes the store's block files may take, all namespaces together; namespaces no "
        "instance uses are evicted first, then the least recently used (default 64 GiB, or a quarter of the "
        "filesystem holding path if less; null: unbounded)"
    )
    max_pending_save_bytes: int = option(
        256 << 20, doc="host bytes of block copies waiting to be written; saves beyond it are dropped"
    )

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("option 'path' must name a directory, got ''")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.io_timeout_s <= 0:
            raise ValueError(f"io_timeout_s must be > 0 seconds, got {self.io_timeout_s}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0 (or null for unbounded), got {self.capacity_bytes}")
        if self.max_pending_save_bytes < 0:
            raise ValueError(f"max_pending_save_bytes must be >= 0, got {self.max_pending_save_bytes}")


@dataclass(frozen=True)
class BlockTransfer:
    """One block to move: which request, which block of it, where in the cache, which hash."""

    request_id: str
    block_index: int
    block_id: int
    block_hash: str

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BlockTransfer:
        return cls(str(data["request_id"]), int(data["block_index"]), int(data["block_id"]), str(data["block_hash"]))


@dataclass
class StorageConnectorMetadata(KVConnectorMetadata):
    """One step's work for the storage worker: blocks to load before the forward pass, blocks to save after.
    ``to_dict`` is the default (``asdict`` recurses); ``from_dict`` rebuilds the nested transfers."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StorageConnectorMetadata:
        return cls(
            loads=[BlockTransfer.from_dict(t) for t in data.get("loads", [])],
            saves=[BlockTransfer.from_dict(t) for t in data.get("saves", [])],
        )


class _Counters:
    """Thread-safe integer counters (I/O threads and the engine thread both count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = defaultdict(int)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class BlockStore:
    """The directory layout of one store for one model/layout namespace, shared by both roles."""

    def __init__(self, root: str, layout: BlockLayout, counters: _Counters) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.layout = layout
        self.counters = counters
        self.namespace_dir = os.path.join(self.root, layout.namespace[:16])
        self._made_dirs: set[str] = set()
        self._marked_at = float("-inf")
        # this connector's own in-use marker
        self._marker = os.path.join(self.namespace_dir, f"{IN_USE_PREFIX}{os.getpid()}-{id(self):x}")
        # every part's layout (tensor parallelism: one file per worker's part of a block)
        self._parts = [layout if shard == layout.shard else dataclasses.replace(layout, shard=shard)
                       for shard in range(layout.num_shards)]

    def path_for(self, block_hash: str, shard: int | None = None) -> str:
        """This engine's part of the block (or part ``shard``)."""
        layout = self.layout if shard is None else self._parts[shard]
        return os.path.join(self.namespace_dir, f"{block_hash}{layout.file_suffix()}")

    def mark_in_use(self) -> None:
        """Tell other processes' evictions that this namespace is in use (at most once a minute)."""
        import time

        now = time.monotonic()
        if now - self._marked_at < IN_USE_REFRESH_S:
            return
        self._marked_at = now
        try:
            os.makedirs(self.namespace_dir, exist_ok=True)
            with open(self._marker, "a"):
                pass
            os.utime(self._marker)
        except OSError as exc:  # a read-only store: eviction then goes by last use alone
            logger.debug("storage connector: could not mark %s in use: %s", self.namespace_dir, exc)

    def release(self) -> None:
        """This connector is done with the namespace (its marker goes; others' stay)."""
        with contextlib.suppress(OSError):
            os.unlink(self._marker)

    def ensure_parent(self, path: str, *, recheck: bool = False) -> None:
        """Create the block's directory once per process (``recheck`` after someone removed it)."""
        parent = os.path.dirname(path)
        if recheck or parent not in self._made_dirs:
            os.makedirs(parent, exist_ok=True)
            self._made_dirs.add(parent)
        if recheck:  # the directory was removed, our marker with it: mark it again now
            self._marked_at = float("-inf")
            self.mark_in_use()

    def contains(self, block_hash: str, refresh_s: float | None = None) -> bool:
        """True if valid-looking files (size and header checked, data not read) hold every part of the block.
        ``refresh_s``: mark each part used now if its last use is older (see ``check_header``)."""
        for shard, layout in enumerate(self._parts):
            path = self.path_for(block_hash, shard)
            try:
                check_header(path, layout, block_hash, refresh_s)
            except FileNotFoundError:
                return False
            except BlockFileError as exc:
                self.report_corrupt(path, exc)
                return False
        return True

    def report_corrupt(self, path: str, error: Exception) -> None:
        """Count and log a bad entry, and move it aside so it is never read again and a save can replace it."""
        self.counters.add("corrupt_blocks")
        logger.warning("storage connector: treating %s as a miss: %s", path, error)
        try:
            os.replace(path, path + CORRUPT_SUFFIX)
        except OSError:
            pass  # already moved or removed by another process


@dataclass(slots=True, eq=False)
class _LoadTicket:
    """One load's state, under the connector's cache-write lock: copied into the cache, or abandoned by its step
    (then it never will be)."""

    abandoned: bool = False
    copied: bool = False


def _log_eviction_failure(future: Future[int]) -> None:
    error = future.exception() if not future.cancelled() else None
    if error is not None:
        logger.error("storage connector: evicting from the store failed: %r", error)


class StorageConnector(KVConnectorBase):
    """Per-block prefix store in a directory; asynchronous saves, parallel checked loads."""

    metadata_cls = StorageConnectorMetadata
    supported_layouts = tuple(KV_LAYOUTS)  # blocks are copied as opaque runs of bytes (block_view)
    handles_parts = True  # one file per worker's part; a block counts when all are there
    options_cls = StorageOptions
    options_owner = "storage connector"
    options: StorageOptions

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec | None = None
    ) -> None:
        super().__init__(config, role, kv_cache_spec)  # parses and checks self.options
        self.io_threads = self.options.io_threads
        self.fsync = self.options.fsync
        self.io_timeout_s = self.options.io_timeout_s
        spec = self.require_spec()
        self.block_size = spec.block_size
        self.counters = _Counters()
        self.store = BlockStore(self.options.path, BlockLayout.for_spec(spec), self.counters)
        if self.config.is_kv_producer and self.options.max_pending_save_bytes < self.store.layout.data_bytes:
            raise ValueError(
                f"max_pending_save_bytes={self.options.max_pending_save_bytes} is less than one block "
                f"({self.store.layout.data_bytes} bytes here): no block could ever be saved; raise it"
            )
        capacity = self.options.capacity_bytes
        if capacity is not None and capacity is not DEFAULT_CAPACITY and capacity < self.store.layout.file_bytes:
            raise ValueError(
                f"capacity_bytes={capacity} is less than one block file ({self.store.layout.file_bytes} bytes "
                f"here): every save would be evicted at once and no lookup would ever hit; raise it (or null for an "
                f"unbounded store)"
            )
        if capacity is DEFAULT_CAPACITY:
            capacity = filesystem_share(self.store.root, 0.25, DEFAULT_CAPACITY)
        self.budget = StoreBudget(self.store.root, capacity, self.counters.add) if capacity is not None else None
        self.store.mark_in_use()
        # scheduler state
        self._matches: dict[str, tuple[int, int]] = {}  # request -> (first block index, matched blocks)
        self._pending_loads: list[BlockTransfer] = []
        self._requests_with_saves: set[str] = set()
        # worker state
        self._block_views: list[np.ndarray] = []  # per layer, [segments, num_blocks, block elements]
        self._executor: ThreadPoolExecutor | None = None
        self._buffers = threading.local()
        self._load_futures: list[tuple[BlockTransfer, _LoadTicket, Future[bool]]] = []
        self._failed_from: dict[str, int] = {}  # request -> first block index that failed to load this step
        self._load_errors: set[int] = set()
        self._cache_writes = threading.Lock()  # a load copies into the cache only while it holds this
        self._inflight_lock = threading.Lock()
        self._inflight: dict[str, int] = defaultdict(int)  # request -> its file writes not yet done
        self._inflight_futures: set[Future[None]] = set()
        self._saw_saves: set[str] = set()
        self._finished_waiting: set[str] = set()
        self._pending_save_bytes = 0
        self._closed = False

    # ================================================================ scheduler side
    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.config.is_kv_consumer or num_computed_tokens % self.block_size:
            return 0, False
        start = num_computed_tokens // self.block_size
        limit = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        matched = 0
        self.store.mark_in_use()
        refresh_s = None if self.budget is None else LAST_USE_REFRESH_S  # about to be loaded: evicted last
        for index in range(start, limit):
            if not self.store.contains(request.block_hashes[index], refresh_s):
                break
            matched += 1
        self.counters.add("lookup_hit_blocks", matched)
        self.counters.add("lookup_miss_blocks", max(0, limit - start - matched))
        self._matches[request.request_id] = (start, matched)
        return matched * self.block_size, False

    def update_state_after_alloc(self, request: KVRequest, block_ids: list[int], num_external_tokens: int) -> None:
        start, matched = self._matches.pop(request.request_id, (0, 0))
        count = num_external_tokens // self.block_size
        if count == 0:
            return
        first = request.num_computed_tokens // self.block_size
        if count > matched or start != first:
            raise ValueError(
                f"storage connector: engine asked to load {count} blocks from block {first} for request "
                f"{request.request_id!r}, but the lookup matched {matched} from block {start}"
            )
        for index in range(start, start + count):
            self._pending_loads.append(
                BlockTransfer(request.request_id, index, block_ids[index], request.block_hashes[index])
            )

    def build_connector_meta(self, step: SchedulerStep) -> StorageConnectorMetadata:
        saves: list[BlockTransfer] = []
        if self.config.is_kv_producer:
            for entry in step.scheduled:
                request = entry.request
                for index in full_block_range(
                    request.num_computed_tokens, entry.num_computed_after_step, self.block_size
                ):
                    saves.append(
                        BlockTransfer(request.request_id, index, entry.block_ids[index], request.block_hashes[index])
                    )
                    self._requests_with_saves.add(request.request_id)
        meta = StorageConnectorMetadata(loads=self._pending_loads, saves=saves)
        self._pending_loads = []
        return meta

    def request_finished(self, request: KVRequest, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request with saves is reported done (and its blocks freed) once its files are written, so the next
        request finds them (read-your-writes); ``wait_for_save`` already copied the blocks out."""
        self._matches.pop(request.request_id, None)
        delay = request.request_id in self._requests_with_saves
        self._requests_with_saves.discard(request.request_id)
        return delay, None

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec = self.require_spec()
        if set(kv_caches) != set(spec.layer_names):
            raise ValueError(
                f"storage connector: kv_caches layers {sorted(kv_caches)} differ from the spec's "
                f"{list(spec.layer_names)}"
            )
        import torch

        # Each layer as an integer numpy array (no copy): numpy copies avoid torch's per-call overhead and intra-op
        # threads, and work for dtypes numpy lacks (bf16, fp8).
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        views = []
        for name in spec.layer_names:
            view = block_view(spec, name, kv_caches[name], who="storage connector")
            views.append(view.view(as_int[view.element_size()]).numpy())
        self._block_views = views

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._meta()
        if meta.loads and not self.config.is_kv_consumer:
            raise ValueError("storage connector: got loads but kv_role is kv_producer")
        for transfer in meta.loads:
            ticket = _LoadTicket()
            self._load_futures.append((transfer, ticket, self._pool().submit(self._load_block, transfer, ticket)))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Each file holds every layer of its block, so the first layer waits for all of this step's loads."""
        self._await_loads()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None, **kwargs: Any) -> None:
        """Nothing per layer: a block file holds all layers, so saves start in :meth:`wait_for_save`."""

    def skip_saves(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self._failed_from[request_id] = 0

    def wait_for_save(self) -> None:
        """Copy this step's new blocks out of the cache, then return; files are written in the background.

        The copy must finish first: from then on vLLM may hand these blocks to another request (a request preempted
        in the next step loses them at once, unannounced). Copying later stores another request's KV under this
        request's hash, with a valid checksum."""
        meta = self._meta()
        self._await_loads()
        queued: set[str] = set()
        accepted: list[tuple[BlockTransfer, str]] = []
        nbytes = self.store.layout.data_bytes
        for transfer in meta.saves:
            self._saw_saves.add(transfer.request_id)
            failed_from = self._failed_from.get(transfer.request_id)
            if failed_from is not None and transfer.block_index >= failed_from:
                continue  # computed from a block that failed to load: the engine recomputes it
            if transfer.block_hash in queued:
                continue
            queued.add(transfer.block_hash)
            path = self.store.path_for(transfer.block_hash)
            if os.path.exists(path):
                self.counters.add("save_skipped_existing")
                if self.budget is not None:
                    self.budget.touch(path)  # computed again: in use, like a hit
                continue
            with self._inflight_lock:
                if self._pending_save_bytes + nbytes > self.options.max_pending_save_bytes:
                    self.counters.add("saves_dropped_backlog")
                    continue
                self._pending_save_bytes += nbytes
                self._inflight[transfer.request_id] += 1
            accepted.append((transfer, path))
        self._failed_from.clear()
        if not accepted:
            return
        submitted = 0
        try:
            copies = self._copy_out([transfer.block_id for transfer, _ in accepted])  # before returning
            for (transfer, path), copy in zip(accepted, copies):
                future = self._pool().submit(self._write_block, transfer, path, memoryview(copy).cast("B"))
                submitted += 1
                with self._inflight_lock:
                    self._inflight_futures.add(future)
                future.add_done_callback(lambda f, rid=transfer.request_id: self._save_done(rid, f))
        except Exception as exc:  # out of memory copying, or shut down meanwhile: a save is never worth a step
            logger.error("storage connector: %d block saves not started: %r", len(accepted) - submitted, exc)
        finally:  # those hold no request's blocks: the request is reported done without them
            for transfer, _ in accepted[submitted:]:
                self.counters.add("save_errors")
                self._settle_save(transfer.request_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finished_waiting |= {r for r in finished_req_ids if r in self._saw_saves}
        with self._inflight_lock:
            done = {r for r in self._finished_waiting if self._inflight.get(r, 0) == 0}
        self._finished_waiting -= done
        self._saw_saves -= done
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, Any]:
        return self.counters.snapshot()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            with self._inflight_lock:
                pending = set(self._inflight_futures)
            _, not_done = wait_futures(pending, timeout=self.io_timeout_s)
            if not_done:
                logger.error("storage connector: %d block saves still running after %gs (io_timeout_s); abandoning "
                             "them (each lands whole or not at all; the process's exit still waits for them)",
                             len(not_done), self.io_timeout_s)
            # queued saves are cancelled; running ones are waited for only if they all ended within io_timeout_s
            self._executor.shutdown(wait=not not_done, cancel_futures=True)
            self._executor = None
        self.store.release()  # unless another instance uses it, the namespace is evicted first now
        if self.budget is not None and self.budget.over_capacity():
            self.budget.evict()  # the last saves' eviction may have been cancelled: leave the store in bounds

    # ---------------------------------------------------------------- internals
    def _meta(self) -> StorageConnectorMetadata:
        return cast(StorageConnectorMetadata, self._get_connector_metadata())  # checked against metadata_cls

    def _pool(self) -> ThreadPoolExecutor:
        if self._closed:
            raise RuntimeError("storage connector is shut down")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.io_threads, thread_name_prefix="wtransfer-storage")
        return self._executor

    def _views(self) -> list[np.ndarray]:
        if not self._block_views:
            raise RuntimeError("storage connector: register_kv_caches() was not called on the worker instance")
        return self._block_views

    def _staging(self) -> tuple[np.ndarray, memoryview]:
        """This thread's reused block-sized staging buffer and its bytes: no allocation per block."""
        staging = getattr(self._buffers, "staging", None)
        if staging is None:
            import numpy as np

            views = self._views()
            staging = np.empty((len(views), views[0].shape[0], views[0].shape[2]), dtype=views[0].dtype)
            self._buffers.staging = staging
            self._buffers.raw = memoryview(staging).cast("B")
        return staging, self._buffers.raw

    def _await_loads(self) -> None:
        if not self._load_futures:
            return
        pending, self._load_futures = self._load_futures, []
        _, not_done = wait_futures([f for _, _, f in pending], timeout=self.io_timeout_s)
        late = 0
        if not_done:
            # Those loads may still finish later, into blocks the engine has reused: under the lock a load either
            # copied already or is marked and never will; the ones not started are cancelled.
            with self._cache_writes:
                for _, ticket, future in pending:
                    if not future.done() and not ticket.copied:
                        ticket.abandoned = True
                        future.cancel()
                        late += 1
        for transfer, ticket, future in pending:
            if ticket.abandoned or not (ticket.copied or future.result()):
                self._load_errors.add(transfer.block_id)
                previous = self._failed_from.get(transfer.request_id, transfer.block_index)
                self._failed_from[transfer.request_id] = min(previous, transfer.block_index)
        if late:
            self.counters.add("loads_abandoned", late)
            logger.warning("storage connector: %d block loads did not finish within %gs (io_timeout_s) from %s; "
                           "they count as failed and never write into the cache", late, self.io_timeout_s,
                           self.store.root)

    def _load_block(self, transfer: BlockTransfer, ticket: _LoadTicket) -> bool:
        """Read, check, then copy into the cache; False (and nothing copied) on any problem."""
        path = self.store.path_for(transfer.block_hash)
        staging, raw = self._staging()
        try:
            read_block_file(path, self.store.layout, transfer.block_hash, raw)
        except BlockFileError as exc:
            self.counters.add("load_errors")
            if os.path.exists(path):
                self.store.report_corrupt(path, exc)
            else:
                logger.warning("storage connector: %s", exc)
            return False
        with self._cache_writes:
            if ticket.abandoned:  # its step gave up on it: the block may be someone else's now
                return False
            for layer, view in enumerate(self._views()):  # only now, with every check passed
                view[:, transfer.block_id] = staging[layer]
            ticket.copied = True
        if self.budget is not None:
            self.budget.touch(path)  # recently used: evicted last
        self.counters.add("loaded_blocks")
        self.counters.add("loaded_bytes", self.store.layout.data_bytes)
        return True

    def _copy_out(self, block_ids: list[int]) -> np.ndarray:
        """The blocks ``block_ids`` of every layer copied into new host memory, one gather per layer;
        ``result[i]`` is block ``block_ids[i]``'s file data, contiguous."""
        import numpy as np

        views = self._views()
        ids = np.asarray(block_ids)
        copies = np.empty((len(ids), len(views), views[0].shape[0], views[0].shape[2]), dtype=views[0].dtype)
        for layer, view in enumerate(views):  # view: [segments, num_blocks, block elements]
            copies[:, layer] = view[:, ids].swapaxes(0, 1)
        return copies

    def _write_block(self, transfer: BlockTransfer, path: str, raw: memoryview) -> None:
        self.store.mark_in_use()
        try:
            self.store.ensure_parent(path)
            try:
                written = write_block_file(path, self.store.layout, transfer.block_hash, raw, fsync=self.fsync)
            except FileNotFoundError:  # the directory was removed under us (a cache clean-up): recreate once
                self.store.ensure_parent(path, recheck=True)
                written = write_block_file(path, self.store.layout, transfer.block_hash, raw, fsync=self.fsync)
        except OSError as exc:
            self.counters.add("save_errors")
            logger.error("storage connector: could not save block %s to %s: %s", transfer.block_hash[:16], path, exc)
            return
        self.counters.add("saved_blocks")
        self.counters.add("saved_bytes", self.store.layout.data_bytes)
        if self.budget is not None and self.budget.added(written):
            # A task of its own: this write (and its request's delayed free) completes now.
            try:
                self._pool().submit(self.budget.evict).add_done_callback(_log_eviction_failure)
            except RuntimeError:  # shutting down: shutdown() evicts once more if needed
                pass

    def _save_done(self, request_id: str, future: Future[None]) -> None:
        error = future.exception() if not future.cancelled() else None
        if error is not None:
            self.counters.add("save_errors")
            logger.error("storage connector: a save for request %s failed: %r", request_id, error)
        with self._inflight_lock:
            self._inflight_futures.discard(future)
        self._settle_save(request_id)

    def _settle_save(self, request_id: str) -> None:
        """One of ``request_id``'s saves is over (written, failed or never started): its bytes and count go."""
        with self._inflight_lock:
            self._pending_save_bytes -= self.store.layout.data_bytes
            self._inflight[request_id] -= 1
            if self._inflight[request_id] <= 0:
                del self._inflight[request_id]

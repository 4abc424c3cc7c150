"""The built-in ``cpu`` spec: a host-memory tier for KV blocks evicted from the engine's cache (GPU or CPU).

Options: :class:`CPUSpecOptions` (their docs, and docs/kv-offloading.md). The tier is one tensor allocated (and
faulted in) on the first ``get_handlers`` call; every transfer reuses it and the preallocated staging buffers of its
direction (a store from a GPU keeps two pairs, so one chunk's copy overlaps the last one's host write).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from wtransfer._dtypes import dtype_from_name
from wtransfer.errors import TransferTimeoutError
from wtransfer.kvcache import KV_LAYOUTS, block_view
from wtransfer.options import option
from wtransfer.specs._base import (
    CPU_MEDIUM,
    DEVICE_MEDIUM,
    OffloadingHandler,
    OffloadingSpec,
    OffloadingSpecOptions,
    TransferResult,
    TransferSpec,
)
from wtransfer.specs._manager import BlockTableManager
from wtransfer.specs.policies import create_policy, policy_class

if TYPE_CHECKING:
    from wtransfer.config import KVTransferConfig
    from wtransfer.kvcache import KVCacheSpec

logger = logging.getLogger("wtransfer")

STAGING_BYTES = 16 << 20
"""One layer's copy chunk by default: with the cache on a GPU, smaller chunks stored below plain index ops (each
chunk's copy and host write are one step of a pipeline). Measure yours with ``python -m benchmarks offload
--device cuda --staging-blocks N``; BENCHMARKS.md's offload-gpu block has the default's figures."""


@dataclass(frozen=True)
class CPUSpecOptions(OffloadingSpecOptions):
    """``kv_connector_extra_config`` of the cpu spec (and of the offloading connector in front of it)."""

    num_cpu_blocks: int | None = option(None, doc="tier size in offloaded blocks (or set cpu_bytes_to_use)")
    cpu_bytes_to_use: int | float | None = option(None, doc="tier size in bytes, e.g. 8 << 30 (or set num_cpu_blocks)")
    eviction_policy: str = option("lru", doc="eviction policy: 'lru', 'arc' or an installed wtransfer.policies name")
    staging_blocks: int | None = option(None, doc="engine blocks per copy chunk (bounds the staging buffers; "
                                                  "default: 16 MiB of one layer)")


CPU_SPEC_OPTIONS = tuple(f.name for f in fields(CPUSpecOptions))
"""Every ``kv_connector_extra_config`` key the cpu spec (and the offloading connector in front of it) reads."""


@dataclass(frozen=True)
class BlockRows:
    """One side of a copy: per-layer ``[segments, rows, row_elems]`` views, and rows per block id."""

    medium: str
    layers: tuple[torch.Tensor, ...]
    rows_per_block: int

    @property
    def num_rows(self) -> int:
        return self.layers[0].shape[1]

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def rows(self, block_ids: Sequence[int]) -> list[int]:
        k = self.rows_per_block
        if k == 1:
            return list(block_ids)
        return [block_id * k + offset for block_id in block_ids for offset in range(k)]


@dataclass
class _Job:
    job_id: int
    src_rows: torch.Tensor
    dst_rows: torch.Tensor
    ready: torch.cuda.Event | None = None  # the caller's stream reached this point: the data is written


class BlockCopyHandler(OffloadingHandler):
    """Copies blocks from ``src`` to ``dst`` on a worker thread: per chunk and layer one ``index_select`` into a
    preallocated staging buffer and one ``index_copy_`` out of it (no per-block loop, no allocation per job)."""

    def __init__(
        self,
        src: BlockRows,
        dst: BlockRows,
        *,
        staging_rows: int | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.src, self.dst = src, dst
        self.timeout_s = timeout_s
        segments, _, row_elems = src.layers[0].shape
        self._row_bytes = row_elems * src.layers[0].element_size() * segments * len(src.layers)
        per_row = segments * row_elems * src.layers[0].element_size()
        self._chunk_rows = max(1, staging_rows if staging_rows is not None else STAGING_BYTES // per_row)
        # across devices the host side of the copy is pinned: a copy from or to pageable memory goes through
        # the driver's own bounce buffer at a fraction of the speed
        kinds = (src.device.type, dst.device.type)
        to_gpu, from_gpu = kinds == ("cpu", "cuda"), kinds == ("cuda", "cpu")
        self._src_staging = torch.empty(segments * self._chunk_rows * row_elems, dtype=src.layers[0].dtype,
                                        device=src.device, pin_memory=to_gpu)
        self._dst_staging = (
            self._src_staging
            if dst.device == src.device
            else torch.empty_like(self._src_staging, device=dst.device, pin_memory=from_gpu)
        )
        # from a GPU a second pair of buffers lets the next chunk's copy run while the host scatters this one
        self._spare = (torch.empty_like(self._src_staging), torch.empty_like(self._dst_staging, pin_memory=True)
                       ) if from_gpu else None
        cuda = next((d for d in (src.device, dst.device) if d.type == "cuda"), None)
        self._stream = torch.cuda.Stream(device=cuda) if cuda is not None else None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._cancelled: set[int] = set()
        self._current: int | None = None  # the job the thread runs
        self._writing = threading.Lock()  # held around each write into the destination, and by cancel()
        self._finished: list[TransferResult] = []
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"wtransfer-offload-{src.medium}-to-{dst.medium}", daemon=True
        )
        self._thread.start()

    # -- the contract --------------------------------------------------------------------------
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        source, destination = spec
        if (source.medium, destination.medium) != (self.src.medium, self.dst.medium):
            raise ValueError(
                f"This handler copies {self.src.medium} -> {self.dst.medium}, got a job "
                f"{source.medium} -> {destination.medium}; use the handler get_handlers() yields for that pair"
            )
        src_rows = self.src.rows(source.block_ids)
        dst_rows = self.dst.rows(destination.block_ids)
        surplus = len(src_rows) - len(dst_rows)
        if 0 < surplus < self.src.rows_per_block:
            # the destination starts inside the first source block (see LoadStoreSpec)
            src_rows = src_rows[surplus:]
        if len(src_rows) != len(dst_rows):
            raise ValueError(
                f"Job {job_id}: {len(source)} {source.medium} blocks ({len(src_rows)} engine-block rows) "
                f"do not match {len(destination)} {destination.medium} blocks ({len(dst_rows)} rows)"
            )
        _check_range(src_rows, self.src)
        _check_range(dst_rows, self.dst)
        with self._cond:
            if self._closed:
                return False
            if job_id in self._pending:
                raise ValueError(f"Job id {job_id} is already in flight; use a fresh id per job")
            self._pending.add(job_id)
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # on the caller's current stream, which wrote the blocks
        self._jobs.put(_Job(job_id, _index(src_rows, self.src.device), _index(dst_rows, self.dst.device), ready))
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._cond:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        wanted = set(job_ids)
        limit = self.timeout_s if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(lambda: not (wanted & self._pending), timeout=limit):
                late = sorted(wanted & self._pending)
                raise TransferTimeoutError(
                    f"KV offload jobs {late} ({self.src.medium} -> {self.dst.medium}) did not finish within "
                    f"{limit:.1f}s; raise transfer_timeout_s if the tier is just slow"
                )

    def cancel(self, job_ids: Iterable[int]) -> bool:
        """Queued jobs never start; a running one stops before its next write (each write is one chunk of one
        layer, under the lock this takes). On a GPU the writes already queued on the copy stream land first."""
        with self._writing:
            with self._cond:
                self._cancelled.update(set(job_ids) & self._pending)
            if self._stream is not None:
                self._stream.synchronize()
        return True

    def shutdown(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=self.timeout_s)
        if self._thread.is_alive():
            logger.warning("Offload handler thread %s did not stop within %.1fs", self._thread.name, self.timeout_s)

    # -- the worker thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            started = time.perf_counter()
            try:
                if job.ready is not None and self._stream is not None:
                    self._stream.wait_event(job.ready)
                self._current = job.job_id
                if job.job_id in self._cancelled:  # cancelled while queued: never starts
                    raise _Cancelled
                self._copy(job.src_rows, job.dst_rows)
                result = TransferResult(
                    job.job_id, True, len(job.src_rows) * self._row_bytes, time.perf_counter() - started
                )
            except _Cancelled:
                result = TransferResult(job.job_id, False, 0, time.perf_counter() - started,
                                        "cancelled: it missed its deadline")
            except Exception as exc:  # reported as a failed job, never lost
                logger.exception("KV offload job %d (%s -> %s) failed", job.job_id, self.src.medium, self.dst.medium)
                error = f"{type(exc).__name__}: {exc}"
                result = TransferResult(job.job_id, False, 0, time.perf_counter() - started, error)
            with self._cond:
                self._pending.discard(job.job_id)
                self._cancelled.discard(job.job_id)
                self._finished.append(result)
                self._cond.notify_all()

    def _copy(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        if self._stream is None:
            self._copy_chunks(src_rows, dst_rows)
            return
        try:
            with torch.cuda.stream(self._stream):
                self._copy_chunks(src_rows, dst_rows)
        finally:  # a failed job too: nothing it queued may still write once it is reported
            self._stream.synchronize()

    def _write(self, dst_layer: torch.Tensor, dst_idx: torch.Tensor, rows: torch.Tensor) -> None:
        """One chunk of one layer into the destination, unless the running job was cancelled (checked under the
        lock ``cancel`` takes, so nothing is written once it returned)."""
        with self._writing:
            if self._current in self._cancelled:
                raise _Cancelled
            dst_layer.index_copy_(1, dst_idx, rows)

    def _copy_chunks(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        pairs = [(self._src_staging, self._dst_staging)] + ([self._spare] if self._spare is not None else [])
        waiting: tuple[Any, ...] | None = None  # from a GPU: the last chunk, scattered once its copy landed
        step = 0
        for start in range(0, len(src_rows), self._chunk_rows):
            src_idx = src_rows[start : start + self._chunk_rows]
            dst_idx = dst_rows[start : start + self._chunk_rows]
            for src_layer, dst_layer in zip(self.src.layers, self.dst.layers):
                src_staging, dst_staging = pairs[step % len(pairs)]
                step += 1
                shape = (src_layer.shape[0], len(src_idx), src_layer.shape[2])
                gathered = src_staging[: shape[0] * shape[1] * shape[2]].view(shape)
                torch.index_select(src_layer, 1, src_idx, out=gathered)
                if self._spare is not None:
                    # this chunk's copy is queued before the last one is scattered, so both run at once;
                    # a pair is reused only after its scatter (two steps on), its copy long done
                    landed = dst_staging[: gathered.numel()].view(shape)
                    landed.copy_(gathered, non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record()
                    if waiting is not None:
                        self._scatter(*waiting)
                    waiting = (copied, dst_layer, dst_idx, landed)
                    continue
                if dst_staging is not src_staging:
                    landed = dst_staging[: gathered.numel()].view(shape)
                    landed.copy_(gathered)  # blocking: the staging buffers are reused next layer
                    gathered = landed
                self._write(dst_layer, dst_idx, gathered)
        if waiting is not None:
            self._scatter(*waiting)

    def _scatter(self, copied: Any, dst_layer: torch.Tensor, dst_idx: torch.Tensor, landed: torch.Tensor) -> None:
        """A chunk copied from a GPU into pinned memory, written into the host tier once the copy landed."""
        copied.synchronize()
        self._write(dst_layer, dst_idx, landed)


class _Cancelled(Exception):
    """The job was cancelled: it stops before its next write."""


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _check_range(rows: list[int], side: BlockRows) -> None:
    if rows and max(rows) >= side.num_rows:
        raise ValueError(
            f"Block id out of range on {side.medium}: row {max(rows)} >= {side.num_rows} rows "
            f"({side.num_rows // side.rows_per_block} blocks)"
        )


class CPUOffloadingSpec(OffloadingSpec):
    """KV blocks evicted from the engine's cache go to host memory, chosen by an eviction policy."""

    supported_layouts = tuple(KV_LAYOUTS)  # blocks are copied as opaque rows (block_view)
    handles_parts = True  # a worker's tier holds that worker's part only

    handler_cls: type[BlockCopyHandler] = BlockCopyHandler
    options_cls = CPUSpecOptions
    options_owner = "cpu offloading spec"
    options: CPUSpecOptions

    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec | None = None) -> None:
        super().__init__(config, kv_cache_spec)  # parses and checks self.options (unknown keys, types)
        if kv_cache_spec is None:
            raise ValueError(
                "The cpu offloading spec needs the engine's KVCacheSpec to size its tier: "
                "OffloadingSpecFactory.create_spec(config, kv_cache_spec)"
            )
        self.dtype = dtype_from_name(kv_cache_spec.dtype)
        self.num_layers = len(kv_cache_spec.layer_names)
        self.segments = kv_cache_spec.block_segments
        self.row_elems = math.prod(kv_cache_spec.block_shape) // self.segments
        self.bytes_per_block = (
            self.num_layers * self.segments * self.row_elems * self.block_size_factor * self.dtype.itemsize
        )
        self.num_blocks = self._num_blocks()
        self.policy_cls = policy_class(self.options.eviction_policy)  # resolve once: fail now, not when evicting
        self.timeout_s = self.options.transfer_timeout_s
        self._manager: BlockTableManager | None = None
        self.tier: torch.Tensor | None = None
        """``[layers, segments, num_blocks * block_size_factor, row]`` once the worker side exists."""
        self._handlers: list[tuple[str, str, BlockCopyHandler]] = []

    def _num_blocks(self) -> int:
        options = self.options
        if options.num_cpu_blocks is not None:
            count = options.num_cpu_blocks
        elif options.cpu_bytes_to_use is not None:
            count = int(options.cpu_bytes_to_use) // self.bytes_per_block
        else:
            raise ValueError(
                "The cpu offloading spec needs a size: set kv_connector_extra_config['cpu_bytes_to_use'] "
                f"(bytes) or ['num_cpu_blocks'] (one block is {self.bytes_per_block} bytes here)"
            )
        if count <= 0:
            raise ValueError(
                f"The cpu tier would hold {count} blocks: one offloaded block is {self.bytes_per_block} bytes "
                f"({self.num_layers} layers x {self.offloaded_block_size} tokens); give it more room"
            )
        return count

    def get_manager(self) -> BlockTableManager:
        if self._manager is None:
            self._manager = BlockTableManager(
                self.num_blocks, self.offloaded_block_size or 0, create_policy(self.policy_cls, self.num_blocks),
                medium=CPU_MEDIUM,
            )
        return self._manager

    def get_handlers(self, kv_caches: dict[str, torch.Tensor]) -> Iterator[tuple[str, str, BlockCopyHandler]]:
        if not self._handlers:
            self._handlers = self._make_handlers(kv_caches)
        yield from self._handlers

    def _make_handlers(self, kv_caches: dict[str, torch.Tensor]) -> list[tuple[str, str, BlockCopyHandler]]:
        assert self.kv_cache_spec is not None
        engine_layers = tuple(self._engine_view(name, kv_caches) for name in self.kv_cache_spec.layer_names)
        device = engine_layers[0].device
        started = time.perf_counter()
        # zeros, not empty: fault every page in now rather than during the first transfers
        self.tier = torch.zeros(
            (self.num_layers, self.segments, self.num_blocks * self.block_size_factor, self.row_elems),
            dtype=self.dtype,
            pin_memory=device.type == "cuda",
        )
        logger.info(
            "CPU offload tier: %d blocks of %d tokens, %.1f MiB, allocated in %.2fs",
            self.num_blocks, self.offloaded_block_size, self.tier.nbytes / 2**20, time.perf_counter() - started,
        )
        engine = BlockRows(DEVICE_MEDIUM, engine_layers, 1)
        tier = BlockRows(CPU_MEDIUM, tuple(self.tier.unbind(0)), self.block_size_factor)
        options = {"staging_rows": self.options.staging_blocks, "timeout_s": self.timeout_s}
        return [
            (DEVICE_MEDIUM, CPU_MEDIUM, self.handler_cls(engine, tier, **options)),
            (CPU_MEDIUM, DEVICE_MEDIUM, self.handler_cls(tier, engine, **options)),
        ]

    def _engine_view(self, name: str, kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
        spec = self.kv_cache_spec
        assert spec is not None
        if name not in kv_caches:
            raise ValueError(f"kv_caches has no layer {name!r}; the KVCacheSpec names {list(spec.layer_names)}")
        return block_view(spec, name, kv_caches[name], who="cpu offloading spec", cpu_only=False)

    def shutdown(self) -> None:
        """Stop the handler threads (joined); the tier is released with the spec."""
        for _, _, handler in self._handlers:
            handler.shutdown()

"""The ``offloading`` connector: KV blocks the engine computes go to an offloading spec's tier, and prefixes the
engine's own cache has lost come back from it.

Options (``kv_connector_extra_config``) are the spec's; the connector itself reads only ``spec_name`` and
``spec_module_path`` (:class:`~wtransfer.specs._base.SpecChoiceOptions`; see :meth:`OffloadingConnector.parse_options`).

How the two halves agree
------------------------
The scheduler instance owns the spec's manager, the worker instance its handlers. Step ``N``'s metadata holds the
loads pinned during admission and the stores of blocks that become full during step ``N``. The worker

* submits the loads in ``start_load_kv`` and waits for them before the first layer (``wait_for_layer_load``): a load
  never outlives its step, so the scheduler unpins step ``N``'s loads when it builds step ``N + 1``;
* submits the stores in ``wait_for_save``, after every layer is written, and does *not* wait for them.

A store counts as stored only when the worker says it landed: ``build_connector_worker_meta`` lists the stores that
finished (``stored``) or failed or were dropped (``failed``), and ``update_connector_output`` completes them in the
manager or frees their slots. So a block is offered for loading exactly when its bytes are in the tier, and a
store computed on top of a failed load is dropped. A finished request whose stores may still read its blocks is
held (``delay_free``) until the worker reports it in ``done_sending``. Each request counts as one use of its blocks
for the eviction policy (touched at first lookup; new blocks are admitted when stored).

A hanging tier never hangs the engine: every wait lasts ``transfer_timeout_s`` at most (a spec option, default 60),
even if the tier's ``wait`` ignores its timeout (one waiter thread per tier). Loads unfinished then fail (the engine
recomputes, per vLLM's ``kv_load_failure_policy``) and are cancelled (``OffloadingHandler.cancel``; the built-in
``cpu`` tier writes nothing once it returned). A tier that cannot cancel gets no load until they end, since a load
finished after its deadline may write into reused cache blocks: such a tier is broken. A store past the deadline
fails: its request's blocks are freed, its tier slots stay taken until the tier reports the job ended, so a late
write lands in no slot offered for loading. Each case logs an error.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from wtransfer.connectors._base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from wtransfer.kvcache import KV_LAYOUTS
from wtransfer.options import option_value
from wtransfer.specs._base import DEVICE_MEDIUM, LoadStoreSpec, SpecChoiceOptions
from wtransfer.specs._factory import OffloadingSpecFactory

if TYPE_CHECKING:
    import torch

    from wtransfer.config import KVTransferConfig
    from wtransfer.connectors._request import KVConnectorOutput, KVRequest, SchedulerStep
    from wtransfer.kvcache import KVCacheSpec
    from wtransfer.specs._base import OffloadingHandler, OffloadingManager, OffloadingSpec

logger = logging.getLogger("wtransfer")


@dataclasses.dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker; each entry is ``{"request_id", "src", "dst"}`` with ``LoadStoreSpec.to_dict()``
    forms (stores may list several request ids)."""

    step: int = 0
    loads: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    stores: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    preempted: list[str] = dataclasses.field(default_factory=list)  # requests whose stores must land first


@dataclasses.dataclass
class _StoreJob:
    keys: tuple[str, ...]  # "<step>:<request id>": how the scheduler names each planned store
    request_ids: tuple[str, ...]
    tier_block_ids: tuple[int, ...]
    started: float = dataclasses.field(default_factory=time.monotonic)


OffloadingConnectorOptions = SpecChoiceOptions
_CONNECTOR_KEYS = frozenset(f.name for f in dataclasses.fields(OffloadingConnectorOptions))


def _store_key(step: int, request_id: str) -> str:
    return f"{step}:{request_id}"


class TierWaiter:
    """Calls one tier's ``wait`` from one thread of its own, and gives up on each call after ``transfer_timeout_s``
    (plus a second). A tier whose ``wait`` ignores its timeout holds this one thread, never one more per step: a
    later wait first waits for it, within its own deadline."""

    def __init__(self, handler: OffloadingHandler, timeout_s: float) -> None:
        self._handler = handler
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._request: list[int] | None = None  # the jobs of the call under way (None: the thread is free)
        self._calls = 0  # calls ended
        self._closed = False
        self._thread: threading.Thread | None = None

    def wait(self, jobs: list[int]) -> None:
        deadline = time.monotonic() + self._timeout_s + 1.0
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="wtransfer-offload-wait", daemon=True)
                self._thread.start()
            if not self._cond.wait_for(lambda: self._request is None, max(deadline - time.monotonic(), 0)):
                return  # the tier is still inside an earlier wait
            self._request, mine = jobs, self._calls + 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._calls >= mine, max(deadline - time.monotonic(), 0))

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._request is not None or self._closed)
                if self._closed:
                    return
                jobs = self._request
            try:
                self._handler.wait(jobs, timeout=self._timeout_s)
            except Exception as exc:  # a timeout (or the tier's own error): the jobs tell which ended
                logger.debug("offloading: waiting for jobs %s: %s", jobs, exc)
            with self._cond:
                self._request = None
                self._calls += 1
                self._cond.notify_all()

    def close(self) -> None:
        """Let the thread end (at once if it is free; a tier stuck in ``wait`` keeps it until it returns)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._request is None:
            self._thread.join(1.0)


class OffloadingConnector(KVConnectorBase):
    """A KV connector driven by an :class:`~wtransfer.specs._base.OffloadingSpec`."""

    metadata_cls = OffloadingConnectorMetadata
    supported_layouts = tuple(KV_LAYOUTS)  # the spec copies the blocks; its factory checks the layout
    handles_parts = True  # each worker's tier holds its part; a store completes when every worker reported
    options_cls = OffloadingConnectorOptions
    options_owner = "offloading connector"
    options: OffloadingConnectorOptions

    @classmethod
    def parse_options(cls, raw: Mapping[str, Any] | None) -> Any:
        """Only ``spec_name``/``spec_module_path``: the spec, created next from the same dict, checks the rest."""
        return super().parse_options({k: v for k, v in (raw or {}).items() if k in _CONNECTOR_KEYS})

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec | None = None
    ) -> None:
        super().__init__(config, role, kv_cache_spec)
        self.spec: OffloadingSpec = OffloadingSpecFactory.create_spec(config, self.require_spec())
        self.engine_block_size = self.require_spec().block_size
        self.factor = self.spec.block_size_factor
        self.offloaded_block_size = self.engine_block_size * self.factor
        self._closed = False
        if role is KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ================================================================== scheduler side
    def _init_scheduler(self) -> None:
        self.manager: OffloadingManager = self.spec.get_manager()
        self._looked_up: set[str] = set()  # requests whose blocks were touched (once per request)
        self._next_store_block: dict[str, int] = {}  # offloaded blocks already considered for storing
        self._with_stores: set[str] = set()  # requests that had stores: their frees are delayed
        self._loads_this_step: list[dict[str, Any]] = []
        self._pinned_this_step: list[list[str]] = []
        self._pinned_last_step: list[list[str]] = []
        self._stores_in_flight: dict[str, list[str]] = {}  # store key -> hashes, until the workers report it
        self._landed_parts: dict[str, int] = {}  # store key -> workers that reported their part landed
        self._events: list[dict[str, Any]] = []
        self._stats = {
            "lookup_blocks": 0, "hit_blocks": 0, "loaded_blocks": 0,
            "stored_blocks": 0, "evicted_blocks": 0, "store_refusals": 0, "failed_store_blocks": 0,
        }

    def _offloaded_hashes(self, request: KVRequest) -> list[str]:
        """One hash per full offloaded block: the chained hash of its last engine block."""
        return request.block_hashes[self.factor - 1 :: self.factor]

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        hashes = self._offloaded_hashes(request)
        if request.request_id not in self._looked_up:
            self._looked_up.add(request.request_id)
            self.manager.touch(hashes)  # one use per request, however often admission retries
            self._stats["lookup_blocks"] += len(hashes)
            self._stats["hit_blocks"] += sum(1 for h in hashes if self.manager.lookup([h]))
        if not self.config.is_kv_consumer:
            return 0, False
        # the engine computes at least one prompt token itself
        loadable = (request.num_tokens - 1) // self.offloaded_block_size
        start = num_computed_tokens // self.offloaded_block_size
        if start >= loadable:
            return 0, False
        hits = self.manager.lookup(hashes[start:loadable])
        if hits == 0:
            return 0, False
        return (start + hits) * self.offloaded_block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request: KVRequest, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        computed = request.num_computed_tokens
        start = computed // self.offloaded_block_size
        end = (computed + num_external_tokens) // self.offloaded_block_size
        hashes = self._offloaded_hashes(request)[start:end]
        source = self.manager.prepare_load(hashes)
        destination = LoadStoreSpec(
            DEVICE_MEDIUM, tuple(block_ids[computed // self.engine_block_size : end * self.factor])
        )
        self._pinned_this_step.append(hashes)
        self._stats["loaded_blocks"] += len(hashes)
        self._loads_this_step.append(
            {"request_id": request.request_id, "src": source.to_dict(), "dst": destination.to_dict()}
        )

    def build_connector_meta(self, step: SchedulerStep) -> OffloadingConnectorMetadata:
        # Last step's loads ran inside its forward pass: unpin them now.
        for hashes in self._pinned_last_step:
            self.manager.complete_load(hashes)
        self._pinned_last_step, self._pinned_this_step = self._pinned_this_step, []
        loads, self._loads_this_step = self._loads_this_step, []
        stores = self._plan_stores(step) if self.config.is_kv_producer else []
        for entry in stores:
            self._stores_in_flight[_store_key(step.step, entry["request_id"])] = entry.pop("hashes")
        self._collect_events()
        preempted = sorted(set(step.preempted_req_ids) & self._with_stores)
        return OffloadingConnectorMetadata(step.step, loads, stores, preempted)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Complete the stores every worker saw land (with tensor parallelism each worker stores its own part: one
        report is not the block); free the slots of failed ones."""
        parts = self.kv_cache_spec.num_shards if self.kv_cache_spec is not None else 1
        for report in output.worker_meta:
            for key in report.get("stored", []):
                if key not in self._stores_in_flight:
                    continue
                self._landed_parts[key] = self._landed_parts.get(key, 0) + 1
                if self._landed_parts[key] >= parts:
                    del self._landed_parts[key]
                    self.manager.complete_store(self._stores_in_flight.pop(key))
            for key in report.get("failed", []):
                hashes = self._stores_in_flight.pop(key, None)
                self._landed_parts.pop(key, None)
                if hashes is not None:
                    self.manager.complete_store(hashes, success=False)
                    self._stats["failed_store_blocks"] += len(hashes)
        self._collect_events()

    def _plan_stores(self, step: SchedulerStep) -> list[dict[str, Any]]:
        entries = []
        for scheduled in step.scheduled:
            request = scheduled.request
            full = scheduled.num_computed_after_step // self.offloaded_block_size
            full = min(full, len(request.block_hashes) // self.factor)
            first = self._next_store_block.get(request.request_id, 0)
            if full <= first:
                continue
            self._next_store_block[request.request_id] = full
            hashes = self._offloaded_hashes(request)
            index_of = {hashes[j]: j for j in range(first, full)}
            plan = self.manager.prepare_store(list(index_of))
            if plan is None:
                self._stats["store_refusals"] += 1
                logger.debug("offloading: tier full of pinned/in-flight blocks; %s not stored", request.request_id)
                continue
            if not plan.block_hashes_to_store:
                continue
            engine_ids = []
            for block_hash in plan.block_hashes_to_store:
                first_engine_block = index_of[block_hash] * self.factor
                engine_ids += scheduled.block_ids[first_engine_block : first_engine_block + self.factor]
            self._with_stores.add(request.request_id)
            self._stats["stored_blocks"] += len(plan.block_hashes_to_store)
            self._stats["evicted_blocks"] += len(plan.block_hashes_evicted)
            entries.append({
                "request_id": request.request_id,
                "src": LoadStoreSpec(DEVICE_MEDIUM, tuple(engine_ids)).to_dict(),
                "dst": plan.store_spec.to_dict(),
                "hashes": list(plan.block_hashes_to_store),
            })
        return entries

    def request_finished(self, request: KVRequest, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._looked_up.discard(request_id)
        self._next_store_block.pop(request_id, None)
        delay = request_id in self._with_stores
        self._with_stores.discard(request_id)
        return delay, None

    def _collect_events(self) -> None:
        self._events.extend(event.to_dict() for event in self.manager.take_events())

    def take_events(self) -> list[dict[str, Any]]:
        """Scheduler side: JSON-safe stored/removed events since the last call, for KV indexers."""
        if self.role is not KVConnectorRole.SCHEDULER:
            return []
        self._collect_events()
        events, self._events = self._events, []
        return events

    # ================================================================== worker side
    def _init_worker(self) -> None:
        self._store_handler: OffloadingHandler | None = None
        self._load_handler: OffloadingHandler | None = None
        self._job_ids = itertools.count(1)
        self._store_jobs: dict[int, _StoreJob] = {}
        self._store_jobs_of: dict[str, set[int]] = {}
        self._report: dict[str, list[str]] = {"stored": [], "failed": []}  # for the scheduler, next step
        self._finished_waiting: set[str] = set()
        self._waiters: dict[int, TierWaiter] = {}  # one per handler
        self._loads_in_flight: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._failed_requests: set[str] = set()  # this step's: their loads failed here, or elsewhere (skip_saves)
        self._load_errors: set[int] = set()
        self._bad_tier_blocks: set[int] = set()
        self._timeout_s = float(option_value(self.spec.options, "transfer_timeout_s", 60.0))
        self._abandoned_loads: set[int] = set()  # given up on, not yet ended: the tier gets no load meanwhile
        self._abandoned_stores: dict[int, _StoreJob] = {}  # given up on, not yet ended: their slots stay taken
        self._worker_stats = {
            "load_jobs": 0, "store_jobs": 0, "bytes_loaded": 0, "bytes_stored": 0,
            "failed_loads": 0, "failed_stores": 0, "preemption_waits": 0, "timed_out_jobs": 0,
        }

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        handlers = {(src, dst): handler for src, dst, handler in self.spec.get_handlers(kv_caches)}
        stores = [(dst, h) for (src, dst), h in handlers.items() if src == DEVICE_MEDIUM]
        if len(stores) != 1:
            raise ValueError(
                f"{type(self.spec).__name__}.get_handlers must yield exactly one handler from "
                f"{DEVICE_MEDIUM!r} to its tier and one back; got {sorted(handlers)}"
            )
        tier, self._store_handler = stores[0]
        load = handlers.get((tier, DEVICE_MEDIUM))
        if load is None:
            raise ValueError(f"{type(self.spec).__name__}.get_handlers yields no {tier!r} -> {DEVICE_MEDIUM!r} handler")
        self._load_handler = load

    def _handlers(self) -> tuple[OffloadingHandler, OffloadingHandler]:
        if self._store_handler is None or self._load_handler is None:
            raise RuntimeError("OffloadingConnector (worker): register_kv_caches() was never called")
        return self._store_handler, self._load_handler

    def _meta(self) -> OffloadingConnectorMetadata:
        return cast(OffloadingConnectorMetadata, self._get_connector_metadata())  # checked against metadata_cls

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._meta()
        store, load = self._handlers()
        self._failed_requests.clear()
        if not meta.loads:
            return
        self._collect()
        for entry in meta.loads:
            source, destination = LoadStoreSpec.from_dict(entry["src"]), LoadStoreSpec.from_dict(entry["dst"])
            job_id = next(self._job_ids)
            if self._abandoned_loads or self._bad_tier_blocks.intersection(source.block_ids) or not load.transfer_async(
                job_id, (source, destination)
            ):
                self._fail_load(entry["request_id"], destination.block_ids)
                continue
            self._loads_in_flight[job_id] = (entry["request_id"], destination.block_ids)
            self._worker_stats["load_jobs"] += 1

    def _fail_load(self, request_id: str, engine_block_ids: tuple[int, ...]) -> None:
        self._worker_stats["failed_loads"] += 1
        self._failed_requests.add(request_id)
        self._load_errors.update(engine_block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # one job carries every layer, so the first layer's wait is the step's only wait
        if self._loads_in_flight:
            _, load = self._handlers()
            jobs = list(self._loads_in_flight)
            self._wait(load, jobs)
            self._collect()
            late = [job for job in jobs if job in self._loads_in_flight]
            if late:  # recomputed instead
                cancelled = load.cancel(late)
                if cancelled:
                    logger.warning("offloading: load jobs %s missed transfer_timeout_s=%.1fs and were cancelled; "
                                   "their requests recompute", late, self._timeout_s)
                else:  # they may still write: no load goes to the tier until they end
                    logger.error("offloading: the tier did not finish load jobs %s within transfer_timeout_s=%.1fs "
                                 "and cannot cancel them; their requests recompute, and no load goes to the tier "
                                 "until they end", late, self._timeout_s)
                for job in late:
                    self._fail_load(*self._loads_in_flight.pop(job))
                    if not cancelled:
                        self._abandoned_loads.add(job)
                self._worker_stats["timed_out_jobs"] += len(late)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None, **kwargs: Any) -> None:
        """Nothing per layer: a store copies every layer of a block, so it starts in ``wait_for_save``."""

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        """Stores still reading blocks of just-preempted requests must finish before this step's forward reuses
        those blocks."""
        preempted = getattr(connector_metadata, "preempted", None)
        if not preempted or self._store_handler is None:
            return
        jobs = sorted({job for request_id in preempted for job in self._store_jobs_of.get(request_id, ())})
        if jobs:
            self._wait(self._store_handler, jobs)
            self._worker_stats["preemption_waits"] += 1
            self._collect()
            # the next forward overwrites those blocks: a store still reading them cannot be trusted
            self._give_up_stores([job for job in jobs if job in self._store_jobs])

    def skip_saves(self, request_ids: set[str]) -> None:
        self._failed_requests.update(request_ids)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if not meta.stores:
            return
        store, _ = self._handlers()
        self.wait_for_layer_load("")  # loads of this step have settled: failures are known
        src_ids: list[int] = []
        dst_ids: list[int] = []
        request_ids: list[str] = []
        keys: list[str] = []
        for entry in meta.stores:
            # Known from now on, even if its store is refused below: the scheduler delays the request's free for it,
            # so get_finished must report it (with no job left) to free it.
            self._store_jobs_of.setdefault(entry["request_id"], set())
            tier_ids = entry["dst"]["block_ids"]
            key = _store_key(meta.step, entry["request_id"])
            if entry["request_id"] in self._failed_requests:
                # computed on top of a failed load (here or in another connector): never store it, and say so
                self._bad_tier_blocks.update(tier_ids)
                self._report["failed"].append(key)
                continue
            src_ids += entry["src"]["block_ids"]
            dst_ids += tier_ids
            request_ids.append(entry["request_id"])
            keys.append(key)
        if not dst_ids:
            return
        tier_medium = meta.stores[0]["dst"]["medium"]
        job_id = next(self._job_ids)
        spec = (LoadStoreSpec(DEVICE_MEDIUM, tuple(src_ids)), LoadStoreSpec(tier_medium, tuple(dst_ids)))
        if not store.transfer_async(job_id, spec):
            self._bad_tier_blocks.update(dst_ids)
            self._worker_stats["failed_stores"] += 1
            self._report["failed"].extend(keys)
            return
        self._worker_stats["store_jobs"] += 1
        self._store_jobs[job_id] = _StoreJob(tuple(keys), tuple(request_ids), tuple(dst_ids))
        for request_id in request_ids:
            self._store_jobs_of.setdefault(request_id, set()).add(job_id)

    def _wait(self, handler: OffloadingHandler, jobs: list[int]) -> None:
        """``handler.wait(jobs)`` for ``transfer_timeout_s`` at most, even if the tier's ``wait`` ignores its timeout;
        what is still unfinished is the caller's to give up on."""
        waiter = self._waiters.get(id(handler))
        if waiter is None:
            waiter = self._waiters[id(handler)] = TierWaiter(handler, self._timeout_s)
        waiter.wait(jobs)

    def _give_up_stores(self, jobs: list[int]) -> None:
        """Give up on store ``jobs``: their requests' engine blocks are freed now, but their tier slots stay taken
        until the tier reports the job ended (it may still write there); then they count as failed."""
        if not jobs:
            return
        logger.error("offloading: the tier did not finish store jobs %s within transfer_timeout_s=%.1fs; "
                     "their blocks count as not stored", jobs, self._timeout_s)
        for job_id in jobs:
            job = self._store_jobs.pop(job_id)
            for request_id in job.request_ids:
                self._store_jobs_of.get(request_id, set()).discard(job_id)
            self._abandoned_stores[job_id] = job
            self._bad_tier_blocks.update(job.tier_block_ids)
        self._worker_stats["failed_stores"] += len(jobs)
        self._worker_stats["timed_out_jobs"] += len(jobs)

    def _collect(self) -> None:
        """Settle every ended job (free finished requests, remember failures); give up on stores older than
        ``transfer_timeout_s``."""
        store, load = self._handlers()
        for result in store.get_finished():
            late = self._abandoned_stores.pop(result.job_id, None)
            if late is not None:  # it ended at last: its slots may be freed (its bytes are not trusted)
                self._report["failed"].extend(late.keys)
                continue
            job = self._store_jobs.pop(result.job_id, None)
            if job is None:
                continue
            for request_id in job.request_ids:
                self._store_jobs_of.get(request_id, set()).discard(result.job_id)
            self._report["stored" if result.success else "failed"].extend(job.keys)
            if result.success:
                self._bad_tier_blocks.difference_update(job.tier_block_ids)
                self._worker_stats["bytes_stored"] += result.num_bytes
            else:
                logger.warning(
                    "offloading: store job %d failed (%s); its blocks will not be loaded", result.job_id, result.error
                )
                self._bad_tier_blocks.update(job.tier_block_ids)
                self._worker_stats["failed_stores"] += 1
        for result in load.get_finished():
            self._abandoned_loads.discard(result.job_id)  # ended late: the tier may take loads again
            entry = self._loads_in_flight.pop(result.job_id, None)
            if entry is None:
                continue
            if result.success:
                self._worker_stats["bytes_loaded"] += result.num_bytes
            else:
                logger.warning(
                    "offloading: load job %d failed (%s); the engine recomputes", result.job_id, result.error
                )
                self._fail_load(*entry)
        oldest = time.monotonic() - self._timeout_s
        self._give_up_stores([job_id for job_id, job in self._store_jobs.items() if job.started < oldest])

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.role is not KVConnectorRole.WORKER:
            return set()
        self.wait_for_layer_load("")
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.role is not KVConnectorRole.WORKER or self._store_handler is None:
            return None, None
        self._collect()
        self._finished_waiting.update(r for r in finished_req_ids if r in self._store_jobs_of)
        sending = {r for r in self._finished_waiting if not self._store_jobs_of.get(r)}
        for request_id in sending:
            self._finished_waiting.discard(request_id)
            self._store_jobs_of.pop(request_id, None)
        return (sending or None), None

    def build_connector_worker_meta(self) -> dict[str, Any] | None:
        """The stores that landed or failed since the last step, for the scheduler's manager."""
        if self.role is not KVConnectorRole.WORKER or self._store_handler is None:
            return None
        self._collect()
        if not (self._report["stored"] or self._report["failed"]):
            return None
        report, self._report = self._report, {"stored": [], "failed": []}
        return report

    # ================================================================== both
    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        if self.role is KVConnectorRole.SCHEDULER:
            return dict(self._stats)
        return dict(self._worker_stats)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.role is KVConnectorRole.WORKER and self._store_handler is not None and self._store_jobs:
            self._wait(self._store_handler, list(self._store_jobs))
        for waiter in getattr(self, "_waiters", {}).values():
            waiter.close()
        for handler in (getattr(self, "_store_handler", None), getattr(self, "_load_handler", None)):
            if handler is not None:
                handler.shutdown()
        self.spec.shutdown()

"""The ``offloading`` connector end to end on the tiny paged engine, with the cpu spec and others."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from wtransfer import KVCacheSpec, KVTransferConfig
from wtransfer.connectors._hashing import request_block_hashes
from wtransfer._registry.kinds import SPECS
from wtransfer._registry.registry import registry_for
from wtransfer.specs.cpu import BlockCopyHandler, CPUOffloadingSpec
from wtransfer.testing.conformance import ConnectorConformance
from wtransfer.testing.paged_engine import PagedKVEngine, reference_kv
from wtransfer.testing.processes import run_python

SPEC = KVCacheSpec(("layer.0", "layer.1"), block_size=4, num_kv_heads=2, head_size=8,
                   dtype="float32", model_fingerprint="offload-e2e")
Engine = Callable[..., PagedKVEngine]


def offloading(**extra: Any) -> KVTransferConfig:
    return KVTransferConfig("offloading", kv_connector_extra_config=dict(extra))


def prompt(seed: int, length: int = 17) -> list[int]:
    return [(seed * 131 + 17 * i + i * i) % 500 for i in range(length)]


def assert_bit_exact(output: Any) -> None:
    expected = reference_kv(SPEC, output.prompt_token_ids)
    for layer, kv in output.kv.items():
        assert torch.equal(kv, expected[layer][:, : kv.shape[1]]), f"{output.request_id}: {layer} differs"


class TestOffloadingConformance(ConnectorConformance):
    connector = "offloading"

    @pytest.fixture
    def connector_options(self, tmp_path: Any) -> dict[str, Any]:
        return {"num_cpu_blocks": 32}


class TestOffloadingConformanceARC(ConnectorConformance):
    connector = "offloading"

    @pytest.fixture
    def connector_options(self, tmp_path: Any) -> dict[str, Any]:
        return {"num_cpu_blocks": 32, "eviction_policy": "arc"}


def test_evicted_prefixes_come_back_from_the_tier_bit_exactly(paged_engine: Engine) -> None:
    # engine: 8 blocks of 4 tokens; working set: 5 prompts x 4 full blocks = 20 blocks;
    # tier: 12 offloaded blocks of 8 tokens (= 24 engine blocks): everything fits there.
    engine = paged_engine(SPEC, 8, kv_transfer_config=offloading(num_cpu_blocks=12, block_size=8),
                          capture_kv=True)
    prompts = {f"p{i}": prompt(i) for i in range(5)}
    first = {}
    for name, tokens in prompts.items():
        first[name] = engine.generate({f"{name}-1": tokens})[f"{name}-1"]
        assert first[name].num_external_tokens == 0
    assert engine.allocator.num_evictions > 0, "the working set must not fit the engine's cache"
    metadata = json.loads(engine.last_metadata_json or "{}")
    assert {"step", "loads", "stores"} <= set(metadata)
    external = 0
    for name, tokens in prompts.items():
        again = engine.generate({f"{name}-2": tokens})[f"{name}-2"]
        assert again.num_local_hit_tokens + again.num_external_tokens == 16, name
        assert again.output_token_ids == first[name].output_token_ids
        assert again.num_load_errors == 0
        assert_bit_exact(again)
        external += again.num_external_tokens
    assert external >= 4 * 16  # at most one prompt can still sit in the engine's own cache
    stats = engine.scheduler_connector.get_kv_connector_stats()
    assert stats["stored_blocks"] == 10 and stats["evicted_blocks"] == 0 and stats["loaded_blocks"] >= 8
    worker_stats = engine.worker_connector.get_kv_connector_stats()
    assert worker_stats["failed_loads"] == worker_stats["failed_stores"] == 0
    events = engine.scheduler_connector.take_events()
    stored = {h for e in events if not e["removed"] for h in e["block_hashes"]}
    assert len(stored) == 10 and all(isinstance(h, str) for h in stored)


def test_a_local_hit_inside_an_offloaded_block_loads_only_the_rest(paged_engine: Engine) -> None:
    engine = paged_engine(SPEC, 8, kv_transfer_config=offloading(num_cpu_blocks=16, block_size=8),
                          capture_kv=True)
    target = prompt(100)
    hashes = request_block_hashes(SPEC, target)
    engine.generate({"t-1": target})
    filler = 0
    while engine.allocator.is_cached(hashes[1]):  # push out the target's blocks, tail first
        filler += 1
        engine.generate({f"filler-{filler}": prompt(1000 + filler, length=4)})
        assert filler < 50
    assert engine.allocator.is_cached(hashes[0]), "the head block should outlive the rest"
    out = engine.generate({"t-2": target})["t-2"]
    # one engine block local, the rest of offloaded block 0 (skipping its first half) and block 1
    assert (out.num_local_hit_tokens, out.num_external_tokens) == (4, 12)
    assert_bit_exact(out)


def test_blocks_filled_while_decoding_are_offloaded_too(paged_engine: Engine) -> None:
    engine = paged_engine(SPEC, 16, kv_transfer_config=offloading(num_cpu_blocks=16),
                          enable_prefix_caching=False, capture_kv=True)
    first = engine.generate({"d": prompt(7, length=6)}, max_new_tokens=12)["d"]
    # KV exists for 6 prompt + 11 generated tokens: 4 full blocks, two of them filled while decoding
    history = first.prompt_token_ids + first.output_token_ids
    again = engine.generate({"e": history + [3]})["e"]
    assert again.num_external_tokens == 16
    assert_bit_exact(again)


def run_scan_workload(paged_engine: Engine, policy: str, rounds: int = 5) -> tuple[float, float, list[Any]]:
    """4 hot prompts used twice per round, then a scan of 6 one-off prompts (12 blocks, the whole tier).

    Returns (share of hot first-uses served from the tier after round 1, overall tier hit rate,
    the hot outputs that loaded from the tier).
    """
    engine = paged_engine(SPEC, 6, kv_transfer_config=offloading(num_cpu_blocks=12, eviction_policy=policy),
                          capture_kv=True)
    hot = {f"hot{i}": prompt(i, length=9) for i in range(4)}
    served = loadable = 0
    loaded = []
    scan = 0
    for round_index in range(rounds):
        for use in (1, 2):
            for name, tokens in hot.items():
                rid = f"{name}-r{round_index}-u{use}"
                out = engine.generate({rid: tokens})[rid]
                if use == 1 and round_index > 0:
                    served += out.num_external_tokens
                    loadable += 8 - out.num_local_hit_tokens
                    if out.num_external_tokens:
                        loaded.append(out)
        for _ in range(6):
            scan += 1
            engine.generate({f"scan{scan}": prompt(10_000 + scan, length=9)})
    stats = engine.scheduler_connector.get_kv_connector_stats()
    return served / loadable, stats["hit_blocks"] / stats["lookup_blocks"], loaded


def test_arc_resists_a_scan_that_flushes_lru(paged_engine: Engine) -> None:
    lru_hot, lru_overall, _ = run_scan_workload(paged_engine, "lru")
    arc_hot, arc_overall, arc_loaded = run_scan_workload(paged_engine, "arc")
    # LRU: the scan (as large as the tier) evicts the hot set every round
    assert lru_hot <= 0.1, lru_hot
    # ARC: the hot set was used twice, lives in T2, and the scan only churns T1
    assert arc_hot >= 0.9, arc_hot
    assert arc_overall > lru_overall
    for out in arc_loaded[:4]:
        assert_bit_exact(out)


# -- failures and delayed frees ------------------------------------------------------------------
class FailingStoreHandler(BlockCopyHandler):
    """Stores fail (as a full disk or a dead remote tier would); loads work."""

    def _copy(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        if self.src.medium == "device":
            raise OSError("tier write failed")
        super()._copy(src_rows, dst_rows)


class FailingStoreSpec(CPUOffloadingSpec):
    handler_cls = FailingStoreHandler


def test_a_failed_store_is_never_loaded(paged_engine: Engine, isolated_registry: None) -> None:
    registry_for(SPECS).register("failing-store", FailingStoreSpec)
    engine = paged_engine(SPEC, 16, kv_transfer_config=offloading(spec_name="failing-store", num_cpu_blocks=8),
                          enable_prefix_caching=False, capture_kv=True)
    first = engine.generate({"a": prompt(5)})["a"]
    again = engine.generate({"b": prompt(5)})["b"]
    # The worker reported the failure (build_connector_worker_meta -> update_connector_output):
    # the scheduler freed the slots instead of offering blocks that never landed.
    assert again.num_external_tokens == 0 and again.num_load_errors == 0
    assert again.output_token_ids == first.output_token_ids
    assert_bit_exact(again)
    assert engine.worker_connector.get_kv_connector_stats()["failed_stores"] >= 1
    assert engine.scheduler_connector.get_kv_connector_stats()["failed_store_blocks"] >= 1
    hashes = request_block_hashes(SPEC, prompt(5))
    assert engine.scheduler_connector.manager.lookup(hashes) == 0


class GatedStoreHandler(BlockCopyHandler):
    gate = threading.Event()

    def _copy(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        if self.src.medium == "device" and not GatedStoreHandler.gate.wait(timeout=10):
            raise RuntimeError("gate never opened")
        super()._copy(src_rows, dst_rows)


class GatedStoreSpec(CPUOffloadingSpec):
    handler_cls = GatedStoreHandler


def test_blocks_are_held_while_their_stores_are_in_flight(paged_engine: Engine, isolated_registry: None) -> None:
    registry_for(SPECS).register("gated-store", GatedStoreSpec)
    GatedStoreHandler.gate.clear()
    engine = paged_engine(SPEC, 8, kv_transfer_config=offloading(spec_name="gated-store", num_cpu_blocks=8))
    manager = engine.scheduler_connector.manager
    hashes = request_block_hashes(SPEC, prompt(6))
    try:
        engine.add_request("a", prompt(6), max_new_tokens=1)
        for _ in range(5):
            engine.step()
        assert engine.has_unfinished(), "finished, but its blocks must wait for the store"
        assert engine.allocator.num_free < 8
        assert manager.lookup(hashes) == 0, "offered for loading before its bytes are in the tier"
    finally:
        GatedStoreHandler.gate.set()
    engine.run(timeout_s=10)  # "a" already produced its output; this waits for the delayed free
    assert not engine.has_unfinished() and engine.allocator.num_free == 8
    assert manager.lookup(hashes) == len(hashes), "landed, so stored: in the same step that reported it"
    out = engine.generate({"b": prompt(6)})["b"]
    assert out.num_local_hit_tokens + out.num_external_tokens == 16


def test_handle_preemptions_waits_for_stores_still_reading_a_preempted_requests_blocks(
    paged_engine: Engine, isolated_registry: None
) -> None:
    """The engine may overwrite a preempted request's blocks in the very next forward; a store
    still copying them must finish first (vLLM calls handle_preemptions before that forward).
    Stores of other requests are not waited for."""
    from wtransfer.connectors.offloading import OffloadingConnectorMetadata

    registry_for(SPECS).register("gated-store", GatedStoreSpec)
    GatedStoreHandler.gate.clear()
    engine = paged_engine(SPEC, 8, kv_transfer_config=offloading(spec_name="gated-store", num_cpu_blocks=8))
    worker = engine.worker_connector
    try:
        engine.add_request("a", prompt(6), max_new_tokens=4)
        engine.step()
        assert worker._store_jobs_of.get("a"), "the prefill's store should be in flight (the gate is closed)"
        worker.handle_preemptions(OffloadingConnectorMetadata(step=1, preempted=["someone-else"]))  # returns at once
        done = threading.Event()
        waiter = threading.Thread(
            target=lambda: (worker.handle_preemptions(OffloadingConnectorMetadata(step=1, preempted=["a"])), done.set()))
        waiter.start()
        assert not done.wait(0.5), "returned while the store still reads the preempted request's blocks"
    finally:
        GatedStoreHandler.gate.set()
    assert done.wait(10)
    waiter.join(10)
    assert not worker._store_jobs_of.get("a")
    assert worker.get_kv_connector_stats()["preemption_waits"] == 1


class StuckHandler(BlockCopyHandler):
    """A third-party tier that hangs: it accepts jobs of one direction and never ends them, and
    its ``wait`` ignores the timeout it is given (until ``release`` at the test's end)."""

    stuck_medium = "device"  # jobs from this medium hang: "device" = stores, the tier's = loads
    release = threading.Event()

    def transfer_async(self, job_id: int, spec: Any) -> bool:
        if self.src.medium == type(self).stuck_medium:
            return True  # accepted, never done
        return super().transfer_async(job_id, spec)

    def wait(self, job_ids: Any, timeout: float | None = None) -> None:
        if self.src.medium == type(self).stuck_medium:
            StuckHandler.release.wait()
            return
        super().wait(job_ids, timeout)

    def cancel(self, job_ids: Any) -> bool:
        return False  # a third-party tier that cannot promise its jobs stop writing


class StuckLoadHandler(StuckHandler):
    stuck_medium = "cpu"


class StuckLoadSpec(CPUOffloadingSpec):
    handler_cls = StuckLoadHandler


class StuckStoreSpec(CPUOffloadingSpec):
    handler_cls = StuckHandler


def test_a_tier_whose_loads_never_end_turns_them_into_recomputes_not_a_hang(
    paged_engine: Engine, isolated_registry: None
) -> None:
    """Evicted prefixes come back through loads the tier never finishes: each step waits
    ``transfer_timeout_s``, then the engine recomputes, bit-exact; while a load it gave up on is
    unfinished no load goes to the tier (the others fail at once, no second wait)."""
    registry_for(SPECS).register("stuck-load", StuckLoadSpec)
    StuckHandler.release.clear()
    engine = paged_engine(SPEC, 8, kv_transfer_config=offloading(spec_name="stuck-load", num_cpu_blocks=12,
                                                                  block_size=8, transfer_timeout_s=0.5),
                          capture_kv=True)
    try:
        prompts = {f"p{i}": prompt(i) for i in range(5)}
        first = {name: engine.generate({f"{name}-1": tokens})[f"{name}-1"] for name, tokens in prompts.items()}
        started = time.monotonic()
        for name, tokens in prompts.items():
            again = engine.generate({f"{name}-2": tokens})[f"{name}-2"]
            assert again.output_token_ids == first[name].output_token_ids
            assert_bit_exact(again)
        assert time.monotonic() - started < 10  # one wait of 0.5 s, not one per prompt, and no hang
    finally:
        StuckHandler.release.set()
    stats = engine.worker_connector.get_kv_connector_stats()
    assert stats["timed_out_jobs"] == 1 and stats["failed_loads"] >= 2, stats


def test_a_tier_whose_stores_never_end_frees_their_blocks_and_never_offers_them(
    paged_engine: Engine, isolated_registry: None
) -> None:
    registry_for(SPECS).register("stuck-store", StuckStoreSpec)
    StuckHandler.release.clear()
    engine = paged_engine(SPEC, 8, kv_transfer_config=offloading(spec_name="stuck-store", num_cpu_blocks=8,
                                                                  transfer_timeout_s=0.5))
    try:
        engine.add_request("a", prompt(6), max_new_tokens=1)
        engine.run(timeout_s=10)  # the request's blocks wait for its store, which never ends: freed at 0.5 s
        assert not engine.has_unfinished() and engine.allocator.num_free == 8
        hashes = request_block_hashes(SPEC, prompt(6))
        assert engine.scheduler_connector.manager.lookup(hashes) == 0  # never offered for loading
        out = engine.generate({"b": prompt(6)})["b"]
        assert out.num_external_tokens == 0 and out.num_load_errors == 0
    finally:
        StuckHandler.release.set()
    assert engine.worker_connector.get_kv_connector_stats()["timed_out_jobs"] >= 1


class RefusingStoreHandler(BlockCopyHandler):
    """A tier that refuses every store at submission (full, or its queue closed)."""

    def transfer_async(self, job_id: int, spec: Any) -> bool:
        if self.src.medium == "device":
            return False
        return super().transfer_async(job_id, spec)


class RefusingStoreSpec(CPUOffloadingSpec):
    handler_cls = RefusingStoreHandler


def test_a_store_refused_at_submission_still_frees_its_requests_blocks(
    paged_engine: Engine, isolated_registry: None
) -> None:
    """The scheduler delays the free of a request with planned stores; a store the tier refused
    has no job to finish, and its request must still be reported done (its blocks used to stay
    allocated for ever)."""
    registry_for(SPECS).register("refusing-store", RefusingStoreSpec)
    engine = paged_engine(SPEC, 8, kv_transfer_config=offloading(spec_name="refusing-store", num_cpu_blocks=8))
    engine.generate({"a": prompt(6)})
    assert not engine.has_unfinished() and engine.allocator.num_free == 8
    assert engine.worker_connector.get_kv_connector_stats()["failed_stores"] >= 1


# -- third-party specs -----------------------------------------------------------------------------
DICT_TIER = '''
"""A third-party tier: blocks kept as separate tensors in a dict, moved by its own thread."""
import queue
import threading

import torch

from wtransfer.specs._base import OffloadingHandler, OffloadingSpec, TransferResult
from wtransfer.specs._manager import BlockTableManager

MEDIUM = "acme-dict"


class DictHandler(OffloadingHandler):
    def __init__(self, store, kv_caches, to_tier):
        self.store, self.kv_caches, self.to_tier = store, kv_caches, to_tier
        self.jobs, self.done, self.cond = queue.SimpleQueue(), [], threading.Condition()
        self.pending = set()
        self.timeouts = []  # each wait's timeout, as the connector gave it
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def transfer_async(self, job_id, spec):
        with self.cond:
            self.pending.add(job_id)
        self.jobs.put((job_id, spec))
        return True

    def _run(self):
        while (item := self.jobs.get()) is not None:
            job_id, (src, dst) = item
            engine_ids = dst.block_ids if not self.to_tier else src.block_ids
            slots = src.block_ids if not self.to_tier else dst.block_ids
            engine_ids = list(engine_ids)[-len(slots):]  # factor 1: one engine block per slot
            for slot, block in zip(slots, engine_ids):
                if self.to_tier:
                    self.store[slot] = [c[:, block].clone() for c in self.kv_caches.values()]
                else:
                    for cache, saved in zip(self.kv_caches.values(), self.store[slot]):
                        cache[:, block] = saved
            with self.cond:
                self.pending.discard(job_id)
                self.done.append(TransferResult(job_id, True))
                self.cond.notify_all()

    def get_finished(self):
        with self.cond:
            done, self.done = self.done, []
        return done

    def wait(self, job_ids, timeout=None):
        self.timeouts.append(timeout)
        wanted = set(job_ids)
        with self.cond:
            if not self.cond.wait_for(lambda: not wanted & self.pending, timeout=timeout or 30):
                raise TimeoutError(sorted(wanted & self.pending))

    def shutdown(self):
        self.jobs.put(None)
        self.thread.join(timeout=10)


class DictTierSpec(OffloadingSpec):
    def __init__(self, config, kv_cache_spec=None):
        super().__init__(config, kv_cache_spec)
        self.num_blocks = int(self.extra_config.get("num_blocks", 8))
        self.manager = None
        self.handlers = []

    def get_manager(self):
        if self.manager is None:
            self.manager = BlockTableManager(self.num_blocks, self.offloaded_block_size, "lru", medium=MEDIUM)
        return self.manager

    def get_handlers(self, kv_caches):
        if not self.handlers:
            store = {}
            self.handlers = [("device", MEDIUM, DictHandler(store, kv_caches, True)),
                             (MEDIUM, "device", DictHandler(store, kv_caches, False))]
        yield from self.handlers

    def shutdown(self):
        for _, _, handler in self.handlers:
            handler.shutdown()
        self.handlers = []
'''

ROUND_TRIP = '''
import dataclasses
import json
import torch
import wtransfer
from wtransfer import KVCacheSpec, KVTransferConfig
from wtransfer.testing.paged_engine import PagedKVEngine, reference_kv

spec = KVCacheSpec(("layer.0", "layer.1"), 4, 2, 8, "float32", "offload-e2e")
config = KVTransferConfig("offloading", kv_connector_extra_config={EXTRA})
tokens = [(3 * i + 1) % 500 for i in range(14)]
with PagedKVEngine(spec, 16, kv_transfer_config=config, enable_prefix_caching=False, capture_kv=True) as engine:
    engine.generate({"a": tokens})
    out = engine.generate({"b": tokens})["b"]
    expected = reference_kv(spec, tokens)
    exact = all(torch.equal(kv, expected[name][:, : kv.shape[1]]) for name, kv in out.kv.items())
    listed = [(c.name, c.distribution) for c in wtransfer.list_components("specs")]
    print(json.dumps({"spec": type(engine.scheduler_connector.spec).__name__, "external": out.num_external_tokens,
                      "exact": exact, "listed": listed}))
'''


def test_third_party_spec_from_an_entry_point_in_a_fresh_process(fake_distribution: Callable[..., Any]) -> None:
    fake_distribution("acme-kv-tier", {"wtransfer.specs": {"acme-dict": "acme_kv_tier.spec:DictTierSpec"}},
                      modules={"acme_kv_tier.spec": DICT_TIER}, version="2.1")
    proc = run_python(ROUND_TRIP.replace("{EXTRA}", '{"spec_name": "acme-dict", "num_blocks": 8}'), timeout=120)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["spec"] == "DictTierSpec"
    assert ["acme-dict", "acme-kv-tier"] in result["listed"] and ["cpu", "wtransfer"] in result["listed"]
    assert result["external"] == 12 and result["exact"] is True


def test_third_party_spec_through_spec_module_path(
    fake_distribution: Callable[..., Any], paged_engine: Engine
) -> None:
    fake_distribution("acme-loose-modules", {}, modules={"acme_loose.tiers": DICT_TIER})
    config = offloading(spec_name="DictTierSpec", spec_module_path="acme_loose.tiers", num_blocks=8)
    engine = paged_engine(SPEC, 16, kv_transfer_config=config, enable_prefix_caching=False, capture_kv=True)
    engine.generate({"a": prompt(9)})
    out = engine.generate({"b": prompt(9)})["b"]
    assert type(engine.scheduler_connector.spec).__name__ == "DictTierSpec"
    assert out.num_external_tokens == 16
    assert_bit_exact(out)


def test_a_spec_without_declared_options_gets_its_own_transfer_timeout_s(
    fake_distribution: Callable[..., Any], paged_engine: Engine
) -> None:
    """A spec with no ``options_cls`` has its options as a plain dict: its ``transfer_timeout_s`` still bounds
    every wait the connector makes on its tier (it used to be 60 s whatever the dict said)."""
    fake_distribution("acme-loose-timeout", {}, modules={"acme_loose_timeout.tiers": DICT_TIER})
    config = offloading(spec_name="DictTierSpec", spec_module_path="acme_loose_timeout.tiers", num_blocks=8,
                        transfer_timeout_s=2.5)
    engine = paged_engine(SPEC, 16, kv_transfer_config=config, enable_prefix_caching=False)
    engine.generate({"a": prompt(9)})
    assert engine.generate({"b": prompt(9)})["b"].num_external_tokens == 16  # a load: the worker waited for it
    assert engine.worker_connector._load_handler.timeouts, "the connector never waited on the tier"
    assert set(engine.worker_connector._load_handler.timeouts) == {2.5}


def test_with_tensor_parallel_parts_a_store_completes_only_when_every_worker_reported(paged_engine: Engine) -> None:
    """With two TP workers each storing its part, one worker's "stored" is not the block."""
    from wtransfer.connectors._request import KVConnectorOutput

    spec = dataclasses.replace(SPEC, num_shards=2)
    engine = paged_engine(spec, 16, kv_transfer_config=offloading(num_cpu_blocks=8))
    engine.generate({"a": prompt(6)})  # the one worker here is part 0: its reports count once
    scheduler = engine.scheduler_connector
    hashes = request_block_hashes(spec, prompt(6))
    assert scheduler.manager.lookup(hashes) == 0, "offered with only one of two parts stored"
    pending = list(scheduler._stores_in_flight)
    assert pending, "the stores wait for the other part"
    scheduler.update_connector_output(KVConnectorOutput(worker_meta=[{"stored": pending}]))  # part 1 reports
    assert scheduler.manager.lookup(hashes) == len(hashes)


class GatedLoadHandler(BlockCopyHandler):
    """The built-in tier with a slow load path: the first load it runs waits for ``gate`` before it writes (a tier
    busy with other work, or a slow link)."""

    gate = threading.Event()
    ran = threading.Event()  # the gated load has ended, written or not
    destination: tuple[int, ...] = ()  # the engine blocks the gated load writes into

    def transfer_async(self, job_id: int, spec: Any) -> bool:
        if self.src.medium == "cpu" and not GatedLoadHandler.destination:
            GatedLoadHandler.destination = tuple(spec[1].block_ids)
        return super().transfer_async(job_id, spec)

    def _copy(self, src_rows: Any, dst_rows: Any) -> None:
        if self.src.medium == "cpu" and not GatedLoadHandler.ran.is_set():
            try:
                GatedLoadHandler.gate.wait(30)
                super()._copy(src_rows, dst_rows)
            finally:
                GatedLoadHandler.ran.set()
            return
        super()._copy(src_rows, dst_rows)


class GatedLoadSpec(CPUOffloadingSpec):
    handler_cls = GatedLoadHandler


def test_a_load_past_its_deadline_never_writes_into_blocks_given_to_another_request(
    paged_engine: Engine, isolated_registry: None
) -> None:
    """Before, the cpu tier kept a load the connector gave up on queued: it later wrote the old prefix's KV into
    engine blocks that another request was using (its KV then differed from a fresh computation). Now the
    connector cancels it and the tier writes nothing more once ``cancel`` returned."""
    registry_for(SPECS).register("gated-load", GatedLoadSpec)
    GatedLoadHandler.gate.clear()
    GatedLoadHandler.ran.clear()
    GatedLoadHandler.destination = ()
    engine = paged_engine(SPEC, 8, kv_transfer_config=offloading(spec_name="gated-load", num_cpu_blocks=12,
                                                                  block_size=8, transfer_timeout_s=0.3), capture_kv=True)
    try:
        for i in range(5):  # p0 goes to the tier and leaves the engine's 8 blocks
            engine.generate({f"p{i}": prompt(i)})
        again = engine.generate({"p0-again": prompt(0)})["p0-again"]  # its load times out: recomputed
        assert_bit_exact(again)
        engine.add_request("other", prompt(9, length=21), max_new_tokens=3)  # takes most of the 8 blocks
        engine.step()
        assert set(engine.block_ids("other")) & set(GatedLoadHandler.destination)  # it holds blocks the load targets
        GatedLoadHandler.gate.set()  # the late load may run now, while "other" holds those blocks
        assert GatedLoadHandler.ran.wait(30)
        other = engine.run(timeout_s=30)["other"]
        expected = reference_kv(SPEC, other.prompt_token_ids)
        for layer, kv in other.kv.items():  # its prompt's KV, as a fresh computation has it
            assert torch.equal(kv[:, :21], expected[layer][:, :21]), f"{layer}: a late load wrote into its blocks"
    finally:
        GatedLoadHandler.gate.set()
    stats = engine.worker_connector.get_kv_connector_stats()
    assert stats["timed_out_jobs"] == 1 and stats["failed_loads"] >= 1, stats


class SlowWaitHandler(BlockCopyHandler):
    """A tier whose loads land at once but whose ``wait`` ignores its timeout until ``release``."""

    release = threading.Event()

    def wait(self, job_ids: Any, timeout: float | None = None) -> None:
        if self.src.medium == "cpu":
            SlowWaitHandler.release.wait(60)
        super().wait(job_ids, timeout)


class SlowWaitSpec(CPUOffloadingSpec):
    handler_cls = SlowWaitHandler


def test_a_tier_whose_wait_ignores_its_timeout_costs_one_thread_not_one_per_step(
    paged_engine: Engine, isolated_registry: None
) -> None:
    """Before, every wait started a thread, and each one stuck in such a tier's ``wait`` stayed: one more per step
    that loaded. Now one waiter per tier; the loads still land and the KV is bit-exact."""
    registry_for(SPECS).register("slow-wait", SlowWaitSpec)
    SlowWaitHandler.release.clear()
    engine = paged_engine(SPEC, 8, kv_transfer_config=offloading(spec_name="slow-wait", num_cpu_blocks=12,
                                                                  block_size=8, transfer_timeout_s=0.2), capture_kv=True)
    try:
        for i in range(5):
            engine.generate({f"p{i}": prompt(i)})
        for i in range(4):  # each comes back from the tier: a load and a wait per prompt
            again = engine.generate({f"p{i}-again": prompt(i)})[f"p{i}-again"]
            assert_bit_exact(again)
            assert again.num_external_tokens > 0
        waiters = [t for t in threading.enumerate() if t.name.startswith("wtransfer-offload-wait")]
        assert len(waiters) <= 2, [t.name for t in waiters]  # one per tier (loads and stores), at most
    finally:
        SlowWaitHandler.release.set()

"""``SpecConformance``: certify a KV offloading spec against the contract.

Subclass it in a test module, name the spec, and (optionally) override the fixtures::

    class TestMySpec(SpecConformance):
        spec = "my-tier"

        @pytest.fixture
        def spec_options(self):
            return {"num_cpu_blocks": 8}

The suite assumes no capacity or medium name: it finds the capacity by filling the tier, and takes media from
``get_handlers``.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from wtransfer.testing.conformance._contract import layout_spec, require

_counter = itertools.count()


def _hashes(n: int) -> list[str]:
    """Fresh, never-seen block hashes."""
    return [f"conformance-block-{next(_counter)}" for _ in range(n)]


class SpecConformance:
    """A battery of contract tests for an offloading spec (set ``spec`` to its name)."""

    spec: str = ""
    max_probe_blocks: int = 4096
    """Upper bound when discovering capacity; a tier larger than this is treated as unbounded."""

    @pytest.fixture
    def spec_options(self) -> dict[str, Any]:
        """``kv_connector_extra_config`` for the spec (keep the tier small: tests fill it)."""
        return {}

    @pytest.fixture(params=["wtransfer", "vllm-cpu"])
    def kv_cache_spec(self, request: Any) -> Any:
        """The engine's cache, once per known layout (a layout the spec does not declare is skipped)."""
        return layout_spec("specs", self.spec, request.param)

    @pytest.fixture
    def offloading_spec(self, spec_options: dict[str, Any], kv_cache_spec: Any) -> Any:
        from wtransfer import KVTransferConfig, OffloadingSpecFactory

        require(self.spec, "SpecConformance subclasses name their spec", "class attribute spec = 'name'", "empty")
        config = KVTransferConfig(kv_connector="offloading",
                                  kv_connector_extra_config={"spec_name": self.spec, **spec_options})
        return OffloadingSpecFactory.create_spec(config, kv_cache_spec)

    # -- helpers ---------------------------------------------------------------------------
    def _store(self, manager: Any, hashes: list[str]) -> Any:
        out = manager.prepare_store(hashes)
        if out is not None:
            manager.complete_store(list(out.block_hashes_to_store))
        return out

    def _capacity(self, manager: Any) -> int:
        """Store fresh blocks one at a time until the first eviction: that count is the capacity."""
        stored = 0
        for _ in range(self.max_probe_blocks):
            out = self._store(manager, _hashes(1))
            require(out is not None, "prepare_store on a tier with only unpinned ready blocks succeeds",
                    "a PrepareStoreOutput (evicting if needed)", "None")
            if out.block_hashes_evicted:
                return stored
            stored += 1
        pytest.skip(f"tier holds more than {self.max_probe_blocks} blocks; capacity tests need a small tier")

    # -- the contract -------------------------------------------------------------------------
    def test_created_by_name_and_is_a_spec(self, offloading_spec: Any) -> None:
        from wtransfer.specs._base import OffloadingManager, OffloadingSpec

        require(isinstance(offloading_spec, OffloadingSpec), "specs subclass OffloadingSpec",
                "an OffloadingSpec instance", type(offloading_spec))
        manager = offloading_spec.get_manager()
        require(isinstance(manager, OffloadingManager), "get_manager returns an OffloadingManager",
                "an OffloadingManager", type(manager))
        require(offloading_spec.get_manager() is manager, "get_manager returns the same manager every call",
                "the same object twice", "two different managers")

    def test_capacity_is_never_exceeded(self, offloading_spec: Any) -> None:
        manager = offloading_spec.get_manager()
        capacity = self._capacity(manager)
        live: dict[str, int] = {}
        for _ in range(3 * capacity):
            out = manager.prepare_store(_hashes(min(2, capacity)))
            require(out is not None, "unpinned ready blocks can always be evicted", "a PrepareStoreOutput", None)
            for evicted in out.block_hashes_evicted:
                live.pop(evicted, None)
                require(manager.lookup([evicted]) == 0, "evicted blocks are gone",
                        f"lookup([{evicted!r}]) == 0", "still found")
            for block_hash, slot in zip(out.block_hashes_to_store, out.store_spec.block_ids):
                require(slot not in live.values(), "a tier slot holds one block at a time",
                        f"slot {slot} free before reuse", f"slot {slot} also holds a live block")
                live[block_hash] = slot
            manager.complete_store(list(out.block_hashes_to_store))
            ready = [h for h in live if manager.lookup([h]) == 1]
            require(len(ready) <= capacity, "capacity is never exceeded", f"at most {capacity} stored blocks",
                    f"{len(ready)} stored")

    def test_pinned_and_in_flight_blocks_are_never_evicted(self, offloading_spec: Any) -> None:
        manager = offloading_spec.get_manager()
        capacity = self._capacity(manager)
        pinned = _hashes(1)
        self._store(manager, pinned)
        manager.prepare_load(pinned)
        in_flight = _hashes(1)
        require(manager.prepare_store(in_flight) is not None, "room is made by evicting unpinned blocks",
                "a PrepareStoreOutput", None)
        for _ in range(2 * capacity):
            out = manager.prepare_store(_hashes(1))
            if out is None:
                break
            require(not set(out.block_hashes_evicted) & set(pinned + in_flight),
                    "pinned (loading) and in-flight (storing) blocks are never evicted",
                    "victims among other blocks", f"evicted {out.block_hashes_evicted}")
            manager.complete_store(list(out.block_hashes_to_store))
        require(manager.lookup(pinned) == 1, "a pinned block stays loadable", "lookup == 1", "0")
        manager.complete_load(pinned)
        manager.complete_store(in_flight)
        require(manager.lookup(in_flight) == 1, "a completed store is loadable", "lookup == 1", "0")

    def test_prepare_store_refuses_when_everything_is_pinned(self, offloading_spec: Any) -> None:
        manager = offloading_spec.get_manager()
        capacity = self._capacity(manager)
        held = _hashes(capacity)
        for block_hash in held:
            self._store(manager, [block_hash])
        require(manager.lookup(held) == capacity, "a tier holds `capacity` blocks", f"lookup == {capacity}",
                manager.lookup(held))
        manager.prepare_load(held)
        newcomer = _hashes(1)
        require(manager.prepare_store(newcomer) is None,
                "prepare_store returns None when room needs evicting pinned blocks", "None", "a store plan")
        require(manager.lookup(held) == capacity and manager.lookup(newcomer) == 0,
                "a refused prepare_store changes nothing", "all pinned blocks still stored", manager.lookup(held))
        manager.complete_load(held)
        require(manager.prepare_store(newcomer) is not None, "unpinned blocks become evictable again",
                "a PrepareStoreOutput after complete_load", None)

    def test_failed_store_frees_its_space(self, offloading_spec: Any) -> None:
        manager = offloading_spec.get_manager()
        manager.take_events()
        failed = _hashes(1)
        manager.prepare_store(failed)
        manager.complete_store(failed, success=False)
        require(manager.lookup(failed) == 0, "a failed store is not reported as stored", "lookup == 0", "1")
        stored_events = [e for e in manager.take_events() if not e.removed and set(e.block_hashes) & set(failed)]
        require(not stored_events, "a failed store emits no stored event", "no event", stored_events)
        again = manager.prepare_store(failed)
        require(again is not None and list(again.block_hashes_to_store) == failed,
                "a failed store's block can be stored again", f"{failed} to store", again)

    def test_events_report_stores_and_evictions(self, offloading_spec: Any) -> None:
        manager = offloading_spec.get_manager()
        capacity = self._capacity(manager)
        manager.take_events()
        fresh = _hashes(capacity + 1)
        evicted: list[str] = []
        for block_hash in fresh:
            out = self._store(manager, [block_hash])
            evicted += list(out.block_hashes_evicted)
        events = manager.take_events()
        stored = {h for e in events if not e.removed for h in e.block_hashes}
        removed = {h for e in events if e.removed for h in e.block_hashes}
        require(set(fresh) <= stored, "every completed store emits a stored event",
                f"stored events for {len(fresh)} blocks", f"{len(stored & set(fresh))}")
        require(evicted and set(evicted) <= removed, "every eviction emits a removed event",
                f"removed events for {evicted}", sorted(removed))
        require(all(isinstance(e.to_dict(), dict) for e in events), "events are JSON-safe", "to_dict()", events)
        require(manager.take_events() == [], "take_events drains", "[] on a second call", "events again")

    def test_round_trip_through_the_tier_is_bit_exact(self, offloading_spec: Any, kv_cache_spec: Any) -> None:
        import torch

        from wtransfer.kvcache import block_view
        from wtransfer.specs._base import DEVICE_MEDIUM, LoadStoreSpec

        factor = offloading_spec.block_size_factor
        num_engine_blocks = 8 * factor
        dtype = getattr(torch, kv_cache_spec.dtype)
        shape = kv_cache_spec.cache_shape(num_engine_blocks)
        generator = torch.Generator().manual_seed(0)
        caches = {name: torch.randn(shape, generator=generator).to(dtype) for name in kv_cache_spec.layer_names}
        original = {name: t.clone() for name, t in caches.items()}
        handlers = {(src, dst): h for src, dst, h in offloading_spec.get_handlers(caches)}
        manager = offloading_spec.get_manager()
        blocks = _hashes(2)
        out = manager.prepare_store(blocks)
        tier = out.store_spec.medium
        require((DEVICE_MEDIUM, tier) in handlers and (tier, DEVICE_MEDIUM) in handlers,
                "get_handlers yields both directions between the engine cache and the tier",
                f"handlers for {(DEVICE_MEDIUM, tier)} and {(tier, DEVICE_MEDIUM)}", sorted(handlers))
        source_ids = list(range(factor, 3 * factor))  # engine blocks 1..2 (in offloaded units)
        store = handlers[(DEVICE_MEDIUM, tier)]
        require(store.transfer_async(1, (LoadStoreSpec(DEVICE_MEDIUM, tuple(source_ids)), out.store_spec)),
                "transfer_async accepts a store job", "True", "False")
        store.wait([1], timeout=30)
        results = store.get_finished()
        require([r.job_id for r in results if r.success] == [1], "get_finished reports the job once, successful",
                "[1]", results)
        manager.complete_store(blocks)
        def blocks_of(name: str, cache: Any) -> Any:  # [segments, blocks, elements], whatever the layout
            return block_view(kv_cache_spec, name, cache, who="SpecConformance", cpu_only=False)

        for name, t in caches.items():
            blocks_of(name, t)[:, factor:3 * factor].zero_()
        load_spec = manager.prepare_load(blocks)
        target_ids = list(range(5 * factor, 7 * factor))
        load = handlers[(tier, DEVICE_MEDIUM)]
        require(load.transfer_async(2, (load_spec, LoadStoreSpec(DEVICE_MEDIUM, tuple(target_ids)))),
                "transfer_async accepts a load job", "True", "False")
        load.wait([2], timeout=30)
        require([r.job_id for r in load.get_finished() if r.success] == [2], "a load job succeeds", "[2]", "failure")
        manager.complete_load(blocks)
        for name, t in caches.items():
            require(torch.equal(blocks_of(name, t)[:, 5 * factor:7 * factor],
                                blocks_of(name, original[name])[:, factor:3 * factor]),
                    "a block loaded back from the tier is bit-exact", f"layer {name} equal to what was stored",
                    "different bytes")
        for handler in {id(h): h for h in handlers.values()}.values():
            handler.shutdown()

"""The offloading manager and its eviction policies, alone (no tensors, no engine)."""

from __future__ import annotations

import random

import pytest

import wtransfer

from wtransfer.specs._base import LoadStoreSpec, OffloadingEvent
from wtransfer.specs._manager import BlockTableManager
from wtransfer.specs.policies import (
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    create_policy,
    policy_class,
)

POLICIES = ["lru", "arc"]


def store(manager: BlockTableManager, *hashes: str, success: bool = True):
    out = manager.prepare_store(hashes)
    assert out is not None, f"no room for {hashes}"
    manager.complete_store(out.block_hashes_to_store, success=success)
    return out


def test_lru_evicts_least_recently_used_first() -> None:
    manager = BlockTableManager(3, block_size=16, policy="lru")
    store(manager, "a", "b", "c")
    manager.touch(["a"])
    out = store(manager, "d")
    assert out.block_hashes_evicted == ("b",)
    assert manager.lookup(["a"]) == 1 and manager.lookup(["b"]) == 0
    assert isinstance(manager.policy, LRUPolicy)
    assert manager.policy.order() == ["c", "a", "d"]
    assert store(manager, "e").block_hashes_evicted == ("c",)


def test_touch_keeps_a_prefix_head_most_recent() -> None:
    manager = BlockTableManager(4, block_size=16, policy="lru")
    store(manager, "p0", "p1", "p2", "x")
    manager.touch(["p0", "p1", "p2"])
    # the tail of the chain is the least recently used of the three
    assert store(manager, "y").block_hashes_evicted == ("x",)
    assert store(manager, "z").block_hashes_evicted == ("p2",)


def test_arc_promotes_on_second_touch() -> None:
    manager = BlockTableManager(4, block_size=16, policy="arc")
    arc = manager.policy
    assert isinstance(arc, ARCPolicy)
    store(manager, "a", "b")
    assert list(arc.t1) == ["a", "b"] and not arc.t2
    manager.touch(["a"])
    assert list(arc.t1) == ["b"] and list(arc.t2) == ["a"]
    manager.touch(["a"])
    assert list(arc.t2) == ["a"]


def test_arc_ghost_hits_adapt_the_target() -> None:
    arc = ARCPolicy(2)
    manager = BlockTableManager(2, block_size=16, policy=arc)
    store(manager, "a", "b")
    manager.touch(["b"])  # T1 = [a], T2 = [b]
    assert store(manager, "c").block_hashes_evicted == ("a",)  # |T1| > p = 0: evict from T1
    assert list(arc.b1) == ["a"] and arc.p == 0
    out = store(manager, "a")  # a B1 ghost hit: T1 was too small, so p grows
    assert arc.p == 1.0
    assert "a" in arc.t2 and "a" not in arc.b1
    assert out.block_hashes_evicted == ("b",)  # |T1| = 1 is not above p = 1: evict from T2
    assert list(arc.b2) == ["b"]
    out = store(manager, "b")  # a B2 ghost hit: T2 was too small, so p shrinks
    assert arc.p == 0.0 and "b" in arc.t2
    assert out.block_hashes_evicted == ("c",)
    assert list(arc.b1) == ["c"]


def test_arc_ghost_lists_stay_bounded() -> None:
    arc = ARCPolicy(8)
    manager = BlockTableManager(8, block_size=16, policy=arc)
    rng = random.Random(1)
    for i in range(2000):
        key = f"k{rng.randrange(40)}" if i % 3 else f"scan{i}"
        if manager.lookup([key]):
            manager.touch([key])
        else:
            store(manager, key)
        assert len(arc.t1) + len(arc.b1) <= 8
        assert len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 16
        assert 0 <= arc.p <= 8


@pytest.mark.parametrize("policy", POLICIES)
def test_pinned_and_in_flight_blocks_are_never_evicted(policy: str) -> None:
    manager = BlockTableManager(3, block_size=16, policy=policy)
    store(manager, "a", "b", "c")
    spec = manager.prepare_load(["a"])
    assert spec == LoadStoreSpec("cpu", (0,))
    manager.touch(["b", "c"])  # a is now the LRU, but it is pinned
    out = store(manager, "d")
    assert "a" not in out.block_hashes_evicted
    in_flight = manager.prepare_store(["e"])  # e is in flight: not ready, not evictable
    assert in_flight is not None and "a" not in in_flight.block_hashes_evicted
    assert manager.lookup(["a"]) == 1
    for new in ("f", "g", "h"):  # keep churning: a (pinned) and e (in flight) must survive
        out = manager.prepare_store([new])
        assert out is not None and len(out.block_hashes_evicted) == 1
        assert not {"a", "e"} & set(out.block_hashes_evicted)
        manager.complete_store([new])
    assert manager.lookup(["a"]) == 1 and "e" in manager.policy
    manager.complete_load(["a"])
    manager.complete_store(["e"])
    assert manager.lookup(["e"]) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_returns_none_when_full_of_pinned_blocks(policy: str) -> None:
    manager = BlockTableManager(2, block_size=16, policy=policy)
    store(manager, "a", "b")
    manager.prepare_load(["a", "b"])
    manager.take_events()
    assert manager.prepare_store(["c"]) is None
    assert manager.lookup(["a", "b"]) == 2 and "c" not in manager
    assert manager.take_events() == []  # nothing changed, nothing announced
    manager.complete_load(["a"])
    assert manager.prepare_store(["c", "d"]) is None  # needs two, only one evictable: all-or-nothing
    assert manager.lookup(["a", "b"]) == 2
    out = manager.prepare_store(["c"])
    assert out is not None and out.block_hashes_evicted == ("a",)


def test_prepare_store_returns_none_when_full_of_in_flight_blocks() -> None:
    manager = BlockTableManager(2, block_size=16)
    assert manager.prepare_store(["a", "b"]) is not None
    assert manager.prepare_store(["c"]) is None
    manager.complete_store(["a", "b"])
    assert manager.prepare_store(["c"]) is not None


def test_prepare_store_skips_blocks_already_held_or_in_flight() -> None:
    manager = BlockTableManager(4, block_size=16)
    store(manager, "a")
    out = manager.prepare_store(["a", "b", "b"])
    assert out is not None and out.block_hashes_to_store == ("b",)
    again = manager.prepare_store(["b"])
    assert again is not None and again.block_hashes_to_store == () and len(again.store_spec) == 0


def test_events_report_stores_and_evictions() -> None:
    manager = BlockTableManager(2, block_size=32, policy="lru")
    store(manager, "a", "b")
    assert manager.take_events() == [OffloadingEvent(("a", "b"), 32, "cpu", removed=False)]
    assert manager.take_events() == []
    store(manager, "c")
    events = manager.take_events()
    assert events == [
        OffloadingEvent(("a",), 32, "cpu", removed=True),
        OffloadingEvent(("c",), 32, "cpu", removed=False),
    ]
    assert OffloadingEvent((b"\x01\xff",), 32, "cpu", False).to_dict()["block_hashes"] == ["01ff"]


def test_a_failed_store_frees_its_slot_and_is_not_reported() -> None:
    manager = BlockTableManager(1, block_size=16)
    out = manager.prepare_store(["a"])
    assert out is not None
    assert manager.lookup(["a"]) == 0  # in flight is not loadable
    with pytest.raises(ValueError, match="still being stored"):
        manager.prepare_load(["a"])
    manager.complete_store(["a"], success=False)
    assert manager.lookup(["a"]) == 0 and manager.num_free == 1
    assert manager.take_events() == []
    assert "a" not in manager.policy
    assert store(manager, "b").store_spec.block_ids == out.store_spec.block_ids


def test_misuse_errors_say_what_to_do() -> None:
    manager = BlockTableManager(1, block_size=16)
    with pytest.raises(ValueError, match="not in the tier.*lookup"):
        manager.prepare_load(["nope"])
    with pytest.raises(ValueError, match="without a matching prepare_load"):
        manager.complete_load(["nope"])
    with pytest.raises(ValueError, match="at least one block"):
        BlockTableManager(0, block_size=16)


@pytest.mark.parametrize("policy", POLICIES)
def test_random_workload_keeps_every_invariant(policy: str) -> None:
    capacity = 16
    manager = BlockTableManager(capacity, block_size=16, policy=policy)
    rng = random.Random(7)
    pinned: dict[str, int] = {}
    in_flight: list[tuple[str, ...]] = []
    for _ in range(3000):
        op = rng.random()
        keys = [f"b{rng.randrange(60)}" for _ in range(rng.randint(1, 4))]
        if op < 0.45:
            out = manager.prepare_store(keys)
            if out is not None:
                assert not set(out.block_hashes_evicted) & set(pinned)
                in_flight.append(out.block_hashes_to_store)
        elif op < 0.7 and in_flight:
            manager.complete_store(in_flight.pop(rng.randrange(len(in_flight))), success=rng.random() < 0.9)
        elif op < 0.85:
            hits = manager.lookup(keys)
            if hits:
                manager.prepare_load(keys[:hits])
                for key in keys[:hits]:
                    pinned[key] = pinned.get(key, 0) + 1
                manager.touch(keys[:hits])
        elif pinned:
            key = rng.choice(sorted(pinned))
            manager.complete_load([key])
            pinned[key] -= 1
            if not pinned[key]:
                del pinned[key]
        slots = [slot.block_id for slot in manager._table.values()]
        assert manager.num_used <= capacity
        assert len(set(slots)) == len(slots) and all(0 <= s < capacity for s in slots)
        assert manager.num_used + manager.num_free == capacity
        assert len(manager.policy) == manager.num_used
        assert all(key in manager for key in pinned)


def test_policy_lookup_by_name_module_path_and_registration(isolated_registry: None) -> None:
    assert policy_class("lru") is LRUPolicy and policy_class("arc") is ARCPolicy
    assert policy_class("wtransfer:arc") is ARCPolicy
    with pytest.raises(wtransfer.UnknownComponentError, match="looks like a 'module:Class' path.*wtransfer.policies"):
        create_policy("wtransfer.specs.policies:ARCPolicy", 4)  # 0.1 imported it; 0.2 says what replaced it
    with pytest.raises(ValueError, match="Did you mean 'arc'.*Available policies: arc, lru"):
        policy_class("arcc")

    class FIFOPolicy(LRUPolicy):
        """Insertion order only: touches do not reorder."""

        name = "fifo"

        def touch(self, key: object) -> None:
            pass

    assert isinstance(create_policy(FIFOPolicy, 2), FIFOPolicy)  # a class is taken as is
    manager = BlockTableManager(2, block_size=16, policy=FIFOPolicy(2))
    store(manager, "a", "b")
    manager.touch(["a"])
    assert store(manager, "c").block_hashes_evicted == ("a",)
    with pytest.raises(wtransfer.InvalidComponentError):
        create_policy(dict, 2)  # type: ignore[arg-type]
    assert issubclass(FIFOPolicy, EvictionPolicy)

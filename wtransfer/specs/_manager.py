"""``BlockTableManager``: the policy-agnostic bookkeeping of a tier with a fixed number of slots.

It maps block hashes to slots, tracks which blocks are ready (stored), pinned (being loaded) or in flight (being
stored), and asks an :class:`~wtransfer.specs.policies.EvictionPolicy` for victims among those that may go. Any spec
whose tier is "N equal slots" can reuse it. Not thread-safe by design: the scheduler calls it from one thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from wtransfer.specs._base import (
    CPU_MEDIUM,
    BlockHash,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from wtransfer.specs.policies import EvictionPolicy, create_policy

logger = logging.getLogger("wtransfer")


@dataclass
class _Slot:
    block_id: int
    ready: bool = False
    pins: int = 0


class BlockTableManager(OffloadingManager):
    """Slots, pins and in-flight state for ``num_blocks`` offloaded blocks of ``block_size`` tokens."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        policy: EvictionPolicy | str = "lru",
        *,
        medium: str = CPU_MEDIUM,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"An offloading tier needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.medium = medium
        self.policy = create_policy(policy, num_blocks) if isinstance(policy, str) else policy
        self._table: dict[BlockHash, _Slot] = {}
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._num_evictable = 0
        self._events: list[OffloadingEvent] = []

    # -- state ---------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return len(self._table)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, block_hash: object) -> bool:
        slot = self._table.get(block_hash)  # type: ignore[arg-type]
        return slot is not None and slot.ready

    def is_pinned(self, block_hash: BlockHash) -> bool:
        slot = self._table.get(block_hash)
        return slot is not None and slot.pins > 0

    def _evictable(self, block_hash: BlockHash) -> bool:
        slot = self._table.get(block_hash)
        return slot is not None and slot.ready and slot.pins == 0

    # -- loads -----------------------------------------------------------------------------
    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self:
                break
            hits += 1
        return hits

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        hashes = list(block_hashes)
        slots = []
        for block_hash in hashes:
            slot = self._table.get(block_hash)
            if slot is None or not slot.ready:
                state = "still being stored" if slot is not None else "not in the tier"
                raise ValueError(
                    f"Cannot load block {block_hash!r}: it is {state}. Load only the prefix that "
                    f"lookup() reported, in the same scheduler step."
                )
            slots.append(slot)
        for slot in slots:
            if slot.pins == 0:
                self._num_evictable -= 1
            slot.pins += 1
        return LoadStoreSpec(self.medium, tuple(slot.block_id for slot in slots))

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        # Reverse order: a prefix's first blocks end up most recently used, so a chain is evicted from its tail
        # (a head block is useful without its tail, not vice versa).
        for block_hash in reversed(list(block_hashes)):
            if block_hash in self:
                self.policy.touch(block_hash)

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        for block_hash in block_hashes:
            slot = self._table.get(block_hash)
            if slot is None or slot.pins == 0:
                raise ValueError(f"complete_load({block_hash!r}) without a matching prepare_load")
            slot.pins -= 1
            if slot.pins == 0:
                self._num_evictable += 1

    # -- stores ----------------------------------------------------------------------------
    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        new = [h for h in dict.fromkeys(block_hashes) if h not in self._table]
        shortfall = len(new) - len(self._free)
        if shortfall > self._num_evictable:
            logger.debug(
                "Tier full: %d blocks to store, %d free, %d evictable (the rest pinned or in flight)",
                len(new), len(self._free), self._num_evictable,
            )
            return None
        evicted: list[BlockHash] = []
        for block_hash in new:
            self.policy.insert(block_hash)
            # Reserved now so the policy can never pick it; ready only once the store completes.
            self._table[block_hash] = _Slot(block_id=-1)
        if shortfall > 0:
            victims = self.policy.evict(shortfall, self._evictable)
            if victims is None or len(victims) != shortfall:
                raise RuntimeError(
                    f"{type(self.policy).__name__}.evict returned {victims!r} for {shortfall} blocks "
                    f"although {self._num_evictable} were evictable: the policy breaks its contract"
                )
            for victim in victims:
                slot = self._table.pop(victim)
                self._free.append(slot.block_id)
                self._num_evictable -= 1
            evicted = victims
            self._emit(evicted, removed=True)
        block_ids = []
        for block_hash in new:
            slot = self._table[block_hash]
            slot.block_id = self._free.pop()
            block_ids.append(slot.block_id)
        return PrepareStoreOutput(tuple(new), LoadStoreSpec(self.medium, tuple(block_ids)), tuple(evicted))

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        stored: list[BlockHash] = []
        for block_hash in block_hashes:
            slot = self._table.get(block_hash)
            if slot is None or slot.ready:
                continue  # already completed, or never prepared: nothing in flight to settle
            if success:
                slot.ready = True
                self._num_evictable += 1
                stored.append(block_hash)
            else:
                del self._table[block_hash]
                self._free.append(slot.block_id)
                self.policy.remove(block_hash)
        self._emit(stored, removed=False)

    # -- events ------------------------------------------------------------------------------
    def _emit(self, block_hashes: list[BlockHash], removed: bool) -> None:
        if block_hashes:
            self._events.append(OffloadingEvent(tuple(block_hashes), self.block_size, self.medium, removed))

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

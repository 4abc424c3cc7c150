"""Eviction policies for offloading tiers: one small interface, ``lru`` and ``arc`` built in.

A policy only orders keys; the manager owns slots, pins and in-flight state. ``evict`` gets a predicate saying which
keys may go, so a policy never needs to know about pins.

Policies are a plugin kind: a distribution ships one in the ``wtransfer.policies`` entry-point group
(``fifo = "acme.fifo:FIFOPolicy"``), named bare (``"fifo"``) or qualified (``"acme:fifo"``) through the same
registry as engines, connectors and specs. A :class:`BlockTableManager` also takes a policy instance.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from wtransfer._registry.registry import ComponentRegistry

logger = logging.getLogger("wtransfer")

Key = Hashable
CanEvict = Callable[[Key], bool]


class EvictionPolicy(ABC):
    """Decides which resident keys leave a tier of ``capacity`` slots first.

    Calls, all from the manager: ``insert`` on admission (a miss), ``touch`` on a hit, ``remove`` when a key leaves
    for another reason (a failed store), ``evict`` to choose and drop victims (all-or-nothing)."""

    name: ClassVar[str] = ""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"{type(self).__name__} capacity must be > 0, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key) -> None:
        """A key was admitted to the tier."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """A resident key was used again."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """A resident key left without being chosen by ``evict`` (no history is kept)."""

    @abstractmethod
    def evict(self, count: int, can_evict: CanEvict) -> list[Key] | None:
        """Choose and drop ``count`` keys for which ``can_evict`` holds; ``None`` (no change) if too few."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident."""


def _take_lru(order: OrderedDict[Key, None], count: int, can_evict: CanEvict) -> list[Key]:
    """Up to ``count`` evictable keys from the least recently used end, without removing them."""
    chosen: list[Key] = []
    if count <= 0:
        return chosen
    for key in order:
        if can_evict(key):
            chosen.append(key)
            if len(chosen) == count:
                break
    return chosen


class LRUPolicy(EvictionPolicy):
    """Least recently used goes first."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def evict(self, count: int, can_evict: CanEvict) -> list[Key] | None:
        victims = _take_lru(self._order, count, can_evict)
        if len(victims) < count:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def order(self) -> list[Key]:
        """Resident keys, least recently used first (for tests and debugging)."""
        return list(self._order)


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement (Megiddo & Modha, FAST 2003), adapted to batched, pin-aware eviction.

    ``T1`` holds keys seen once recently, ``T2`` keys seen at least twice; ghost lists ``B1``/``B2`` remember keys
    recently evicted from each. A new key hitting ``B1`` grows ``T1``'s target size ``p``, one hitting ``B2``
    shrinks it; eviction takes from ``T1`` while it is above ``p``, else from ``T2``. A scan thus churns through
    ``T1`` and leaves the frequently used ``T2`` alone."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self.p = 0.0
        self._last_admit_was_b2_hit = False

    def insert(self, key: Key) -> None:
        if key in self.t1 or key in self.t2:
            self.touch(key)
            return
        self._last_admit_was_b2_hit = False
        if key in self.b1:
            delta = max(len(self.b2) / len(self.b1), 1.0)
            self.p = min(float(self.capacity), self.p + delta)
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            delta = max(len(self.b1) / len(self.b2), 1.0)
            self.p = max(0.0, self.p - delta)
            del self.b2[key]
            self.t2[key] = None
            self._last_admit_was_b2_hit = True
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def evict(self, count: int, can_evict: CanEvict) -> list[Key] | None:
        if count <= 0:
            return []
        in_t1 = len(_take_lru(self.t1, count, can_evict))
        if in_t1 + len(_take_lru(self.t2, count - in_t1, can_evict)) < count:
            return None
        victims: list[Key] = []
        for _ in range(count):
            prefer_t1 = bool(self.t1) and (
                len(self.t1) > self.p or (self._last_admit_was_b2_hit and len(self.t1) >= self.p)
            )
            lists = ((self.t1, self.b1), (self.t2, self.b2))
            for resident, ghosts in lists if prefer_t1 else reversed(lists):
                found = _take_lru(resident, 1, can_evict)
                if found:
                    key = found[0]
                    del resident[key]
                    ghosts[key] = None
                    victims.append(key)
                    break
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        """Keep ARC's bounds: ``|T1|+|B1| <= c`` and all four lists ``<= 2c``."""
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while (self.b2 or self.b1) and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            (self.b2 if self.b2 else self.b1).popitem(last=False)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2


def _registry() -> ComponentRegistry:
    """The process-wide registry of the ``policies`` kind (imported late: this module stays light)."""
    from wtransfer._registry.kinds import POLICIES
    from wtransfer._registry.registry import registry_for

    return registry_for(POLICIES)


def policy_class(name: str | type[EvictionPolicy]) -> type[EvictionPolicy]:
    """A policy name (bare ``"lru"`` or qualified ``"distribution:name"``) or a class -> the class; unknown names
    suggest close ones, an ambiguous bare name lists the qualified ones."""
    from wtransfer._registry.component import check_subclass
    from wtransfer.errors import UnknownComponentError

    registry = _registry()
    if isinstance(name, type):
        return check_subclass(registry.kind, name, f"eviction policy {name.__qualname__}")
    text = str(name).strip()
    try:
        return registry.get_class(text)
    except UnknownComponentError as unknown:
        module = text.partition(":")[0]
        if ":" in text and "." in module and all(part.isidentifier() for part in module.split(".")):
            # a "package.module:Class" path, which 0.1 imported: say what replaced it
            raise UnknownComponentError(
                f"{unknown}. {text!r} looks like a 'module:Class' path; policies are no longer imported by path: "
                "ship the policy as an entry point instead: in your pyproject.toml, [project.entry-points."
                '"wtransfer.policies"] NAME = "package.module:Class", and name it by that entry-point name'
            ) from None
        raise


def create_policy(name: str | type[EvictionPolicy], capacity: int) -> EvictionPolicy:
    """Instantiate the policy ``name`` (see :func:`policy_class`) for a tier of ``capacity`` slots."""
    policy = policy_class(name)(capacity)
    logger.debug("Eviction policy %s for %d blocks", type(policy).__name__, capacity)
    return policy

"""A byte budget for a directory of block files, shared by every process that writes to it.

A KV store grows with every block saved; every weight update (and every cache reset) starts a
new namespace whose predecessor may never be read again. So a store with a capacity evicts the
least recently used block files, across all namespaces: a namespace nobody reads any more is
never touched again and goes first. "Used" is a file's modification time: a save sets it, and a
load that hit refreshes it (:meth:`StoreBudget.touch`).

Several processes may share the store (TP workers, instances, restarts): there is no shared
index to keep consistent. Each process keeps a running estimate of the store's size (a scan at
first use, plus what it wrote since); when the estimate passes the capacity, it scans the
directory for the truth and deletes the oldest files until the store is under
``LOW_WATER`` × capacity. Two processes evicting at once may delete the same file (one of them
gets ``FileNotFoundError``, ignored) or a little more than needed; block files are immutable and
published by rename, so a reader either opens a whole file or none (a miss, recomputed).
Between two scans the store may exceed the capacity by what other processes wrote since.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from wtransfer.connectors._blockfile import BLOCK_SUFFIX, CORRUPT_SUFFIX

logger = logging.getLogger("wtransfer")

LOW_WATER = 0.9
"""An eviction stops once the store is under this fraction of its capacity (not at the brim:
every save would otherwise pay for a scan)."""


class StoreBudget:
    """Keeps the block files under ``root`` within ``capacity_bytes``; least recently used go first."""

    def __init__(self, root: str, capacity_bytes: int, count: Callable[[str, int], None]) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self._count = count  # (counter name, amount): the owner's stats
        self._lock = threading.Lock()
        self._estimate: int | None = None
        self._evicting = threading.Lock()
        self._wanted = False  # an eviction was asked for since the running pass began
        self._queued = False  # added() asked its caller for an eviction that has not begun
        self._added_since_scan = 0

    def added(self, nbytes: int) -> bool:
        """A file of ``nbytes`` was published; True if the store is (estimated) over its capacity
        and no eviction was asked for since the last one began (the caller then runs :meth:`evict`)."""
        with self._lock:
            self._added_since_scan += nbytes
            if self._estimate is None:
                self._estimate = self._scan_total()
            else:
                self._estimate += nbytes
            if self._estimate <= self.capacity_bytes or self._queued:
                return False
            self._queued = True
            return True

    def over_capacity(self) -> bool:
        """Whether the store is (estimated) over its capacity."""
        with self._lock:
            return self._estimate is not None and self._estimate > self.capacity_bytes

    def touch(self, path: str) -> None:
        """A load hit ``path``: it is recently used now (a read-only store is left as it is)."""
        try:
            os.utime(path)
        except OSError:
            pass

    def evict(self) -> int:
        """Delete the least recently used files until the store is under ``LOW_WATER`` × capacity.
        Returns the bytes freed. One eviction runs at a time per process: a call while one runs
        returns at once and the running one makes another pass, so a file published during a
        pass is never left over the capacity."""
        with self._lock:
            self._wanted, self._queued = True, False
        freed = 0
        while True:
            if not self._evicting.acquire(blocking=False):
                return freed
            try:
                while self._take_wanted():
                    freed += self._evict_once()
            finally:
                self._evicting.release()
            with self._lock:
                if not self._wanted:
                    return freed

    def _take_wanted(self) -> bool:
        with self._lock:
            wanted, self._wanted = self._wanted, False
            return wanted

    def _evict_once(self) -> int:
        started = time.perf_counter()
        with self._lock:
            self._added_since_scan = 0  # files published from now on may be missing from the scan
        files = self._scan()
        total = sum(size for _, _, size in files)
        target = int(self.capacity_bytes * LOW_WATER)
        freed = removed = removed_bytes = 0
        if total > self.capacity_bytes:
            # corrupt leftovers first, then by last use
            files.sort(key=lambda entry: (not entry[0].endswith(CORRUPT_SUFFIX), entry[1]))
            for path, _, size in files:
                if total - freed <= target:
                    break
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    freed += size  # another process evicted it first: gone, but not counted here
                    continue
                except OSError as exc:
                    logger.warning("storage connector: could not evict %s: %s", path, exc)
                    continue
                freed += size
                removed += 1
                removed_bytes += size
            self._remove_empty_namespaces()
        with self._lock:
            self._estimate = total - freed + self._added_since_scan  # never less than the truth
        if removed:
            self._count("evicted_blocks", removed)
            self._count("evicted_bytes", removed_bytes)
            logger.debug("storage connector: evicted %d files (%d bytes) from %s in %.3f s",
                         removed, removed_bytes, self.root, time.perf_counter() - started)
        return freed

    # ---------------------------------------------------------------- internals
    def _scan(self) -> list[tuple[str, float, int]]:
        """(path, last use, size) of every block file (and corrupt leftover) under the root."""
        found: list[tuple[str, float, int]] = []
        try:
            namespaces = list(os.scandir(self.root))
        except FileNotFoundError:
            return found
        for namespace in namespaces:
            if not namespace.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(namespace.path))
            except FileNotFoundError:
                continue
            for entry in entries:
                if not (entry.name.endswith(BLOCK_SUFFIX) or entry.name.endswith(CORRUPT_SUFFIX)):
                    continue  # temporaries of writes in progress are not the store's yet
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append((entry.path, stat.st_mtime, stat.st_size))
        return found

    def _scan_total(self) -> int:
        return sum(size for _, _, size in self._scan())

    def _remove_empty_namespaces(self) -> None:
        try:
            namespaces = list(os.scandir(self.root))
        except FileNotFoundError:
            return
        for namespace in namespaces:
            if namespace.is_dir(follow_symlinks=False):
                try:
                    os.rmdir(namespace.path)  # only if empty; a writer recreates it when needed
                except OSError:
                    pass

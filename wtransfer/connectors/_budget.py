"""A byte budget for a directory of block files, shared by every process that writes to it.

Every weight update (and cache reset) starts a new namespace whose predecessor may never be read again. A store
with a capacity evicts first the files of namespaces no connector marked in use for ``IN_USE_TTL_S``, then the
least recently used ("used": a file's mtime, set by a save and refreshed by a load hit, :meth:`StoreBudget.touch`).

Several processes may share the store (TP workers, instances, restarts) with no shared index. Each keeps an
estimate of the store's size (a scan at first use, plus what it wrote since); past the capacity it scans for the
truth and deletes the oldest files until under ``LOW_WATER`` × capacity. Two processes evicting at once may delete
the same file (``FileNotFoundError``, ignored) or a little more than needed; files are immutable and published by
rename, so a reader opens a whole file or none (a miss). Between scans the store may exceed the capacity by what
other processes wrote since.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from wtransfer.connectors._blockfile import BLOCK_SUFFIX, CORRUPT_SUFFIX, TMP_SUFFIX

logger = logging.getLogger("wtransfer")

LOW_WATER = 0.9
"""An eviction stops once the store is under this fraction of its capacity (not at the brim: every save would
otherwise pay for a scan)."""
IN_USE_PREFIX = ".in-use."
"""A namespace's marker files, one per connector using it (``.in-use.<id>``): each refreshes its own
(:meth:`wtransfer.connectors.storage.BlockStore.mark_in_use`) at most every ``IN_USE_REFRESH_S`` while it looks up
or saves blocks, and removes it at shutdown."""
IN_USE_REFRESH_S = 60.0
IN_USE_TTL_S = 600.0
"""A namespace whose markers are all older than this (seconds), or that has none, is used by no instance (or by one
idle that long): its files are evicted before any other namespace's."""
ABANDONED_WRITE_S = 600.0
"""A write's temporary file (:data:`TMP_SUFFIX`) not written to for this long (seconds) was left by a writer that
died before its rename: it counts against the capacity and is evicted first, with the corrupt leftovers."""


def filesystem_share(root: str, share: float, most: int) -> int:
    """``share`` of the size of the filesystem that holds ``root`` (or would), at most ``most``."""
    path = os.path.abspath(root)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        stat = os.statvfs(path)
    except OSError:
        return most
    return max(1, min(most, int(stat.f_blocks * stat.f_frsize * share)))


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
        """A file of ``nbytes`` was published; True if the store is (estimated) over capacity and no eviction was
        asked for since the last one began (the caller then runs :meth:`evict`)."""
        with self._lock:
            self._added_since_scan += nbytes
            if self._estimate is None:
                self._estimate = sum(size for _, _, size in self._scan())
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
        """Delete the least recently used files until under ``LOW_WATER`` × capacity; return the bytes freed.

        One eviction runs at a time per process: a call meanwhile returns at once and the running one makes another
        pass, so a file published during a pass is never left over the capacity."""
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
            # leftovers first (corrupt, abandoned writes), then namespaces no instance uses, then by last use
            live = self._live_namespaces()
            files.sort(key=lambda entry: (not entry[0].endswith((CORRUPT_SUFFIX, TMP_SUFFIX)),
                                          os.path.dirname(entry[0]) in live, entry[1]))
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
            self._remove_empty_namespaces(live)
        with self._lock:
            self._estimate = total - freed + self._added_since_scan  # never less than the truth
        if removed:
            self._count("evicted_blocks", removed)
            self._count("evicted_bytes", removed_bytes)
            logger.debug("storage connector: evicted %d files (%d bytes) from %s in %.3f s",
                         removed, removed_bytes, self.root, time.perf_counter() - started)
        return freed

    # ---------------------------------------------------------------- internals
    def _namespaces(self) -> list[os.DirEntry[str]]:
        """The namespace directories under the root (symbolic links are not the store's)."""
        try:
            return [entry for entry in os.scandir(self.root) if entry.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return []

    def _scan(self) -> list[tuple[str, float, int]]:
        """(path, last use, size) of every block file (and leftover: corrupt, or an abandoned write) under the root."""
        found: list[tuple[str, float, int]] = []
        abandoned = time.time() - ABANDONED_WRITE_S
        for namespace in self._namespaces():
            try:
                entries = list(os.scandir(namespace.path))
            except FileNotFoundError:
                continue
            for entry in entries:
                temporary = entry.name.endswith(TMP_SUFFIX)
                if not (temporary or entry.name.endswith(BLOCK_SUFFIX) or entry.name.endswith(CORRUPT_SUFFIX)):
                    continue
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if temporary and stat.st_mtime >= abandoned:
                    continue  # a write in progress: not the store's yet
                found.append((entry.path, stat.st_mtime, stat.st_size))
        return found

    def _live_namespaces(self) -> set[str]:
        """The namespace directories some connector marked in use within ``IN_USE_TTL_S``."""
        live, oldest = set(), time.time() - IN_USE_TTL_S
        for namespace in self._namespaces():
            try:
                markers = [entry for entry in os.scandir(namespace.path) if entry.name.startswith(IN_USE_PREFIX)]
                if any(marker.stat().st_mtime >= oldest for marker in markers):
                    live.add(namespace.path)
            except OSError:
                pass
        return live

    def _remove_empty_namespaces(self, live: set[str]) -> None:
        """Remove namespace directories left empty; ``live``: those in use (their markers stay)."""
        for namespace in self._namespaces():
            if namespace.path not in live:  # stale markers (of crashed users) keep no namespace
                try:
                    names = os.listdir(namespace.path)
                    if all(name.startswith(IN_USE_PREFIX) for name in names):
                        for name in names:
                            marker = os.path.join(namespace.path, name)
                            if os.stat(marker).st_mtime < time.time() - IN_USE_TTL_S:  # not marked meanwhile
                                os.unlink(marker)
                except OSError:
                    pass
            try:
                os.rmdir(namespace.path)  # only if empty; a writer recreates it when needed
            except OSError:
                pass

"""Resource probes for the bench and conformance tests: how much memory and how many file
descriptors this process holds, and which staged copies of a round processes map.

Also the process table (:func:`stat_fields`, :func:`process_table`, :func:`descendants`): state, parent and CPU
ticks of processes, for the leak checks and the bench's measure of how busy the machine was (Linux only: without
``/proc`` they find nothing).

On Linux everything is read from ``/proc`` and nothing needs installing. Only where ``/proc``
is unavailable (macOS, Windows) do the memory and descriptor probes import ``psutil``, lazily,
on first use; without it they raise an ``ImportError`` that says to ``pip install psutil``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

_STATUS = "/proc/self/status"


def _psutil() -> Any:
    """``psutil``, for systems without ``/proc``; a clear error when it is not installed."""
    try:
        import psutil
    except ImportError as exc:
        raise ImportError(
            "wtransfer measures memory, open files and CPU time through /proc, which this system "
            "lacks; install psutil to measure them here: pip install psutil"
        ) from exc
    return psutil


def _status_kib(field: str) -> int | None:
    """One ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; None without /proc."""
    prefix = field.encode()
    try:
        with open(_STATUS, "rb") as handle:
            for line in handle:
                if line.startswith(prefix):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakRss:
    """Peak resident memory of this process since it was created or last ``reset()``.

    Uses the kernel's high-water mark (``VmHWM`` of ``/proc/self/status``, reset by writing
    ``5`` to ``/proc/self/clear_refs``) where allowed, which sees every spike however short.
    Where that reset is refused (some containers) or there is no ``/proc``, a daemon thread
    samples the RSS every millisecond instead, and a spike shorter than that may be missed.
    The RSS comes from ``/proc/self/status`` (``VmRSS``), or from psutil without ``/proc``.
    """

    def __init__(self) -> None:
        self._process: Any = None
        if _status_kib("VmRSS:") is None:  # no /proc: psutil, or a clear error now
            self._process = _psutil().Process()
        self._kernel = self._process is None and self._reset_kernel_peak()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.baseline = self.current()
        self._sampled = self.baseline
        if not self._kernel:
            self._start_sampling()

    @staticmethod
    def _reset_kernel_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            return True
        except OSError:
            return False

    def _start_sampling(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._sample, name="wtransfer-rss", daemon=True)
            self._thread.start()

    def current(self) -> int:
        """Resident memory of this process now, in bytes."""
        if self._process is not None:
            return int(self._process.memory_info().rss)
        rss = _status_kib("VmRSS:")
        return rss if rss is not None else 0

    def reset(self) -> None:
        """Start a new measurement from the current RSS."""
        self.baseline = self.current()  # read here: the sampler thread may raise _sampled meanwhile
        self.restart_peak()

    def restart_peak(self) -> None:
        """Forget the peak so far but keep the baseline (to leave out work that is not measured)."""
        self._sampled = self.current()
        if self._kernel:
            self._kernel = self._reset_kernel_peak()
            if not self._kernel:
                self._start_sampling()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._sampled = max(self._sampled, self.current())

    def peak(self) -> int:
        """Highest resident memory since creation or the last ``reset()``/``restart_peak()``, in bytes."""
        if self._kernel:
            hwm = _status_kib("VmHWM:")
            if hwm is not None:
                return hwm
        return max(self._sampled, self.current())

    def extra(self) -> int:
        """Peak minus the RSS at ``reset()``: what the measured work added."""
        return max(self.peak() - self.baseline, 0)

    def close(self) -> None:
        """Stop the sampling thread, if one runs."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)


def open_fd_count() -> int:
    """Open file descriptors of this process (for leak checks).

    The count from ``/proc/self/fd`` includes the one descriptor that listing it holds open,
    so compare counts with each other, not with an absolute number.
    """
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # pragma: no cover - no /proc
        return int(_psutil().Process().num_fds())


__all__ = ["PeakRss", "descendants", "open_fd_count", "process_table", "staging_segments", "stat_fields"]


def staging_segments(pids: list[int]) -> dict[int, int]:
    """inode -> size of every staged copy of a round (``memfd:wtransfer-staging``) the processes ``pids`` map (Linux).

    How a benchmark or a test sees that a node holds one staged copy however many workers it runs.
    """
    found: dict[int, int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as handle:
                lines = handle.readlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == "/memfd:wtransfer-staging":
                start, end = (int(x, 16) for x in parts[0].split("-"))
                found[int(parts[4])] = max(found.get(int(parts[4]), 0), end - start)
    return found


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` that follow ``pid (comm)``: ``[0]`` is the state letter (``"Z"``: a zombie,
    ended but not reaped yet), ``[1]`` the parent, ``[11:15]`` utime, stime, cutime and cstime in clock ticks
    (proc(5)'s fields 3 on). None when they cannot be read: the process is gone, there is no ``/proc``, or it
    may not be read (``hidepid``).

    The command name may hold spaces and ``)``, so the fields start after its last ``)``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].decode().split()


def process_table() -> dict[int, list[str]]:
    """:func:`stat_fields` of every process that could be read (none without ``/proc``)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    table = {}
    for entry in entries:
        if entry.isdigit() and (fields := stat_fields(entry)) is not None:
            table[int(entry)] = fields
    return table


def descendants(table: dict[int, list[str]], root: int) -> set[int]:
    """The processes below ``root`` in ``table`` (:func:`process_table`), zombies included."""
    parents = {pid: int(fields[1]) for pid, fields in table.items()}
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found

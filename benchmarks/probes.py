"""CPU probes for the sharded benchmark (Linux): CPU time a process used, and how long its threads
waited for a core. Both read the kernel's own accounting in ``/proc``."""

from __future__ import annotations

import os

from wtransfer._probes import stat_fields


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` (this one or a child) has used so far."""
    fields = stat_fields(pid)
    if fields is None:
        if os.path.isdir("/proc/self"):
            raise ProcessLookupError(f"no process {pid}, or its /proc/{pid}/stat cannot be read")
        raise OSError("cpu_seconds reads /proc, which this system lacks")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_queue_seconds(pid: int) -> float | None:
    """Seconds the threads of process ``pid`` spent runnable but waiting for a core, so far.

    The second field of ``/proc/<pid>/task/<tid>/schedstat`` (the kernel's run delay: time
    runnable but not running, wake-up latency included), summed over the process's threads; a
    thread that already exited is no longer counted, so a difference of two readings leaves out
    threads that ended in between. None where the kernel does not keep these statistics (no
    ``/proc``, or every field zero).
    """
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    ran = waited = 0
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as handle:
                fields = handle.read().split()
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
        except (OSError, IndexError, ValueError):
            if tid == str(pid):  # the main thread has no schedstat: the kernel keeps none
                return None
    if ran == 0:  # a process that ran reads all zeros where the kernel keeps no run-queue statistics
        return None
    return waited / 1e9

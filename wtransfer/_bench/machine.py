"""How busy the machine was around a benchmark, judged from outside the benchmark's own processes.

A miss on a machine other processes were using is often the machine's; on an idle one, the code's. The load
average counts the benchmark itself once it runs, so it is read *before* the run; during it, the CPU time the whole
machine spent (``/proc/stat``) minus what this process and its descendants spent is other processes'. A run
pinned to some cores (``taskset``) is judged on those cores alone.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from wtransfer._probes import descendants, process_table
from wtransfer.testing.bench_blocks import usable_cpus

BUSY_SHARE = 0.10
"""Other processes (or the hypervisor) taking this share of the machine's CPU time during the run make it "busy"."""
BUSY_LOAD = 0.5
"""Where ``/proc/stat`` cannot be read, a load average per core this high before the run does."""


@dataclass(frozen=True)
class MachineLoad:
    cores: int
    """The cores the run may use (fewer than the host's when pinned)."""
    load_before: float | None
    """The 1-minute load average when the run started (None where there is none); shown, not judged where CPU times
    are known."""
    others_share: float | None
    """The share of the machine's CPU time that processes outside the run took during it."""
    steal_share: float | None = None
    """The share the hypervisor gave other machines (``steal``), during the run."""
    own_share: float | None = None
    """The share the run itself took (this process and its descendants)."""
    host_cores: int | None = None
    """The host's cores, which its load average counts over (None: the same as ``cores``)."""

    @property
    def busy(self) -> bool:
        if self.others_share is None:
            return (self.load_before or 0.0) / (self.host_cores or self.cores) >= BUSY_LOAD
        return self.others_share >= BUSY_SHARE or (self.steal_share or 0.0) >= BUSY_SHARE

    def words(self) -> str:
        """E.g. "idle: other processes took 0.4% of its CPU during the run (load average 0.12 on 2 cores before it)"."""
        parts = []
        if self.others_share is not None:
            parts.append(f"other processes took {self.others_share:.1%} of its CPU during the run")
            if (self.steal_share or 0.0) >= 0.005:
                parts.append(f"the hypervisor {self.steal_share:.1%}")
        host = self.host_cores or self.cores
        where = f"on {self.cores} cores" if host == self.cores else f"on the {self.cores} pinned cores"
        if self.load_before is not None:
            pinned = "" if host == self.cores else "the host's "
            load = f"{pinned}load average {self.load_before:.2f} on {host} cores before it"
        else:
            load = where
        return f"{'busy' if self.busy else 'idle'}: {', '.join(parts) or 'CPU times unknown'} ({load})"

    def to_dict(self) -> dict[str, object]:
        return {"cores": self.cores, "host_cores": self.host_cores, "load_before": self.load_before,
                "others_share": self.others_share,
                "steal_share": self.steal_share, "own_share": self.own_share, "busy": self.busy,
                "words": self.words()}


class LoadWatch:
    """Started before a run, finished after it: how much of the machine the run had to itself."""

    def __init__(self) -> None:
        self._cpus = usable_cpus()
        self.host_cores = os.cpu_count() or 1
        self.cores = len(self._cpus) if self._cpus else self.host_cores
        try:
            self.load_before: float | None = os.getloadavg()[0]
        except OSError:  # pragma: no cover - no load average on this platform
            self.load_before = None
        self._machine = _machine_seconds(self._cpus)
        self._own = _own_seconds()
        self._started = time.monotonic()

    def finish(self) -> MachineLoad:
        machine, own = _machine_seconds(self._cpus), _own_seconds()
        if machine is None or self._machine is None:
            return MachineLoad(self.cores, self.load_before, None, host_cores=self.host_cores)
        busy, steal, total = (end - start for end, start in zip(machine, self._machine))
        if total <= 0:
            return MachineLoad(self.cores, self.load_before, None, host_cores=self.host_cores)
        mine = own - self._own
        return MachineLoad(self.cores, self.load_before, max(0.0, busy - mine) / total, steal / total,
                           min(mine, busy) / total, self.host_cores)


def _machine_seconds(cpus: set[int] | None = None) -> tuple[float, float, float] | None:
    """Busy (without steal), steal and total CPU seconds since boot of ``cpus`` (default: every core), or None."""
    try:
        rows = [line.split() for line in Path("/proc/stat").read_text().splitlines()]
        if cpus is None:
            rows = [row for row in rows if row and row[0] == "cpu"]  # every core
        else:
            rows = [row for row in rows if row and re.fullmatch(r"cpu(\d+)", row[0]) and int(row[0][3:]) in cpus]
            if len(rows) != len(cpus):  # a pinned CPU /proc/stat does not list: no share rather than a wrong one
                return None
        sums = [0] * 8
        for row in rows:
            sums = [a + int(b) for a, b in zip(sums, (row[1:] + ["0"] * 8)[:8])]
    except (OSError, ValueError):
        return None
    if not rows:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = sums
    tick = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq
    return busy / tick, steal / tick, (busy + steal + idle + iowait) / tick


def _own_seconds() -> float:
    """CPU seconds of this process, its reaped children, and its live descendants (with theirs)."""
    times = os.times()
    own = times.user + times.system + times.children_user + times.children_system
    table = process_table()
    ticks = sum(sum(int(x) for x in table[pid][11:15]) for pid in descendants(table, os.getpid()))  # utime .. cstime
    return own + ticks / os.sysconf("SC_CLK_TCK")

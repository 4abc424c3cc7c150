"""The benchmarks' CPU probes read the kernel's own accounting: checked against processes whose
CPU use and contention are known by construction."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from wtransfer._probes import cpu_seconds, run_queue_seconds

SPIN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or run_queue_seconds(os.getpid()) is None
                    or len(os.sched_getaffinity(0)) < 2, reason="needs Linux schedstats and two cores")
def test_spinners_sharing_a_core_wait_for_it_and_one_alone_does_not() -> None:
    """Two processes each burning 1 CPU second on one core: each is runnable about as long as the
    other runs, so each waits for the core (about 1 s). A third, alone on the other core, burns as
    much and hardly waits. A probe that read the time on the CPU instead (schedstat's first field)
    fails the third; one that saw nothing, or only a sleeping thread, fails the first two."""
    shared, alone = sorted(os.sched_getaffinity(0))[:2]
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=1.0)]) for _ in range(3)]
    try:
        for spinner, core in zip(spinners, (shared, shared, alone)):
            os.sched_setaffinity(spinner.pid, {core})
        samples: dict[int, tuple[float, float]] = {}
        while any(s.poll() is None for s in spinners):
            for spinner in spinners:
                try:
                    cpu, waited = cpu_seconds(spinner.pid), run_queue_seconds(spinner.pid)
                except (ProcessLookupError, FileNotFoundError):
                    continue
                if waited is not None:  # None: it exited between the two readings; keep the last sample
                    samples[spinner.pid] = (cpu, waited)
            time.sleep(0.02)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    (cpu_a, waited_a), (cpu_b, waited_b), (cpu_c, waited_c) = (samples[s.pid] for s in spinners)
    for cpu in (cpu_a, cpu_b, cpu_c):
        assert cpu >= 0.5, f"{cpu:.2f} CPU s seen of the ~1 s a spinner burned"
    assert waited_a >= 0.3 and waited_b >= 0.3, f"spinners sharing a core waited only {waited_a:.2f}, {waited_b:.2f} s"
    assert waited_c < 0.5, f"a spinner alone on its core waited {waited_c:.2f} s"

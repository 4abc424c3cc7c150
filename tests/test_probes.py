"""The benchmarks' CPU probes read the kernel's own accounting: checked against processes whose
CPU use and contention are known by construction."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.probes import cpu_seconds, run_queue_seconds

SPIN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\nprint(time.monotonic())\n"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or run_queue_seconds(os.getpid()) is None,
                    reason="needs Linux schedstats")
def test_spinners_sharing_a_core_wait_for_it_and_cpu_plus_wait_is_their_lifetime() -> None:
    """Three processes each burning 1 CPU second on one core: each gets at most a third of it, so
    each waits for the core at least about twice as long as it runs, however busy the host is
    (other load only adds waiting). A spinner never sleeps, so the CPU it used plus the time it
    waited is its whole life. A probe that read the time on the CPU instead (schedstat's first
    field) reports waits equal to the CPU time; one that saw nothing, or only a sleeping thread,
    reports none; either fails. (An earlier version also wanted a spinner "alone" on the second
    core to hardly wait, which fails whenever something else runs on that core.) Each spinner's
    counts are read once it exited, before it is reaped, and it says when it stopped spinning: this
    test's own process, itself waiting for a core on a busy host, may see an exit late (a CI run
    once failed with a life of 8.50 s seen against 6.11 s counted)."""
    core = min(os.sched_getaffinity(0))
    started = time.monotonic()
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=1.0)], stdout=subprocess.PIPE, text=True)
                for _ in range(3)]
    lifetimes: dict[int, float] = {}
    try:
        for spinner in spinners:
            os.sched_setaffinity(spinner.pid, {core})
        samples: dict[int, tuple[float, float]] = {}
        while len(lifetimes) < len(spinners):
            for spinner in spinners:
                if spinner.pid in lifetimes:
                    continue
                # exited (a zombie until reaped: its counts are final), without reaping it
                exited = os.waitid(os.P_PID, spinner.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
                try:
                    cpu, waited = cpu_seconds(spinner.pid), run_queue_seconds(spinner.pid)
                except (ProcessLookupError, FileNotFoundError):
                    cpu = waited = None
                if waited is not None:  # None: it exited between the two readings; keep the last sample
                    samples[spinner.pid] = (cpu, waited)
                if exited:
                    lifetimes[spinner.pid] = time.monotonic() - started
            time.sleep(0.02)
    finally:
        printed = {}
        for spinner in spinners:
            spinner.kill()
            printed[spinner.pid] = spinner.communicate()[0]
    spun = {pid: float(out.split()[-1]) - started for pid, out in printed.items()}
    for spinner in spinners:
        cpu, waited = samples[spinner.pid]
        assert cpu >= 0.5, f"{cpu:.2f} CPU s seen of the ~1 s a spinner burned"
        assert waited >= 1.5 * cpu, f"a spinner sharing its core with two others waited {waited:.2f} s for {cpu:.2f} s of CPU"
        # its whole life is at most what this process saw (it noticed the exit late, if at all) and at
        # least until it stopped spinning; its start-up reads files it may sleep on
        life, least = lifetimes[spinner.pid], spun[spinner.pid]
        assert 0.75 * least - 0.2 <= cpu + waited <= life + 0.05, (
            f"CPU {cpu:.2f} s + wait {waited:.2f} s over a life of {least:.2f} s (spinning) to {life:.2f} s (seen)")

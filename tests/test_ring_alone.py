"""The ring-alone table of ``wtransfer bench sharded`` (shm, one worker), through the CLI: it must
run with several writers on a model with uneven rows, and each run checks itself (every byte of
the model in exactly one writer's run, and after every round each run holding what its writer
wrote there in that round)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# uneven rows (7, 5, 1000, 3 rows over 2 and 4 writers), 1-D tensors (one of one element), one over 1 MiB
MODEL = "7x3,5,1000x700,3x1x2,2x4096,1"


def test_the_ring_alone_runs_with_several_writers_beside_the_engine_and_checks_every_run() -> None:
    run = subprocess.run([sys.executable, "-m", "wtransfer", "bench", "sharded", "--model", MODEL, "--ranks", "2,4",
                          "--gathers", "0", "--no-checksums", "--repeats", "1", "--rounds", "2", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode in (0, 1), run.stderr  # 1: a target missed on this tiny model
    figures = json.loads(run.stdout)
    alone = {row["writers"]: row for row in figures["ring_alone"]}
    assert sorted(alone) == [1, 2, 4]
    assert all(row["gb_per_s"] > 0 and len(row["runs"]) == 1 for row in alone.values())
    assert alone[1]["ratio"] == 1.0
    cores = len(os.sched_getaffinity(0))
    for row in alone.values():  # each process's own CPU clock, against the reader's phases
        assert row["cores"] == cores  # the cores this process may use, not the machine's count
        # the bucket phase holds every process's CPU of it: never more than every core busy (a
        # little slack: a writer stops its clock after its last message, as the reader takes it).
        # How busy it keeps the cores is a figure of the host, not of the ring: with another job
        # on the second core it fell to 0.185 of a core, so only "some CPU was clocked" is checked
        assert 0 < row["bucket_busy"] <= cores * 1.1, row
        assert 0 < row["commit_share"] < 1, row
        # the estimate never makes a round slower than it ran: its phases' CPU fits in their time
        assert row["gain_estimate"] >= 0.98, row


def test_the_ring_alone_is_left_out_with_more_than_one_worker() -> None:
    run = subprocess.run([sys.executable, "-m", "wtransfer", "bench", "sharded", "--model", MODEL, "--ranks", "2",
                          "--workers", "2", "--gathers", "0", "--no-checksums", "--repeats", "1", "--rounds", "2",
                          "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode in (0, 1), run.stderr
    assert json.loads(run.stdout)["ring_alone"] == []

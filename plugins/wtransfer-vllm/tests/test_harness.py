"""The harness leaves nothing behind: a process a test starts (a vLLM server, a script holding an engine) dies with
the test process, however that ends. Before, a Ctrl-C during the test command left a ``vllm`` API server running on
its own (parent PID 1): it ran in a session of its own, and only the fixture's teardown, which a killed pytest
worker never reaches, stopped it. Needs no vLLM."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from vllm_harness import PLUGIN_ROOT

STARTER = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from vllm_harness import tied_popen
server = tied_popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(server.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_server_dies_with_the_test_process_that_started_it_however_it_ends() -> None:
    assert PLUGIN_ROOT.is_dir()
    test_process = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    server = int(test_process.stdout.readline())
    assert not _gone(server)
    test_process.kill()  # as a killed pytest worker: no teardown runs
    test_process.wait()
    deadline = time.monotonic() + 10
    while not _gone(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(server), f"the server (pid {server}) outlived the process that started it"

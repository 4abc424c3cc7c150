"""The main README's "Use with vLLM" commands, run as written (with the cached vLLM environment
activated in place of the setup block, whose pins must match the harness's)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from vllm_harness import REPO_ROOT, UNNEEDED, VLLM_REQUIREMENT, cpu_flags

README = REPO_ROOT / "README.md"


def block(marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)```\n<!-- /{marker} -->", README.read_text(), re.S)
    assert match, f"README has no {marker} block"
    return match.group(1)


def run_block(vllm_python: Path, marker: str, timeout: float) -> subprocess.CompletedProcess[str]:
    bin_dir = str(vllm_python.parent)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(vllm_python.parents[1]))
    process = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block(marker)], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever the block left running (a server)
        except ProcessLookupError:
            pass
    done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    assert done.returncode == 0, f"README {marker} block exited {done.returncode}\n{out[-4000:]}\n{err[-6000:]}"
    return done


def test_setup_block_pins_what_the_tests_use() -> None:
    setup = block("vllm-setup")
    assert VLLM_REQUIREMENT in setup and "torch==2.13.0" in setup
    assert all(name in setup for name in UNNEEDED)
    assert "pip install -e . -e plugins/wtransfer-vllm" in setup


@pytest.fixture
def readme_model() -> Path:
    path = Path("/tmp/tiny-llama")  # the path the README uses
    shutil.rmtree(path, ignore_errors=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_offline_then_serve_commands_run_as_written(vllm_python: Path, readme_model: Path) -> None:
    # On AMX hosts the KV block's second run (a fresh worker whose first request is a store hit) died
    # with SIGILL until the bridge asked Linux for AMX tile permission (wtransfer_vllm.amx).
    print(f"host CPU flags: {cpu_flags()}")
    offline = run_block(vllm_python, "vllm-offline", timeout=600)
    (result,) = [line for line in offline.stdout.splitlines() if line.startswith("result: ")]  # one clear line
    assert result.endswith("identical to a fresh load: True"), result
    # vLLM started with no weights; the trainer's fp32 tensors all cast; after round 1 only the layers
    rounds = re.findall(r"round (\d): (\d+) tensors, [\d.]+ MB as bf16 \((\d+) cast from fp32\)", offline.stdout)
    assert [int(version) for version, _, _ in rounds] == [1, 2, 3, 4], offline.stdout
    assert all(tensors == cast for _, tensors, cast in rounds), rounds
    assert all(int(tensors) < int(rounds[0][1]) for _, tensors, _ in rounds[1:]), rounds

    store = Path("/tmp/kv-store")  # the README's
    shutil.rmtree(store, ignore_errors=True)
    try:
        out = run_block(vllm_python, "vllm-kv", timeout=600).stdout
        first, second = [line for line in out.splitlines() if line.startswith("reused ")]
    finally:
        shutil.rmtree(store, ignore_errors=True)
    assert first.startswith("reused 0 of 129 prompt tokens") and second.startswith("reused 128 of 129 prompt tokens")
    assert first.split("tokens: ")[1] == second.split("tokens: ")[1]

    with socket.socket() as sock:
        if sock.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.fail("port 8000 (the README's) is taken on this machine; free it to run this test")
    served = run_block(vllm_python, "vllm-serve", timeout=600)
    assert "weight_info: {'weight_version': 'step-2'}" in served.stdout
    (result,) = [line for line in served.stdout.splitlines() if line.startswith("result: ")]
    assert result.endswith("outputs changed: True"), result

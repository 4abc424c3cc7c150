"""The vLLM commands of README.md and docs/vllm.md, run as written (with the cached vLLM environment
activated in place of the setup block, whose pins must match the harness's)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_harness import REPO_ROOT, UNNEEDED, VLLM_REQUIREMENT, cpu_flags, tied_popen

README = REPO_ROOT / "README.md"
PAGES = (README, REPO_ROOT / "docs" / "vllm.md")  # the vLLM page holds the serve and KV commands


def block(marker: str) -> str:
    pattern = rf"<!-- {marker} -->\n```bash\n(.*?)```\n<!-- /{marker} -->"
    found = [code for page in PAGES for code in re.findall(pattern, page.read_text(), re.S)]
    assert len(found) == 1, f"README.md and docs/vllm.md hold {len(found)} {marker} blocks; one is run, so keep one"
    return found[0]


def run_block(vllm_python: Path, marker: str, timeout: float) -> subprocess.CompletedProcess[str]:
    bin_dir = str(vllm_python.parent)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(vllm_python.parents[1]))
    process = tied_popen(["bash", "-euo", "pipefail", "-c", block(marker)], cwd=REPO_ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever the block left running (a server)
        except ProcessLookupError:
            pass
    done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    assert done.returncode == 0, f"the {marker} block exited {done.returncode}\n{out[-4000:]}\n{err[-6000:]}"
    return done


def test_setup_block_pins_what_the_tests_use() -> None:
    setup = block("vllm-setup")
    assert VLLM_REQUIREMENT in setup and "torch==2.13.0" in setup
    assert all(name in setup for name in UNNEEDED)
    assert "pip install -e . -e plugins/wtransfer-vllm" in setup


@pytest.fixture
def readme_model() -> Path:
    path = Path("/tmp/tiny-llama")  # the path the README and docs/vllm.md use
    shutil.rmtree(path, ignore_errors=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_offline_then_serve_commands_run_as_written(vllm_python: Path, readme_model: Path) -> None:
    # On AMX hosts the KV block's second run (a fresh worker whose first request is a store hit) died
    # with SIGILL until the bridge asked Linux for AMX tile permission (wtransfer_vllm.amx).
    print(f"host CPU flags: {cpu_flags()}")
    offline = run_block(vllm_python, "vllm-offline", timeout=600)
    assert last_line(offline).startswith("PASS: after 4 rounds over shm"), offline.stdout[-3000:]
    assert "exited unexpectedly" not in offline.stdout + offline.stderr  # both vLLMs shut down cleanly
    # what wtransfer causes reads clean: no per-round warning of layers a round leaves out by design
    # (rotary caches, the tied head), no fp32-into-bf16 warning from the check's fresh load
    assert "Failed to load weights" not in offline.stdout + offline.stderr
    assert "Attempted to load weight" not in offline.stdout + offline.stderr
    # vLLM started with no weights; the trainer's fp32 tensors all cast; after round 1 only the layers
    rounds = re.findall(r"round (\d): (\d+) tensors, [\d.]+ MB as bf16 \((\d+) cast from fp32\)", offline.stdout)
    assert [int(version) for version, _, _ in rounds] == [1, 2, 3, 4], offline.stdout
    assert all(tensors == cast for _, tensors, cast in rounds), rounds
    assert all(int(tensors) < int(rounds[0][1]) for _, tensors, _ in rounds[1:]), rounds

    store = Path("/tmp/kv-store")  # docs/vllm.md's
    shutil.rmtree(store, ignore_errors=True)
    try:
        kv = run_block(vllm_python, "vllm-kv", timeout=600)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    assert last_line(kv).startswith("PASS: the second instance loaded 128 prompt tokens"), kv.stdout[-3000:]
    first, second = [line for line in kv.stdout.splitlines() if " instance: reused " in line]
    assert first.startswith("first instance: reused 0 of 129") and second.startswith("second instance: reused 128 of 129")
    assert first.split("tokens: ")[1] == second.split("tokens: ")[1]
    assert "exited unexpectedly" not in kv.stdout + kv.stderr

    with socket.socket() as sock:
        if sock.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.fail("port 8000 (docs/vllm.md's) is taken on this machine; free it to run this test")
    served = run_block(vllm_python, "vllm-serve", timeout=600)
    assert "weight_info: {'weight_version': '3'}" in served.stdout  # the last round's stats["version"]
    assert "round 3:" in served.stdout
    assert last_line(served).startswith("PASS: 3 rounds synced into vllm serve over gloo"), served.stdout[-3000:]


def last_line(done: subprocess.CompletedProcess[str]) -> str:
    """What a user reads last: the block's last line of output."""
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else ""


PLUGIN_README = REPO_ROOT / "plugins" / "wtransfer-vllm" / "README.md"


def test_the_plugin_readmes_install_lines_work_in_a_fresh_venv(tmp_path: Path) -> None:
    """The plugin README's install block, verbatim, in a new virtual environment and a copy of
    the checkout, after the torch pin of the README's vLLM line (vLLM itself is the harness's
    cached environment, built from the same pins). ``pip install ./plugins/wtransfer-vllm`` alone,
    as the README once said, fails there: no index has the ``wtransfer`` it requires."""
    match = re.search(r"<!-- plugin-install -->\n```bash\n(.*?)```\n<!-- /plugin-install -->", PLUGIN_README.read_text(), re.S)
    assert match, "the plugin README has no plugin-install block"
    (torch_pin,) = re.findall(r"^pip install (torch==\S+) vllm", PLUGIN_README.read_text(), re.M)
    checkout = tmp_path / "checkout"  # a copy: a second editable build in the same tree could race the harness's
    shutil.copytree(REPO_ROOT, checkout, ignore=shutil.ignore_patterns(
        ".git", "tests", "build", "*.egg-info", "__pycache__", ".pytest_cache", "examples"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", f"pip install -q {torch_pin}\n{match.group(1)}"],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert done.stdout.strip().splitlines()[-1] == "wtransfer-vllm 0.1.0 installed", done.stdout[-2000:]
    entry_points = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "from importlib.metadata import entry_points; "
         "print(sorted(e.value for e in entry_points(group='vllm.general_plugins')))"],
        capture_output=True, text=True, timeout=120, env=env, check=True)
    assert "wtransfer_vllm.registration:register" in entry_points.stdout  # vLLM will find it

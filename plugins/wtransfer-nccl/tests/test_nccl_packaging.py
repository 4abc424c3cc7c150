"""wtransfer-nccl as a real installed distribution, on any machine (no GPU needed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from venvs import pip

CUDA_PROBE = "import torch; print(torch.cuda.is_available())"


def run(python: Path, code: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    if check and out.returncode != 0:
        raise AssertionError(f"exit {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out


def has_cuda(python: Path) -> bool:
    return run(python, CUDA_PROBE).stdout.strip() == "True"


def test_installing_is_the_only_step(plugin_venv: Path) -> None:
    listed = run(plugin_venv, "from wtransfer.cli import main; main(['list', 'engines', '--json'])")
    rows = [r for r in json.loads(listed.stdout) if r["name"] == "nccl"]
    assert rows == [{"kind": "engines", "name": "nccl", "distribution": "wtransfer-nccl", "version": "0.1.0",
                     "target": "wtransfer_nccl.engine:NCCLWeightTransferEngine", "status": "available"}]
    checked = run(plugin_venv, "from wtransfer.cli import main; raise SystemExit(main(['check', '--json']))",
                  check=False)
    nccl = [r for r in json.loads(checked.stdout) if r["name"] == "nccl"]
    assert nccl[0]["status"] == "ok", nccl
    broken = [r for r in json.loads(checked.stdout) if r["status"] in ("broken", "conflict")]
    assert checked.returncode == (1 if broken else 0)


def test_found_by_name_in_spawned_children(plugin_venv: Path, tmp_path: Path) -> None:
    (tmp_path / "child.py").write_text(
        "import wtransfer\n"
        "def main(path):\n"
        "    cls = wtransfer.get_class('engines', 'wtransfer-nccl:nccl')\n"
        "    open(path, 'w').write(cls.__name__ + ' ' + cls.trainer_cls.__name__)\n"
    )
    out_file = tmp_path / "out.txt"
    run(plugin_venv, f"""
import multiprocessing as mp, sys
sys.path.insert(0, {str(tmp_path)!r})
import child
if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child.main, args=({str(out_file)!r},))
    p.start(); p.join(120)
    assert p.exitcode == 0, p.exitcode
""")
    assert out_file.read_text() == "NCCLWeightTransferEngine NCCLTrainer"


def test_without_cuda_creation_fails_at_once_naming_the_cpu_engines(plugin_venv: Path) -> None:
    if has_cuda(plugin_venv):
        pytest.skip("this machine has CUDA; the no-CUDA error cannot happen here")
    out = run(plugin_venv, """
from wtransfer import WeightTransferConfig, WeightTransferEngineFactory
from wtransfer.engines import create_trainer
errors = []
try:
    WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="nccl"))
except Exception as exc:
    errors.append(f"{type(exc).__name__}|{isinstance(exc, RuntimeError)}|{exc}")
class Client:
    def init_weight_transfer_engine(self, info): raise AssertionError("must fail before any client call")
try:
    create_trainer("nccl", client=Client(), source={}, init_info={"world_size": 2})
except Exception as exc:
    errors.append(f"{type(exc).__name__}|{isinstance(exc, RuntimeError)}|{exc}")
print("\\n".join(errors))
""")
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2
    for line, side in zip(lines, ("worker", "trainer")):
        name, is_runtime, message = line.split("|", 2)
        assert name == "NCCLUnavailableError" and is_runtime == "True"
        assert f"{side} side" in message and "no CUDA device" in message
        assert "'shm'" in message and "'gloo'" in message


def test_uninstalling_brings_back_the_install_hint(plugin_venv: Path) -> None:
    # Runs last in this module (pytest keeps file order): it removes the plugin from the venv.
    pip(plugin_venv, "uninstall", "--yes", "--quiet", "wtransfer-nccl")
    out = run(plugin_venv, """
from wtransfer import WeightTransferConfig, WeightTransferEngineFactory, UnknownComponentError
try:
    WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="nccl"))
except UnknownComponentError as exc:
    print(exc)
""")
    assert "wtransfer-nccl" in out.stdout and "pip install" in out.stdout

"""Fixtures for the wtransfer-nccl tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wtransfer.testing.distributions import is_installed

PLUGIN_ROOT = Path(__file__).resolve().parents[1]


def plugin_installed_here() -> bool:
    return is_installed("wtransfer-nccl")


@pytest.fixture(scope="session")
def plugin_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment (seeing this one's packages) with wtransfer-nccl really pip-installed.

    Returns its python. Tests may pip-uninstall the plugin from it at the end.
    """
    if plugin_installed_here():
        pytest.skip("wtransfer-nccl is installed in this environment; these tests need one without it")
    root = tmp_path_factory.mktemp("venv")
    source = tmp_path_factory.mktemp("src") / "wtransfer-nccl"
    shutil.copytree(PLUGIN_ROOT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         "--no-build-isolation", str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return python


@pytest.fixture
def engine_module():
    """``wtransfer_nccl.engine`` imported from this source tree (no install needed)."""
    sys.path.insert(0, str(PLUGIN_ROOT))
    try:
        import wtransfer_nccl.engine as module

        yield module
    finally:
        sys.path.remove(str(PLUGIN_ROOT))

"""Fixtures for the wtransfer-nccl tests."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from wtransfer.testing.distributions import is_installed
from wtransfer.testing.leaks import leaves_nothing_behind  # noqa: F401 - autouse: every module checked
from venvs import layered_venv, pip

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
    python = layered_venv(root)
    # Built in pip's isolated build environment, as a user's install is: the running
    # environment's setuptools may be too old to build a wheel.
    pip(python, "install", "--quiet", "--no-deps", str(source))
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

"""Shared fixtures of wtransfer's own test suite (plugin-author fixtures live in wtransfer.testing)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wtransfer.testing.leaks import leaves_nothing_behind  # noqa: F401 - autouse: every module checked

EXAMPLE_PLUGIN = Path(__file__).parent / "example_plugin"


@pytest.fixture(scope="session")
def example_plugin_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean copy of tests/example_plugin (so builds leave nothing in the checkout)."""
    source = tmp_path_factory.mktemp("src") / "example_plugin"
    shutil.copytree(EXAMPLE_PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    return source


@pytest.fixture(scope="session")
def installed_example(example_plugin_source: Path, once_per_run) -> Path:
    """The example plugin really built and ``pip install``-ed, into a private target directory
    (once per run, whichever test worker needs it first)."""
    return once_per_run("example-plugin-site", lambda target: subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(example_plugin_source)],
        check=True, capture_output=True, text=True, timeout=300,
    ))

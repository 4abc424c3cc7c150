"""Fixtures for the wtransfer-verl tests: verl runs in the environment the wtransfer-vllm tests build (vLLM's,
with Ray and verl beside it), so both share one install."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from wtransfer.testing.leaks import leaves_nothing_behind  # noqa: F401 - autouse: every module checked

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "wtransfer-vllm" / "tests"))
from vllm_harness import ensure_vllm_venv  # noqa: E402


@pytest.fixture(scope="session")
def verl_python() -> Path:
    if os.environ.get("WTRANSFER_SKIP_VLLM") == "1":
        pytest.skip("WTRANSFER_SKIP_VLLM=1: the tests that need the vLLM environment (verl's too) were skipped")
    return ensure_vllm_venv()

"""Dogfooding: every built-in component passes the same conformance suites third parties use."""

from __future__ import annotations

from typing import Any

import pytest

from wtransfer.testing.conformance import SpecConformance


class TestCPUSpecLRU(SpecConformance):
    spec = "cpu"

    @pytest.fixture
    def spec_options(self) -> dict[str, Any]:
        return {"num_cpu_blocks": 6, "eviction_policy": "lru"}


class TestCPUSpecARC(SpecConformance):
    spec = "cpu"

    @pytest.fixture
    def spec_options(self) -> dict[str, Any]:
        return {"num_cpu_blocks": 6, "eviction_policy": "arc", "block_size": 8}

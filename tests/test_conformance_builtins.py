"""Dogfooding: every built-in component passes the same conformance suites third parties use.

The connectors run ``ConnectorConformance`` beside their own tests: ``storage`` in
test_kv_storage.py, ``multi`` in test_kv_multi.py, ``offloading`` (LRU and ARC) in
test_offload_connector.py. The example plugin certifies its engine and spec after a real
pip install (test_conformance_kit.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from wtransfer.testing.conformance import EngineConformance, SpecConformance


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


class TestSharedMemoryEngine(EngineConformance):
    engine = "shm"
    fault_schedules = 6



class TestGlooEngine(EngineConformance):
    engine = "gloo"
    fault_schedules = 6

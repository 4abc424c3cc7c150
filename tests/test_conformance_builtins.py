"""Dogfooding: every built-in component passes the same conformance suites third parties use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from wtransfer.testing.conformance import ConnectorConformance, EngineConformance, SpecConformance


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


class TestStorageConnector(ConnectorConformance):
    connector = "storage"
    persistent = True

    @pytest.fixture
    def connector_options(self, tmp_path: Path) -> dict[str, Any]:
        return {"path": str(tmp_path / "kv")}


class TestMultiConnector(ConnectorConformance):
    connector = "multi"
    persistent = True

    @pytest.fixture
    def connector_options(self, tmp_path: Path) -> dict[str, Any]:
        return {"connectors": [
            {"kv_connector": "storage", "kv_connector_extra_config": {"path": str(tmp_path / "fast")}},
            {"kv_connector": "storage", "kv_connector_extra_config": {"path": str(tmp_path / "shared")}},
        ]}


class TestSharedMemoryEngine(EngineConformance):
    engine = "shm"


class TestOffloadingConnector(ConnectorConformance):
    connector = "offloading"
    persistent = False  # the CPU tier lives inside the connector instance

    @pytest.fixture
    def connector_options(self, tmp_path: Path) -> dict[str, Any]:
        return {"spec_name": "cpu", "num_cpu_blocks": 64}

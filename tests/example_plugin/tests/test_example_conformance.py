"""The example plugin certifies itself with wtransfer's conformance kit, as any plugin author would."""

from __future__ import annotations

import pytest

from wtransfer.testing.conformance import EngineConformance, SpecConformance


class TestFIFOSpec(SpecConformance):
    spec = "example-fifo"

    @pytest.fixture
    def spec_options(self):
        return {"num_cpu_blocks": 5}


class TestExampleEngine(EngineConformance):
    engine = "wtransfer-example:example"

"""Conformance suites for plugin authors: subclass one, set the component's name, run pytest. Each failure names
the contract point, what was expected and what the plugin did."""

from wtransfer.testing.conformance._contract import ContractViolation, require
from wtransfer.testing.conformance.connectors import ConnectorConformance
from wtransfer.testing.conformance.engines import EngineConformance
from wtransfer.testing.conformance.specs import SpecConformance

__all__ = ["ConnectorConformance", "ContractViolation", "EngineConformance", "SpecConformance", "require"]

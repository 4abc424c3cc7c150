"""Failures that explain themselves: which contract point, what was expected, what happened."""

from __future__ import annotations

from typing import Any


class ContractViolation(AssertionError):
    """A plugin broke a point of its kind's contract."""


def require(condition: Any, point: str, expected: str, got: Any = None) -> None:
    """Fail with a message naming the contract ``point`` unless ``condition`` holds."""
    if not condition:
        message = f"contract point: {point}\n  expected: {expected}"
        if got is not None:
            message += f"\n  the plugin did: {got}"
        raise ContractViolation(message)

"""The trainer's view of the workers' control plane, implemented by the user.

Each call may block until every worker finished that step (trainers run it on another thread while they
send). All arguments are JSON-safe dicts: forward them as they are.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class WeightSyncClient(Protocol):
    """Drives the worker-side engines: one call fans out to every worker process."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Any:
        """Workers: ``engine.init_transfer_engine(engine.parse_init_info(init_info))``."""

    def start_weight_update(self) -> Any:
        """Workers: ``engine.start_weight_update()``."""

    def update_weights(self, update_info: dict[str, Any]) -> Any:
        """Workers: ``engine.receive_weights(engine.parse_update_info(update_info), load_weights)``."""

    def finish_weight_update(self, weight_version: str | None = None) -> Any:
        """Workers: ``engine.finish_weight_update()``; ``weight_version`` (optional) is the round's label."""

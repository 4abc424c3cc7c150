"""``LLMClient``: the trainer's control plane to an offline ``vllm.LLM`` in the same process.

``vllm.LLM`` has the four weight-sync methods, but two of them take request dicts
(``{"init_info": ...}``, ``{"update_info": ...}``); wtransfer's trainer (like vLLM's
``VLLMWeightSyncClient`` protocol) passes the bare dicts. This adapts one to the other.
For ``vllm serve`` use vLLM's own ``HTTPVLLMWeightSyncClient(base_url)`` unchanged; for
Ray actors, vLLM's ``RayVLLMWeightSyncClient``.
"""

from __future__ import annotations

from typing import Any


class LLMClient:
    """Drive an offline ``vllm.LLM``'s workers from ``wtransfer.create_trainer``.

    The trainer calls ``update_weights`` from a background thread while it sends; do not
    generate with the same ``LLM`` during ``send_weights()``.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def get_weight_version(self) -> str | None:
        """The version vLLM reports (the trainer's, see the bridge's README); None while torn."""
        return self.llm.get_weight_version()

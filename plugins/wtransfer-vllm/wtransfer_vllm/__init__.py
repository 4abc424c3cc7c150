"""wtransfer inside vLLM: every wtransfer engine, usable by name in ``vllm.LLM`` and ``vllm serve``.

Installing this package is the only step: vLLM loads ``wtransfer_vllm.registration.register``
through its ``vllm.general_plugins`` entry point in every process it starts. The names
below are imported on first use, so ``import wtransfer_vllm`` stays cheap (no vLLM, no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "FleetClient": "wtransfer_vllm.fleet",
    "FleetCommitError": "wtransfer_vllm.fleet",
    "LLMClient": "wtransfer_vllm.client",
    "register": "wtransfer_vllm.registration",
    "registration_plan": "wtransfer_vllm.naming",
    "trainer_init_info": "wtransfer_vllm.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'wtransfer_vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from wtransfer_vllm.client import LLMClient
    from wtransfer_vllm.fleet import FleetClient, FleetCommitError
    from wtransfer_vllm.naming import registration_plan
    from wtransfer_vllm.registration import register
    from wtransfer_vllm.trainer import trainer_init_info

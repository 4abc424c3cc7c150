"""Engine-neutral descriptions of a request and of one scheduler step, as seen by a KV connector.

vLLM hands connectors its own objects (``Request``, ``SchedulerOutput``, ``KVCacheBlocks``), tying them to vLLM.
These plain dataclasses carry just what a connector needs, so any paged-KV engine can build them and any connector
read them; all round-trip through ``to_dict``/``from_dict`` as JSON-safe dicts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVRequest:
    """One request, as the scheduler side of a connector sees it.

    ``token_ids``: every token known so far (prompt, then generated). ``block_hashes``: one hex chained hash per
    *full* block of ``token_ids`` (:mod:`wtransfer.connectors._hashing`), kept up to date by the engine.
    ``num_computed_tokens``: tokens whose KV is already in the engine's cache (local prefix hits plus what it
    computed). ``kv_transfer_params``: the per-request connector dict from the API (where a remote prefill left its
    blocks, say)."""

    request_id: str
    token_ids: list[int]
    block_hashes: list[str] = field(default_factory=list)
    num_computed_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "token_ids": list(self.token_ids),
            "block_hashes": list(self.block_hashes),
            "num_computed_tokens": self.num_computed_tokens,
            "kv_transfer_params": self.kv_transfer_params,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVRequest:
        return cls(
            request_id=str(data["request_id"]),
            token_ids=[int(t) for t in data["token_ids"]],
            block_hashes=[str(h) for h in data.get("block_hashes", [])],
            num_computed_tokens=int(data.get("num_computed_tokens", 0)),
            kv_transfer_params=data.get("kv_transfer_params"),
        )


@dataclass
class ScheduledRequest:
    """A request the scheduler runs in this step.

    ``request.num_computed_tokens`` counts tokens with KV in the cache when the forward pass starts (local hits,
    earlier steps, and this step's external loads); the step computes ``num_scheduled_tokens`` more. ``block_ids``
    are all the request's blocks, in token order (block ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``).
    """

    request: KVRequest
    block_ids: list[int]
    num_scheduled_tokens: int

    @property
    def num_computed_after_step(self) -> int:
        return self.request.num_computed_tokens + self.num_scheduled_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request.to_dict(),
            "block_ids": list(self.block_ids),
            "num_scheduled_tokens": self.num_scheduled_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScheduledRequest:
        return cls(
            request=KVRequest.from_dict(data["request"]),
            block_ids=[int(b) for b in data["block_ids"]],
            num_scheduled_tokens=int(data["num_scheduled_tokens"]),
        )


@dataclass
class SchedulerStep:
    """What the scheduler decided for one engine step: the argument of ``build_connector_meta``.

    ``finished_req_ids``: requests finished (or aborted) since the previous step, also passed to the worker's
    ``get_finished``. ``preempted_req_ids``: requests preempted while scheduling this step; their blocks are already
    free and this step may write into them (see :meth:`~wtransfer.connectors.KVConnectorBase.handle_preemptions`)."""

    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "scheduled": [s.to_dict() for s in self.scheduled],
            "finished_req_ids": list(self.finished_req_ids),
            "preempted_req_ids": list(self.preempted_req_ids),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SchedulerStep:
        return cls(
            step=int(data["step"]),
            scheduled=[ScheduledRequest.from_dict(s) for s in data.get("scheduled", [])],
            finished_req_ids=[str(r) for r in data.get("finished_req_ids", [])],
            preempted_req_ids=[str(r) for r in data.get("preempted_req_ids", [])],
        )


@dataclass
class KVConnectorOutput:
    """What the workers told the engine after one step: the argument of ``update_connector_output``.

    vLLM's ``KVConnectorOutput``, engine-neutral and JSON-safe; ``worker_meta`` holds one entry per worker whose
    ``build_connector_worker_meta`` returned something this step."""

    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    invalid_block_ids: list[int] = field(default_factory=list)
    worker_meta: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "finished_sending": sorted(self.finished_sending),
            "finished_recving": sorted(self.finished_recving),
            "invalid_block_ids": sorted(self.invalid_block_ids),
            "worker_meta": list(self.worker_meta),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVConnectorOutput:
        return cls(
            finished_sending=[str(r) for r in data.get("finished_sending", [])],
            finished_recving=[str(r) for r in data.get("finished_recving", [])],
            invalid_block_ids=[int(b) for b in data.get("invalid_block_ids", [])],
            worker_meta=[dict(m) for m in data.get("worker_meta", [])],
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> KVConnectorOutput:
        return cls.from_dict(json.loads(text))


def full_block_range(num_tokens_before: int, num_tokens_after: int, block_size: int) -> Sequence[int]:
    """Indices of the blocks that become full when a request grows between these token counts."""
    return range(num_tokens_before // block_size, num_tokens_after // block_size)

"""Engine-neutral descriptions of a request and of one scheduler step, as seen by a KV connector.

vLLM hands connectors its own objects (``Request``, ``SchedulerOutput``, ``KVCacheBlocks``), tying them to vLLM.
These plain dataclasses carry just what a connector needs, so any paged-KV engine can build them and any connector
read them. They stay in their process; what crosses one (connector metadata, :class:`KVConnectorOutput`) is JSON,
through :class:`JSONDataclass`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

_T = TypeVar("_T", bound="JSONDataclass")


class JSONDataclass:
    """JSON wire form of a dataclass (see :class:`~wtransfer.connectors.KVConnectorMetadata` for what its fields may
    be): ``to_dict``/``from_dict`` for flat dataclasses, ``to_json``/``from_json`` on top of them."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[_T], data: dict[str, Any]) -> _T:
        return cls(**data)

    def to_json(self) -> str:
        """``TypeError`` naming the class if a field is not JSON-safe."""
        try:
            return json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{type(self).__qualname__}.to_dict() is not JSON-safe ({exc}); it crosses process boundaries as "
                "JSON: use str/int/float/bool/None, lists and dicts"
            ) from exc

    @classmethod
    def from_json(cls: type[_T], text: str) -> _T:
        return cls.from_dict(json.loads(text))


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


@dataclass
class KVConnectorOutput(JSONDataclass):
    """What the workers told the engine after one step: the argument of ``update_connector_output``.

    vLLM's ``KVConnectorOutput``, engine-neutral and JSON-safe; ``worker_meta`` holds one entry per worker whose
    ``build_connector_worker_meta`` returned something this step."""

    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    invalid_block_ids: list[int] = field(default_factory=list)
    worker_meta: list[dict[str, Any]] = field(default_factory=list)


def full_block_range(num_tokens_before: int, num_tokens_after: int, block_size: int) -> Sequence[int]:
    """Indices of the blocks that become full when a request grows between these token counts."""
    return range(num_tokens_before // block_size, num_tokens_after // block_size)

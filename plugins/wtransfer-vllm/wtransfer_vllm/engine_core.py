"""The engine core's side of a wtransfer round: workers' failures raised, stale KV dropped.

Workers report a wtransfer engine's failure as a reply (see :mod:`wtransfer_vllm.worker_rpc`);
the engine core raises it once every worker replied. And after a round commits, no request
computes with KV made by the old weights:

vLLM's prefix cache keeps the KV of every full block it computed and serves it to any later
request with the same prefix. A weight update does not touch it (vLLM leaves the reset to the
caller), so an RL loop's generate -> sync -> generate answers its repeated prompts from KV
computed with the previous policy: tokens and logprobs then differ from a fresh load of the
same weights, while vLLM's weight digests agree. Requests still running at the commit hold
such KV too.

Every client ends a round the same way: ``finish_weight_update`` reaches the engine core as
``collective_rpc("finish_weight_update")`` (offline ``LLM``, ``vllm serve``'s HTTP endpoint,
Ray, vLLM's trainer factory; once per data-parallel engine, once for all its TP workers). So
the bridge wraps that one method of vLLM's ``EngineCore``: when the backend is a wtransfer one,
once the workers' commit returned (or failed: a TP worker may have committed while another did
not), it resets the prefix cache, the KV connector's cache, and a multimodal model's encoder
cache. Requests running at that moment are preempted: their KV is recomputed with the new
weights, but the tokens they already generated with the old weights stay in their output (a
request that spans a sync is mixed; pause generation around a sync if that matters). vLLM's
own backends are left as vLLM made them.
"""

from __future__ import annotations

import logging
from typing import Any

from wtransfer_vllm.vllm_internals import (
    engine_core_config,
    engine_core_kv_connector,
    engine_core_running_requests,
    hook_engine_core_rpc,
    reset_encoder_cache,
    reset_prefix_cache,
)
from wtransfer_vllm.worker_rpc import WORKER_METHODS, committed_round, raise_worker_failures

logger = logging.getLogger("vllm.wtransfer_vllm")


def install(is_ours: Any) -> bool:
    """Wrap ``EngineCore.collective_rpc`` once per process; ``is_ours(backend)`` tells a
    wtransfer backend name from vLLM's. Returns whether the wrap is in place."""

    def wrapper_for(original: Any) -> Any:
        def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
            config = getattr(engine_core_config(self), "weight_transfer_config", None)
            if method not in WORKER_METHODS or config is None or not is_ours(getattr(config, "backend", None)):
                return original(self, method, timeout, args, kwargs)
            try:
                replies = original(self, method, timeout, args, kwargs)
                raise_worker_failures(method, replies)  # the workers return failures (worker_rpc)
            except BaseException:
                if method == "finish_weight_update":  # one TP worker may have committed while another failed
                    try:
                        drop_stale_kv(self)
                    except Exception:
                        logger.exception("wtransfer-vllm: resetting vLLM's caches after a failed commit failed too")
                raise
            if method == "finish_weight_update":
                replies, weights = committed_round(replies)
                drop_stale_kv(self, weights)
            return replies

        return collective_rpc

    return hook_engine_core_rpc(wrapper_for)  # vLLM's engine core itself (see vllm_internals)


def drop_stale_kv(engine_core: Any, weights: str | None = None) -> None:
    """Everything the engine core keeps that was computed with the old weights, gone.

    Called on the engine core's own thread, between steps (utility calls run there), right
    after every worker committed the round. ``weights`` names what they committed (see
    ``engine.round_identity``): a wtransfer KV connector then keys its blocks to those weights,
    so other instances at the same weights share them; without it the connector's new
    namespace is one nobody else can match.
    """
    connector = engine_core_kv_connector(engine_core)
    named = connector if weights is not None and hasattr(connector, "weights_committed") else None
    if named is not None:
        named.weights_committed(weights)
    running = engine_core_running_requests(engine_core)
    # reset_running_requests: running requests are preempted (their blocks freed, their KV
    # recomputed with the new weights; tokens already generated stay); without it vLLM skips the
    # reset while any request runs.
    if not reset_prefix_cache(engine_core):
        if named is not None:
            named.weights_committed(None)  # a later reset must not name blocks after this round
        raise RuntimeError(
            "wtransfer-vllm: the round committed, but vLLM could not reset its prefix cache (a request is "
            "waiting for remote KV); requests could be served KV computed with the old weights"
        )
    if getattr(engine_core_config(engine_core).model_config, "is_multimodal_model", False):
        reset_encoder_cache(engine_core)
    logger.info("wtransfer-vllm round ended: prefix cache and KV connector cache reset "
                "(%d running request(s) preempted; their KV is recomputed with the new weights)", running)

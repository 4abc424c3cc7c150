"""Bounded waits on the collectives of a torch.distributed engine, and what their failures mean.

One rule for every rank: a collective whose peer died, stalled or disconnected ends as a
:class:`~wtransfer.TransferError` (:class:`~wtransfer.TransferTimeoutError` when time ran out) within
``timeout_s``; it never hangs, and no watchdog kills the process first. A backend chooses how with
``host_waits``.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from wtransfer.errors import TransferError, TransferTimeoutError

if TYPE_CHECKING:
    from wtransfer.engines.trainer.client import ClientCall

_POLL_S = 0.0005
SLICE_S = 0.2
"""A host-blocking wait that also watches the client call looks at it this often."""
CLIENT_FAILURE_GRACE_S = 5.0
"""How long after the client call failed a trainer's waits still let collectives complete (refusing workers
vote, then fail their call: the vote completes and the refusal stays clean)."""
WATCHDOG_MARGIN_S = 60.0
"""Without ``host_waits``, a group's own timeout exceeds ``timeout_s`` by this much at least
(or by ``timeout_s``): wtransfer's deadline, which aborts the group, always comes first."""


def _raise_if_failed_long_ago(call: ClientCall | None) -> None:
    """Raise the client call's error once it failed more than ``CLIENT_FAILURE_GRACE_S`` ago."""
    if call is not None and call.error is not None and call.finished_at is not None:
        if time.monotonic() - call.finished_at > CLIENT_FAILURE_GRACE_S:
            call.raise_if_failed()


class CollectiveWaits:
    """How a rank waits for an async collective, at most ``timeout_s``; part of the torch.distributed backend."""

    host_waits: ClassVar[bool] = True
    """Whether ``Work.wait()`` blocks the host until done, bounded by the group's timeout (gloo). NCCL's
    only orders streams and its watchdog kills the process: such a backend sets False, and wtransfer polls
    ``is_completed()`` against its own deadline, aborting the group when it passes."""

    def transport_timeout_s(self, timeout_s: float) -> float:
        """The process group's own timeout: ``timeout_s`` with ``host_waits``; otherwise past wtransfer's
        deadline, so a watchdog never acts first."""
        return timeout_s if self.host_waits else timeout_s + max(WATCHDOG_MARGIN_S, timeout_s)

    def wait(self, work: Any, what: str, timeout_s: float, call: ClientCall | None = None) -> None:
        """Wait for an async collective, at most ``timeout_s``.

        With ``call`` (the trainer's waits, its client call in flight) a failed call stops the wait too,
        ``CLIENT_FAILURE_GRACE_S`` after it failed, whatever the transport noticed: a worker that died or
        hung is seen through its client even when no socket of this rank's group closes. Where
        ``host_waits`` the wait blocks in slices of ``SLICE_S`` (a completed collective returns at once);
        else it polls ``is_completed()``.
        """
        deadline = time.monotonic() + timeout_s
        try:
            if call is None and self.host_waits:
                work.wait()
                return
            # Refusing workers vote, then fail their call; under load the failure may be seen first. The
            # collectives get a moment to complete (counted from the failure, across waits), so a refusal
            # stays clean.
            _raise_if_failed_long_ago(call)
            while not self._completes_within(work):
                _raise_if_failed_long_ago(call)
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(f"{what} did not complete within {timeout_s:g} s")
            # "Completed" includes failed, and NCCL without async error handling returns from wait()
            # without raising. (gloo's wait() raises; its Work.exception() is deprecated.)
            exception = None if self.host_waits else getattr(work, "exception", None)
            error = exception() if callable(exception) else None
            if error is not None:
                raise TransferError(f"{what} failed: {error} (a peer died, stalled or disconnected)")
            work.wait()
        except TransferError:
            work = None  # noqa: F841 - the traceback keeps this frame: let the group go
            raise
        except RuntimeError as exc:  # gloo reports dead peers and its own timeouts as RuntimeError
            work = None  # noqa: F841
            # gloo words its timeouts both "Timed out ..." and "Application timeout caused pair closure"
            message = str(exc).lower()
            kind = TransferTimeoutError if "timed out" in message or "timeout" in message else TransferError
            raise kind(f"{what} failed: {exc} (a peer died, stalled or disconnected)") from exc
        except BaseException:  # the client's own error (any type), an interrupt
            work = None  # noqa: F841
            raise

    def _completes_within(self, work: Any) -> bool:
        """Whether ``work`` completed (or failed) within one slice (blocking) or one poll."""
        if self.host_waits:
            try:
                work.wait(timedelta(seconds=SLICE_S))
                return True
            except (RuntimeError, TypeError):  # TypeError: a Work whose wait() takes no timeout
                pass  # raised again by the caller's own wait(), outside this handler: a chained exception's
                # traceback would keep this frame, and with it the work and its group's connections
        if work.is_completed():
            return True
        time.sleep(_POLL_S)  # a poll (also where a timed wait is unsupported and returns at once)
        return False

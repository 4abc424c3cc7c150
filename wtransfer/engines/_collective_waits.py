"""Bounded waits on the collectives of a torch.distributed engine, and what their failures mean.

Every rank of the family (a worker, the trainer, another sending trainer rank) waits for its
async collectives the same way, and this is where wtransfer's own deadline (``timeout_s``),
the process group's timeout and a backend's watchdog meet. It sits apart so that one rule
holds everywhere: a collective whose peer died, stalled or disconnected ends as a
:class:`~wtransfer.TransferError` (a :class:`~wtransfer.TransferTimeoutError` when time ran
out) within ``timeout_s``; it never hangs, and no watchdog kills the process first. A backend
chooses how by one flag, ``host_waits``. :class:`CollectiveWaits` is mixed into
:class:`~wtransfer.engines._td_backend.TorchDistributedBackend`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ClassVar

from wtransfer.errors import TransferError, TransferTimeoutError

if TYPE_CHECKING:
    from wtransfer.engines._trainer import ClientCall

_POLL_S = 0.0005
CLIENT_FAILURE_GRACE_S = 5.0
"""How long a poll that saw the client call fail still waits for its collective to complete: a
worker fails its call only after it voted, so a vote that does not complete by then never will."""
WATCHDOG_MARGIN_S = 60.0
"""Without ``host_waits``, a group's own timeout exceeds ``timeout_s`` by this much at least
(or by ``timeout_s``): wtransfer's deadline, which aborts the group, always comes first."""


class CollectiveWaits:
    """How a rank waits for an async collective, at most ``timeout_s``; part of the torch.distributed backend."""

    host_waits: ClassVar[bool] = True
    """Whether ``Work.wait()`` blocks this host until the collective is done, bounded by the
    group's own timeout (gloo). NCCL's only orders CUDA streams and its timeout is enforced by a
    watchdog that kills the process: such a backend sets this to False, and wtransfer then polls
    ``is_completed()`` against its own deadline and aborts the group when it passes."""

    def transport_timeout_s(self, timeout_s: float) -> float:
        """The timeout the process group itself gets. Where the transport's timeout is what ends
        a wait (``host_waits``: gloo), ``timeout_s``; otherwise past wtransfer's own deadline (which
        aborts the group first), so a watchdog acting on the group's timeout never acts."""
        return timeout_s if self.host_waits else timeout_s + max(WATCHDOG_MARGIN_S, timeout_s)

    def wait(self, work: Any, what: str, timeout_s: float, call: ClientCall | None = None) -> None:
        """Wait for an async collective, at most ``timeout_s``.

        With ``call`` (the manifest vote, before any worker is known to be in the round) the
        wait polls, so a failed client call stops it at once. Data waits block where the
        transport's wait blocks the host and ends at the group's timeout (gloo): by then every
        worker is in the round, and a worker that fails drops its group, which fails our
        pending collectives immediately ("connection closed"). Where it does not
        (``host_waits = False``), they poll against ``timeout_s`` too.
        """
        deadline = time.monotonic() + timeout_s
        try:
            if call is None and self.host_waits:
                work.wait()
                return
            failed_at = None
            while not work.is_completed():
                if call is not None and call.error is not None:
                    # Workers that refuse the round vote first and then fail their call: under load that
                    # failure can be seen before the vote's own completion. The vote gets a moment to
                    # complete (the verdict then says why, and the refusal stays clean).
                    failed_at = time.monotonic() if failed_at is None else failed_at
                    if time.monotonic() - failed_at > CLIENT_FAILURE_GRACE_S:
                        call.raise_if_failed()
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(f"{what} did not complete within {timeout_s:g} s")
                time.sleep(_POLL_S)
            # "Completed" includes failed, and a group that does not tear the process down on
            # errors (NCCL with async error handling off) returns from wait() without raising.
            # (gloo's wait() raises: it is not asked, Work.exception() warns of its deprecation.)
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

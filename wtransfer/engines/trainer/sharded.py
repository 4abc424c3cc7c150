"""Sharded trainers (FSDP2 / DTensor): every rank sends its own shards, or rank 0 gathers and sends.

With a ``sender_cls`` backend and a plain ``ModuleSource`` on every rank, each rank sends the shards it
holds (``shm``: into the shared segment, :mod:`wtransfer.engines.rounds.shards`; ``gloo``: on its own groups
with the workers, :mod:`wtransfer.engines.rounds.part_streams`); a :class:`ParticipantTrainer`'s ``sender`` is
that rank's side. Otherwise rank 0
gathers. How each rank calls in: :func:`wtransfer.engines.trainer.create.create_trainer`.

A sharded parameter becomes whole only through a collective (``full_tensor()``) every rank must enter in
the same order, so a :class:`ParticipantTrainer`'s ``send_weights()`` walks the source in rank 0's order,
dropping each gathered tensor. Memory stays bounded: rank 0 gathers a parameter only when its bucket is
packed, the others hold one at a time.

The walk is a contract: every ``send_weights()`` walks the source exactly once on every rank, whether the
round succeeds or fails. Rank 0's :class:`LockstepSource` finishes a failed round's walk before raising,
so no rank is left in a gather rank 0 never enters; if rank 0's iterator itself died, a
:class:`ModuleSource` underneath runs the remaining gathers (``finish_walk``). Gathers run on the source's
own (FSDP's) group; the transport never uses it, nor the default group.

The ranks also agree on every step (:mod:`wtransfer.engines.trainer.agreement`). Out of reach: a user's own source (no
``ModuleSource`` underneath) raising on rank 0 alone leaves the others in their gather until the training
group's timeout; rank 0 logs an error saying so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from wtransfer.engines.channel.protocol import RoundCalledOff
from wtransfer.engines.rounds.cast import CastPlan
from wtransfer.engines.rounds.manifest import TensorEntry
from wtransfer.engines.rounds.source import WeightSource, wrapped_sources
from wtransfer.engines.trainer.agreement import CONNECT_WAIT_S, TELL_WAIT_S
from wtransfer.errors import TransferError, TransferTimeoutError

if TYPE_CHECKING:
    import torch

    from wtransfer.engines.trainer.agreement import RankAgreement

logger = logging.getLogger("wtransfer")
T = TypeVar("T")

TOLD_FAILURE_WAIT_S = 3.0
"""A rank that could not join rank 0's transport waits this long for rank 0's reason (it may have failed first)."""


class LockstepSource(WeightSource):
    """Rank 0's view of a sharded source: each round runs in :meth:`walk_once`, which walks what the round left
    of the source (all, if it walked none; :meth:`finish_round`) so the other ranks' gathers complete."""

    def __init__(self, source: WeightSource) -> None:
        self.inner = source
        self._walked = False
        self._current: Iterator[tuple[str, torch.Tensor]] | None = None
        self._yielded, self._complete = 0, False

    def metadata(self) -> list[TensorEntry]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._walked = True
        self._current = self._counted()
        return self._current

    def _counted(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One counted walk; everything that can fail (even ``iter()``) runs after ``begin_walk``."""
        self._yielded, self._complete = 0, False
        begin = getattr(_module_source_under(self.inner), "begin_walk", None)
        if callable(begin):
            begin()  # the wrapper over it may fail before it reads it
        for item in iter(self.inner):
            self._yielded += 1
            yield item
        self._complete = True

    def walk_once(self, run: Callable[[], T]) -> T:
        """``run()`` one round, then walk what it left of the source (all of it, if it failed before reading), so
        the other ranks' gathers complete whether the round succeeded or not. Raises the round's own error."""
        self._walked, self._current = False, None
        try:
            result = run()
        except BaseException:
            try:  # the other ranks wait in their next gather: walk on, sending nothing
                drained = self.finish_round()
                logger.info("trainer rank 0: walked %d more tensor(s) after a failed round so the other trainer "
                            "ranks finish", drained)
            except Exception as drain_error:  # the round's own error is the one to report
                logger.warning("trainer rank 0: finishing the walk after a failed round failed too: %s", drain_error)
            raise
        self.finish_round()  # a complete round walked everything: nothing left
        return result

    def finish_round(self) -> int:
        """Walk whatever this round has not walked yet; returns how many tensors that took."""
        walk = self._current if self._current is not None else None if self._walked else self._counted()
        self._walked, self._current = True, None
        return 0 if walk is None else self._finish(walk)

    def _finish(self, walk: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Finish a walk (in the module source if its iterator died); returns the tensors walked."""
        drained = 0
        error: Exception | None = None
        try:
            for _ in walk:
                drained += 1
        except Exception as exc:
            error = exc
        if self._complete:
            return drained
        module_source = _module_source_under(self.inner)
        if module_source is None:
            logger.error(
                "trainer rank 0: the weight source died after %d tensor(s)%s and cannot be walked on, so the "
                "other trainer ranks stay in their next gather until the training group's timeout; do not run "
                "collectives on that group before it ends (pass a ModuleSource, or a wrapper over one, and "
                "wtransfer finishes the gathers itself)",
                self._yielded, f" ({type(error).__name__}: {error})" if error else "",
            )
            return drained
        return drained + module_source.finish_walk()


def _module_source_under(source: Any) -> Any:
    """The ``ModuleSource`` (or any source that can finish a walk) a wrapped source reads from."""
    return next((s for s in wrapped_sources(source) if callable(getattr(s, "finish_walk", None))), None)


class ParticipantTrainer:
    """A trainer rank other than rank 0: it writes its own shards (``sender``), or runs the gathers."""

    def __init__(self, backend: str, rank: int, source: WeightSource, *, agreement: RankAgreement,
                 sender_cls: type | None = None) -> None:
        self.backend = backend
        self.rank = rank
        self.source = source
        self.weight_version = 0
        self._closed = False
        self.agreement = agreement
        self._attempt = 0  # send_weights() calls, counted as rank 0 counts its own
        heard = agreement.follow("connect", CONNECT_WAIT_S)
        if not heard["ok"]:
            raise TransferError(f"trainer rank {rank}: trainer rank 0 could not create its {backend} trainer, so "
                                f"there is none to follow: {heard.get('reason')}")
        self.timeout_s = float(heard["timeout_s"])
        """Rank 0's ``timeout_s``: how long this rank waits to hear from it."""
        self.sender: Any = None
        """With parallel senders (rank 0 says so): this rank's side of the transport."""
        if heard.get("senders") is not None:
            self.sender = self._join(sender_cls, heard["senders"])

    def _join(self, sender_cls: type | None, info: dict[str, Any]) -> Any:
        """Join rank 0's transport as a sender; every rank raises if one could not."""
        try:
            if sender_cls is None:
                raise TransferError(f"trainer rank 0 sends {self.backend} rounds from every rank, but this "
                                    f"rank's {self.backend} trainer class has no sender_cls (another version?)")
            sender = sender_cls(info, self.rank, self.source, self.timeout_s)
        except BaseException as exc:
            self.agreement.leave("senders")  # rank 0's decision then names this rank as missing
            heard = self.agreement.decided("senders", TOLD_FAILURE_WAIT_S)
            cause = f"; trainer rank 0 failed first: {heard.get('reason')}" if heard and not heard["ok"] else ""
            raise TransferError(f"trainer rank {self.rank}: could not join trainer rank 0's {self.backend} "
                                f"transport: {type(exc).__name__}: {exc}{cause}") from exc
        try:
            heard = self.agreement.follow("senders", self.timeout_s + TELL_WAIT_S)
        except BaseException:
            sender.close()
            raise
        if not heard["ok"]:
            sender.close()
            raise TransferError(f"trainer rank {self.rank}: not every trainer rank could join trainer rank 0's "
                                f"{self.backend} transport: {heard.get('reason')}")
        return sender

    def send_weights(self, weight_version: str | None = None, *, version: int | None = None) -> dict[str, Any]:
        """Send this rank's shards, or walk the source as rank 0 does, dropping every tensor. Rank 0 says
        first whether the round runs (else no gather is entered) and last whether the workers took it: this
        raises unless they did, or if this rank's own gather fails. ``weight_version`` and ``version`` are rank 0's
        to give (taken here so every rank makes the same call)."""
        self._attempt += 1
        step = self._attempt
        if self._closed:
            self.agreement.leave(f"round/{step}")
            raise TransferError(f"this {self.backend} participant (rank {self.rank}) was shut down")
        version = self.weight_version + 1
        heard = self.agreement.follow(f"round/{step}", self.timeout_s)
        if not heard["ok"]:
            raise TransferError(f"trainer rank {self.rank}: trainer rank 0 refused round {version}, so no rank "
                                f"gathers: {heard.get('reason')}")
        started = time.perf_counter()
        tensors = nbytes = 0
        try:
            if self.sender is not None:  # this rank writes its own shards: no gather anywhere
                tensors, nbytes = self.sender.serve_round(step, CastPlan.from_dict(heard.get("cast")))
            else:
                for _name, tensor in self.source:
                    tensors += 1
                    nbytes += tensor.numel() * tensor.element_size()
                    del tensor  # gathered, not kept: one parameter at a time on this rank
        except RoundCalledOff as exc:  # the workers refused the round before any byte moved: rank 0 has why
            outcome = self.agreement.follow(f"outcome/{step}", self.timeout_s + TELL_WAIT_S)
            raise TransferError(f"trainer rank {self.rank}: round {version} was refused before any byte moved: "
                                f"{outcome.get('reason')}") from exc
        except BaseException as exc:
            self.agreement.leave(f"outcome/{step}")  # rank 0 need not wait for this rank's outcome
            if isinstance(exc, KeyboardInterrupt) or type(exc) in (TransferError, TransferTimeoutError):
                raise
            if isinstance(exc, TransferError):  # a transport's own subclass: the public type, with its words
                raise TransferError(f"trainer rank {self.rank}: round {version} failed: {exc}") from exc
            doing = "writing its shards of" if self.sender is not None else "gathering the weights for"
            raise TransferError(
                f"trainer rank {self.rank}: {doing} round {version} failed: "
                f"{type(exc).__name__}: {exc} (another trainer rank died or left the round)"
            ) from exc
        # Rank 0 still sends the last buckets and waits for the workers (each wait <= timeout_s).
        outcome = self.agreement.follow(f"outcome/{step}", 3 * self.timeout_s + TELL_WAIT_S)
        if not outcome["ok"]:
            raise TransferError(f"trainer rank {self.rank}: round {version} failed on trainer rank 0 (the sender), "
                                f"so the workers did not take it: {outcome.get('reason')}")
        self.weight_version = int(outcome.get("version", version))  # rank 0 numbers the rounds
        seconds = time.perf_counter() - started
        own = getattr(self.sender, "phases", None)  # what a torch.distributed sender timed of its own part
        phases = {"send": seconds, **(own.to_dict() if own is not None else {})}
        return {"backend": self.backend, "rank": self.rank, "sender": False, "version": self.weight_version,
                "wrote_shards": self.sender is not None, "tensors": tensors, "bytes": nbytes, "seconds": seconds,
                "phases": phases}

    def shutdown(self) -> None:
        self._closed = True
        if self.sender is not None:
            self.sender.close()

    def __enter__(self) -> ParticipantTrainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def ranks_can_send(sender_cls: type | None, source: WeightSource) -> bool:
    """Whether a sharded trainer's ranks send their own shards: the backend can, and the source is a module's
    (a user's wrapper may rename or convert, so its tensors are gathered and sent as yielded)."""
    from wtransfer.engines.rounds.shards import UnsupportedPlacement, rank_parts, writes_shards_as_is

    if sender_cls is None or not writes_shards_as_is(source):
        return False

    try:
        rank_parts(source.named_tensors(), 0)
    except UnsupportedPlacement as exc:
        logger.info("sharded trainer: rank 0 gathers and sends every tensor, because %s", exc)
        return False
    return True

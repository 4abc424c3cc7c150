"""How a round reaches the model: the framework's job, the same for every engine.

Every worker engine's ``receive_weights`` and ``finish_weight_update`` are wrapped (see
:meth:`WeightTransferEngine.__init_subclass__`), so third-party engines get this for free. The trainer
picks the mode per round (it travels in the manifest):

``atomic`` (the default)
    The engine's loader writes into the node's staging copy (:mod:`wtransfer.engines.rounds.staging`), never the model;
    ``receive_weights`` returns once the copy is whole on this node. ``finish_weight_update``, called only
    after *every* worker's receive returned, loads it into the model. A round that fails before that
    leaves every model bit-identical to the previous version.
``streaming``
    The engine writes into the model as bytes arrive (its buffers only). A round that fails after the
    first write leaves the model **torn** and says so (``weights_torn``, ``weight_version`` None,
    :class:`~wtransfer.errors.WeightsTornError`) until a complete round lands.

``weight_version`` names a version only when every byte of the model is that version's: the trainer's
number for the round committed last (so restarted workers and reconnected trainers agree); ``None`` while
torn. A round without a wtransfer manifest counts one past the version before it.

What a worker takes is decided by what it holds, never by the trainer's memory. Each committed state has a
content identity (:func:`wtransfer.engines.rounds.manifest.identity_after`); a partial round applies only on top of the identity it
names (or carries every tensor of the model), a delta round only on top of its base (:mod:`wtransfer.engines.rounds.delta`, whose
loader rebuilds changed tensors so the modes above see whole tensors), and a version at or below one this
worker holds or began to commit is refused: labels only go up. The trainer learns all of it at rendezvous
(:meth:`RoundState.holdings`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtransfer.engines.channel.protocol import RoundCalledOff
from wtransfer.engines.rounds.manifest import STARTUP_IDENTITY, Manifest, identity_after
from wtransfer.engines.rounds.packing import copy_tensor, delivered_target
from wtransfer.engines.rounds.phases import Phases
from wtransfer.errors import ManifestMismatchError, TransferError, WeightsTornError

if TYPE_CHECKING:
    import torch

    from wtransfer.engines.rounds.staging import NodeStaging

logger = logging.getLogger("wtransfer")

DEFAULT_COMMIT = "atomic"
SHUTDOWN_WAIT_S = 60.0
"""How long a shutdown waits for a commit loading on another thread before it closes the staged copy under it."""


class _Loader:
    """Base of the loaders the framework hands an engine: the real loader's checks, run once.

    The framework validates before the engine runs (:meth:`RoundState.begin`); the engine's own call gets
    the same verdict, and every write of a refused round is refused too, so nothing is ever written.
    """

    def __init__(self, real: Any) -> None:
        self.real = real
        self.rejection: ManifestMismatchError | None = None
        self.ended = False
        """The round's receive returned or failed: a call from an engine that kept this loader is refused."""
        self._checked = False

    def validate_manifest(self, manifest: Manifest) -> None:
        if not self._checked:
            self._checked = True
            check = getattr(self.real, "validate_manifest", None)
            try:
                if callable(check):
                    check(manifest)
            except ManifestMismatchError as exc:
                self.rejection = exc
        self.refuse_if_rejected()

    def refuse_if_rejected(self) -> None:
        if self.rejection is not None:
            raise ManifestMismatchError(str(self.rejection))
        if self.ended:  # written now, it would change a model (or staged copy) whose label no longer watches it
            raise TransferError("a loader was called after its round's receive_weights() had returned or failed, or "
                                "after a later round began; an engine writes only during receive_weights(), through "
                                "that round's loader (nothing was written)")


class StreamingLoader(_Loader):
    """Writes straight into the model, remembering whether anything may have been written. From the first write
    the model holds no one version (``on_touch`` says so, before the write): a label read during the round, or
    left by a round that never ends cleanly, must not name the old one."""

    def __init__(self, real: Any, on_touch: Callable[[], None]) -> None:
        super().__init__(real)
        self.touched = False
        self._on_touch = on_touch
        real_destination = getattr(real, "destination", None)
        if callable(real_destination):
            self.destination = self._destination  # only offered where the real loader offers it
        self._real_destination = real_destination

    def _touch(self) -> None:
        if not self.touched:
            self.touched = True
            self._on_touch()

    def _destination(self, name: str) -> torch.Tensor | None:
        self.refuse_if_rejected()
        target = self._real_destination(name)  # type: ignore[misc]
        if target is not None:
            self._touch()  # the engine may write into it from now on
        return target

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.refuse_if_rejected()
        self._touch()
        self.real(weights)


class AtomicLoader(_Loader):
    """An atomic round: nothing reaches the model before commit. Either the engine hands over a staged
    copy of its own (:func:`adopt_staged`), or the node's workers elect a stager at the first write
    (:mod:`wtransfer.engines.rounds.staging`)."""

    def __init__(self, real: Any, state: RoundState, manifest: Manifest) -> None:
        super().__init__(real)
        self._state = state
        self._manifest = manifest
        self._node: NodeStaging | None = None
        self._views: dict[str, torch.Tensor] | None = None  # the stager's: where each tensor goes
        self._delivered: set[str] = set()
        self.adopted: dict[str, torch.Tensor] | None = None

    def node(self) -> NodeStaging:
        """This node's staging, elected at the first write (an engine that adopts never elects)."""
        self.refuse_if_rejected()  # (a round that ended or was refused reaches no staging)
        if self._node is None:
            assert self._manifest.commit is not None
            self._node = self._state.node_staging(self._manifest.commit.key)
        return self._node

    @property
    def discards(self) -> bool:
        """A follower: takes part in the transport, keeps nothing (read by the ``Unpacker``)."""
        return not self.node().is_stager

    def _stage(self) -> dict[str, torch.Tensor] | None:
        """The stager's views of this round in the node's copy; None for a follower."""
        self.refuse_if_rejected()
        if self._views is None and self.node().is_stager:
            self._views = self.node().begin(self._manifest)
        return self._views

    def destination(self, name: str) -> torch.Tensor | None:
        views = self._stage()
        target = None if views is None else views.get(name)
        if target is not None:
            self._delivered.add(name)  # written in place; the engine checks it got every byte
        return target

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        views = self._stage()
        if views is None:
            return
        for name, tensor in weights:
            target = delivered_target(views, name, tensor, f"round {self._manifest.version}")
            if tensor.numel() and tensor.data_ptr() != target.data_ptr():
                copy_tensor(target, tensor)
            self._delivered.add(name)

    def adopt(self, views: dict[str, torch.Tensor]) -> None:
        self.refuse_if_rejected()
        expected = [(e.name, e.torch_dtype(), e.shape) for e in self._manifest.entries]
        got = [(name, t.dtype, tuple(t.shape)) for name, t in views.items()]
        if got != expected or self._views is not None:
            raise TransferError(f"round {self._manifest.version}: the engine's staged copy is not the round's "
                                f"tensors (or the engine also delivered some through load_weights)")
        self.adopted = views

    def staged(self) -> dict[str, torch.Tensor]:
        """The receive returned: the whole round, in a copy nothing changes before commit."""
        if self.adopted is not None:
            return self.adopted
        version = self._manifest.version
        if self.node().is_stager:
            views = self._stage()
            assert views is not None
            missing = [name for name in views if name not in self._delivered]
            if missing:
                raise TransferError(f"round {version} ended with {len(missing)} of {len(views)} tensors never "
                                    f"delivered (first: {missing[:3]})")
            self.node().settle(version, None)
            return views
        assert self._manifest.commit is not None
        return self.node().await_staged(self._manifest, self._manifest.commit.timeout_s)

    def failed(self, exc: BaseException) -> None:
        """Tell the node's followers (their await fails now, not at its timeout)."""
        if self._node is not None and self._node.is_stager:
            self._node.settle(self._manifest.version, f"the node's stager failed round {self._manifest.version}: {exc}")


def adopt_staged(engine: Any, load_weights: Any, views: dict[str, torch.Tensor]) -> bool:
    """Hand the framework a round already whole in memory that nothing writes before commit (``shm``'s
    segment), so an atomic round commits from it without a staging copy.

    Returns False unless ``load_weights`` is the framework's own atomic loader (a wrapped loader must see
    every tensor): the engine then delivers ``views`` through ``load_weights`` as usual.
    """
    loader = round_state(engine).loader
    if load_weights is not loader or not isinstance(loader, AtomicLoader):
        return False
    loader.adopt(views)
    return True


class _Superseded(TransferError):
    """A round still received when a later one began (see :meth:`RoundState.begin`)."""


class _Round:
    """One receive's token, made before it begins: a later round's :meth:`RoundState.begin` ends it (and its loader,
    which then refuses every call), and an ended round touches no state (it belongs to the later round)."""

    def __init__(self) -> None:
        self.ended = False
        self.committer: _Loader | None = None
        self.manifest: Manifest | None = None  # the manifest its commit checks against (a delta round's target)
        self.identity: str | None = None  # what the worker holds once it commits

    def end(self) -> None:
        self.ended = True
        if self.committer is not None:
            self.committer.ended = True


@dataclass
class _Received:
    manifest: Manifest | None
    staged: dict[str, torch.Tensor] | None  # None: already in the model (streamed)
    real: Any
    identity: str | None = None  # what this worker holds once it commits
    closes: int = 0  # the engine's shutdowns when the round began: one since, and what it read may be gone


class RoundState:
    """One worker's rounds: what its model holds, and the round waiting for commit."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.committed = 0  # the trainer's version of the last round loaded whole (0: the start-up weights)
        self.torn = False
        self.spent = 0  # the highest version this worker began to commit: some worker may hold it
        self.calls = threading.local()  # .depth > 0 while a wrapped method runs on this thread (super() calls pass)
        self.loader: Any = None  # what the engine got this round (a DeltaLoader in front, for a delta round)
        self._committer: _Loader | None = None  # the staged or streaming loader that commits the round, behind it
        self._round: _Round | None = None  # the round begun last (ended once its receive returned or failed)
        self._manifest: Manifest | None = None
        self._received: _Received | None = None
        self._staging: NodeStaging | None = None
        self._warned_no_manifest = False
        self._committing = threading.Lock()  # a round begins, or the engine shuts down, once a commit has ended
        self.closes = 0  # shutdowns so far: a round that saw one before its commit ended reports the model torn
        self.rejection: ManifestMismatchError | None = None  # this round cannot be taken here
        self.phases = Phases()
        """The last round's phases (see ``WeightTransferEngine.round_seconds``)."""
        self.identity: str | None = STARTUP_IDENTITY
        """The content identity of what the model holds (None: torn, or filled by a round that named none)."""

    @property
    def weight_version(self) -> int | None:
        return None if self.torn else self.committed

    @property
    def held_identity(self) -> str | None:
        """The content identity the model holds now (None while torn)."""
        return None if self.torn else self.identity

    def holdings(self) -> dict[str, Any]:
        """What this worker holds and the highest version it began to commit, JSON-safe: what it tells a trainer
        at rendezvous."""
        return {"version": self.weight_version, "identity": self.held_identity,
                "spent": max(self.spent, self.committed)}

    # -- receive ------------------------------------------------------------------------------
    def begin(self, update_info: Any, real: Any, round: _Round) -> tuple[Any, int]:
        """Round ``round`` starts: the loader the engine writes through, and the engine's shutdowns so far (the
        round's commit reports torn if one came since). The round is registered before anything slow runs. A round
        still received on another thread (its client timed out, then sent the next one) is ended here: its loader
        writes nothing more, and it touches no state."""
        with self._committing:  # a commit still running on another thread (a client that timed out) ends first
            if self._round is not None:
                self._round.end()
            self._round = round
            self._received = None  # an earlier round received but never committed is dropped
            closes = self.closes
            self._committer = self.loader = self.rejection = None
            manifest = getattr(update_info, "parsed", None)
            wire = self._manifest = round.manifest = manifest if isinstance(manifest, Manifest) else None
            delta = wire.delta if wire is not None else None
            round.identity = identity_after(wire) if wire is not None else None
            if delta is not None:  # the loaders below see the tensors it rebuilds, whole
                self._manifest = round.manifest = delta.target_manifest(wire)
            committer = round.committer = self._begin(real)
        try:
            loader, rejection = committer, None
            if delta is not None:
                from wtransfer.engines.rounds.delta_loader import DeltaLoader

                loader = DeltaLoader(committer, real, wire, self.held_identity)
            if wire is not None:
                # Checked before the engine runs, so a round this model cannot take is refused before any
                # byte moves; the engine hears the verdict from validate_round().
                try:
                    loader.validate_manifest(wire)  # first: a loader's covers() may read what it checked
                    self._check_holds(wire, real)
                except ManifestMismatchError as exc:
                    rejection = committer.rejection = exc  # its every write is refused too: an engine that never
                    # asks validate_round() still writes nothing
        except Exception as exc:
            if round.ended:
                raise self._superseded() from exc
            raise
        with self._committing:
            if round.ended:
                raise self._superseded()
            self.loader, self.rejection = loader, rejection
        return loader, closes

    def _check_holds(self, wire: Manifest, real: Any) -> None:
        """Refuse a round this worker's own state cannot take: a label that does not go up, or a round that leaves
        tensors out on top of weights other than those it names (a partial round, or one a loader's ``covers()``
        says does not write the whole model)."""
        held = self.holdings()
        what = (f"holds version {held['version']}" if not self.torn else "is torn (a round failed part-way into it)")
        if wire.version <= held["spent"]:
            raise ManifestMismatchError(
                f"{self.owner} {what} and began to commit up to version {held['spent']}: round {wire.version} would label "
                f"other weights with a number already used. Labels only go up: create_trainer() learns the highest "
                f"at rendezvous (reconnect() after workers restarted); first_version= / send_weights(version=) must "
                f"be above it")
        if wire.delta is not None or (wire.base is not None and wire.base == held["identity"]):
            return  # a delta round's base is its loader's to check
        covers = getattr(real, "covers", None)
        if covers(wire) if callable(covers) else not wire.partial:
            return  # every tensor of the model arrives (a loader that cannot tell trusts a round sent whole)
        content = "" if self.torn else f" (content {held['identity']})"
        needs = "weights the trainer does not know" if wire.base is None else f"content {wire.base}"
        raise ManifestMismatchError(
            f"{self.owner} {what}{content}, not the weights round {wire.version} applies on top of ({needs}), and "
            f"the round leaves tensors of its model out: they would keep values of another version under this "
            f"label. Send one round that carries every tensor of the model (a worker whose loader offers covers(), "
            f"as module_loader and vLLM's do, takes it whatever it holds); the rounds after it land again")

    def validate_round(self) -> None:
        """Raise the framework's verdict on the round being received, if it refused it."""
        if self.rejection is not None:
            raise ManifestMismatchError(str(self.rejection))

    def _begin(self, real: Any) -> Any:
        plan = self._manifest.commit if self._manifest is not None else None
        whole_round = getattr(real, "whole_round", False) is True
        mode = plan.mode if plan is not None else "streaming"
        if whole_round and plan is not None:
            mode = "atomic"  # a loader that must see the whole round at once is always staged
        elif whole_round:
            raise TransferError(
                f"{self.owner}: this loader needs the whole round staged, which needs a wtransfer manifest "
                f"with a commit plan in the update info; send the round with create_trainer's trainer"
            )
        if mode == "streaming":
            if plan is None and self._manifest is None and not self._warned_no_manifest:
                self._warned_no_manifest = True
                logger.warning("%s: its update info carries no wtransfer manifest, so rounds are streamed "
                               "into the model (a failed one leaves it torn)", self.owner)
            committer: _Loader = StreamingLoader(real, self._written)
        else:
            assert plan is not None and self._manifest is not None
            committer = AtomicLoader(real, self, self._manifest)
        self._committer = committer
        return committer

    def _written(self) -> None:
        """A streamed round writes into the model: torn until it commits (see :class:`StreamingLoader`)."""
        self.torn = True

    def node_staging(self, key: str) -> NodeStaging:
        """This node's staging for trainer ``key`` (elected once per trainer, again if the stager left)."""
        from wtransfer.engines.rounds.staging import NodeStaging

        if self._staging is not None and self._staging.key != key:
            self._staging.close()  # another trainer: its copy is of no use any more
            self._staging = None
        if self._staging is None:
            self._staging = NodeStaging(key)
        self._staging.rejoin_if_orphaned()
        return self._staging

    def received(self, real: Any, closes: int, round: _Round) -> None:
        """The engine's receive returned: the round is whole here (and, staged, on this node). ``closes``: the
        engine's shutdowns when it began."""
        if round.ended:  # (only a later round's begin() ends it before this round's call returns)
            raise self._superseded()
        loader = round.committer
        if self._committer is not loader:  # (a shutdown let go of it: close())
            raise TransferError("the round's loader was let go of before the round was staged")
        self.validate_round()  # an engine that ignored the verdict (and so wrote nothing) still fails the round
        if isinstance(loader, StreamingLoader):  # torn if it wrote: the round counts only at finish
            staged = None
        else:
            assert isinstance(loader, AtomicLoader) and round.manifest is not None
            staged = loader.staged()
        # Recorded under the round lock, so no later round begins and no shutdown lets go of the round between the
        # checks and the record; a shutdown holds the lock while the engine shuts down: wait for it, at most
        # SHUTDOWN_WAIT_S (what it let go of shows as a loader no longer the round's).
        if not self._committing.acquire(timeout=SHUTDOWN_WAIT_S):
            raise TransferError(f"the round could not be recorded: its lock was held for {SHUTDOWN_WAIT_S:g} s (by a "
                                f"shutdown or a commit on another thread)")
        try:
            if round.ended:
                raise self._superseded()
            if self._committer is not loader:  # (a shutdown let go of it: close())
                raise TransferError("the round's loader was let go of before the round was staged")
            self._received = _Received(round.manifest, staged, real, round.identity, closes)
        finally:
            self._committing.release()

    def _superseded(self) -> _Superseded:
        return _Superseded(f"{self.owner}: a later round began while this one was still being received (on another "
                           f"thread: a client that timed out, then sent the next round?); this round counts for "
                           f"nothing, and its loader refused writes from then on")

    def failed(self, exc: BaseException, closes: int, round: _Round) -> BaseException:
        """The round failed on this worker: tell the node's followers, say what the model holds. ``closes``: the
        engine's shutdowns when the round began (one since took what the round was using: say so). A round that a
        later one superseded touches nothing: what this state holds is the later round's."""
        if isinstance(exc, _Superseded):
            return exc
        waited = self._committing.acquire(timeout=SHUTDOWN_WAIT_S)  # no later round begins while this one's
        try:  # failure is recorded (one that began already ended this round)
            if round.ended:
                if not isinstance(exc, Exception):  # (an interrupt stays one)
                    return exc
                error = self._superseded()
                error.__cause__ = exc
                logger.warning("%s The engine then raised %s: %s", error, type(exc).__name__, exc)
                return error
            return self._failed(exc, closes, round)
        finally:
            if waited:
                self._committing.release()

    def _failed(self, exc: BaseException, closes: int, round: _Round) -> BaseException:
        loader, manifest = round.committer, round.manifest  # (not this state's: its lock may have timed out)
        version = manifest.version if manifest is not None else "?"
        if closes != self.closes and isinstance(exc, Exception) and not isinstance(exc, (ManifestMismatchError,
                                                                                        RoundCalledOff)):
            cause, exc = exc, TransferError(
                f"{self.owner}: the engine was shut down during round {version} (its shutdown() was called by its "
                f"loader, a signal handler or another thread); call init_transfer_engine() again to take the next "
                f"round. The engine then raised {type(exc).__name__}: {exc}")
            exc.__cause__ = cause
        if isinstance(loader, AtomicLoader):
            loader.failed(exc)
        if not isinstance(exc, (ManifestMismatchError, RoundCalledOff)) and self._staging is not None:
            # Any failure but a rejection ends the trainer (a new one stages under a new key): free it now.
            self._staging.close()
            self._staging = None
        error: BaseException = exc
        rejected = isinstance(exc, (ManifestMismatchError, RoundCalledOff))
        if self.torn and not rejected and isinstance(exc, Exception) and not isinstance(exc, WeightsTornError):
            wrote = isinstance(loader, StreamingLoader) and loader.touched
            how = "this streamed round" if wrote else "an earlier round"
            error = WeightsTornError(
                f"{self.owner}: round {version} failed and the model is torn (part of it was written by "
                f"{how}); weight_version is None until a complete round lands. Cause: {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
        if self.torn:
            logger.error("%s: round %s failed; the model is torn until a complete round lands: %s",
                         self.owner, version, exc)
        elif isinstance(loader, AtomicLoader):
            logger.warning("%s: round %s failed before commit; the model still holds version %d: %s",
                           self.owner, version, self.committed, exc)
        if self._committer is loader:
            self._committer = None
        _notify_failed(error)
        return error

    # -- commit -------------------------------------------------------------------------------
    def commit(self) -> None:
        """``finish_weight_update``: load a staged round into the model, count the round."""
        with self._committing:
            try:
                self._commit()
            finally:
                if getattr(self.calls, "close_after", False):  # shut down from inside the commit: let go now
                    self._close_deferred()

    def close_deferred(self) -> None:
        """A shutdown came on a round's own thread (from a loader or a signal handler) and the round's call has
        returned: let go of the staging, once no commit runs on another thread (waiting at most
        ``SHUTDOWN_WAIT_S``)."""
        if not getattr(self.calls, "close_after", False):
            return
        waited = self._committing.acquire(timeout=SHUTDOWN_WAIT_S)
        try:
            self._close_deferred()
        finally:
            if waited:
                self._committing.release()

    def _close_deferred(self) -> None:
        self.calls.close_after = False
        self.closes += 1  # a round that began meanwhile (on another thread) must not commit what this frees
        try:
            self.close()
        except Exception:  # the round's own outcome (often a WeightsTornError) is what the caller must see
            logger.exception("%s: letting go of the staged copy after a shutdown failed", self.owner)

    def _commit(self) -> None:
        received, self._received = self._received, None
        if received is None:
            state = "torn" if self.torn else f"unchanged (version {self.committed})"
            raise TransferError(
                f"{self.owner}.finish_weight_update() without a completed receive_weights() in this round; "
                f"the model is {state}"
            )
        self._committer = None
        if received.manifest is not None:  # from here on some worker may hold it: its number is never reused
            self.spent = max(self.spent, received.manifest.version)
        try:
            if received.staged is not None:
                received.real(list(received.staged.items()))
            if self.closes != received.closes:  # shut down under it (on this thread, or after the wait ran out)
                raise TransferError("the engine was shut down while the round was received or loaded")
        except Exception as exc:
            self.torn = True
            where = "from staging failed part-way" if received.staged is not None else "failed at commit"
            error = WeightsTornError(
                f"{self.owner}: loading round {received.manifest.version if received.manifest else '?'} "
                f"{where}, so the model is torn; weight_version is None until a complete round lands. "
                f"Cause: {type(exc).__name__}: {exc}"
            )
            logger.error("%s", error)
            _notify_failed(error)
            raise error from exc
        manifest = received.manifest
        self.committed = manifest.version if manifest is not None else self.committed + 1
        self.torn = False
        self.identity = received.identity

    def close(self) -> None:
        self._received = None
        self._committer = None
        if self._staging is not None:
            self._staging.close()
            self._staging = None


def _notify_failed(error: BaseException) -> None:
    from wtransfer._registry.manager import notify

    try:
        notify("wtransfer_update_failed", error=error)
    except Exception:  # an observer must never change the round's outcome
        logger.exception("a wtransfer_update_failed hook raised")


def reserve_staging(engine: Any, key: str, size: int) -> None:
    """Before the first round: ``engine``'s node stager for trainer ``key`` pre-faults a ``size``-byte copy."""
    if size < 0:
        raise ValueError(f"a staged copy of {size} bytes")
    round_state(engine).node_staging(key).reserve(size)


def round_state(engine: Any) -> RoundState:
    state = engine.__dict__.get("_wtransfer_round")
    if state is None:
        state = engine.__dict__["_wtransfer_round"] = RoundState(type(engine).__name__)
    return state


def wrap_round_methods(cls: type) -> None:
    """Give ``cls``'s own ``receive_weights`` / ``finish_weight_update`` / ``shutdown`` the commit protocol
    (``super()`` calls from a wrapped one run unwrapped)."""
    for name, body in (("receive_weights", _receive), ("finish_weight_update", _finish), ("shutdown", _shutdown)):
        method = cls.__dict__.get(name)
        if callable(method) and not getattr(method, "__wtransfer_round__", False):
            wrapped = functools.wraps(method)(_outermost(body, method))
            wrapped.__wtransfer_round__ = True  # type: ignore[attr-defined]
            setattr(cls, name, wrapped)


def _outermost(body: Callable[..., None], method: Callable[..., None]) -> Callable[..., None]:
    """``body(state, method, self, *args)`` for the outermost call; nested (``super()``) calls run ``method``."""

    def wrapper(self: Any, *args: Any) -> None:
        state = round_state(self)
        calls = state.calls  # per thread: another thread's shutdown() during a receive is outermost too
        if getattr(calls, "depth", 0):
            if body is _shutdown and calls.outer is not _shutdown:  # on the round's own thread (a loader, a signal
                state.closes += 1  # handler): the commit sees it; what the round may still read is let go of once
                calls.close_after = True  # the round's call returns (see RoundState.close_deferred)
            return method(self, *args)
        calls.depth, calls.outer, calls.close_after = 1, body, False
        try:
            return body(state, method, self, *args)
        finally:
            state.close_deferred()  # still "inside": a signal handler's shutdown now is nested, not a second lock
            calls.depth, calls.close_after = 0, False

    return wrapper


def _receive(state: RoundState, method: Callable[..., None], self: Any, update_info: Any, load_weights: Any) -> None:
    phases = state.phases = Phases()
    closes, round = state.closes, _Round()
    try:
        loader, closes = state.begin(update_info, load_weights, round)
        with phases("receive"):
            method(self, update_info, loader)
        with phases("stage"):
            state.received(load_weights, closes, round)
    except BaseException as exc:
        error = state.failed(exc, closes, round)
        if error is exc:
            raise
        raise error from (error.__cause__ or exc)  # (failed() may name a clearer cause than the engine's error)
    finally:
        round.end()  # its loader takes no more writes (an engine that kept it)


def _finish(state: RoundState, method: Callable[..., None], self: Any) -> None:
    phases = state.phases  # this round's, even if the next one begins meanwhile (a client that timed out)
    with phases("load"):
        state.commit()
    with phases("finish"):
        method(self)


def _shutdown(state: RoundState, method: Callable[..., None], self: Any) -> None:
    # A commit still loading on another thread (a client that timed out, then shut down or rejoined) ends first, so
    # the model holds the whole round. One stuck longer than SHUTDOWN_WAIT_S is shut down under: it reports torn.
    waited = state._committing.acquire(timeout=SHUTDOWN_WAIT_S)
    state.closes += 1  # before the engine lets go of anything a round may still read
    try:
        method(self)
    finally:
        state.close()
        if waited:
            state._committing.release()

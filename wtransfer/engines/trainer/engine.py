"""The trainer side of a weight-transfer backend: :class:`TrainerWeightTransferEngine` drives each round.

The trainer owns the wire parameters (bucket size, buffers, protocol version) and sends the workers'
init dict through the user's :class:`~wtransfer.engines.trainer.client.WeightSyncClient`. Client calls may
block until all workers are done, so each runs on a background thread; one that raises aborts the
engine's side promptly. Backends derive from it and implement its extension points (the last methods).
"""

from __future__ import annotations

import logging
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from wtransfer.engines.channel.protocol import ManifestRejected, gc_paused
from wtransfer.engines.rounds.cast import CastPlan, agreed, check_dtype_option
from wtransfer.engines.rounds.commit import DEFAULT_COMMIT
from wtransfer.engines.rounds.manifest import (
    COMMIT_MODES,
    DIGEST_ALGORITHMS,
    IN_FLIGHT_MODES,
    CommitPlan,
    DeltaPlan,
    Manifest,
    TensorEntry,
    build_manifest,
    identity_after,
)
from wtransfer.engines.rounds.packing import Bucket, plan_buckets
from wtransfer.engines.rounds.phases import Phases
from wtransfer.engines.rounds.source import WeightSource, as_source
from wtransfer.engines.trainer.client import (
    ClientCall,
    ClientThread,
    WeightSyncClient,
    accepts_weight_version,
    check_client,
)
from wtransfer.engines.trainer.options import TrainerInitOptions
from wtransfer.engines.trainer.sharded import ranks_can_send
from wtransfer.errors import TransferError
from wtransfer.options import describe_options, options_dict, parse_options

if TYPE_CHECKING:
    from types import TracebackType

    from wtransfer.engines.trainer.agreement import RankAgreement
    from wtransfer.engines.trainer.delta_choice import DeltaChoice
    from wtransfer.engines.trainer.delta_encoder import DeltaEncoder, DeltaRound

logger = logging.getLogger("wtransfer")


def _check_version(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (a round's number, e.g. the training step), got {value!r}")


class TrainerWeightTransferEngine(ABC):
    """Trainer side of a backend: rendezvous at creation, one whole round per ``send_weights()``.

    Subclasses implement ``prepare_workers`` (allocate, return the workers' init dict), ``wait_for_workers``
    (wait for them to join), ``send_round`` and ``release``; the methods after them are optional hooks.
    """

    backend: ClassVar[str] = "?"
    init_options_cls: ClassVar[type[TrainerInitOptions]] = TrainerInitOptions
    """What ``init_info`` accepts, with its defaults: a :class:`TrainerInitOptions` subclass."""
    sender_cls: ClassVar[type | None] = None
    """Sharded trainers: the class with which every other rank sends its own shards. None: rank 0 gathers
    every tensor and sends it alone."""
    senders_join_with_workers: ClassVar[bool] = False
    """Whether the other ranks join while the workers do (their groups include the workers, who
    build them at init), so they are told before the workers' init call, not after it."""

    def __init__(
        self,
        *,
        client: WeightSyncClient,
        source: WeightSource | Any,
        init_info: Mapping[str, Any] | None = None,
        checksums: bool = False,
        is_checkpoint_format: bool = True,
        sharded: bool = False,
        commit: str = DEFAULT_COMMIT,
        delta: bool | str = False,
        dtype: Any = None,
        partial: bool = False,
        in_flight: str = "recompute",
        first_version: int | None = None,
    ) -> None:
        if delta not in (False, True, "auto"):
            raise ValueError(f"create_trainer(): delta={delta!r} is not one of False, True or 'auto' (each round "
                             f"chooses delta or dense from what earlier rounds measured)")
        if delta and partial:
            raise ValueError("create_trainer(): delta already sends only what changed; partial=True is for "
                             "sources that yield a subset of the model's tensors: choose one")
        if delta and sharded:
            raise ValueError("create_trainer(): delta needs an unsharded trainer (one process holding the "
                             "whole model); sharded trainers send every round whole")
        if commit not in COMMIT_MODES:
            raise ValueError(
                f"create_trainer(): commit={commit!r} is not a commit mode; use 'atomic' (the default: a failed "
                f"round leaves every worker's model as it was, for one host copy of the model per node) or "
                f"'streaming' (buffers only; a failed round leaves the workers' models torn, and they say so)"
            )
        if in_flight not in IN_FLIGHT_MODES:
            raise ValueError(
                f"create_trainer(): in_flight={in_flight!r} is not one of {', '.join(IN_FLIGHT_MODES)}: what a "
                f"serving engine does with the requests running when a round commits"
            )
        check_client(client)
        if first_version is not None:
            _check_version("first_version", first_version)
        self._first_version = first_version
        self.in_flight = in_flight
        self.commit: str = commit
        self._staging_key = secrets.token_hex(8)
        self.client = client
        self.sharded = bool(sharded)
        """Rank 0 of a sharded trainer: every round walks the whole source, even one that fails."""
        self.source: WeightSource = as_source(source)
        self.parallel_senders = self.sharded and ranks_can_send(self.sender_cls, self.source)
        """Sharded: every trainer rank writes its own shards (no gathers); else rank 0 gathers and sends."""
        if self.sharded and not self.parallel_senders:
            from wtransfer.engines.trainer.sharded import LockstepSource

            self.source = LockstepSource(self.source)
        self._check_defaults_declaration()  # also set after the class was defined
        self.init_options: Any = self._parse_init_info(dict(init_info or {}))
        self.init_info: dict[str, Any] = options_dict(self.init_options)
        """The same as a dict, every key filled in."""
        self.world_size: int = self.init_options.world_size
        self.timeout_s: float = self.init_options.timeout_s
        self.bucket_bytes: int = self.init_options.bucket_bytes
        self.num_buffers: int = self.init_options.num_buffers
        self.checksums = bool(checksums)
        self.partial = bool(partial)
        """Rounds may carry any subset of the model's tensors (the rest keep their committed values)."""
        self.cast = CastPlan(None, check_dtype_option(dtype))
        """The dtype each floating tensor travels in (see :mod:`wtransfer.engines.rounds.cast`)."""
        self.source_entries: tuple[TensorEntry, ...] = ()
        """The current round's tensors as the source holds them (the manifest has them as they travel)."""
        self.delta: DeltaEncoder | None = None
        """With ``delta``: the version the workers committed, and each round's encoding against it."""
        self.delta_choice: DeltaChoice | None = None
        """With ``delta="auto"``: what earlier rounds measured, and each round's choice of delta or dense."""
        if delta:
            from wtransfer.engines.trainer.delta_encoder import DeltaEncoder

            self.delta = DeltaEncoder()
        if delta == "auto":
            from wtransfer.engines.trainer.delta_choice import DeltaChoice

            self.delta_choice = DeltaChoice()
        self.is_checkpoint_format = bool(is_checkpoint_format)
        self.weight_version = 0
        self._version_floor = 0
        """Every version at or below is taken: a worker holds it or began to commit it."""
        self._asked_version: int | None = None  # send_weights(version=N): this round's number
        self._fleet_identity: str | None = None
        """The content identity every worker should hold (:func:`identity_after`): a partial round's base. Learned
        from the workers at the first rendezvous, then the last round's (a later rendezvous keeps it only where every
        worker still holds it); None where they differ or say nothing."""
        self._base_learned = False
        """Whether a rendezvous set :attr:`_fleet_identity` (later ones keep it, or None: the trainer's partial
        rounds carry what changed since the base it took first, then since its own rounds)."""
        self._commit_failed = False
        self._broken: str | None = None
        self._clean_rejection = False
        self._closed = False
        self._connected = False
        self._attempt = 0  # send_weights() calls: every sharded rank counts them alike
        self.told_ranks = False
        """Sharded: the other ranks heard that rank 0 connected (they may be joining the transport)."""
        self.agreement: RankAgreement | None = None
        """Sharded trainers: how rank 0 tells the other ranks what it decided (set by ``create_trainer``)."""
        self.phases = Phases()
        """Where the current (or last) round's time went, by phase (``stats["phases"]``)."""
        self._client_thread = ClientThread()
        self._last_call: ClientCall | None = None  # reconnect() waits for it
        self._finish_takes_version = accepts_weight_version(client.finish_weight_update)

    # -- configuration -----------------------------------------------------------------
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._check_defaults_declaration()

    @classmethod
    def _check_defaults_declaration(cls) -> None:
        """``init_options_cls`` must extend that of every trainer class it derives from, else a plugin's
        defaults or its base's keys would be lost silently. Checked at class definition and at creation."""
        own = cls.init_options_cls
        for base in cls.__mro__[1:]:
            required = base.__dict__.get("init_options_cls")
            if not (isinstance(required, type) and issubclass(base, TrainerWeightTransferEngine)):
                continue
            if not (isinstance(own, type) and issubclass(own, required)):
                raise TypeError(
                    f"{cls.__qualname__}.init_options_cls = {getattr(own, '__qualname__', own)!s} does not "
                    f"extend {required.__qualname__}, the init_info of {base.__qualname__} it derives from: "
                    f"its keys and defaults would be lost. Subclass {required.__qualname__} (redeclaring "
                    f"the fields whose default changes)"
                )

    @classmethod
    def describe_init_options(cls) -> list[dict[str, Any]]:
        """``describe_options`` rows for ``init_info`` (what ``wtransfer show engine NAME`` prints)."""
        return describe_options(cls.init_options_cls)

    def _parse_init_info(self, info: dict[str, Any]) -> TrainerInitOptions:
        """Check the user's ``init_info`` (unknown keys, types, ranges) before any worker is touched."""
        return parse_options(self.init_options_cls, info, owner=f"the {self.backend} trainer", where="init_info")

    @property
    def num_workers(self) -> int:
        return self.world_size - 1

    CLIENT_REASON_WAIT_S: ClassVar[float] = 1.0
    """After a failed transfer, how long to wait for the client's error (it names the workers' reason)."""

    SHORTFALL_GRACE_S: ClassVar[float] = 3.0
    """How long the rendezvous still waits for workers after the client's init call returned."""

    def check_shortfall(self, call: ClientCall, joined: set[int]) -> None:
        """Fail fast when ``world_size`` is larger than the workers the client drives: its init call
        returned (plus a short grace) with fewer joined, and a timeout would blame ranks that do not exist."""
        if not call.done or call.error is not None or len(joined) >= self.num_workers:
            return
        assert call.finished_at is not None
        if time.monotonic() - call.finished_at >= min(self.SHORTFALL_GRACE_S, self.timeout_s):
            raise TransferError(
                f"{self.backend} rendezvous: init_info world_size={self.world_size} expects "
                f"{self.num_workers} worker(s), but client.init_weight_transfer_engine() returned after "
                f"{len(joined)} joined (rank(s) {sorted(joined) or 'none'}); world_size counts the trainer "
                f"plus every worker process the client drives"
            )

    # -- life cycle ---------------------------------------------------------------------
    def connect(self) -> None:
        """Rendezvous with the workers through ``client.init_weight_transfer_engine``."""
        if self._connected:
            return
        try:
            self._rendezvous()
        except BaseException:
            self.shutdown()
            raise
        self._connected = True

    def _rendezvous(self) -> None:
        """Prepare the transport and have every worker join it; on failure the other trainer ranks
        hear why before the caller releases the transport."""
        self.served_answers: dict[int, Any] = {}
        """What each worker said at rendezvous its model loads (rank -> served dtypes dict or None)."""
        self.held_answers: dict[int, Any] = {}
        """What each worker said at rendezvous it holds (rank -> ``WeightTransferEngine.held_weights()`` or None)."""
        try:
            worker_info = self.prepare_workers()
            if self.agreement is not None and self.parallel_senders and self.senders_join_with_workers:
                self.tell_ranks_connected()
            self._call_while("init_weight_transfer_engine", worker_info, work=self.wait_for_workers,
                             phases=Phases())  # not a round's
            self.settle_cast()
            self._learn_holdings()
            self.connected()
        except BaseException as exc:
            if self.told_ranks and self.agreement is not None:
                # The other ranks are joining the transport this closes: they hear why first.
                self.agreement.refuse("senders", exc)
            raise

    def _learn_holdings(self) -> None:
        """Number past every label a worker holds or began to commit. The first time, take what every worker holds
        as the next partial round's base (none where they differ); later, keep the base only where every worker
        still holds it: the workers' word and this trainer's memory must agree."""
        held = {rank: h for rank, h in self.held_answers.items() if isinstance(h, dict)}
        used = [v for h in held.values() for v in (h.get("version"), h.get("spent"))
                if isinstance(v, int) and not isinstance(v, bool)]
        self._version_floor = max([self._version_floor, self.weight_version, *used])
        identities = {h.get("identity") for h in held.values()}
        learned = identities.pop() if len(held) == self.num_workers and len(identities) == 1 else None
        if self._base_learned and learned != self._fleet_identity:
            # this trainer's partial rounds carry what changed since the base it knows: workers that hold anything
            # else now (every one restarted, say) need a round with every tensor first
            learned = None
        self._fleet_identity, self._base_learned = learned, True
        if self._first_version is not None and not self.weight_version:
            if self._first_version <= self._version_floor:
                holders = ", ".join(f"rank {rank}: version {h.get('version')}, began to commit up to {h.get('spent')}"
                                    for rank, h in sorted(held.items())) or "this trainer's own rounds"
                raise ValueError(
                    f"create_trainer(first_version={self._first_version}): the workers already use labels up to "
                    f"{self._version_floor} ({holders}); a label names one state forever, so pass a first_version "
                    f"above {self._version_floor}, or leave it out to number past it")
            self._version_floor = self._first_version - 1
        self._first_version = None  # numbering is set: a reconnect() after the first round keeps it

    def reconnect(self, client: WeightSyncClient | None = None) -> None:
        """Rendezvous again with workers that restarted (through ``client``, or the same client).

        The transport is released and prepared anew, as at creation; the trainer keeps its round count
        and, with ``delta=True``, its base (a restarted worker refuses the next delta and gets it whole).
        With ``delta="auto"`` the choice measures the link again (the workers may be behind another one).
        This is also how a trainer left unusable by a failed round is used again.

        The workers must be ``init_info["world_size"]`` as at creation. A still-running client call of an
        earlier round is waited for (``timeout_s``) so it never overlaps the new rendezvous. If the
        rendezvous fails, the trainer stays unusable but open (keeping ``client``): call ``reconnect()``
        again. Not while a round runs; unsharded trainers only.
        """
        if self.sharded:
            raise TransferError(f"reconnect() needs an unsharded {self.backend} trainer; a sharded trainer's "
                                f"ranks join together: shut every rank down and create them again")
        if self._closed:
            raise TransferError(f"this {self.backend} trainer was shut down; create a new one")
        if client is not None:
            check_client(client)
        last = self._last_call
        if last is not None and not last.wait(self.timeout_s):
            raise TransferError(f"client.{last.what}() of an earlier round is still running after {self.timeout_s:g} s; "
                                f"reconnect() once it returned (or shut this trainer down and create a new one)")
        self._client_thread.close()
        self._release_logged("before reconnecting")
        if client is not None:
            self.client = client
            self._finish_takes_version = accepts_weight_version(client.finish_weight_update)
        self._client_thread = ClientThread()
        # New workers' node stagers must not meet the old workers' (still bound if that pool lives on).
        self._staging_key = secrets.token_hex(8)
        self._connected = False
        try:
            self._rendezvous()
        except BaseException as exc:
            self._release_logged("after a failed reconnect")
            self._broken = f"reconnect() failed ({type(exc).__name__}: {exc})"
            raise
        self._connected, self._broken = True, None
        if self.delta_choice is not None:
            self.delta_choice = type(self.delta_choice)()

    def send_weights(self, weight_version: str | None = None, *, version: int | None = None) -> dict[str, Any]:
        """Run one whole update round; returns its stats (bytes, tensors, seconds, GB/s, buckets).

        ``version`` numbers the round (e.g. the training step; default: one past every label in use); it must be
        above every version a worker holds or began to commit, else the round is refused before anything moves.
        ``weight_version`` labels the round for clients whose ``finish_weight_update`` takes one
        (default: ``str(stats["version"])``).
        """
        from wtransfer._registry.manager import notify

        refusal = None
        taken = max(self.weight_version, self._version_floor)
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version <= taken):
            refusal = (f"send_weights(version={version!r}): a round's number is an int above {taken} (versions up to "
                       f"it are held by a worker, begun by a commit, or below first_version), and a label names one "
                       f"state forever: pass a larger version (nothing was sent)")
        elif self._closed:
            refusal = f"this {self.backend} trainer was shut down; create a new one"
        elif self._broken is not None:
            refusal = (
                f"this {self.backend} trainer is unusable after an earlier failure ({self._broken}); "
                + ("shut every rank down and create the trainer again" if self.sharded else
                   "call reconnect(), which meets the workers again (restart first any worker that died), or shut it "
                   "down and create a new one")
            )
        self._attempt += 1
        if self.agreement is not None:  # no rank enters a gather unless every rank will
            try:
                self.agreement.decide(f"round/{self._attempt}", {"ok": refusal is None, "reason": refusal,
                                                                  "cast": self.cast.to_dict()}, self.timeout_s)
            except Exception as exc:  # a rank missing, or the store gone
                if refusal is None:
                    self._broken = f"the trainer ranks could not agree on a round: {exc}"
                    refusal = f"this {self.backend} trainer did not start the round: {exc}"
        if refusal is not None:
            raise TransferError(refusal)
        self._clean_rejection = self._commit_failed = False
        self._asked_version = version
        try:
            with gc_paused():
                gathered = self.sharded and not self.parallel_senders
                if gathered:  # every other rank mirrors the walk: it runs whole, even when the round fails
                    stats = self.source.walk_once(lambda: self._run_round(weight_version))  # type: ignore[attr-defined]
                elif self.delta is not None:
                    stats = self._run_delta_round(weight_version)
                else:
                    stats = self._run_round(weight_version)
        except BaseException as exc:
            usable = self._clean_rejection or self._commit_failed  # the transport is idle: rounds may follow
            if self._broken is None and not usable and not isinstance(exc, KeyboardInterrupt):
                # A timed-out client call may still be running: a retried round would overlap it.
                self._broken = f"{type(exc).__name__}: {exc}"
            if self.parallel_senders:  # the other ranks wait for this round's next step: there is none
                self.stop_senders(f"{type(exc).__name__}: {exc}")
            try:
                self.round_failed()
            except Exception as cleanup:  # the round's own error is what the caller must see
                logger.exception("Error while the %s trainer cleaned up after a failed round", self.backend)
                if self._broken is None:  # what the round set up may still be in use: no round may reuse it
                    self._broken = f"cleaning up after a failed round failed: {type(cleanup).__name__}: {cleanup}"
            self._tell_outcome({"ok": False, "reason": f"{type(exc).__name__}: {exc}"})
            notify("wtransfer_update_failed", error=exc)
            raise
        finally:
            self._asked_version = None
        self._tell_outcome({"ok": True, "version": stats["version"]})
        notify("wtransfer_update_finished", stats=stats)
        return stats

    def _tell_outcome(self, outcome: dict[str, Any]) -> None:
        """Sharded: the other ranks learn how the round ended (a rank that left is only logged:
        the workers' side of the round is what it is, and the next round's agreement fails)."""
        if self.agreement is None:
            return
        try:  # a success waits for the others (they are at their outcome step already); a failure does not
            self.agreement.decide(f"outcome/{self._attempt}", outcome, self.timeout_s)
        except Exception as exc:  # never replaces the round's own result
            logger.warning("%s trainer: could not tell the other trainer ranks how round %d ended: %s",
                           self.backend, self.weight_version + (0 if outcome["ok"] else 1), exc)

    def _run_delta_round(self, label: str | None) -> dict[str, Any]:
        """A round of only what changed; if a worker cannot apply it (no base, another base), a full
        round at once. The engine reads the encoded round as its source, so every engine carries it."""
        assert self.delta is not None
        why = None
        if self.delta_choice is not None:
            mode, why = self.delta_choice.choose()
            if mode == "dense":
                self.delta.forget()  # the base's memory is freed; a later delta round starts with a full one
                stats = self._run_round(label)
                self.delta_choice.dense_round(stats["bytes"], stats["seconds"])
                return {**stats, "delta": "dense", "delta_choice": why}
        source, started, refused, encoded = self.source, time.perf_counter(), None, None
        try:
            encoded = self.delta.encode(source, self._next_version(), self.cast)
            encoding, refusing = time.perf_counter() - started, 0.0
            self.source = encoded
            try:
                stats = self._run_round(label, encoded)
            except Exception as exc:  # the client's own error type: what counts is a clean rejection
                if not (self._clean_rejection and encoded.plan.base is not None):
                    raise
                logger.info("%s trainer: a worker cannot apply delta round %d (%s); sending it whole",
                            self.backend, self._next_version(), exc)
                self._clean_rejection, refused = False, str(exc)
                refusing = time.perf_counter() - started - encoding
                whole_started = time.perf_counter()
                self.source = encoded = self.delta.whole(encoded)  # from the base: the source is walked once
                encoding += time.perf_counter() - whole_started
                stats = self._run_round(label, encoded)
            self.delta.committed(encoded)
            self.delta.sent(stats["wire_bytes"], stats["seconds"])  # how fast the link is, for the next choices
        finally:
            self.source = source
            if encoded is not None:
                encoded.settle()  # a failed round: none of its encoding keeps writing the base
        seconds = time.perf_counter() - started  # the encoding (and a refused attempt) included
        counts = encoded.stats  # final: every tensor is done
        cast = self.cast.cast_count(source.metadata())  # the encoder cast what it compared: count the source
        # the encoding before the round (the rest runs as the engine reads it), and a refused first attempt
        phases = {"encode": encoding, **({"refused": refusing} if refused is not None else {}), **stats["phases"]}
        if self.delta_choice is not None:
            self.delta_choice.delta_round(stats["delta"], stats["bytes"], seconds, refused is not None)
            stats["delta_choice"] = why
        return {**stats, "phases": phases, "delta_refused": refused, "seconds": seconds, "cast_tensors": cast,
                "gb_per_s": stats["bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
                "changed_fraction": counts.changed_elements / max(counts.elements, 1),
                "unchanged_tensors": counts.unchanged_tensors, "sparse_tensors": counts.sparse_tensors,
                "dense_tensors": counts.dense_tensors}

    def _run_round(self, label: str | None, encoded: DeltaRound | None = None) -> dict[str, Any]:
        # A round's time is the whole round as the caller waits for it, client calls included.
        started = time.perf_counter()
        phases = self.phases = Phases()  # the engine's send_round adds its pack and wait
        with phases("plan"):
            self.source_entries = tuple(self.source.metadata())
            entries = self.cast.entries(self.source_entries)
            manifest = self._manifest(list(entries), encoded.plan if encoded is not None else None)
            buckets = self.plan(manifest)
            # the JSON-safe dict every worker's parse_update_info receives
            update_info = {"manifest": manifest.to_dict(), "is_checkpoint_format": self.is_checkpoint_format}
        with phases("start"):
            self._call("start_weight_update").result(self.timeout_s)
        with phases("send"):
            self._call_while("update_weights", update_info,
                             work=lambda call: self.send_round(manifest, buckets, call), phases=phases)
        version_label = (str(manifest.version if label is None else label),) if self._finish_takes_version else ()
        finish: ClientCall | None = None
        try:
            with phases("commit"):  # from the call on: the workers may begin to load at once
                finish = self._call("finish_weight_update", *version_label)
                finish.result(self.timeout_s)
        except Exception as exc:
            # The commit failed on some worker, or its outcome is unknown (a client timeout, a lost connection):
            # some workers may hold this round, others not, one may still be committing from the transport's
            # memory. A call that returned leaves the trainer usable, because every later round is safe whatever
            # they hold: nothing is written before every worker voted, a worker votes only once a commit it began
            # has ended, and a worker takes a round that leaves tensors out only on top of what it names. A call
            # still running may yet reach the workers and commit the next round early: reconnect() waits for it.
            # The version is spent (some worker may hold it), and the next round names this one as its base.
            self._commit_failed = finish is not None and finish.done
            self._version_floor = max(self._version_floor, manifest.version)
            self._fleet_identity = identity_after(manifest)
            raise
        seconds = time.perf_counter() - started
        self.weight_version = manifest.version
        self._fleet_identity = identity_after(manifest)
        total = manifest.total_bytes
        sharded = {"wrote_shards": self.parallel_senders} if self.sharded else {}
        delta = {} if encoded is None else {"delta": "full" if encoded.plan.base is None else "delta"}
        model_bytes = total if encoded is None else encoded.plan.model_bytes
        cast = self.cast.cast_count(self.source_entries)
        return {
            **sharded,
            **delta,
            "backend": self.backend,
            "version": manifest.version,
            "cast_tensors": cast,
            "commit": self.commit,
            "workers": self.num_workers,
            "tensors": len(manifest.entries),
            "bytes": model_bytes,
            "wire_bytes": total,
            "buckets": len(buckets),
            "bucket_bytes": self.bucket_bytes,
            "num_buffers": self.num_buffers,
            "seconds": seconds,
            "gb_per_s": model_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            "phases": phases.to_dict(),
        }

    def _call(self, method: str, *args: Any) -> ClientCall:
        """Start ``client.<method>(*args)`` on the client thread; the engine keeps working meanwhile."""
        self._last_call = ClientCall(method, getattr(self.client, method), *args, thread=self._client_thread)
        return self._last_call

    def _call_while(self, method: str, *args: Any, work: Callable[[ClientCall], None], phases: Phases) -> None:
        """Run ``work(call)`` while ``client.<method>(*args)`` runs, then wait for the call to return (``phases``:
        where that last wait counts)."""
        call = self._call(method, *args)
        try:
            work(call)
        except BaseException as exc:
            self._raise_preferring_client(exc, call)
        with phases("wait"):  # for the workers to return from the call
            call.result(self.timeout_s)

    def _next_version(self) -> int:
        """The next round's version: the one asked for, else one past every label in use."""
        return self._asked_version or self.free_version

    @property
    def free_version(self) -> int:
        """The lowest number a round may take now: one past every label a worker holds or began to commit (as
        learned at rendezvous, and from this trainer's rounds since). A framework labelling rounds by its own step takes
        ``max(step, free_version)`` when a step may sync twice or a new trainer replaced the last one."""
        return max(self.weight_version, self._version_floor) + 1

    def plan(self, manifest: Manifest) -> list[Bucket]:
        """The round's bucket layout; workers compute the same from the manifest and init info."""
        return plan_buckets(manifest.entries, self.bucket_bytes)

    def _manifest(self, entries: list[TensorEntry], delta: DeltaPlan | None = None) -> Manifest:
        plan = CommitPlan(self.commit, self._staging_key, self.timeout_s, self.in_flight)
        return build_manifest(entries, self._next_version(), DIGEST_ALGORITHMS[0] if self.checksums else None, plan, delta,
                              self.partial, self._fleet_identity if delta is None else None)

    def _raise_preferring_client(self, exc: BaseException, call: ClientCall) -> None:
        """Re-raise a failure, preferring the client's own error: it carries the workers' reason."""
        if isinstance(exc, ManifestRejected):
            # A clean abort: every side stopped before any data moved; the engine stays usable.
            self._clean_rejection = call.wait(self.timeout_s)  # a client still hanging is not clean
            if call.error is not None:
                raise call.error from None
            raise TransferError(str(exc)) from exc
        if not isinstance(exc, KeyboardInterrupt):
            self._broken = f"{type(exc).__name__}: {exc}"
        # Briefly: a client whose transport died with the link may never answer, and the
        # caller was promised an error within timeout_s of the stall.
        call.wait(min(self.timeout_s, self.CLIENT_REASON_WAIT_S))
        if call.error is not None and call.error is not exc:
            raise call.error from exc
        raise exc

    def shutdown(self) -> None:
        """Release every resource (idempotent). The workers' engines are shut down by their owner."""
        if self._closed:
            return
        self._closed = True
        self._client_thread.close()
        self._release_logged("at shutdown")

    def _release_logged(self, when: str) -> None:
        """``release()``, logging what it raises: the caller's own outcome is what matters then."""
        try:
            self.release()
        except Exception:
            logger.exception("Error while releasing the %s trainer's transport %s", self.backend, when)

    def __enter__(self) -> TrainerWeightTransferEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    # -- backend hooks -----------------------------------------------------------------------
    @abstractmethod
    def prepare_workers(self) -> dict[str, Any]:
        """Allocate a fresh transport; return the JSON-safe init dict for every worker.

        Called again after :meth:`release` on ``reconnect()``."""

    @abstractmethod
    def wait_for_workers(self, call: ClientCall) -> None:
        """Wait (bounded by ``timeout_s``) until every worker joined; watch ``call`` for failure."""

    @abstractmethod
    def send_round(self, manifest: Manifest, buckets: list[Bucket], call: ClientCall) -> None:
        """Move one round's buckets; raise :class:`ManifestRejected` on a clean abort."""

    @abstractmethod
    def release(self) -> None:
        """Free buffers, sockets and groups (idempotent: it may run twice, and before any prepare)."""

    def round_failed(self) -> None:
        """A round raised (a worker refused it, failed, or timed out), before ``send_weights`` raises too: undo what
        the transport set up that a later round must not reuse. The default does nothing."""

    def connected(self) -> None:
        """Every worker joined and said what it loads (``self.cast`` is final): allocate what depends
        on the round's size. The default does nothing."""

    def settle_cast(self) -> None:
        """Every worker said what it loads (``served_answers``): the cast is final. The user's dtype needs no
        agreement. Idempotent: a transport may settle it early, to size what its workers stage."""
        if self.cast.dtype is None:
            self.cast = CastPlan(agreed(self.served_answers), None)

    def whole_round_bytes(self) -> int | None:
        """The bytes of a whole round as the workers load it, laid out as it is staged; None for a source that
        knows its tensors only once a round starts (TRL's stream). Call after :meth:`settle_cast`."""
        from wtransfer.engines.rounds.staging import staging_offsets

        try:
            entries = self.cast.entries(self.source.metadata())
        except Exception as exc:
            logger.debug("%s trainer: the round's size is known at its first round (%s: %s)", self.backend,
                         type(exc).__name__, exc)
            return None
        return staging_offsets(entries)[1]

    def open_senders(self) -> dict[str, Any]:
        """Backends with a ``sender_cls``: the JSON-safe dict the other trainer ranks join with."""
        raise NotImplementedError(f"the {self.backend} trainer has no sender_cls")

    def wait_for_senders(self, ranks: list[int]) -> None:
        """Backends with a ``sender_cls``: wait (bounded by ``timeout_s``) until ``ranks`` joined."""
        raise NotImplementedError(f"the {self.backend} trainer has no sender_cls")

    def stop_senders(self, reason: str) -> None:
        """Backends with a ``sender_cls``: tell the other ranks the current round failed (best effort)."""

    def tell_ranks_connected(self) -> None:
        """Sharded: tell the other ranks there is a trainer to follow (and, with parallel senders,
        how to join the transport)."""
        assert self.agreement is not None
        senders = self.open_senders() if self.parallel_senders else None
        self.agreement.decide("connect", {"ok": True, "timeout_s": self.timeout_s, "senders": senders},
                              self.timeout_s)
        self.told_ranks = True

"""wtransfer's engines as verl checkpoint engines: ``checkpoint_engine.backend=wtransfer:gloo``.

verl (0.9) moves weights from its actor to its rollout workers through a ``CheckpointEngine`` it picks by
name from ``CheckpointEngineRegistry``. Importing this module (verl does, through the ``verl.plugins``
entry point, at ``import verl``) registers ``wtransfer:NAME`` for every installed wtransfer engine.

Each sync, verl's ``CheckpointEngineManager`` runs ``prepare()`` on every worker, ``build_topology()`` once,
``init_process_group()`` on every worker, then the actor's ``send_weights()`` and the rollout workers'
``receive_weights()`` at once, then ``finalize()``. Here:

* the actor's rank 0 is a wtransfer trainer; its other ranks only walk verl's generator (each tensor
  is gathered collectively over the actor group);
* each rollout worker is a wtransfer worker whose "model" is a host copy of the weights. A round is
  staged whole and checked (checksums, delta digests, the label) before ``receive_weights`` yields
  anything: verl's rollout sees every tensor of a round that committed, or an error and no tensor;
* a round is labelled ``global_steps + 1`` (the weights of step 0 are version 1; wtransfer's version 0 is
  the start-up weights), or the next free number when a step syncs twice or a new actor replaced one:
  labels only go up, since a rollout worker keeps its wtransfer engine, and so what it holds, when a new
  actor connects;
* the transport and the control connections are kept from one sync to the next (verl's
  ``rebuild_group`` option rebuilds them every sync, each sync then a full round), and rebuilt after a
  failed sync, a restarted worker or a new topology. A rollout worker whose rank or world size changed starts a new engine,
  and its labels start again.

``engine_kwargs.wtransfer:NAME`` takes ``host`` (the address the actor's rank 0 listens on and rollout
workers reach; default loopback), ``timeout_s``, ``rebuild_group``, ``init_info`` (the wtransfer
trainer's, e.g. ``master_address`` for gloo across hosts), ``engine_options`` (the workers' engine
options) and ``create_trainer`` options: ``dtype``, ``checksums``, ``delta``, ``commit``.
verl's ``bucket_size`` is not used: wtransfer's ``init_info.bucket_bytes`` is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import wtransfer
from wtransfer.engines import StreamSource
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from wtransfer_verl.link import ActorLink, RolloutLinks

logger = logging.getLogger("wtransfer_verl")

PREFIX = "wtransfer:"


class HostCopy:
    """A rollout worker's wtransfer loader: the weights as of the last committed round, on the host.

    ``whole_round``: every round is staged whole before it reaches this copy, whatever commit mode the actor
    asks for. ``destination`` is what delta rounds rebuild from. ``written`` lists, in order, what the last
    round carried (all of it on a dense round; the changed tensors on a delta one).
    """

    whole_round = True
    delta_ready = True  # tensors a round leaves out keep their values here, as in the rollout engine

    def __init__(self) -> None:
        self.held: dict[str, Any] = {}
        self.written: list[str] = []

    def destination(self, name: str) -> Any:
        return self.held.get(name)

    def __call__(self, weights: list[tuple[str, Any]]) -> None:
        for name, tensor in weights:
            kept = self.held.get(name)
            if kept is not None and kept.shape == tensor.shape and kept.dtype == tensor.dtype:
                kept.copy_(tensor)
            else:
                self.held[name] = tensor.detach().clone()
            self.written.append(name)


class WTransferCheckpointEngine(CheckpointEngine):
    """One verl checkpoint engine per wtransfer engine (``backend`` is set on the registered subclass)."""

    backend: ClassVar[str] = ""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, *, host: str = "127.0.0.1",
                 timeout_s: float = 300.0, rebuild_group: bool = False, init_info: dict[str, Any] | None = None,
                 engine_options: dict[str, Any] | None = None, **trainer_options: Any) -> None:
        self.is_master = is_master
        self.host = host
        self.timeout_s = float(timeout_s)
        self.rebuild_group = rebuild_group
        self.init_info = dict(init_info or {})
        self.engine_options = dict(engine_options or {})
        self.trainer_options = trainer_options
        self.role: str | None = None
        self._key: tuple[Any, ...] | None = None  # the topology the transport was built for
        self._failed = False
        # the actor's rank 0
        self._links: RolloutLinks | None = None
        self._trainer: Any = None
        self._source = StreamSource()
        # a rollout worker
        self._link: ActorLink | None = None
        self._engine: Any = None
        self._place: tuple[int, int] | None = None
        self._copy = HostCopy()
        self._handed_all = False
        """Whether verl took every tensor of the last round: if not, the next round hands on the whole copy."""
        self.last_stats: dict[str, Any] | None = None
        """The actor's: stats of the last round (``send_weights()`` of the wtransfer trainer)."""

    # -- verl's set-up calls ----------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """The actor's rank 0 listens (a new listener after a failed sync or when a worker went away); its
        address and token are the metadata verl hands every worker."""
        if not self.is_master:
            return {}
        if self._links is None or self._failed or self.rebuild_group or not self._links.alive():
            self._close_actor()
            self._links = RolloutLinks(self.host, self.timeout_s)
        return {"wtransfer": self._links.address}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        master = (metadata[0] or {}).get("wtransfer")
        if master is None:
            raise wtransfer.WTransferError(
                f"{PREFIX}{cls.backend}: the actor's rank 0 reported no address; it must be created with is_master=True")
        actor = {"role": ["trainer"] + ["walker"] * (actor_wg_world_size - 1),
                 "rank": [0] * actor_wg_world_size,
                 "world_size": [rollout_world_size] * actor_wg_world_size,
                 "master": [master] * actor_wg_world_size}
        rollout = {"role": ["rollout"] * rollout_world_size,
                   "rank": list(range(rollout_world_size)),
                   "world_size": [rollout_world_size] * rollout_world_size,
                   "master": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, role: str, rank: int, world_size: int, master: dict[str, Any]) -> None:
        """Join (or keep) the transport: the trainer's rendezvous with every rollout worker."""
        self.role = role
        key = (master["host"], master["port"], master["token"], world_size, rank)
        if role == "walker" or (key == self._key and not self._failed):
            return
        if role == "trainer":
            try:
                self._build_trainer(world_size)
            except BaseException:
                self._close_actor()  # the rollout workers waiting in init_process_group see it now
                raise
        elif role == "rollout":
            self._build_worker(master, rank, world_size)
        else:
            raise ValueError(f"{PREFIX}{self.backend}: unknown role {role!r} from build_topology")
        self._key, self._failed = key, False

    def _build_trainer(self, world_size: int) -> None:
        assert self._links is not None, "prepare() first"
        if self._trainer is not None:
            self._trainer.shutdown()
            self._trainer = None
        self._links.accept(world_size)
        self._trainer = wtransfer.create_trainer(
            self.backend, client=self._links, source=self._source,
            init_info={"timeout_s": self.timeout_s, **self.init_info, "world_size": world_size + 1},
            **self.trainer_options)
        self._links.call("ready")

    def _build_worker(self, master: dict[str, Any], rank: int, world_size: int) -> None:
        """Connect to a (new) actor. The engine is kept while this worker's place is the same, so a new trainer
        learns at rendezvous what it holds, and numbers its rounds past that."""
        self._close_link()
        place = (rank, world_size)
        if self._engine is not None and self._place != place:
            self._engine.shutdown()
            self._engine = None
        if self._engine is None:
            self._engine = wtransfer.WeightTransferEngineFactory.create_engine(
                wtransfer.WeightTransferConfig(backend=self.backend, options=self.engine_options),
                wtransfer.ParallelConfig(rank=rank, world_size=world_size))
            self._place = place
            self._handed_all = False  # a new engine: the next round is handed on whole
        self._link = ActorLink(master, rank, self.timeout_s)
        self._link.serve(self._handle, until="ready")

    def _handle(self, op: str, info: Any) -> dict[str, Any]:
        engine = self._engine
        if op == "init":
            engine.init_transfer_engine(engine.parse_init_info(info))
        elif op == "start":
            self._copy.written = []
            engine.start_weight_update()
        elif op == "update":
            engine.receive_weights(engine.parse_update_info(info), self._copy)
        elif op == "finish":
            engine.finish_weight_update()
        elif op != "ready":
            raise ValueError(f"unknown call {op!r} from the actor")
        return {"weight_version": engine.weight_version}

    # -- a sync ---------------------------------------------------------------------------------------
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Rank 0 sends one round labelled ``global_steps``; the other ranks walk ``weights`` (verl gathers
        each tensor over the actor group as it is read). Returns verl's sync metrics."""
        if hasattr(weights, "__aiter__"):  # held whole: the trainer reads its source from another thread
            weights = [item async for item in weights]
        if self.role != "trainer":
            for _ in weights:
                pass
            return {}
        try:
            self._source.feed(weights)
            version = None if global_steps is None else max(global_steps + 1, self._trainer.free_version)
            stats = await asyncio.to_thread(self._trainer.send_weights, version=version)
        except BaseException:
            self._source.drain()  # the other ranks gather each tensor with this generator
            self._source.entries = None  # the next sync learns verl's tensors again
            self._close_actor()  # the rollout workers stop waiting now; the next prepare() starts afresh
            raise
        self.last_stats = stats
        return {"wtransfer/version": stats["version"], "wtransfer/seconds": stats["seconds"],
                "wtransfer/bytes": stats["bytes"], "wtransfer/wire_bytes": stats.get("wire_bytes", stats["bytes"])}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, Any]]:
        """The tensors of one round, yielded only once it committed on this worker: the ones it carried, or the
        whole copy when verl did not take all of the last round's (its loader failed part-way)."""
        if self._link is None:
            raise wtransfer.WTransferError(f"{PREFIX}{self.backend}: receive_weights() before init_process_group()")
        try:
            await asyncio.to_thread(self._link.serve, self._handle, "finish")
        except BaseException as exc:
            self._failed = True
            self._handed_all = False  # it may have committed before the answer was lost: hand on the whole copy next
            raise wtransfer.TransferError(
                f"{PREFIX}{self.backend}: the sync for step {global_steps} did not commit on this rollout worker, "
                f"and no tensor of it was handed on (it keeps version {self._engine.weight_version}): {exc}") from exc
        names = list(self._copy.written) if self._handed_all else list(self._copy.held)
        self._handed_all = False
        for name in names:
            yield name, self._copy.held[name]
        self._handed_all = True

    def finalize(self) -> None:
        """Keeps the transport for the next sync, unless ``rebuild_group``: then the actor's trainer and every
        connection close, and the next sync starts a new trainer. A rollout worker keeps its engine (what it
        holds, so labels still go up) and its host copy."""
        if self.rebuild_group:
            self._close_actor()
            self._close_link()
            self._key = None

    def shutdown(self) -> None:
        """Release the transport, the connections and the host copy (idempotent)."""
        self._close_actor()
        self._close_worker()
        self._copy = HostCopy()
        self._key = None
        self._handed_all = False

    def _close_actor(self) -> None:
        if self._trainer is not None:
            self._trainer.shutdown()
            self._trainer = None
        if self._links is not None:
            self._links.close()
            self._links = None

    def _close_link(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def _close_worker(self) -> None:
        self._close_link()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
            self._place = None


def register() -> list[str]:
    """Register ``wtransfer:NAME`` in verl's registry for every installed wtransfer engine; returns the names."""
    names = []
    for info in wtransfer.list_components("engines"):
        name = f"{PREFIX}{info.name}"
        cls = type(f"WTransfer_{info.name}_CheckpointEngine", (WTransferCheckpointEngine,),
                   {"backend": info.name, "__module__": __name__})
        CheckpointEngineRegistry.register(name)(cls)
        names.append(name)
    return names


REGISTERED = register()

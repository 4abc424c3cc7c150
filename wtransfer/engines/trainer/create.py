"""``create_trainer``: the trainer side of a backend, found through its worker engine's entry point.

A backend declares one entry point, its worker engine class, whose ``trainer_cls`` names the trainer side: a
separately installed backend (``wtransfer-nccl``) needs no other registration. A sharded trainer's ranks each call
it; rank 0 gets the sender, the others a :class:`~wtransfer.engines.trainer.sharded.ParticipantTrainer`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wtransfer.engines.rounds.source import WeightSource, as_source
from wtransfer.engines.trainer.client import WeightSyncClient
from wtransfer.engines.trainer.engine import TrainerWeightTransferEngine
from wtransfer.errors import WTransferError

if TYPE_CHECKING:
    from wtransfer.engines.trainer.agreement import RankAgreement
    from wtransfer.engines.trainer.sharded import ParticipantTrainer

logger = logging.getLogger("wtransfer")


class NoTrainerSideError(WTransferError, ValueError):
    """The named engine only has a worker side (its class sets no ``trainer_cls``)."""


def create_trainer(
    backend: str,
    *,
    client: WeightSyncClient | None,
    source: WeightSource | Any,
    init_info: Mapping[str, Any] | None = None,
    rank: int | None = None,
    **options: Any,
) -> TrainerWeightTransferEngine | ParticipantTrainer:
    """Create the trainer side of ``backend`` and rendezvous with the workers.

    ``backend`` is a bare or qualified engine name; its worker class's ``trainer_cls`` is used. Options:

    - ``checksums``: every tensor is hashed as sent and verified by every worker before the round commits.
    - ``commit``: ``"atomic"`` (default: each node stages the round in one shared host copy, loaded only
      once every worker received it whole, so a failed round leaves every model bit-identical) or
      ``"streaming"`` (buffers only; a failed round leaves the models torn: ``weight_version`` None,
      ``weights_torn`` True).
    - ``delta=True`` (unsharded only): send only what changed since the version every worker committed
      (changed elements' positions and values, a compressed XOR on slow links, or whole), each rebuilt
      tensor checked against the trainer's digest before commit; a worker without that version gets a full round automatically.
      Costs one host copy of the model; ``stats["wire_bytes"]`` is what crossed the transport.
      ``delta="auto"``: each round chooses delta or dense from what earlier rounds measured (see
      :mod:`wtransfer.engines.trainer.delta_choice`); dense rounds keep no base.
    - ``dtype``: floating tensors travel in the dtype the workers load (they say at rendezvous), cast on
      the rank that holds them; ``dtype="bfloat16"`` (or a ``torch.dtype``) forces one. A cast rounds as
      ``tensor.to(dtype)`` does (fp32 beyond bf16's range becomes inf); ``stats["cast_tensors"]`` counts them.
    - ``partial=True``: a round may carry any subset of the tensors; the rest keep their committed values
      and atomicity covers what it carries. vLLM then keeps a host copy of the checkpoint from the first
      round on (which must be whole) to reload touched layers whole.
    - ``in_flight``: what a serving engine does with running requests at commit: ``"recompute"`` (default:
      preempted, KV recomputed with the new weights), ``"keep"`` (they go on with the KV they hold; new
      requests never meet KV of other weights) or ``"drain"`` (the commit waits for them, up to half of
      ``timeout_s``, new requests queue; then the rest are recomputed).

    A sharded trainer (FSDP2 / DTensor, one process per rank) calls this on every rank with its ``rank``
    and the same source: rank 0 is the sender (it needs ``client`` and ``init_info``), every other rank
    gets a :class:`~wtransfer.engines.trainer.sharded.ParticipantTrainer` (``client`` may be None). With a
    ``sender_cls`` backend and a plain ``ModuleSource`` every rank sends its own shards; otherwise rank 0
    sends what the ranks gather. Call ``send_weights()`` on every rank each round. Rank 0 tells the others
    its decisions on a gloo group built here (a collective: torch.distributed must be initialised): a
    failed rendezvous raises on every rank, a refused or failed round raises in every ``send_weights()``,
    and no rank waits in a gather rank 0 will not run.
    """
    from wtransfer._registry.kinds import ENGINES
    from wtransfer._registry.manager import notify
    from wtransfer._registry.registry import registry_for

    engine_cls = registry_for(ENGINES).get_class(backend)
    trainer_cls = getattr(engine_cls, "trainer_cls", None)
    if trainer_cls is None:
        raise NoTrainerSideError(
            f"Engine {backend!r} ({engine_cls.__module__}.{engine_cls.__qualname__}) has no trainer "
            f"side: its class sets no 'trainer_cls'. Use a backend that has one (shm, gloo, nccl) "
            f"or drive this engine's workers with the trainer code its plugin documents."
        )
    accepted = {"checksums", "is_checkpoint_format", "commit", "delta", "dtype", "partial", "in_flight", "first_version"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(
            f"create_trainer() got unknown option(s) {', '.join(unknown)}; accepted: {', '.join(sorted(accepted))}. "
            f"Transport settings (world_size, bucket_bytes, ...) go in init_info."
        )
    agreement = None
    if rank is not None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"create_trainer(): 'rank' must be this process's trainer rank (an int >= 0), got {rank!r}")
        from wtransfer.engines.trainer.agreement import RankAgreement

        agreement = RankAgreement(rank, source)  # a collective: every trainer rank builds it here
        if rank > 0:
            from wtransfer.engines.trainer.sharded import ParticipantTrainer

            participant = ParticipantTrainer(backend, rank, as_source(source), agreement=agreement,
                                             sender_cls=trainer_cls.sender_cls)
            logger.info("Trainer rank %d of a sharded %s trainer: %s", rank, backend,
                        "writes its own shards" if participant.sender is not None else "gathers only, rank 0 sends")
            return participant
    trainer: TrainerWeightTransferEngine | None = None
    try:
        if client is None:
            raise TypeError("create_trainer(): the sender (rank 0, or an unsharded trainer) needs a client")
        trainer = trainer_cls(client=client, source=source, init_info=init_info, sharded=rank is not None, **options)
        trainer.agreement = agreement
        trainer.connect()
    except BaseException as exc:
        # The other ranks wait to hear whether there is a trainer to follow (unless connect() told them).
        if agreement is not None and not (trainer is not None and trainer.told_ranks):
            agreement.refuse("connect", exc)
        raise
    if agreement is not None:
        try:
            _connect_ranks(trainer, agreement)
        except BaseException:
            trainer.shutdown()
            raise
    logger.info("Created %s trainer for %d worker(s)", backend, trainer.num_workers)
    notify(ENGINES.created_hook, engine=trainer)
    return trainer


def _connect_ranks(trainer: TrainerWeightTransferEngine, agreement: RankAgreement) -> None:
    """Rank 0 of a sharded trainer, connected: tell the other ranks (unless they were told before the
    workers' init), and with parallel senders wait until every rank joined the transport (if one
    cannot, every rank raises)."""
    if not trainer.told_ranks:
        trainer.tell_ranks_connected()
    if not trainer.parallel_senders:
        return
    try:
        trainer.wait_for_senders(agreement.others)
    except BaseException as exc:
        agreement.decide("senders", {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}, trainer.timeout_s)
        raise
    agreement.decide("senders", {"ok": True}, trainer.timeout_s)

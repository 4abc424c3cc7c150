"""Sharded trainer ranks agree on every round: rank 0 decides, every rank hears it, with a timeout.

The gathers of a sharded round are collectives on the training group (FSDP's). A rank that
enters one while rank 0 never will (its trainer is closed or broken, its rendezvous failed)
waits there until the training group's own timeout, often half an hour, or worse: it
mismatches the next training collective. And a rank whose gathers completed cannot tell
whether the workers took the round. So rank 0 tells the others, on a small gloo group of
their own (never the training group, never the default group's operations), three things:
whether its trainer connected, whether a round starts, and how the round ended. Every
wait here has a timeout; a rank that hears nothing in time raises instead of waiting on.

Messages are one fixed-size byte tensor holding a JSON object: nothing is pickled.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

from wtransfer.errors import TransferError

logger = logging.getLogger("wtransfer")

MESSAGE_BYTES = 4096
"""One decision: a JSON object, NUL-padded (reasons are cut to fit)."""
CONNECT_WAIT_S = 600.0
"""How long the other ranks wait for rank 0's rendezvous (they do not know its timeout yet)."""
TELL_WAIT_S = 30.0
"""How long rank 0 spends telling the others that it failed before it knew its own timeout."""


def trainer_group_ranks(source: Any) -> list[int]:
    """The global ranks of the trainer's group: the device mesh of the source's first DTensor,
    else the whole default group."""
    import torch.distributed as dist

    module = getattr(getattr(source, "inner", source), "module", None)
    if module is not None:
        from torch.distributed.tensor import DTensor

        for parameter in module.parameters():
            if isinstance(parameter, DTensor):
                return sorted(int(r) for r in parameter.device_mesh.mesh.flatten().tolist())
    return list(range(dist.get_world_size()))


class RankAgreement:
    """Rank 0's word, heard by every trainer rank of a sharded trainer (a collective to build:
    every rank creates one, in ``create_trainer``)."""

    def __init__(self, trainer_rank: int, source: Any) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "create_trainer(..., rank=R): a sharded trainer needs torch.distributed initialised on every "
                "trainer rank (the gathers are its collectives); call torch.distributed.init_process_group first"
            )
        self.trainer_rank = trainer_rank
        ranks = trainer_group_ranks(source)
        self.group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=CONNECT_WAIT_S),
                                    use_local_synchronization=True)
        mine = torch.tensor([trainer_rank], dtype=torch.int64)
        everyone = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
        dist.all_gather(everyone, mine, group=self.group)
        claimed = [int(t.item()) for t in everyone]
        senders = [ranks[i] for i, r in enumerate(claimed) if r == 0]
        if len(senders) != 1 or sorted(claimed) != list(range(len(ranks))):
            raise ValueError(
                f"create_trainer(..., rank=R): the {len(ranks)} processes of the trainer group (global ranks {ranks}) "
                f"passed rank={claimed}; each must pass a different rank from 0 to {len(ranks) - 1}, and exactly one 0"
            )
        self.sender = senders[0]
        self.broken: str | None = None

    def tell(self, message: dict[str, Any], timeout_s: float) -> None:
        """Rank 0: say ``message`` to every other rank. Never raises (a rank that died cannot
        hear it; its own failure is reported elsewhere); never waits longer than ``timeout_s``."""
        if self.broken is not None:
            return
        try:
            self._broadcast(message, timeout_s)
        except Exception as exc:  # a participant died: rank 0's own round reports the failure
            self.broken = f"{type(exc).__name__}: {exc}"
            logger.warning("sharded trainer: could not tell the other ranks %s: %s", message.get("step"), exc)

    def hear(self, step: str, timeout_s: float) -> dict[str, Any]:
        """Another rank: wait (at most ``timeout_s``) for rank 0's ``step`` message."""
        if self.broken is not None:
            raise TransferError(f"trainer rank {self.trainer_rank}: rank 0 can no longer be heard ({self.broken}); "
                                f"create the trainer again on every rank")
        try:
            message = self._broadcast(None, timeout_s)
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise TransferError(
                f"trainer rank {self.trainer_rank}: heard nothing from trainer rank 0 about '{step}' within "
                f"{timeout_s:g} s ({exc}); it died, hangs, or stopped calling send_weights()"
            ) from exc
        if message.get("step") != step:
            self.broken = f"expected {step!r}, heard {message.get('step')!r}"
            raise TransferError(f"trainer rank {self.trainer_rank}: trainer ranks are out of step ({self.broken}); "
                                f"every rank must call send_weights() the same number of times")
        return message

    def _broadcast(self, message: dict[str, Any] | None, timeout_s: float) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        buffer = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        if message is not None:
            encoded = json.dumps(message).encode()
            if len(encoded) > MESSAGE_BYTES:
                message = {**message, "reason": str(message.get("reason", ""))[: MESSAGE_BYTES // 2] + " ..."}
                encoded = json.dumps(message).encode()[:MESSAGE_BYTES]
            buffer[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        work = dist.broadcast(buffer, src=self.sender, group=self.group, async_op=True)
        work.wait(datetime.timedelta(seconds=timeout_s))
        if message is not None:
            return message
        raw = bytes(buffer.numpy()).rstrip(b"\0")
        return json.loads(raw.decode())

"""Sharded trainer ranks agree on every round, through the trainer group's key-value store.

A sharded round's gathers are collectives on the training group. A rank that enters one rank 0 never
will waits until the training group's timeout (or mismatches the next training collective), and a rank
whose gathers completed cannot tell whether the workers took the round. So at three steps (rank 0
connected; a round starts; a round ended) the ranks agree:

* every other rank announces itself under the step's key and waits for rank 0's decision;
* rank 0 waits for every announcement, **claims** each one, and publishes its decision;
* a rank that waited ``timeout_s`` in vain withdraws its announcement and raises. Claiming and
  withdrawing are both compare-and-set on the same key, so exactly one wins: a rank is either
  claimed (it will hear the decision and follow it) or gone (rank 0 sees that, refuses the round
  and raises). Nobody is left in a gather that another rank will not enter.

The store is the default group's, under a prefix unique to this trainer. Not collectives with timeouts:
a timed-out gloo operation stays pending and later completes against a peer that gave up. Values are
JSON: nothing is pickled.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import time
from typing import Any

from wtransfer.engines.rounds.source import wrapped_sources
from wtransfer.errors import TransferError

logger = logging.getLogger("wtransfer")

CONNECT_WAIT_S = 600.0
"""How long the other ranks wait for rank 0's rendezvous (they do not know its timeout yet)."""
TELL_WAIT_S = 30.0
"""Slack over rank 0's own bounded waits: how much longer another rank waits for its decision (rank 0 may have
started waiting later, as when it claimed a rank that was giving up, and still has to publish)."""
GONE = "gone"
TAKEN = "taken"


def trainer_group_ranks(source: Any) -> list[int]:
    """The global ranks of the trainer's group: the device mesh of the source's first DTensor,
    else the whole default group (every rank must see the same)."""
    import torch.distributed as dist

    module = next((s.module for s in wrapped_sources(source) if hasattr(s, "module")), None)
    parameters = getattr(module, "parameters", None)
    if callable(parameters):
        from torch.distributed.tensor import DTensor

        for parameter in parameters():
            if isinstance(parameter, DTensor):
                return sorted(int(r) for r in parameter.device_mesh.mesh.flatten().tolist())
    return list(range(dist.get_world_size()))


class RankAgreement:
    """The trainer ranks' agreement (a collective to build: every rank creates one before rank 0 connects)."""

    def __init__(self, trainer_rank: int, source: Any) -> None:
        import secrets

        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "create_trainer(..., rank=R): a sharded trainer needs torch.distributed initialised on every "
                "trainer rank (the gathers are its collectives); call torch.distributed.init_process_group first"
            )
        self.trainer_rank = trainer_rank
        ranks = trainer_group_ranks(source)
        # One collective to check the ranks and share a name for this trainer's keys. The group is kept:
        # a destroyed group's name would be reused by the next trainer, over keys the store still holds.
        self._setup_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        mine = torch.tensor([trainer_rank, secrets.randbits(62) if trainer_rank == 0 else 0], dtype=torch.int64)
        everyone = [torch.zeros(2, dtype=torch.int64) for _ in ranks]
        dist.all_gather(everyone, mine, group=self._setup_group)
        claimed = [int(t[0]) for t in everyone]
        if claimed.count(0) != 1 or sorted(claimed) != list(range(len(ranks))):
            raise ValueError(
                f"create_trainer(..., rank=R): the {len(ranks)} processes of the trainer group (global ranks {ranks}) "
                f"passed rank={claimed}; each must pass a different rank from 0 to {len(ranks) - 1}, and exactly one 0"
            )
        name = int(everyone[claimed.index(0)][1])
        self.others = list(range(1, len(ranks)))
        self.store = dist.PrefixStore(f"wtransfer/agreement/{name:x}/", dist.distributed_c10d._get_default_store())

    # -- rank 0 -------------------------------------------------------------------------------
    def decide(self, step: str, decision: dict[str, Any], wait_s: float) -> None:
        """Rank 0: publish ``decision`` (``{"ok": ...}``) for ``step``. Going ahead first claims every other
        rank (waiting at most ``wait_s``); if one is missing, ``ok`` becomes False for everyone and
        :class:`TransferError` is raised. A refusal is published at once."""
        if not decision.get("ok"):
            self.store.set(f"{step}/decision", json.dumps(decision))
            return
        missing = self._claim_all(step, wait_s)
        if not missing:
            self._forget_before(step)
        if missing and decision.get("ok"):
            decision = {"ok": False, "reason": f"trainer rank(s) {', '.join(map(str, missing))} did not take part in "
                                               f"'{step}' within {wait_s:g} s (died, hung, or stopped waiting)"}
        self.store.set(f"{step}/decision", json.dumps(decision))
        if missing:
            raise TransferError(f"trainer rank 0: {decision['reason']}")

    def refuse(self, step: str, exc: BaseException) -> None:
        """Rank 0: tell the other ranks that ``step`` failed with ``exc``. Best effort: if the store is gone,
        this rank's own error is the one to raise."""
        with contextlib.suppress(Exception):
            self.decide(step, {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}, 0.0)

    def _forget_before(self, step: str) -> None:
        """Every rank is past the previous round's keys once it is claimed for ``round/N``: drop them."""
        kind, _, number = step.partition("/")
        if kind != "round" or not number.isdigit() or int(number) < 2:
            return
        previous = int(number) - 1
        for name in (f"round/{previous}", f"outcome/{previous}"):
            for key in [f"{name}/decision", *(f"{name}/r{rank}" for rank in self.others)]:
                try:
                    self.store.delete_key(key)
                except Exception:  # pragma: no cover - a key never written
                    pass

    def _claim_all(self, step: str, wait_s: float) -> list[int]:
        deadline = time.monotonic() + wait_s
        missing = []
        for rank in self.others:
            key = f"{step}/r{rank}"
            try:
                self.store.wait([key], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except Exception:  # not there in time: mark it gone (unless it arrives at this instant)
                pass
            value = self.store.compare_set(key, "", GONE).decode()  # sets GONE only where absent
            if value == GONE or self.store.compare_set(key, value, TAKEN).decode() != TAKEN:
                missing.append(rank)
        return missing

    # -- every other rank ------------------------------------------------------------------------
    def follow(self, step: str, wait_s: float) -> dict[str, Any]:
        """Another rank: announce itself at ``step`` and return rank 0's decision. Raises
        :class:`TransferError` if none came within ``wait_s`` (the rank is withdrawn) or rank 0 gave up first."""
        key, announcement = f"{step}/r{self.trainer_rank}", "here"
        try:
            if self.store.compare_set(key, "", announcement).decode() != announcement:
                raise TransferError(f"trainer rank {self.trainer_rank}: trainer rank 0 stopped waiting for this "
                                    f"rank at '{step}' before it arrived; create the trainer again on every rank")
            try:
                self.store.wait([f"{step}/decision"], datetime.timedelta(seconds=wait_s))
            except Exception as exc:
                if self.store.compare_set(key, announcement, GONE).decode() == GONE:  # withdrawn: not claimed
                    raise TransferError(
                        f"trainer rank {self.trainer_rank}: heard nothing from trainer rank 0 about '{step}' within "
                        f"{wait_s:g} s; it died, hangs, or has not called send_weights() (raise timeout_s if "
                        f"rank 0 does long work of its own between rounds)"
                    ) from exc
                # Claimed: rank 0 counts on this rank; its own wait may have started later than ours.
                self.store.wait([f"{step}/decision"], datetime.timedelta(seconds=wait_s + TELL_WAIT_S))
            return json.loads(self.store.get(f"{step}/decision").decode())
        except TransferError:
            raise
        except Exception as exc:  # the store itself failed: rank 0's process is gone
            raise TransferError(f"trainer rank {self.trainer_rank}: lost the trainer ranks' store at '{step}': "
                                f"{type(exc).__name__}: {exc}") from exc

    def decided(self, step: str, wait_s: float) -> dict[str, Any] | None:
        """Rank 0's decision for ``step`` if it comes within ``wait_s``, without taking part (to find its reason)."""
        try:
            self.store.wait([f"{step}/decision"], datetime.timedelta(seconds=wait_s))
            return json.loads(self.store.get(f"{step}/decision").decode())
        except Exception:  # none in time, or the store is gone
            return None

    def leave(self, step: str) -> None:
        """Another rank that will not take part in ``step`` (its gathers failed): rank 0 sees it at once."""
        try:
            self.store.compare_set(f"{step}/r{self.trainer_rank}", "", GONE)
        except Exception:  # pragma: no cover - the store itself is gone
            logger.debug("could not withdraw from %s", step, exc_info=True)

"""``delta="auto"``: each round chooses delta or dense from what earlier rounds measured.

The rules are checked on their own with given measurements; two end-to-end runs check what a user
sees on a real worker process: on a slow link (a client whose update call holds the round for the
time its wire bytes take at 2 MB/s) the rounds go dense twice, then full, then delta with few bytes,
and after a dense round in between (the base freed) full and delta again; on a
link the choice calls fast, every round is dense and the trainer keeps no base. Every round is
compared with the trainer's weights, digest by digest.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zstandard")

import wtransfer  # noqa: E402
from wtransfer.engines.trainer import delta_choice as _delta_choice  # noqa: E402
from wtransfer.engines.trainer.delta_choice import LONGEST_WAIT, DeltaChoice  # noqa: E402
from wtransfer.engines.trainer.delta_encoder import DeltaEncoder  # noqa: E402
from wtransfer.engines.rounds.source import TensorSource  # noqa: E402
from wtransfer.engines.wire import Manifest  # noqa: E402
from wtransfer.local import LocalWorkerPool  # noqa: E402
from wtransfer.testing.models import digests, tiny_llama  # noqa: E402

GB = 1e9
TIMEOUT = 60.0


def _modes(choice: DeltaChoice, rounds: int) -> list[str]:
    return [choice.choose()[0] for _ in range(rounds)]


def _measured(choice: DeltaChoice, seconds: float) -> None:
    """Two dense rounds, as the first ones of a trainer: the second one's rate is the link's."""
    for first in (True, False):
        mode, why = choice.choose()
        assert (mode, "measures the link" in why) == ("dense", True)
        choice.dense_round(int(GB), seconds * (4 if first else 1))  # a slow first round does not count


def test_the_first_two_rounds_are_dense_and_a_fast_link_stays_dense() -> None:
    choice = DeltaChoice()
    _measured(choice, 1.0)  # 1 GB/s: faster than encoding pays for (the first round's 0.25 GB/s is not)
    assert _modes(choice, 3) == ["dense"] * 3


def test_a_slow_link_goes_delta_and_stays_while_delta_wins() -> None:
    choice = DeltaChoice()
    _measured(choice, 10.0)  # 0.1 GB/s: a 1 Gbit/s link
    mode, why = choice.choose()
    assert mode == "delta" and "base is filled" in why
    choice.delta_round("full", int(GB), 10.0, refused=False)
    assert choice.choose()[0] == "delta"
    choice.delta_round("delta", int(GB), 1.0, refused=False)  # 1 GB/s of model: 10x dense
    assert choice.choose()[0] == "delta"
    choice.delta_round("delta", int(GB), 0.5, refused=False)
    assert choice.choose()[0] == "delta"


def test_a_short_dense_round_stays_dense_however_slow_its_rate() -> None:
    choice = DeltaChoice()
    choice.choose()
    choice.dense_round(int(1e6), 0.05)
    choice.choose()
    choice.dense_round(int(1e6), 0.05)  # 20 MB/s, but 50 ms: the calls' fixed costs, not the wire
    mode, why = choice.choose()
    assert mode == "dense" and "fixed costs" in why


def test_a_delta_round_slower_than_dense_sends_dense_rounds_and_retries_later_and_later() -> None:
    choice = DeltaChoice()
    _measured(choice, 10.0)
    choice.choose()
    choice.delta_round("full", int(GB), 10.0, refused=False)
    choice.choose()
    choice.delta_round("delta", int(GB), 12.0, refused=False)  # every element changed: slower than dense
    mode, why = choice.choose()
    assert mode == "dense" and "last delta round ran at 83.3 MB/s" in why
    assert _modes(choice, 2) == ["dense", "delta"]  # 2 dense rounds, then delta again (a full round first)
    choice.delta_round("full", int(GB), 10.0, refused=False)
    choice.choose()
    choice.delta_round("delta", int(GB), 11.0, refused=False)  # lost again: now 4 dense rounds
    assert _modes(choice, 5) == ["dense"] * 4 + ["delta"]
    choice.delta_round("full", int(GB), 10.0, refused=False)
    choice.choose()
    choice.delta_round("delta", int(GB), 1.0, refused=False)  # it wins: the next loss waits 2 rounds again
    choice.choose()
    choice.delta_round("delta", int(GB), 11.0, refused=False)
    assert _modes(choice, 3) == ["dense", "dense", "delta"]


def test_the_wait_before_trying_delta_again_is_bounded() -> None:
    choice = DeltaChoice()
    _measured(choice, 10.0)
    for _ in range(10):  # delta loses every time it is tried
        while choice.choose()[0] == "dense":
            pass
        choice.delta_round("full", int(GB), 10.0, refused=False)
        choice.choose()
        choice.delta_round("delta", int(GB), 12.0, refused=False)
    assert _modes(choice, LONGEST_WAIT + 1) == ["dense"] * LONGEST_WAIT + ["delta"]


def test_refusals_in_a_row_send_dense_rounds_but_one_refusal_does_not() -> None:
    choice = DeltaChoice()
    _measured(choice, 10.0)
    choice.choose()
    choice.delta_round("full", int(GB), 10.0, refused=True)  # a restarted worker: once
    assert choice.choose()[0] == "delta"
    choice.delta_round("delta", int(GB), 1.0, refused=False)
    assert choice.choose()[0] == "delta"
    choice.delta_round("full", int(GB), 10.0, refused=True)  # a GPU worker: every time
    assert choice.choose()[0] == "delta"
    choice.delta_round("full", int(GB), 10.0, refused=True)
    mode, why = choice.choose()
    assert mode == "dense" and "2 delta rounds in a row were refused" in why


def test_forget_frees_the_base_and_the_next_delta_round_is_full() -> None:
    encoder = DeltaEncoder()
    tensors = {"w": torch.arange(4096, dtype=torch.float32)}
    first = encoder.encode(TensorSource(tensors), 1)
    encoder.committed(first)
    first.settle()
    tensors["w"][:3] += 1
    second = encoder.encode(TensorSource(tensors), 2)
    assert second.plan.base == first.plan.id  # a real delta against the committed base
    second.settle()
    encoder.forget()
    assert (encoder.base, encoder.digests, encoder.base_id) == ({}, {}, None)
    third = encoder.encode(TensorSource(tensors), 3)
    assert third.plan.base is None, "after forget() the next round must carry everything"
    third.settle()


class SlowLinkPool(LocalWorkerPool):
    """A worker pool whose update call holds each round for the time its wire bytes take at ``rate``."""

    rate: float | None = None

    def update_weights(self, update_info: dict[str, Any]) -> list[dict[str, Any]]:
        answers = super().update_weights(update_info)
        if self.rate is not None:
            time.sleep(Manifest.from_dict(update_info["manifest"]).total_bytes / self.rate)
        return answers


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _run(rate: float | None, rounds: int, before: Any = None) -> tuple[list[dict[str, Any]], Any]:
    model = tiny_llama(seed=0, frozen_embedding=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    seen = []
    with SlowLinkPool(1, "wtransfer.testing.models:tiny_llama", backend="shm", timeout_s=TIMEOUT,
                      factory_kwargs={"seed": 1, "frozen_embedding": True}, torch_threads=1) as pool:
        pool.rate = rate
        trainer = wtransfer.create_trainer("shm", client=pool, source=model, delta="auto",
                                           init_info={"world_size": 2, "timeout_s": TIMEOUT})
        try:
            for step in range(1, rounds + 1):
                if step > 1:
                    _train(model, optimizer, step)
                if before is not None:
                    before(step, trainer)
                stats = trainer.send_weights()
                expected = digests(model)
                wrong = sorted(n for n, d in pool.digests()[0].items() if expected.get(n) != d)
                assert not wrong, f"round {step} ({stats['delta']}): the worker differs in {wrong[:5]}"
                seen.append(stats)
                print(f"round {step}: {stats['delta']}, {stats['wire_bytes']} of {stats['bytes']} bytes, "
                      f"{stats['seconds']:.3f} s: {stats['delta_choice']}")
            return seen, trainer.delta
        finally:
            trainer.shutdown()


def test_auto_on_a_slow_link_sends_deltas_and_a_switch_to_dense_and_back_keeps_every_round_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    bases = {}

    def before(step: int, trainer: Any) -> None:
        bases[step] = len(trainer.delta.base)
        # round 6 sees the link as fast (dense, the base freed); from round 7 on it is slow again
        monkeypatch.setattr(_delta_choice, "DELTA_BELOW", 1.0 if step == 6 else 0.5e9)

    seen, encoder = _run(rate=2e6, rounds=8, before=before)
    assert [s["delta"] for s in seen] == ["dense", "dense", "full", "delta", "delta", "dense", "full", "delta"]
    for stats in (seen[3], seen[4], seen[7]):
        assert stats["wire_bytes"] < 0.25 * stats["bytes"], stats
        assert stats["seconds"] < seen[1]["seconds"], "a delta round on a slow link must beat a dense one"
    assert bases[3] == 0 and bases[4] > 0, "the full round fills the base"
    assert bases[7] == 0, "a dense round frees the base"
    assert len(encoder.base) > 0


def test_auto_on_a_fast_link_sends_dense_rounds_and_keeps_no_base(monkeypatch: pytest.MonkeyPatch) -> None:
    # this tiny model's rounds are all fixed cost: without the floor on a round's time, a threshold they pass
    # easily stands for a fast link
    monkeypatch.setattr(_delta_choice, "SHORTEST_FOR_DELTA", 0.0)
    monkeypatch.setattr(_delta_choice, "DELTA_BELOW", 1e6)
    seen, encoder = _run(rate=None, rounds=4)
    assert [s["delta"] for s in seen] == ["dense"] * 4
    assert all(s["wire_bytes"] == s["bytes"] for s in seen)
    assert "faster than encoding" in seen[-1]["delta_choice"]
    assert encoder.base == {} and encoder.digests == {}, "a trainer sending dense rounds keeps no base"

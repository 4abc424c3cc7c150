"""Partial rounds (``create_trainer(..., partial=True)``): a round carries any subset of the model.

A real transformers Llama trained by AdamW; after a whole round, rounds carry only the MLP
weights, then everything but the embedding. Every worker must then hold exactly the merged
weights: each tensor as the last round that carried it sent it, bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import wtransfer  # noqa: E402
from wtransfer.engines.rounds.manifest import tensor_checksum  # noqa: E402
from wtransfer.local import LocalWorkerPool  # noqa: E402
from wtransfer.testing.models import tiny_llama  # noqa: E402

TIMEOUT = 60.0


class Subset(wtransfer.WeightSource):
    """The model's parameters whose names ``keep`` accepts: what a trainer of part of a model sends."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.keep: Any = lambda name: True

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters() if self.keep(n)]

    def metadata(self) -> list[wtransfer.TensorEntry]:
        return [wtransfer.TensorEntry(n, wtransfer.dtype_name(t.dtype), tuple(t.shape)) for n, t in self._named()]

    def __iter__(self):
        return iter(self._named())


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize(("backend", "commit"), [("shm", "atomic"), ("gloo", "streaming")])
def test_partial_rounds_leave_every_other_tensor_as_committed(backend: str, commit: str) -> None:
    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    source = Subset(model)
    sent: dict[str, int] = {}  # what the workers must hold: each tensor as last sent
    with LocalWorkerPool(2, "wtransfer.testing.models:tiny_llama", backend=backend, factory_kwargs={"seed": 1},
                         timeout_s=TIMEOUT, torch_threads=1) as pool:
        trainer = wtransfer.create_trainer(backend, client=pool, source=source, partial=True, commit=commit,
                                           init_info={"world_size": 3, "timeout_s": TIMEOUT, "bucket_bytes": 1 << 16})
        try:
            for step, keep in enumerate([lambda n: True, lambda n: ".mlp." in n, lambda n: ".mlp." in n,
                                         lambda n: "embed_tokens" not in n]):
                source.keep = keep
                carried = source._named()
                stats = trainer.send_weights()
                sent.update({name: tensor_checksum(t) for name, t in carried})
                assert stats["tensors"] == len(carried)
                assert stats["bytes"] == sum(t.numel() * t.element_size() for _, t in carried)  # only the subset
                for rank, got in enumerate(pool.digests()):
                    wrong = sorted(name for name in sent if got[name] != sent[name])
                    assert not wrong, f"round {step + 1}: worker {rank} differs in {wrong[:5]}"
                _train(model, optimizer, step)  # every parameter moves; only the next round's subset travels
            before = pool.digests()
            source.keep = lambda n: ".mlp." in n
            model.extra = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))  # a tensor the workers lack
            source.keep = lambda n: n == "extra" or ".mlp." in n
            with pytest.raises(Exception, match="unknown tensor, not a parameter .*: 'extra'"):
                trainer.send_weights()
            assert pool.digests() == before  # refused before any byte was written
        finally:
            trainer.shutdown()


def test_partial_and_delta_are_one_choice() -> None:
    with pytest.raises(ValueError, match="choose one"):
        wtransfer.create_trainer("shm", client=object(), source=tiny_llama(seed=0), delta=True, partial=True)

"""``StreamSource``: a framework's one-pass generator per round (TRL's and verl's syncs hand over one).

The first round holds the generator's tensors to learn them; later rounds read it as they pack, and a
round whose tensors differ from the last fails before commit, naming the tensor, the workers keeping the
round before. ``drain()`` walks what a failed round left (a framework's other ranks gather each tensor
with it). Checked against a real worker process's model.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import wtransfer
from wtransfer.engines import StreamSource
from wtransfer.local import LocalWorkerPool
from wtransfer.testing.models import digests, matrix_model

FACTORY = "wtransfer.testing.models:matrix_model"


def test_learns_the_first_round_streams_the_next_and_refuses_other_tensors() -> None:
    model = matrix_model(seed=1)
    read: list[str] = []

    def generator(reshape: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, parameter in model.named_parameters():
            read.append(name)
            value = parameter.detach().clone()
            yield name, (value.reshape(-1) if name == reshape else value)

    source = StreamSource()
    with LocalWorkerPool(1, FACTORY, backend="shm", timeout_s=60) as pool:
        trainer = wtransfer.create_trainer("shm", client=pool, source=source,
                                           init_info={"world_size": pool.world_size, "timeout_s": 60})
        try:
            source.feed(generator())
            assert len(read) == len(list(model.parameters()))  # held: the round must be described first
            trainer.send_weights()
            assert pool.digests()[0] == digests(model)

            with torch.no_grad():
                for name, parameter in matrix_model(seed=7).named_parameters():
                    getattr(model, name).copy_(parameter)
            read.clear()
            source.feed(generator())
            assert read == []  # streamed: read as it is packed
            trainer.send_weights()
            assert pool.digests()[0] == digests(model) and read == [n for n, _ in model.named_parameters()]

            before = pool.digests()[0]
            read.clear()
            source.feed(generator(reshape="bf16"))
            with pytest.raises(wtransfer.WTransferError, match="bf16"):
                trainer.send_weights()
            source.drain()
            assert read == [n for n, _ in model.named_parameters()]  # walked to the end, for the other ranks
            assert pool.digests()[0] == before and pool.stats()[0]["weight_version"] == 2
        finally:
            trainer.shutdown()


def test_sending_before_feeding_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="feed"):
        StreamSource().metadata()

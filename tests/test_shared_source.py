"""``shm``'s ``share_source``: after the first staged round the trainer's tensors live in the node's staged copy,
so later rounds copy nothing on the trainer. Checked on the weights, in the RL order (sync, train, sync), with real
worker processes: the workers hold exactly each round's weights, never what the trainer wrote since, and the
trainer's model stays usable after the trainer is gone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wtransfer.engines import ModuleSource, create_trainer
from wtransfer.errors import ManifestMismatchError
from wtransfer.local import LocalWorkerPool
from wtransfer.testing.models import build_model, digests

FACTORY = "wtransfer.testing.models:worker_model"
SHAPES = [[f"layer{i}.{kind}", shape] for i in range(6) for kind, shape in (("weight", [128, 128]), ("bias", [128]))]


def _in_segment(tensor: torch.Tensor, trainer: Any) -> bool:
    segment = trainer._segment.data
    return segment.data_ptr() <= tensor.data_ptr() < segment.data_ptr() + segment.numel()


def _staged_copies_mapped() -> set[str]:
    """The inodes of the staged segments this process maps (a host copy of the model each)."""
    with open("/proc/self/maps") as maps:
        return {line.split()[4] for line in maps if "wtransfer-staging" in line}


def _copies(monkeypatch: Any) -> list[int]:
    """Counts the trainer's copies into the staged segment (Packer.pack_staged's ParallelCopier)."""
    from wtransfer.engines.rounds import packing

    counted: list[int] = []
    real = packing.ParallelCopier.copy

    def copy(self: Any, target: torch.Tensor, tensor: torch.Tensor) -> None:
        counted.append(target.numel())
        real(self, target, tensor)

    monkeypatch.setattr(packing.ParallelCopier, "copy", copy)
    return counted


def test_shared_source_rounds_copy_nothing_and_workers_hold_each_round_exactly(monkeypatch):
    copies = _copies(monkeypatch)
    with LocalWorkerPool(2, FACTORY, backend="shm", factory_kwargs={"shapes": SHAPES, "dtype": "float32"},
                         timeout_s=30) as pool:
        model = build_model(SHAPES, "float32", random=True, seed=1)
        trainer = create_trainer("shm", client=pool, source=ModuleSource(model),
                                 init_info={"world_size": pool.world_size, "timeout_s": 30, "share_source": True})
        try:
            trainer.send_weights()
            first = digests(model)
            assert all(d == first for d in pool.digests())
            assert trainer.shared_tensors == len(SHAPES)
            assert all(_in_segment(p, trainer) for p in model.parameters())
            assert len(copies) == len(SHAPES)  # the first round writes every tensor once

            # A training step writes the shared tensors in place: the workers still hold round 1 exactly.
            for p in model.parameters():
                p.requires_grad_(True)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            loss = sum((p * p).sum() for p in model.parameters())
            loss.backward()
            optimizer.step()
            assert digests(model) != first
            assert all(d == first for d in pool.digests()), "a worker's model follows the trainer's live tensors"
            assert all(_in_segment(p, trainer) for p in model.parameters())

            copies.clear()
            trainer.send_weights()
            second = digests(model)
            assert all(d == second for d in pool.digests())
            assert copies == [], f"round 2 copied {len(copies)} tensors that already lived in the staged copy"
            assert len(trainer._copies) == 1, "a reused segment is recorded once, not once per round"

            # reconnect() prepares a new segment: the next round moves the tensors there and shares them again
            # (they stayed in the old one and every round copied them: two host copies of the model)
            trainer.reconnect()
            with torch.no_grad():
                model.get_parameter("layer0.weight").add_(1.0)
            copies.clear()
            trainer.send_weights()
            assert len(copies) == len(SHAPES)  # into the new segment, once
            assert trainer.shared_tensors == len(SHAPES)
            assert all(_in_segment(p, trainer) for p in model.parameters())
            assert all(d == digests(model) for d in pool.digests())
            assert len(_staged_copies_mapped()) == 1, "the segment before reconnect() is still mapped"
            copies.clear()
            trainer.send_weights()
            second = digests(model)
            assert copies == [] and all(d == second for d in pool.digests())
        finally:
            trainer.shutdown()
        # The trainer is gone: its model still reads and trains (the mapping lives as long as the tensors).
        assert digests(model) == second
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        assert digests(model) != second

        # A model whose tensors travel cast (bf16 here, fp32 workers) shares nothing and is copied every round.
        cast_model = build_model(SHAPES, "bfloat16", random=True, seed=2)
        trainer = create_trainer("shm", client=pool, source=ModuleSource(cast_model),
                                 init_info={"world_size": pool.world_size, "timeout_s": 30, "share_source": True})
        try:
            copies.clear()
            trainer.send_weights()
            trainer.send_weights()
            assert trainer.shared_tensors == 0
            assert len(copies) == 2 * len(SHAPES)
            expected = digests(_upcast(cast_model))
            assert all(d == expected for d in pool.digests())
        finally:
            trainer.shutdown()

        # Without the option the trainer keeps its own tensors.
        plain = build_model(SHAPES, "float32", random=True, seed=3)
        trainer = create_trainer("shm", client=pool, source=ModuleSource(plain),
                                 init_info={"world_size": pool.world_size, "timeout_s": 30})
        try:
            trainer.send_weights()
            assert trainer.shared_tensors == 0
            assert not any(_in_segment(p, trainer) for p in plain.parameters())
            assert all(d == digests(plain) for d in pool.digests())
        finally:
            trainer.shutdown()


def _upcast(model: torch.nn.Module) -> torch.nn.Module:
    fp32 = build_model(SHAPES, "float32", random=False)
    with torch.no_grad():
        for (_, target), (_, source) in zip(fp32.named_parameters(), model.named_parameters()):
            target.copy_(source.float())
    return fp32



class _Doubled(ModuleSource):
    """A source that yields other values than the tensors it holds (as a LoRA merge would)."""

    def __iter__(self):
        for name, tensor in super().__iter__():
            yield name, tensor * 2


def test_shared_source_never_writes_over_the_trainers_tensors(monkeypatch):
    """What could write over the trainer's tensors once they live in the staged copy: parameters swapped between
    rounds, a subclass yielding other values, views of a shared buffer, and a failed round after which a worker's
    commit may still read the copy. Each round the workers hold the trainer's weights and the trainer keeps them."""
    with LocalWorkerPool(1, FACTORY, backend="shm", factory_kwargs={"shapes": SHAPES, "dtype": "float32"},
                         timeout_s=30) as pool:
        init_info = {"world_size": pool.world_size, "timeout_s": 30, "share_source": True}
        model = build_model(SHAPES, "float32", random=True, seed=1)
        trainer = create_trainer("shm", client=pool, source=ModuleSource(model), init_info=init_info)
        try:
            trainer.send_weights()
            # Swapped between modules: each now sits at the other's place in the staged copy.
            first, second = model.layer0.weight, model.layer1.weight
            model.layer0.weight, model.layer1.weight = second, first
            held = digests(model)
            trainer.send_weights()
            assert digests(model) == held, "a round wrote over the trainer's swapped tensors"
            assert all(d == held for d in pool.digests())
            assert trainer.shared_tensors == len(SHAPES)  # moved into a fresh copy, each at its place

            # A round the worker refuses (a tensor of another shape): the trainer's tensors go back to its own
            # memory, untouched, the one taken out of the module for that round too; the next round shares them
            # again.
            wrong, start, size = model.layer5.bias, trainer._segment.data.data_ptr(), trainer._segment.size
            model.layer5.bias = torch.nn.Parameter(torch.zeros(7), requires_grad=False)
            with pytest.raises(ManifestMismatchError, match=r"shape \[7\] != model .*'layer5.bias'"):
                trainer.send_weights()
            model.layer5.bias = wrong
            assert digests(model) == held and trainer.shared_tensors == 0
            assert not any(start <= p.data_ptr() < start + size for p in model.parameters())  # out of the old copy
            trainer.send_weights()
            assert all(d == held for d in pool.digests()) and trainer.shared_tensors == len(SHAPES)
        finally:
            trainer.shutdown()

        doubled_model = build_model(SHAPES, "float32", random=True, seed=4)
        before = digests(doubled_model)
        trainer = create_trainer("shm", client=pool, source=_Doubled(doubled_model), init_info=init_info)
        try:
            trainer.send_weights()
            trainer.send_weights()
            assert trainer.shared_tensors == 0 and digests(doubled_model) == before
        finally:
            trainer.shutdown()

        # Parameters that are views of one flat buffer (a flat-parameter optimizer's layout) stay views of it.
        flat_model = build_model(SHAPES, "float32", random=True, seed=5)
        flat = torch.cat([p.detach().reshape(-1) for p in flat_model.parameters()])
        offset = 0
        for p in flat_model.parameters():
            p.data = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        trainer = create_trainer("shm", client=pool, source=ModuleSource(flat_model), init_info=init_info)
        try:
            trainer.send_weights()
            assert trainer.shared_tensors == 0
            flat.add_(1.0)  # reaches the module's parameters still
            trainer.send_weights()
            assert all(d == digests(flat_model) for d in pool.digests())
        finally:
            trainer.shutdown()

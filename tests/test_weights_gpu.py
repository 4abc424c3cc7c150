"""Rounds into a worker whose model lives on a GPU: the built-in engines receive into the staged host
copy and the commit copies it into the CUDA tensors. They skip without CUDA (CI never has one).

What they check: every round lands bit-exact and the parameters stay CUDA tensors (a commit that
swapped them for host copies matches every digest and fails here: planted once, caught on one H200);
a round failing at its last tensor, after earlier buckets moved, leaves an atomic worker's GPU model
as it was and a streamed one torn and saying so; a delta round is refused and sent whole; a trainer's
one-pass stream of CUDA tensors (what verl's and TRL's generators hand over) lands in a host model; and
the fault-schedule checker's invariants hold with the trainer's tensors and every worker's model on the GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import wtransfer
from wtransfer.engines import ModuleSource, StreamSource
from wtransfer.engines.wire import tensor_checksum
from wtransfer.errors import TransferError
from wtransfer.local import LocalWorkerPool
from wtransfer.testing.conformance.schedules import run_schedules
from wtransfer.testing.models import digests, matrix_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FACTORY = "wtransfer.testing.models:matrix_model"
ON_GPU = {"seed": 0, "device": "cuda"}
TIMEOUT = 60.0
BUCKET = 1 << 20


class _FailsOnce(ModuleSource):
    """The trainer's weights; raises once at the last tensor (the buckets before it went out), when armed."""

    armed = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        last = len(self.metadata()) - 1
        for index, item in enumerate(super().__iter__()):
            if self.armed and index == last:
                self.armed = False
                raise RuntimeError("the trainer's source failed mid-round")
            yield item


def _new_weights(model: torch.nn.Module, seed: int) -> None:
    with torch.no_grad():
        for name, parameter in matrix_model(seed=seed).named_parameters():
            getattr(model, name).copy_(parameter)


def _trainer(backend: str, pool: LocalWorkerPool, source: object, commit: str, delta: bool = False):
    return wtransfer.create_trainer(backend, client=pool, source=source, commit=commit, delta=delta,
                                    init_info={"world_size": pool.world_size, "bucket_bytes": BUCKET,
                                               "timeout_s": TIMEOUT})


@pytest.mark.parametrize("commit", ["atomic", "streaming"])
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_rounds_land_bit_exact_in_a_model_on_the_gpu(backend: str, commit: str) -> None:
    model = matrix_model(seed=1)
    with LocalWorkerPool(1, FACTORY, backend=backend, factory_kwargs=ON_GPU, timeout_s=TIMEOUT) as pool:
        trainer = _trainer(backend, pool, model, commit)
        try:
            for round_index, seed in enumerate((None, 7), start=1):
                if seed is not None:
                    _new_weights(model, seed)
                trainer.send_weights()
                assert pool.digests()[0] == digests(model), f"round {round_index}"
                stats = pool.stats()[0]
                assert stats["devices"] == ["cuda:0"], "the commit must write into the GPU tensors, not replace them"
                assert stats["weight_version"] == round_index
        finally:
            trainer.shutdown()


@pytest.mark.parametrize("commit", ["atomic", "streaming"])
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_failed_round_leaves_the_gpu_model_as_it_was_or_says_torn(backend: str, commit: str) -> None:
    model = matrix_model(seed=1)
    source = _FailsOnce(model)
    with LocalWorkerPool(1, FACTORY, backend=backend, factory_kwargs=ON_GPU, timeout_s=TIMEOUT) as pool:
        trainer = _trainer(backend, pool, source, commit)
        try:
            trainer.send_weights()
            before = pool.digests()[0]
            _new_weights(model, 7)
            source.armed = True
            with pytest.raises((TransferError, RuntimeError)):
                trainer.send_weights()
            after, stats = pool.digests()[0], pool.stats()[0]
            if commit == "atomic":
                assert after == before and stats["weight_version"] == 1 and not stats["weights_torn"]
            else:  # streamed: the buckets that arrived were written, and it says so
                assert after != before and stats["weight_version"] is None and stats["weights_torn"], stats
        finally:
            trainer.shutdown()
        retry = _trainer(backend, pool, model, commit)  # a failed trainer is done; a new one lands whole
        try:
            retry.send_weights()
            assert pool.digests()[0] == digests(model)
            assert pool.stats()[0]["devices"] == ["cuda:0"]
        finally:
            retry.shutdown()


def test_delta_rounds_to_a_gpu_model_are_refused_and_sent_whole() -> None:
    """Deltas apply to host models only (docs/delta.md): the worker refuses, saying why, and the same
    ``send_weights()`` sends the round whole, bit-exact."""
    model = matrix_model(seed=1)
    with LocalWorkerPool(1, FACTORY, backend="shm", factory_kwargs=ON_GPU, timeout_s=TIMEOUT) as pool:
        trainer = _trainer("shm", pool, model, "atomic", delta=True)
        try:
            assert trainer.send_weights()["delta"] == "full"
            _new_weights(model, 7)
            stats = trainer.send_weights()
            assert "cuda" in (stats["delta_refused"] or ""), stats
            assert pool.digests()[0] == digests(model)
            assert pool.stats()[0]["weight_version"] == 2
        finally:
            trainer.shutdown()


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_stream_of_cuda_tensors_lands_bit_exact_in_a_host_model(backend: str) -> None:
    """An RL framework's actor on a GPU hands over one pass of CUDA tensors per sync (verl's and TRL's
    generators): the first round holds them, later ones are read as they are packed."""
    model = matrix_model(seed=1).cuda()
    source = StreamSource()
    with LocalWorkerPool(1, FACTORY, backend=backend, timeout_s=TIMEOUT) as pool:
        trainer = wtransfer.create_trainer(backend, client=pool, source=source,
                                           init_info={"world_size": pool.world_size, "bucket_bytes": BUCKET,
                                                      "timeout_s": TIMEOUT})
        try:
            for seed in (None, 7, 9):
                if seed is not None:
                    _new_weights(model, seed)
                source.feed((name, p.detach()) for name, p in model.named_parameters())
                trainer.send_weights()
                assert pool.digests()[0] == {n: tensor_checksum(p.detach().cpu()) for n, p in model.named_parameters()}
                assert pool.stats()[0]["devices"] == ["cpu"]
        finally:
            trainer.shutdown()


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_labels_hold_under_random_schedules_with_models_on_the_gpu(backend: str) -> None:
    """Seeded sequences of rounds (whole, partial, delta), failing loads, client timeouts, restarted workers and
    replaced or dying trainers, as ``test_conformance_builtins.py`` runs them on host models, here with the
    trainer's tensors and both workers' models on the GPU: after every step each label names exactly what the
    workers' GPU tensors hold, and the models stay on the GPU."""
    init_info = {"master_address": "127.0.0.1"} if backend == "gloo" else {}
    assert run_schedules(backend, range(4), init_info=init_info, device="cuda") == 4

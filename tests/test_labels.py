"""A label never lies when faults come in sequence: checked on the weights, not on the numbers.

A worker's ``weight_version`` must name exactly what its model holds after any schedule of ordinary events: a
commit that failed on one worker followed by a partial round, a restarted worker, a replaced trainer, a client
call whose outcome the trainer never saw. Each test here failed on the implementation that trusted the trainer's
memory (noted per test); the seeded random schedules run in ``test_conformance_builtins.py``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import wtransfer
from wtransfer.engines.worker.loader import ModuleLoader
from wtransfer.engines.rounds.source import TensorSource
from wtransfer.engines.wire import tensor_checksum
from wtransfer.errors import ManifestMismatchError, TransferError, WeightsTornError
from wtransfer.local import LocalWorkerPool
from wtransfer.testing.models import build_model, digests

from test_atomic_rounds import TIMEOUT, ThreadedWorkers

SHAPES = [["a.weight", [64, 64]], ["a.bias", [64]], ["b.weight", [32, 64]], ["b.bias", [32]]]
GLOO = {"master_address": "127.0.0.1"}


def _init(workers: Any, backend: str) -> dict[str, Any]:
    return {"world_size": workers.world_size, "timeout_s": TIMEOUT, "bucket_bytes": 4096,
            **(GLOO if backend == "gloo" else {})}


def _holds(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names whose values in ``model`` differ from ``tensors``."""
    return [name for name, tensor in tensors.items() if not torch.equal(model.get_parameter(name), tensor)]


class FailsOnce(ModuleLoader):
    """A worker's real loader whose next load, once armed, writes one tensor and raises (out of memory)."""

    armed = False

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self.armed:
            self.armed = False
            super().__call__(weights[:1])
            raise RuntimeError("out of memory while loading the round")
        super().__call__(weights)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_partial_round_after_a_failed_commit_is_refused_until_a_whole_round_heals(backend: str) -> None:
    """Round 2's load fails on worker 1 (torn); partial round 3 must not label worker 1's mix "3" (it did: both
    workers reported 3, worker 1 holding round 1's values in the tensors round 3 left out). It is refused, naming
    the torn worker, nothing written; a round carrying every tensor heals it; partial rounds then land again.
    Every state has its own content identity, the same on every worker."""
    models = [build_model(SHAPES, "float32") for _ in range(2)]
    workers = ThreadedWorkers(backend, models)
    workers.loaders[1] = failing = FailsOnce(models[1])
    tensors = {name: torch.randn(shape) for name, shape in SHAPES}
    trainer = wtransfer.create_trainer(backend, client=workers, source=TensorSource(tensors), partial=True,
                                       init_info=_init(workers, backend))
    identities: list[str | None] = []
    try:
        assert trainer.send_weights()["version"] == 1
        identities.append(workers.engines[0].weights_identity)
        for tensor in tensors.values():
            tensor.add_(1.0)
        failing.armed = True
        with pytest.raises(WeightsTornError, match="out of memory"):
            trainer.send_weights()
        assert [(e.weight_version, e.weights_torn) for e in workers.engines] == [(2, False), (None, True)]
        before = [digests(m) for m in models]

        tensors["b.weight"].add_(1.0)  # only b.weight trained: a partial round carries it alone
        trainer.source = TensorSource({"b.weight": tensors["b.weight"]})
        with pytest.raises(ManifestMismatchError, match="is torn.*carries every tensor of the model"):
            trainer.send_weights()
        assert [digests(m) for m in models] == before, "a refused round wrote into a model"
        assert [(e.weight_version, e.weights_torn) for e in workers.engines] == [(2, False), (None, True)]

        trainer.source = TensorSource(tensors)  # every tensor: any worker takes it, whatever it holds
        assert trainer.send_weights()["version"] == 3
        identities.append(workers.engines[0].weights_identity)
        tensors["a.bias"].add_(1.0)
        trainer.source = TensorSource({"a.bias": tensors["a.bias"]})
        assert trainer.send_weights()["version"] == 4
        identities.append(workers.engines[0].weights_identity)
        trainer.source = TensorSource({"a.bias": tensors["a.bias"]})  # the same tensor, the same values again
        assert trainer.send_weights()["version"] == 5
        identities.append(workers.engines[0].weights_identity)
        for model in models:
            assert not _holds(model, tensors)
        assert [(e.weight_version, e.weights_torn) for e in workers.engines] == [(5, False), (5, False)]
        assert workers.engines[1].weights_identity == identities[-1]
        assert len(set(identities)) == len(identities) and None not in identities, identities
    finally:
        trainer.shutdown()
        workers.shutdown()


@pytest.mark.parametrize("restarted", ["one", "every", "every, under a new trainer"])
def test_a_restarted_worker_refuses_a_partial_round_it_cannot_complete(restarted: str) -> None:
    """A restarted worker holds its start-up weights: a partial round would label them with the fleet's newer
    version (it did). It is refused, naming what the worker holds; a whole round brings both workers to it. When
    every worker restarted they all hold one state, the start-up weights, but the trainer's partial round carries
    what changed since the base it knows (its own last round, or what the workers held when it was created, here
    another trainer's round): it is refused too (the trainer took the start-up weights as its base, and both
    workers served the start-up ``a.bias`` labelled 2)."""
    model = build_model(SHAPES, "float32", random=True)
    with LocalWorkerPool(2, "wtransfer.testing.models:worker_model", backend="shm",
                         factory_kwargs={"shapes": SHAPES, "dtype": "float32"}, timeout_s=TIMEOUT) as pool:
        init_info = {"world_size": pool.world_size, "timeout_s": TIMEOUT}
        if restarted == "every, under a new trainer":  # another trainer's round 1; this one sends none before
            with wtransfer.create_trainer("shm", client=pool, source=model, init_info=init_info) as first:
                assert first.send_weights()["version"] == 1
        trainer = wtransfer.create_trainer("shm", client=pool, source=model, partial=True, init_info=init_info)
        try:
            if restarted != "every, under a new trainer":
                assert trainer.send_weights()["version"] == 1
            for rank in ([1] if restarted == "one" else [0, 1]):
                pool.restart(rank)
            trainer.reconnect()
            with torch.no_grad():
                model.get_parameter("a.weight").add_(1.0)
            trainer.source = TensorSource({"a.weight": model.get_parameter("a.weight")})
            with pytest.raises(ManifestMismatchError, match=r"holds version 0 \(content startup\)"):
                trainer.send_weights()
            trainer.source = wtransfer.ModuleSource(model)
            assert trainer.send_weights()["version"] == 2
            assert pool.digests() == [digests(model)] * 2
            assert [(s["weight_version"], s["weights_torn"]) for s in pool.stats()] == [(2, False)] * 2
        finally:
            trainer.shutdown()


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_labels_only_go_up_across_trainers(backend: str) -> None:
    """Trainer A sends rounds 1-3 and exits; trainer B's first round is 4, not 1 again (it was 1: the workers
    went 3 -> 1 for other weights). A resumed job may name its numbering, never at or below a label in use."""
    model = build_model(SHAPES, "float32", random=True)
    with LocalWorkerPool(2, "wtransfer.testing.models:worker_model", backend=backend,
                         factory_kwargs={"shapes": SHAPES, "dtype": "float32"}, timeout_s=TIMEOUT) as pool:
        init_info = {"world_size": pool.world_size, "timeout_s": TIMEOUT, **(GLOO if backend == "gloo" else {})}

        def trainer(**options: Any) -> Any:
            return wtransfer.create_trainer(backend, client=pool, source=model, init_info=init_info, **options)

        with trainer() as first:
            assert [first.send_weights()["version"] for _ in range(3)] == [1, 2, 3]
        with torch.no_grad():
            model.get_parameter("b.bias").add_(1.0)
        with trainer() as second:
            assert second.send_weights()["version"] == 4
        assert [(s["weight_version"], s["weights_torn"]) for s in pool.stats()] == [(4, False)] * 2
        assert pool.digests() == [digests(model)] * 2
        with pytest.raises(ValueError, match="first_version=3.*labels up to 4"):
            trainer(first_version=3)
        with trainer(first_version=100) as resumed:
            assert resumed.send_weights()["version"] == 100
            with pytest.raises(TransferError, match=r"send_weights\(version=100\): a round's number is an int above 100"):
                resumed.send_weights(version=100)
            assert resumed.send_weights(version=150)["version"] == 150
        assert [s["weight_version"] for s in pool.stats()] == [150, 150]


class ClientTimeout(Exception):
    """An HTTP client's timeout (httpx's is not an ``OSError``)."""


class SlowCommit(ModuleLoader):
    """Loads tensor by tensor, slowly, and records what each commit wrote (the model right after it)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.committed: list[dict[str, int]] = []
        self.loading = threading.Event()

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.loading.set()
        for pair in weights:
            time.sleep(0.1)
            super().__call__([pair])
        self.committed.append(digests(self.module))


class DetachedFinish(ThreadedWorkers):
    """A client that does not serialise its calls: ``finish_weight_update`` times out at once while the workers
    still commit, and the next round's calls reach them meanwhile."""

    def finish_weight_update(self) -> None:
        slow = self.loaders[1]
        slow.loading.clear()
        self.finishing = threading.Thread(target=super().finish_weight_update)
        self.finishing.start()
        assert slow.loading.wait(TIMEOUT)  # the slow worker's commit is under way when the client gives up
        raise ClientTimeout("finish_weight_update: read timed out")


def test_the_round_after_an_unknown_outcome_never_writes_into_memory_a_worker_still_commits_from() -> None:
    """Round 1's finish times out on the client while worker 1 still commits it from the shm segment. The next
    round must not write that segment before worker 1 is done (it did: worker 1 committed a mix of rounds 1 and
    2 and labelled it 1). The trainer stays usable; every commit holds exactly its own round."""
    models = [build_model(SHAPES, "float32") for _ in range(2)]
    workers = DetachedFinish("shm", models)
    workers.loaders[1] = slow = SlowCommit(models[1])
    tensors = {name: torch.randn(shape) for name, shape in SHAPES}
    trainer = wtransfer.create_trainer("shm", client=workers, source=TensorSource(tensors),
                                       init_info=_init(workers, "shm"))
    try:
        sent = []
        with pytest.raises(ClientTimeout):
            trainer.send_weights()
        sent.append({name: tensor_checksum(t) for name, t in tensors.items()})
        for tensor in tensors.values():
            tensor.add_(1.0)
        with pytest.raises(ClientTimeout):  # round 2 follows at once: its outcome is unknown too
            trainer.send_weights()
        sent.append({name: tensor_checksum(t) for name, t in tensors.items()})
        workers.finishing.join(TIMEOUT)
        assert slow.committed == sent, "a commit loaded bytes of another round than its own"
        assert [(e.weight_version, e.weights_torn) for e in workers.engines] == [(2, False), (2, False)]
    finally:
        trainer.shutdown()
        workers.shutdown()


def test_a_worker_refuses_labels_it_used_and_rounds_that_would_keep_a_torn_models_leftovers() -> None:
    """The worker's own guard, whatever the trainer believes: a round labelled at or below the version it holds
    or began to commit is refused (a failed commit spends its number); a torn worker whose loader keeps what a
    round leaves out (``strict=False``) refuses such a round; a round carrying every tensor heals it."""
    from test_atomic_rounds import HandEngine, _update_dict

    shapes = [[f"w{i}", [32]] for i in range(4)]
    model = build_model(shapes, "float32")
    load = FailsOnce(model, strict=False)
    engine = HandEngine(wtransfer.WeightTransferConfig(backend="hand"))

    def send(version: int, value: float, names: list[str] | None = None) -> None:
        HandEngine.tensors = {f"w{i}": torch.full((32,), value) for i in range(4) if names is None or f"w{i}" in names}
        engine.receive_weights(engine.parse_update_info(_update_dict(HandEngine.tensors, version, "atomic")), load)
        engine.finish_weight_update()

    try:
        send(3, 1.0)
        for version in (3, 2):
            with pytest.raises(ManifestMismatchError, match="holds version 3 and began to commit up to version 3"):
                send(version, 9.0)
        assert engine.weight_version == 3 and all(float(p.sum()) == 32 for p in model.parameters())
        load.armed = True
        with pytest.raises(WeightsTornError):
            send(5, 2.0)
        assert engine.held_weights() == {"version": None, "identity": None, "spent": 5}
        with pytest.raises(ManifestMismatchError, match="began to commit up to version 5"):
            send(5, 2.0)
        with pytest.raises(ManifestMismatchError, match="is torn.*leaves tensors of its model out"):
            send(6, 3.0, names=["w0", "w1"])  # strict=False would keep w2, w3 half old, half new
        assert engine.weights_torn
        send(6, 3.0)
        assert engine.weight_version == 6 and all(float(p.sum()) == 96 for p in model.parameters())
        assert engine.held_weights()["spent"] == 6 and engine.weights_identity is not None
    finally:
        engine.shutdown()

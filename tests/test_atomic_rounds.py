"""All-or-nothing rounds, checked on the weights: a failed round leaves every worker bit-identical to
the previous version (atomic) or plainly torn (streaming), never mixed and labelled as the old one.

Real worker processes, real shared memory and gloo groups; the in-process cases run real engines in
threads (one trainer, several workers with different models) where a test needs per-worker models.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import wtransfer
from wtransfer.engines import WeightSource
from wtransfer.engines.wire import Manifest, TensorEntry
from wtransfer.engines.rounds.source import TensorSource
from wtransfer._probes import staging_segments
from wtransfer.errors import ManifestMismatchError, TransferError, WeightsTornError
from wtransfer.local import LocalWorkerPool
from wtransfer.testing.leaks import Resources
from wtransfer.testing.models import build_model, digests, mutate

FACTORY = "wtransfer.testing.models:worker_model"
TIMEOUT = 30.0
# 28 tensors, ~3.6 MB: 14 layers of a 256x256 fp32 weight and a bias
SHAPES = [[f"layer{i}.{kind}", shape] for i in range(14) for kind, shape in (("weight", [256, 256]), ("bias", [256]))]
BUCKET = 64 * 1024


class FailingSource(WeightSource):
    """The trainer's weights, raising once ``fail_at`` of the round's bytes were read (then never again)."""

    def __init__(self, model: torch.nn.Module, fail_at: float | None = None) -> None:
        self.inner = TensorSource(dict(model.named_parameters()))
        self.fail_at = fail_at
        self.on_fail: Any = None  # instead of raising: something else fails the round (a kill)

    def metadata(self) -> list[TensorEntry]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        total = sum(e.nbytes for e in self.metadata())
        read = 0
        for name, tensor in self.inner:
            if self.fail_at is not None and read >= self.fail_at * total:
                self.fail_at = None
                if self.on_fail is None:
                    raise RuntimeError("the trainer's weight source failed mid-round")
                self.on_fail()
            read += tensor.numel() * tensor.element_size()
            yield name, tensor


def trainer_model() -> torch.nn.Module:
    return build_model(SHAPES, "float32", random=True, seed=1)


def send(backend: str, pool: Any, source: WeightSource, commit: str, extra: dict) -> Any:
    return wtransfer.create_trainer(
        backend, client=pool, source=source, commit=commit,
        init_info={"world_size": pool.world_size, "bucket_bytes": BUCKET, "timeout_s": TIMEOUT, **extra},
    )


def classify(got: dict[str, int], old: dict[str, int], new: dict[str, int]) -> tuple[int, int]:
    """(tensors equal to the new version, tensors equal to the old one); each differs between the two."""
    assert all(old[n] != new[n] for n in old), "every tensor must change between the versions"
    return sum(got[n] == new[n] for n in got), sum(got[n] == old[n] for n in got)


BACKENDS = [("shm", {}), ("gloo", {}), ("gloo", {"direct_min_bytes": 16 * 1024})]
BACKEND_IDS = ["shm", "gloo", "gloo-in-place"]


@pytest.mark.parametrize("commit", ["atomic", "streaming"])
@pytest.mark.parametrize(("backend", "extra"), BACKENDS, ids=BACKEND_IDS)
def test_a_round_failing_at_60_percent_leaves_old_weights_or_says_torn(backend: str, extra: dict, commit: str) -> None:
    model = trainer_model()
    with LocalWorkerPool(2, FACTORY, backend=backend, factory_kwargs={"shapes": SHAPES, "dtype": "float32"},
                         timeout_s=TIMEOUT, torch_threads=1) as pool:
        source = FailingSource(model)
        trainer = send(backend, pool, source, commit, extra)
        trainer.send_weights()
        v1 = digests(model)
        assert pool.digests() == [v1, v1]
        mutate(model, 2)
        for parameter in model.parameters():
            parameter.data.add_(1.0)  # every tensor differs from v1
        v2 = digests(model)
        source.fail_at = 0.6
        with pytest.raises((TransferError, RuntimeError)):
            trainer.send_weights()
        got, stats = pool.digests(), pool.stats()
        for rank in range(2):
            fresh, old = classify(got[rank], v1, v2)
            if commit == "atomic":
                assert (fresh, old) == (0, len(SHAPES)), f"worker {rank}: {fresh} new, {old} old tensors"
                assert stats[rank]["weight_version"] == 1 and stats[rank]["weights_torn"] is False
            else:
                assert fresh > 0 and old > 0, f"worker {rank}: the streamed round did not tear ({fresh} new, {old} old)"
                assert stats[rank]["weight_version"] is None and stats[rank]["weights_torn"] is True
        trainer.shutdown()
        # A complete round from a new trainer lands bit-exact and clears the torn state.
        retry = send(backend, pool, FailingSource(model), commit, extra)
        version = retry.send_weights()["version"]
        assert version == 2  # a new trainer numbers past what the workers hold or received (1): labels only go up
        assert pool.digests() == [v2, v2]
        assert [(s["weight_version"], s["weights_torn"]) for s in pool.stats()] == [(version, False)] * 2
        retry.shutdown()


@pytest.mark.parametrize(("backend", "extra"), BACKENDS[:2], ids=BACKEND_IDS[:2])
def test_the_workers_of_a_node_share_one_staged_copy(backend: str, extra: dict) -> None:
    model = trainer_model()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    with LocalWorkerPool(3, FACTORY, backend=backend, factory_kwargs={"shapes": SHAPES, "dtype": "float32"},
                         timeout_s=TIMEOUT, torch_threads=1) as pool:
        trainer = send(backend, pool, model, "atomic", extra)
        # before any round the node's copy exists, every page in memory: the first round pays no faults
        # (shm's trainer makes it, gloo's workers elect a stager that does, as they join)
        maker = [os.getpid()] if backend == "shm" else pool.pids  # gloo's copy is the workers' alone
        before = staging_segments([*pool.pids, os.getpid()])
        assert len(before) == 1 and staging_segments(maker) == before, f"one staged copy at join: {before}"
        ((inode, early),) = before.items()
        assert total <= early < total + len(SHAPES) * 64 + 4096
        assert resident_staging_bytes(maker) >= early
        if backend == "gloo":
            assert sum(bool(staging_segments([pid])) for pid in pool.pids) == 1, "made by the node's stager only"
        for round_index in range(2):
            mutate(model, round_index)
            trainer.send_weights()
            assert pool.digests() == [digests(model)] * 3
        # the rounds went through that very copy: none was made again
        assert staging_segments([*pool.pids, os.getpid()]) == {inode: early}
        mapped = [staging_segments([pid]) for pid in pool.pids]
        assert all(len(m) == 1 for m in mapped) and len(staging_segments(pool.pids)) == 1, \
            f"one staging segment per node, mapped by every worker: {mapped}"
        ((_, size),) = staging_segments(pool.pids).items()
        assert total <= size < total + len(SHAPES) * 64 + 4096
        trainer.shutdown()


def resident_staging_bytes(pids: list[int]) -> int:
    """The most bytes of a staged copy (``memfd:wtransfer-staging``) that one of ``pids`` has in memory."""
    most = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps") as handle:
            inside = False
            for line in handle:
                if "-" in line.split()[0] and not line.split()[0].endswith(":"):  # a mapping's first line
                    inside = "/memfd:wtransfer-staging" in line
                elif inside and line.startswith("Rss:"):
                    most = max(most, int(line.split()[1]) * 1024)
    return most


# -- in-process workers with different models -------------------------------------------------------
class ThreadedWorkers:
    """A ``WeightSyncClient`` over real worker engines in this process, one thread per worker call."""

    def __init__(self, backend: str, models: list[torch.nn.Module], strict: bool = True) -> None:
        self.models = models
        self.loaders = [wtransfer.module_loader(m, strict=strict) for m in models]
        self.engines = [
            wtransfer.WeightTransferEngineFactory.create_engine(
                wtransfer.WeightTransferConfig(backend=backend),
                wtransfer.ParallelConfig(rank=rank, world_size=len(models)),
            )
            for rank in range(len(models))
        ]
        self.errors: list[list[BaseException]] = [[] for _ in models]
        self.idle = threading.Event()
        """Set while no call runs on the workers (a trainer may return before a failed round's call does)."""
        self.idle.set()

    @property
    def world_size(self) -> int:
        return len(self.models) + 1

    def _fan_out(self, call: Any) -> None:
        failures: list[BaseException | None] = [None] * len(self.engines)

        def run(rank: int) -> None:
            try:
                call(rank, self.engines[rank])
            except BaseException as exc:
                failures[rank] = exc
                self.errors[rank].append(exc)

        threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(self.engines))]
        self.idle.clear()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.idle.set()
        raised = [f for f in failures if f is not None]
        if raised:  # the rejection, if any: it names the worker's reason
            raise next((f for f in raised if isinstance(f, ManifestMismatchError)), raised[0])

    def init_weight_transfer_engine(self, info: dict) -> None:
        self._fan_out(lambda rank, e: e.init_transfer_engine(e.parse_init_info(info)))

    def start_weight_update(self) -> None:
        self._fan_out(lambda rank, e: e.start_weight_update())

    def update_weights(self, info: dict) -> None:
        self._fan_out(lambda rank, e: e.receive_weights(e.parse_update_info(info), self.loaders[rank]))

    def finish_weight_update(self) -> None:
        self._fan_out(lambda rank, e: e.finish_weight_update())

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()


@pytest.mark.parametrize("commit", ["atomic", "streaming"])
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_one_worker_rejecting_leaves_the_accepting_ones_unchanged_and_the_trainer_working(
    backend: str, commit: str
) -> None:
    shapes = [["a.weight", [64, 64]], ["a.bias", [64]], ["b.weight", [300, 70]]]
    accepting = build_model([*shapes, ["c.weight", [8]]], "float32")  # also holds c
    rejecting = build_model(shapes, "float32")
    workers = ThreadedWorkers(backend, [accepting, rejecting], strict=False)
    tensors = {name: torch.randn(shape) for name, shape in shapes} | {"c.weight": torch.randn(8)}
    before = [digests(accepting), digests(rejecting)]
    trainer = wtransfer.create_trainer(
        backend, client=workers, source=TensorSource(tensors), commit=commit,
        init_info={"world_size": workers.world_size, "bucket_bytes": 4096, "timeout_s": TIMEOUT,
                   **({"master_address": "127.0.0.1"} if backend == "gloo" else {})},
    )
    try:
        with pytest.raises(ManifestMismatchError, match="unknown tensor, not a parameter .*: 'c.weight'"):
            trainer.send_weights()
        assert [digests(accepting), digests(rejecting)] == before, "a rejected round wrote into a model"
        assert [(e.weight_version, e.weights_torn) for e in workers.engines] == [(0, False), (0, False)]
        del tensors["c.weight"]  # the round every worker accepts
        trainer.send_weights()
        for model in (accepting, rejecting):
            assert all(torch.equal(getattr(model, n.split(".")[0]).get_parameter(n.split(".")[1]), t)
                       for n, t in tensors.items())
        assert [(e.weight_version, e.weights_torn) for e in workers.engines] == [(1, False), (1, False)]
    finally:
        trainer.shutdown()
        workers.shutdown()


def test_a_commit_failing_on_one_worker_leaves_the_trainer_usable_and_its_next_round_heals_it() -> None:
    """Worker 1's commit fails part-way (its loader raises on the second round, as out of memory
    would) after worker 0's landed: the trainer raises the workers' error, says nothing committed,
    and stays usable; its next round is numbered past the failed one (worker 0 holds that number)
    and brings both workers to it, bit for bit."""
    shapes = [["a.weight", [64, 64]], ["b.weight", [300, 70]]]
    models = [build_model(shapes, "float32") for _ in range(2)]
    workers = ThreadedWorkers("shm", models)
    real, loads = workers.loaders[1], []

    def out_of_memory_once(weights: list[tuple[str, torch.Tensor]]) -> None:
        loads.append(len(weights))
        if len(loads) == 2:
            real(weights[:1])  # part of the round is in the model when it fails
            raise RuntimeError("out of memory while loading the round")
        real(weights)

    workers.loaders[1] = out_of_memory_once
    tensors = {name: torch.randn(shape) for name, shape in shapes}
    trainer = wtransfer.create_trainer("shm", client=workers, source=TensorSource(tensors),
                                       init_info={"world_size": workers.world_size, "timeout_s": TIMEOUT})
    try:
        assert trainer.send_weights()["version"] == 1
        for tensor in tensors.values():
            tensor.add_(1.0)
        with pytest.raises(WeightsTornError, match="out of memory"):
            trainer.send_weights()
        assert trainer.weight_version == 1
        assert [(e.weight_version, e.weights_torn) for e in workers.engines] == [(2, False), (None, True)]
        for tensor in tensors.values():
            tensor.add_(1.0)
        assert trainer.send_weights()["version"] == 3
        assert [(e.weight_version, e.weights_torn) for e in workers.engines] == [(3, False), (3, False)]
        for model in models:
            assert all(torch.equal(model.get_parameter(n), t) for n, t in tensors.items())
    finally:
        trainer.shutdown()
        workers.shutdown()


def _write_faults(tensor: torch.Tensor) -> int:
    """Write one byte into ``tensor``'s memory from a forked child of this process; the signal that
    ended the child (0: the write went through)."""
    import ctypes

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        import faulthandler

        faulthandler.disable()  # the fault is expected: no traceback on stderr
        ctypes.memset(tensor.data_ptr(), 0xFF, 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_worker_cannot_write_into_the_staged_round_it_commits_from(backend: str) -> None:
    """shm: every worker maps the trainer's staged round read-only; gloo: the node's follower maps its
    stager's copy read-only. A write into it faults (in a forked child of the worker, which the fault
    kills) instead of changing what another worker commits, and the round commits bit-exact everywhere.
    Broken by: a writable mapping there (the write lands, and with it the models would differ)."""
    import signal

    from wtransfer.engines.rounds.commit import round_state

    shapes = [["a.weight", [64, 64]], ["b.weight", [300, 70]]]
    models = [build_model(shapes, "float32") for _ in range(2)]
    workers = ThreadedWorkers(backend, models)
    tried: list[tuple[int, str, int]] = []
    for rank, real in enumerate(list(workers.loaders)):
        def trying(weights: list[tuple[str, torch.Tensor]], rank: int = rank, real: Any = real) -> None:
            node = round_state(workers.engines[rank])._staging
            if node is None or not node.is_stager:  # shm stages nothing of its own; gloo: a follower
                tried.extend((rank, name, _write_faults(tensor)) for name, tensor in weights)
            real(weights)
        workers.loaders[rank] = trying
    tensors = {name: torch.randn(shape) for name, shape in shapes}
    trainer = wtransfer.create_trainer(
        backend, client=workers, source=TensorSource(tensors),
        init_info={"world_size": workers.world_size, "timeout_s": TIMEOUT,
                   **({"master_address": "127.0.0.1"} if backend == "gloo" else {})})
    try:
        trainer.send_weights()
        assert tried and {signal_ for _, _, signal_ in tried} == {signal.SIGSEGV}, tried
        assert len({rank for rank, _, _ in tried}) == (2 if backend == "shm" else 1), tried
        for model in models:
            assert all(torch.equal(model.get_parameter(n), t) for n, t in tensors.items())
    finally:
        trainer.shutdown()
        workers.shutdown()


def _stager(key: str, pids: list[int]) -> int:
    """The index (in ``pids``) of the worker listening on its node's staging socket for trainer ``key``."""
    with open("/proc/net/unix") as listing:
        inodes = [line.split()[6] for line in listing
                  if line.split()[-1] == f"@wtransfer-stage-{key}" and line.split()[3] == "00010000"]
    assert len(inodes) == 1, inodes
    for index, pid in enumerate(pids):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inodes[0]}]":
                    return index
            except OSError:
                continue
    raise AssertionError(f"no worker holds the staging socket of {key}")


class _KillsStager:
    """The pool, with the node's stager killed by SIGKILL during round 2: as its tensors arrive (the
    trainer's source, half-way), or once every worker received the round and before the commit."""

    def __init__(self, pool: Any, when: str) -> None:
        self.pool, self.when, self.victim, self.rounds = pool, when, None, 0

    def kill(self) -> None:
        os.kill(self.pool.pids[self.victim], 9)
        self.pool.processes[self.victim].join(10)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def update_weights(self, info: dict) -> Any:
        self.rounds += 1
        replies = self.pool.update_weights(info)
        if self.rounds == 2 and self.when == "before commit":
            self.kill()
        return replies


@pytest.mark.parametrize("when", ["receiving", "before commit"])
def test_the_nodes_stager_dying_fails_the_round_and_the_next_lands_on_the_survivor_and_a_restarted_worker(
        when: str) -> None:
    """gloo, two workers on one node: one stages the atomic round for both. SIGKILLed mid-receive or
    between receive and commit, the round fails within ``timeout_s`` naming it, the survivor's model
    is untouched (round 1, bit for bit, version 1), and after a restart and ``reconnect()`` the next
    round lands bit-exact on both. Broken by: a follower that commits a round the transport did not
    bring whole, or a pool that commits on some workers while another is dead; a death noticed only
    at a timeout fails the time check."""
    import time

    model = trainer_model()
    with LocalWorkerPool(2, FACTORY, backend="gloo", factory_kwargs={"shapes": SHAPES, "dtype": "float32"},
                         timeout_s=TIMEOUT, torch_threads=1) as pool:
        client = _KillsStager(pool, when)
        source = FailingSource(model)
        trainer = send("gloo", client, source, "atomic", {})
        trainer.send_weights()
        v1 = digests(model)
        assert pool.digests() == [v1, v1]
        client.victim = _stager(trainer._staging_key, pool.pids)
        for parameter in model.parameters():
            parameter.data.add_(1.0)
        if when == "receiving":  # half-way through the source: the workers are receiving the round
            source.fail_at, source.on_fail = 0.5, client.kill
        started = time.monotonic()
        with pytest.raises(TransferError, match=f"local worker {client.victim}"):
            trainer.send_weights()
        assert time.monotonic() - started < TIMEOUT
        survivor = 1 - client.victim
        pool.restart(client.victim)
        assert pool.digests()[survivor] == v1, "the stager's death changed the survivor's model"
        assert pool.stats()[survivor]["weight_version"] == 1
        trainer.reconnect()
        # a failed commit spends its version (the trainer cannot tell which workers took it)
        assert trainer.send_weights()["version"] == (3 if when == "before commit" else 2)
        assert pool.digests() == [digests(model)] * 2
        trainer.shutdown()


# -- the framework layer, for an engine that knows nothing about it ------------------------------------
class HandEngine(wtransfer.WeightTransferEngine):
    """A third-party engine written against the seed API only: it calls ``load_weights`` per tensor and
    raises after ``fail_after`` of them. It never heard of staging or commit modes."""

    init_info_cls = dict  # type: ignore[assignment]
    update_info_cls = wtransfer.engines.ManifestUpdateInfo
    fail_after: int | None = None
    asks: bool = True
    """Whether it asks the framework's verdict before it writes (an engine may not)."""
    tensors: dict[str, torch.Tensor] = {}
    kept: list[Any] = []
    """Every loader it was handed (an engine may keep one past its round)."""

    def init_transfer_engine(self, init_info: Any) -> None:
        pass

    def receive_weights(self, update_info: Any, load_weights: Any) -> None:
        self.kept.append(load_weights)
        if self.asks:
            self.validate_round()  # the framework's verdict on the round, checked before this ran
        for index, entry in enumerate(update_info.parsed.entries):
            if self.fail_after is not None and index == self.fail_after:
                raise TransferError("link lost")
            load_weights([(entry.name, self.tensors[entry.name])])

    def shutdown(self) -> None:
        pass


def _update_dict(tensors: dict[str, torch.Tensor], version: int, mode: str) -> dict:
    from wtransfer.engines.rounds.manifest import CommitPlan, build_manifest, entry_for

    entries = [entry_for(n, t) for n, t in tensors.items()]
    return {"manifest": build_manifest(entries, version, None, CommitPlan(mode, os.urandom(6).hex(), 10.0)).to_dict()}


@pytest.mark.parametrize("commit", ["atomic", "streaming"])
def test_a_third_party_engine_gets_commit_modes_and_honest_state_unasked(commit: str) -> None:
    from wtransfer._registry.manager import plugin_manager

    shapes = [[f"w{i}", [32]] for i in range(6)]
    model = build_model(shapes, "float32")
    load = wtransfer.module_loader(model)
    engine = HandEngine(wtransfer.WeightTransferConfig(backend="hand"))
    failures: list[BaseException] = []

    class Recorder:
        @wtransfer.hookimpl
        def wtransfer_update_failed(self, error: BaseException) -> None:
            failures.append(error)

    recorder = Recorder()
    plugin_manager().register(recorder)
    try:
        HandEngine.tensors = {f"w{i}": torch.full((32,), 1.0) for i in range(6)}
        engine.receive_weights(engine.parse_update_info(_update_dict(HandEngine.tensors, 1, commit)), load)
        if commit == "atomic":
            assert all(float(p.sum()) == 0 for p in model.parameters()), "an atomic round wrote before commit"
        engine.finish_weight_update()
        assert engine.weight_version == 1 and all(float(p.sum()) == 32 for p in model.parameters())

        HandEngine.tensors = {f"w{i}": torch.full((32,), 2.0) for i in range(6)}
        HandEngine.fail_after = 3
        expected = WeightsTornError if commit == "streaming" else TransferError
        with pytest.raises(expected) as info:
            engine.receive_weights(engine.parse_update_info(_update_dict(HandEngine.tensors, 2, commit)), load)
        sums = [float(p.sum()) for p in model.parameters()]
        if commit == "atomic":
            assert sums == [32.0] * 6 and engine.weight_version == 1 and not engine.weights_torn
            assert "torn" not in str(info.value) and "weight_version stays" not in str(info.value)
            with pytest.raises(TransferError, match=r"without a completed receive_weights.*unchanged \(version 1\)"):
                engine.finish_weight_update()
        else:
            assert sums == [64.0] * 3 + [32.0] * 3  # three new tensors, three old: torn
            assert engine.weight_version is None and engine.weights_torn
            assert "the model is torn" in str(info.value) and "link lost" in str(info.value)
            with pytest.raises(TransferError, match="the model is torn"):
                engine.finish_weight_update()
        assert failures and failures[-1] is info.value
        HandEngine.fail_after = None
        engine.receive_weights(engine.parse_update_info(_update_dict(HandEngine.tensors, 3, commit)), load)
        engine.finish_weight_update()
        assert all(float(p.sum()) == 64 for p in model.parameters())
        assert engine.weight_version == 3 and not engine.weights_torn  # the round's version, not a count

        # The engine kept round 3's loader and writes through it after the round (a thread it left running):
        # refused, whichever way it writes, so the model keeps version 3 whole under that label.
        for stale in (HandEngine.kept[-1], HandEngine.kept[-2]):  # (round 2's too, which failed)
            with pytest.raises(TransferError, match="after its round's receive_weights"):
                stale([("w0", torch.full((32,), 9.0))])
            with pytest.raises(TransferError, match="after its round's receive_weights"):
                stale.destination("w1").fill_(9.0)
        assert all(float(p.sum()) == 64 for p in model.parameters())
        assert engine.weight_version == 3 and not engine.weights_torn

        # A round the framework refuses (its label does not go up), received by an engine that never asks the
        # verdict: its first write is refused, so the model keeps version 3 whole.
        HandEngine.asks, HandEngine.tensors = False, {f"w{i}": torch.full((32,), 3.0) for i in range(6)}
        with pytest.raises(ManifestMismatchError, match="Labels only go up"):
            engine.receive_weights(engine.parse_update_info(_update_dict(HandEngine.tensors, 3, commit)), load)
        assert all(float(p.sum()) == 64 for p in model.parameters())
        assert engine.weight_version == 3 and not engine.weights_torn
    finally:
        plugin_manager().unregister(recorder)
        HandEngine.fail_after, HandEngine.asks, HandEngine.kept = None, True, []
        engine.shutdown()


class _StallingEngine(HandEngine):
    """A hand engine whose round 1 stalls ``where`` (after its first tensor, or in the framework's check of the
    round before the engine runs) until ``resume`` is set: a thread left running after its client timed out."""

    stalled, resume = threading.Event(), threading.Event()
    where = "mid-stream"

    def receive_weights(self, update_info: Any, load_weights: Any) -> None:
        round_one = update_info.parsed.version == 1
        for index, entry in enumerate(update_info.parsed.entries):
            if round_one and index == 1 and self.where == "mid-stream":
                self._stall()
            load_weights([(entry.name, torch.full((32,), float(update_info.parsed.version)))])

    @classmethod
    def _stall(cls) -> None:
        cls.stalled.set()
        assert cls.resume.wait(TIMEOUT)


class _CheckingLoader:
    """``module_loader``, with a ``validate_manifest`` that stalls round 1 where :class:`_StallingEngine` says."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = wtransfer.module_loader(model)

    def validate_manifest(self, manifest: Manifest) -> None:
        if manifest.version == 1 and _StallingEngine.where == "in its check":
            _StallingEngine._stall()
        self.inner.validate_manifest(manifest)

    def destination(self, name: str) -> torch.Tensor | None:
        return self.inner.destination(name)

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.inner(weights)


@pytest.mark.parametrize("where", ["mid-stream", "in its check"])
@pytest.mark.parametrize("commit", ["atomic", "streaming"])
def test_a_round_left_running_on_another_thread_writes_nothing_once_a_later_round_began(commit: str,
                                                                                         where: str) -> None:
    """Round 1 is streamed on a thread that stalls ``where`` (its client timed out). The engine is shut down and
    initialised again, and round 2 (``commit``) lands. When round 1's thread resumes, its writes are refused and
    its call fails saying a later round superseded it: the model keeps round 2 whole, under label 2. Broken by:
    ending a round's loader only when its own call returns (round 1's second tensor then lands under label 2), or
    taking a round's token after its check ran (round 1 then holds round 2's loader)."""
    shapes = [[f"w{i}", [32]] for i in range(3)]
    model = build_model(shapes, "float32")
    load = _CheckingLoader(model)
    engine = _StallingEngine(wtransfer.WeightTransferConfig(backend="hand"))
    _StallingEngine.stalled.clear()
    _StallingEngine.resume.clear()
    _StallingEngine.where = where
    errors: list[BaseException] = []
    tensors = {f"w{i}": torch.zeros(32) for i in range(3)}

    def round_one() -> None:
        try:
            engine.receive_weights(engine.parse_update_info(_update_dict(tensors, 1, "streaming")), load)
        except BaseException as exc:
            errors.append(exc)

    stalled = threading.Thread(target=round_one)
    try:
        stalled.start()
        assert _StallingEngine.stalled.wait(TIMEOUT)
        engine.shutdown()  # the client timed out: the worker is shut down and joins again
        engine.init_transfer_engine({})
        engine.receive_weights(engine.parse_update_info(_update_dict(tensors, 2, commit)), load)
        engine.finish_weight_update()
        assert all(float(p.sum()) == 64 for p in model.parameters())
        _StallingEngine.resume.set()
        stalled.join(TIMEOUT)
        assert not stalled.is_alive()
        assert [float(p.sum()) for p in model.parameters()] == [64.0] * 3, "round 1 wrote after round 2 landed"
        assert (engine.weight_version, engine.weights_torn) == (2, False)
        assert len(errors) == 1 and "a later round began while this one was still being received" in str(errors[0])
        with pytest.raises(TransferError, match="without a completed receive_weights"):
            engine.finish_weight_update()  # round 1's client, back: nothing of round 1 commits
        assert [float(p.sum()) for p in model.parameters()] == [64.0] * 3 and engine.weight_version == 2
    finally:
        _StallingEngine.resume.set()
        stalled.join(TIMEOUT)
        _StallingEngine.where = "mid-stream"
        engine.shutdown()


class _SlowShutdownEngine(HandEngine):
    """A hand engine whose ``shutdown()`` takes a second, and whose round pauses after its first tensor."""

    paused = threading.Event()

    def receive_weights(self, update_info: Any, load_weights: Any) -> None:
        for index, entry in enumerate(update_info.parsed.entries):
            if index == 1:
                self.paused.set()
                time.sleep(0.3)
            load_weights([(entry.name, torch.full((32,), 1.0))])

    def shutdown(self) -> None:
        time.sleep(1.0)


def test_a_round_received_while_another_thread_shuts_the_engine_down_is_not_committed() -> None:
    """An atomic round whose receive ends while another thread's ``shutdown()`` is still running (its client
    timed out): the shutdown lets go of the staged copy, so the round must not be recorded as received. A later
    ``finish_weight_update()`` commits nothing, and the worker keeps version 0 whole. Broken by: recording the round
    once the shutdown ended without checking what it let go of (the commit then loads the released copy and the
    worker is torn)."""
    shapes = [[f"w{i}", [32]] for i in range(3)]
    model = build_model(shapes, "float32")
    engine = _SlowShutdownEngine(wtransfer.WeightTransferConfig(backend="hand"))
    _SlowShutdownEngine.paused.clear()
    errors: list[BaseException] = []
    tensors = {f"w{i}": torch.zeros(32) for i in range(3)}

    def receive() -> None:
        try:
            engine.receive_weights(engine.parse_update_info(_update_dict(tensors, 1, "atomic")),
                                   wtransfer.module_loader(model))
        except BaseException as exc:
            errors.append(exc)

    receiving = threading.Thread(target=receive)
    receiving.start()
    try:
        assert _SlowShutdownEngine.paused.wait(TIMEOUT)
        engine.shutdown()  # from this thread, while the round's receive ends
        receiving.join(TIMEOUT)
        assert not receiving.is_alive()
        assert errors and "was shut down during round 1" in str(errors[0]), errors
        with pytest.raises(TransferError, match="without a completed receive_weights"):
            engine.finish_weight_update()
        assert all(float(p.sum()) == 0 for p in model.parameters())
        assert (engine.weight_version, engine.weights_torn) == (0, False)
    finally:
        receiving.join(TIMEOUT)


def test_a_commit_that_fails_part_way_marks_the_worker_torn() -> None:
    shapes = [[f"w{i}", [16]] for i in range(4)]
    model = build_model(shapes, "float32")
    real = wtransfer.module_loader(model)

    class BreaksOnThird:
        validate_manifest = staticmethod(real.validate_manifest)

        def __call__(self, weights: list) -> None:
            for index, item in enumerate(weights):
                if index == 2:
                    raise MemoryError("device out of memory")
                real([item])

    engine = HandEngine(wtransfer.WeightTransferConfig(backend="hand"))
    HandEngine.tensors = {f"w{i}": torch.full((16,), 1.0) for i in range(4)}
    engine.receive_weights(engine.parse_update_info(_update_dict(HandEngine.tensors, 1, "atomic")), BreaksOnThird())
    with pytest.raises(WeightsTornError, match="from staging failed part-way"):
        engine.finish_weight_update()
    assert engine.weights_torn and engine.weight_version is None
    engine.shutdown()


def test_an_unknown_commit_mode_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="'atomic'.*'streaming'"):
        wtransfer.create_trainer("shm", client=object(), source={"w": torch.zeros(1)}, commit="two-phase")
    with pytest.raises(ValueError, match="commit mode 'eventual'"):
        Manifest.from_dict({"format": 2, "version": 1, "tensors": [], "commit": {"mode": "eventual", "key": "k", "timeout_s": 1}})


def test_a_control_plane_timeout_marks_the_trainer_broken_so_no_retry_overlaps_the_hung_call() -> None:
    shapes = [["w", [64]]]
    model = build_model(shapes, "float32")

    class SlowStart(ThreadedWorkers):
        """A control plane whose start call hangs past the trainer's timeout (then returns)."""

        hang = 0.0

        def start_weight_update(self) -> None:
            import time

            time.sleep(self.hang)
            super().start_weight_update()

    workers = SlowStart("shm", [model])
    trainer = wtransfer.create_trainer("shm", client=workers, source={"w": torch.ones(64)},
                                       init_info={"world_size": 2, "timeout_s": 1.0})
    try:
        trainer.send_weights()
        SlowStart.hang = 3.0
        with pytest.raises(wtransfer.TransferTimeoutError, match="start_weight_update"):
            trainer.send_weights()
        SlowStart.hang = 0.0
        with pytest.raises(TransferError, match="unusable after an earlier failure.*start_weight_update"):
            trainer.send_weights()
        assert workers.engines[0].weight_version == 1 and torch.equal(model.w, torch.ones(64))
    finally:
        trainer.shutdown()
        workers.shutdown()


def _as_another_user(key: str, pipe: Any) -> None:
    """In a child process that dropped to user 'nobody': try both sides of a node's staging."""
    import socket as socket_module

    from wtransfer.engines.rounds.staging import NodeStaging

    os.setuid(65534)
    outcome = {}
    try:
        NodeStaging(key)  # the name is taken by root's stager: follow it?
        outcome["follower"] = "followed a stager of another user"
    except TransferError as exc:
        outcome["follower"] = str(exc)
    raw = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    raw.connect(f"\0wtransfer-stage-{key}")  # straight to the stager, as a squatter's client would
    raw.settimeout(10)
    outcome["stager_closed"] = raw.recv(1) == b""
    pipe.send(outcome)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/net/unix"), reason="needs root to become another user")
def test_node_staging_refuses_other_users_on_both_sides() -> None:
    """Abstract socket names are visible host-wide: another user must neither map our staged
    weights (the stager closes its connection) nor feed them to us (a follower refuses it)."""
    import multiprocessing
    import secrets

    from wtransfer.engines.rounds.staging import NodeStaging

    key = secrets.token_hex(8)
    stager = NodeStaging(key)
    try:
        assert stager.is_stager
        context = multiprocessing.get_context("fork")
        ours, theirs = context.Pipe(duplex=False)
        child = context.Process(target=_as_another_user, args=(key, theirs))
        child.start()
        assert ours.poll(60), "the other user's process reported nothing"
        outcome = ours.recv()
        child.join(10)
    finally:
        stager.close()
    assert "held by a process of user id 0" in outcome["follower"], outcome
    assert outcome["stager_closed"] is True, outcome


def test_a_worker_waits_for_a_stager_caught_between_bind_and_listen() -> None:
    """The other worker has bound the node's staging name but does not listen yet (a busy host
    descheduled it there): this worker keeps trying and follows it once it listens. The election
    used to retry 50 times without a pause, over within microseconds, and failed the round
    ("could neither stage nor reach this node's stager") under a loaded CI host."""
    import secrets
    import socket

    from wtransfer.engines.rounds.staging import NodeStaging

    key = secrets.token_hex(8)
    stager = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stager.bind(f"\0wtransfer-stage-{key}")
    late = threading.Timer(0.3, stager.listen, args=(4,))
    late.start()
    node = None
    try:
        node = NodeStaging(key)
        assert not node.is_stager  # it follows the worker that bound the name first
        stager.settimeout(5)
        follower, _ = stager.accept()
        follower.close()
    finally:
        late.cancel()
        if node is not None:
            node.close()
        stager.close()


class _KeepsWhatItIsGiven:
    """A loader that keeps every tensor it is given (the contract says: valid during the call only) and fails its
    second round, so the worker's error holds frames whose locals view the engine's shared memory."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner, self.kept, self.calls = wtransfer.module_loader(model), [], 0

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.kept += [tensor for _, tensor in weights]
        if self.calls == 1:
            raise RuntimeError("the loader failed (injected)")
        self.inner(weights)

    def finish(self) -> None:
        self.calls += 1


@pytest.mark.parametrize("commit", ["atomic", "streaming"])
def test_tensors_a_worker_was_given_stay_readable_after_the_engine_closed(commit: str, caplog: Any) -> None:
    """Views of the ring or the staged copy that outlive their round (kept by a loader against the contract, or by
    the frames of a worker's error, which error reporters format with their locals) read zeros once the engine
    shut down: the shared memory was given back, and reading them must not crash the process (``mmap.close()``
    unmapped them under the live tensors: a segfault). Their address range goes with the last of them."""
    import logging
    import traceback

    caplog.set_level(logging.CRITICAL, logger="wtransfer")  # no log record keeps the workers' errors alive
    shapes = [["a.weight", [16, 16]], ["a.bias", [16]], ["b.weight", [30, 20]]]  # each whole in a 4 KiB bucket
    model = build_model(shapes, "float32")
    tensors = {name: torch.randn(shape) for name, shape in shapes}
    workers = ThreadedWorkers("shm", [model])
    loader = workers.loaders[0] = _KeepsWhatItIsGiven(model)
    trainer = wtransfer.create_trainer("shm", client=workers, source=TensorSource(tensors), commit=commit,
                                       init_info={"world_size": workers.world_size, "bucket_bytes": 4096,
                                                  "timeout_s": TIMEOUT})
    try:
        trainer.send_weights()
        loader.finish()
        with pytest.raises(TransferError):
            trainer.send_weights()
    finally:
        trainer.shutdown()
        workers.shutdown()
    error = workers.errors[0][-1]
    report = "".join(traceback.TracebackException.from_exception(error, capture_locals=True).format())
    assert "the loader failed (injected)" in report and "tensor(" in report  # formatted whole, locals and all
    assert len(loader.kept) > len(shapes)  # round 1's, and round 2's up to the failed call
    assert not any(t.any() for t in loader.kept)  # every byte read: zeros, the pages were given back


@pytest.mark.parametrize("commit", ["atomic", "streaming", "delta"])
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_conjugate_views_land_as_their_values_read(backend: str, commit: str) -> None:
    """A source may hand over lazy conjugate views (``z.conj()``), whose memory holds other values than they read.
    Each lands as it reads, whole in a bucket or split over several, and the trainer's digests agree. Those of
    32768 elements or more were copied as raw bytes, which torch refused ("view is not supported for conjugate
    view tensors"): the round failed."""
    shapes = [["whole", [40000], "complex64"], ["split", [200000], "complex64"]]
    model = build_model(shapes, "float32")
    z = torch.randn(200000, dtype=torch.complex64)
    tensors = {"whole": z[:40000].conj(), "split": z.conj()}
    assert all(t.is_conj() for t in tensors.values())
    workers = ThreadedWorkers(backend, [model])
    trainer = wtransfer.create_trainer(
        backend, client=workers, source=TensorSource(tensors), commit="atomic" if commit == "delta" else commit,
        delta=commit == "delta", checksums=True,
        init_info={"world_size": workers.world_size, "bucket_bytes": 1 << 20, "timeout_s": TIMEOUT,
                   **({"master_address": "127.0.0.1"} if backend == "gloo" else {})})
    try:
        for _ in range(2 if commit == "delta" else 1):  # a delta round is encoded from the second on
            z[:100] += 1
            trainer.send_weights()
            for name, tensor in tensors.items():
                assert torch.equal(model.get_parameter(name), tensor.resolve_conj()), name
    finally:
        trainer.shutdown()
        workers.shutdown()


class _ConjugateDestinations:
    """A loader whose ``destination(name)`` is a lazy conjugate view of its parameter: a tensor written there reads
    back as written (its parameter holds the conjugate), and a call copies through the same view."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def destination(self, name: str) -> torch.Tensor:
        return self.model.get_parameter(name).data.conj()

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.destination(name).copy_(tensor)


@pytest.mark.parametrize("commit", ["atomic", "streaming"])
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_loader_whose_destinations_are_conjugate_views_gets_the_values_sent(backend: str, commit: str) -> None:
    """Bytes written in place land in a destination's memory as they are, and a lazy view's memory holds other
    values than it reads: such a destination takes its tensors through the loader, whole or split over buckets,
    so each reads as sent (raw bytes into it would have failed the round, or left it the conjugate)."""
    shapes = [["whole", [40000], "complex64"], ["split", [200000], "complex64"]]
    model = build_model(shapes, "float32")
    tensors = {name: torch.randn(shape, dtype=torch.complex64) for name, shape, _ in shapes}
    workers = ThreadedWorkers(backend, [model])
    loader = workers.loaders[0] = _ConjugateDestinations(model)
    trainer = wtransfer.create_trainer(
        backend, client=workers, source=TensorSource(tensors), commit=commit,
        init_info={"world_size": workers.world_size, "bucket_bytes": 1 << 20, "timeout_s": TIMEOUT,
                   **({"master_address": "127.0.0.1"} if backend == "gloo" else {})})
    try:
        trainer.send_weights()
        for name, tensor in tensors.items():
            assert torch.equal(loader.destination(name), tensor), name
            assert torch.equal(model.get_parameter(name), tensor.conj()), name
    finally:
        trainer.shutdown()
        workers.shutdown()


def _mapping_at(address: int) -> str | None:
    """The line of ``/proc/self/maps`` whose range holds ``address`` (None: nothing is mapped there)."""
    for line in open("/proc/self/maps"):
        low, high = (int(end, 16) for end in line.split()[0].split("-"))
        if low <= address < high:
            return line.strip()
    return None


def _open_memfds() -> set[str]:
    return {entry for entry in Resources.now().memfds if entry.startswith("fd ")}


def test_a_closed_segment_gives_its_memory_back_at_once_and_its_range_with_the_last_view() -> None:
    """What ``close()`` promises, read from the kernel's view of this process: once the segment is closed its
    range no longer maps the memfd and no descriptor of it is open, though a view of it lives on, reads zeros and
    takes a late write without a crash; the view's range goes when the view goes. And a segment is never mapped past its file's end (the first read
    there was a SIGBUS)."""
    import gc

    from wtransfer.engines.rounds.staging import SharedSegment, create_memfd, map_shared

    small = create_memfd(4096, "wtransfer-test")
    try:
        with pytest.raises(ValueError, match="cannot map 8192 bytes of shared memory that holds 4096"):
            map_shared(small, 8192, writable=False)
    finally:
        os.close(small)
    gc.collect()  # no earlier test's segment closes between the two reads of the open descriptors
    fds = _open_memfds()
    segment = SharedSegment.create(1 << 20)
    segment.data.fill_(7)
    view, start = segment.data[4096:8192], segment.data.data_ptr()
    assert "/memfd:wtransfer-staging" in (_mapping_at(start) or "") and _open_memfds() - fds
    segment.close()
    released = _mapping_at(start)
    assert released is not None and "memfd" not in released and " rw-p " in released, released
    assert not _open_memfds() - fds, "a descriptor of the closed segment is still open"
    assert not view.any()  # the view reads zeros
    view[0] = 1  # and a late write stays its own
    assert int(view[0]) == 1 and _mapping_at(start) == released
    del view, segment
    gc.collect()
    assert _mapping_at(start) != released, "the range outlived its last view"


class _SlowLoader:
    """A worker's real loader that says when the commit begins loading, then takes ``seconds``; ``shutdown``: it
    shuts its own engine down first, on the committing thread (as a signal handler or a hook might). ``in_place``:
    it also offers ``destination()`` (slow in the same way from its second call), so the engine writes into the
    model's tensors."""

    def __init__(self, model: torch.nn.Module, seconds: float, shutdown: Any = None, in_place: bool = False) -> None:
        self.inner, self.loading = wtransfer.module_loader(model), threading.Event()
        self.seconds, self.shutdown = seconds, shutdown
        self.asked = 0
        if in_place:
            self.destination = self._destination

    def _slow(self) -> None:
        self.loading.set()
        if self.shutdown is not None:
            self.shutdown()
        time.sleep(self.seconds)

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self._slow()
        self.inner(weights)

    def _destination(self, name: str) -> torch.Tensor | None:
        self.asked += 1
        if self.asked > 1:  # the first tensor it returned may be written into by now
            self._slow()
        return self.inner.destination(name)


@pytest.mark.parametrize("backend, who", [("shm", "another thread"), ("shm", "another thread, past the wait"),
                                          ("shm", "the committing thread"), ("gloo", "the committing thread"),
                                          ("shm", "the receiving thread"), ("gloo", "the receiving thread"),
                                          ("shm", "another thread, mid-stream"), ("gloo", "another thread, mid-stream"),
                                          ("shm", "another thread, mid-stream, in place")])
def test_a_shutdown_during_a_commit_leaves_the_whole_round_or_says_torn(backend: str, who: str,
                                                                        monkeypatch: Any) -> None:
    """A client that timed out shuts the worker down (or rejoins a new trainer) while its commit still loads from
    the staged copy. From another thread the shutdown waits for the commit: the model holds the whole round under
    its label (releasing the copy under the commit loaded zeros under version 1). A commit stuck past
    ``SHUTDOWN_WAIT_S``, or a shutdown on the committing thread itself, has the copy released under it: the worker
    says torn instead of labelling what it loaded. Either way, once the round ends the worker holds no staged copy
    (gloo's is the node's own, in this process). A streamed round writes as it is received: from its first write
    the worker says torn (whether the engine hands tensors to its loader or writes into the ones ``destination()``
    returned), and stays so when its engine is shut down mid-round, by its loader or from another thread
    (whose shutdown then frees what the round reads, and the round fails saying so). Then a new trainer's round heals
    the worker: the model holds its values, bit for bit, under its label."""
    import wtransfer.engines.rounds.commit as commit

    monkeypatch.setattr(commit, "SHUTDOWN_WAIT_S", 0.2 if who == "another thread, past the wait" else 30.0)
    # (in place: every tensor larger than a bucket, so each is written where destination() says, none handed over)
    shapes = [["a.weight", [64, 64]], ["a.bias", [2048 if who.endswith("in place") else 64]], ["b.weight", [300, 70]]]
    model = build_model(shapes, "float32")
    tensors = {name: torch.randn(shape) for name, shape in shapes}
    before = _open_memfds()
    workers = ThreadedWorkers(backend, [model])
    engine = workers.engines[0]
    streamed = who == "the receiving thread" or "mid-stream" in who
    loader = workers.loaders[0] = _SlowLoader(model, 1.0 if "wait" in who else 0.5,
                                              None if who.startswith("another thread") else engine.shutdown,
                                              in_place=who.endswith("in place"))
    init_info = {"world_size": workers.world_size, "bucket_bytes": 4096, "timeout_s": TIMEOUT,
                 **({"master_address": "127.0.0.1"} if backend == "gloo" else {})}
    trainer = wtransfer.create_trainer(backend, client=workers, source=TensorSource(tensors), init_info=init_info,
                                       commit="streaming" if streamed else "atomic")
    outcome: list[Any] = []

    def send() -> None:
        try:
            outcome.append(trainer.send_weights())
        except TransferError as exc:
            outcome.append(exc)

    sending = threading.Thread(target=send)
    try:
        sending.start()
        assert loader.loading.wait(TIMEOUT)
        if streamed:  # written into mid-round: no one version's, whatever happens next
            assert (engine.weight_version, engine.weights_torn) == (None, True)
        if who.startswith("another thread"):
            engine.shutdown()  # mid-commit (or mid-stream), from another thread
        sending.join(TIMEOUT)
        assert not sending.is_alive() and workers.idle.wait(TIMEOUT)
        if who == "another thread":
            assert engine.weight_version == 1 and not engine.weights_torn
            assert not _holds_other_values(model, tensors) and isinstance(outcome[0], dict)
        else:
            assert engine.weight_version is None and engine.weights_torn, _holds_other_values(model, tensors)
            assert isinstance(outcome[0], TransferError)
        if streamed:  # the worker's own error says what happened
            assert "was shut down during round 1" in str(workers.errors[0][-1]), repr(workers.errors[0][-1])
        staged = {fd for fd in _open_memfds() - before if "wtransfer-staging" in fd}
        if backend == "gloo":  # the trainer (in this process too) stages nothing: only the worker's node did
            assert not staged, f"the shut-down worker still holds its staged copy: {staged}"
        trainer.shutdown()
        loader.shutdown, loader.seconds = None, 0.0
        healed = {name: tensor + 1 for name, tensor in tensors.items()}  # other values than any round's so far
        trainer = wtransfer.create_trainer(backend, client=workers, source=TensorSource(healed), init_info=init_info)
        stats = trainer.send_weights()
        assert not _holds_other_values(model, healed)
        assert (engine.weight_version, engine.weights_torn) == (stats["version"], False)
    finally:
        sending.join(TIMEOUT)
        trainer.shutdown()
        workers.shutdown()


def _holds_other_values(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, tensor in tensors.items() if not torch.equal(model.get_parameter(name), tensor)]


def test_a_worker_whose_trainer_aborts_a_streamed_round_says_so_and_takes_the_next_one() -> None:
    """shm: worker 1's loader fails mid-round and the trainer aborts the round. Worker 0 lets go of that trainer
    itself (not through shutdown(), which would blame a shutdown of its engine): its error names the abort, and both
    workers, torn, take a new trainer's round bit for bit."""
    shapes = [["a.weight", [64, 64]], ["b.weight", [300, 70]]]
    models = [build_model(shapes, "float32") for _ in range(2)]
    workers = ThreadedWorkers("shm", models)
    real = workers.loaders[1]

    def failing(weights: list[tuple[str, torch.Tensor]]) -> None:
        raise RuntimeError("out of memory (simulated)")

    workers.loaders[1] = failing
    tensors = {name: torch.randn(shape) for name, shape in shapes}
    init_info = {"world_size": workers.world_size, "bucket_bytes": 4096, "timeout_s": TIMEOUT}
    trainer = wtransfer.create_trainer("shm", client=workers, source=TensorSource(tensors), commit="streaming",
                                       init_info=init_info)
    try:
        with pytest.raises(TransferError):
            trainer.send_weights()
        assert workers.idle.wait(TIMEOUT)
        told = str(workers.errors[0][-1])
        assert "aborted" in told and "shut down during" not in told, told
        trainer.shutdown()
        workers.loaders[1] = real
        trainer = wtransfer.create_trainer("shm", client=workers, source=TensorSource(tensors), init_info=init_info)
        stats = trainer.send_weights()
        assert not any(_holds_other_values(model, tensors) for model in models)
        assert [(e.weight_version, e.weights_torn) for e in workers.engines] == [(stats["version"], False)] * 2
    finally:
        trainer.shutdown()
        workers.shutdown()

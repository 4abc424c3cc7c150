"""Real processes, real shared memory, real gloo groups: rounds, rejections, dead peers, leaks."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import wtransfer
from wtransfer.testing.models import build_model, digests, mutate
from wtransfer.engines.rounds.manifest import TensorEntry
from wtransfer.engines.rounds.source import TensorSource, WeightSource
from wtransfer._probes import PeakRss, open_fd_count
from wtransfer.errors import ManifestMismatchError, TransferError, WeightsTornError
from wtransfer._fork_server import worker_process
from wtransfer.local import LocalWorkerPool
from wtransfer.testing.conformance.engines import _shm_names, shm_left_since

FACTORY = "wtransfer.testing.models:worker_model"
TIMEOUT = 30.0

MIXED = [
    ["embed.weight", [300, 70], "float32"],  # 84000 bytes: split over buckets of 8 KiB
    ["layer.q.weight", [16, 16], "bfloat16"],
    ["layer.q.bias", [16], "float16"],
    ["layer.fp8a", [8, 8], "float8_e4m3fn"],
    ["layer.fp8b", [5, 3], "float8_e5m2"],
    ["layer.mask", [33], "bool"],
    ["layer.rot", [6], "complex64"],
    ["layer.rot2", [2, 2], "complex128"],
    ["layer.count", [4], "int64"],
    ["layer.i8", [9], "int8"],
    ["layer.scale", [], "float32"],
    ["layer.empty", [0, 4], "float16"],
    ["norm.weight", [70], "bfloat16"],
]




def pool_for(backend: str, shapes: list, workers: int = 2, **kwargs: Any) -> LocalWorkerPool:
    return LocalWorkerPool(
        workers, FACTORY, backend=backend, factory_kwargs={"shapes": shapes, "dtype": "float32"},
        timeout_s=TIMEOUT, torch_threads=1, **kwargs,
    )


def assert_workers_hold(pool: LocalWorkerPool, model: torch.nn.Module) -> None:
    expected = digests(model)
    for rank, got in enumerate(pool.digests()):
        assert got == expected, f"worker {rank} differs"


def checksummed_trainer(backend: str, pool: LocalWorkerPool, model: torch.nn.Module, extra: dict) -> Any:
    """A trainer with small buckets (tensors split across them) and checksums, for ``pool``'s workers."""
    init_info = {"world_size": pool.world_size, "bucket_bytes": 8192, "num_buffers": 2, "timeout_s": TIMEOUT}
    return wtransfer.create_trainer(backend, client=pool, source=model, init_info={**init_info, **extra},
                                    checksums=True)


CONFIGS = [
    ("shm", {}),
    ("gloo", {}),
    ("gloo", {"direct_min_bytes": 1024}),  # large tensors broadcast in place, straight into parameters
    ("gloo", {"direct_min_bytes": 1024, "channels": 3}),  # buckets spread over three groups
]


@pytest.mark.parametrize(("backend", "extra"), CONFIGS, ids=["shm", "gloo", "gloo-in-place", "gloo-3-channels"])
def test_two_workers_receive_every_round_bit_exactly(backend: str, extra: dict) -> None:
    before = _shm_names()
    model = build_model(MIXED, "float32", random=True)
    with pool_for(backend, MIXED) as pool:
        trainer = checksummed_trainer(backend, pool, model, extra)
        last_rounds: list[dict[str, float]] = []
        try:
            for round_index in range(1, 4):
                mutate(model, round_index)
                stats = trainer.send_weights()
                assert stats["version"] == round_index and stats["tensors"] == len(MIXED)
                assert stats["buckets"] > 10 and stats["bytes"] == sum(p.nbytes for p in model.parameters())
                assert_workers_hold(pool, model)
                workers = pool.stats()
                assert [s["weight_version"] for s in workers] == [round_index] * 2
                rounds = [s["round_seconds"] for s in workers]
                assert_phases_cover_the_round(stats, rounds)
                assert all(now != before for now, before in zip(rounds, last_rounds)), "a worker's phases are stale"
                last_rounds = rounds
        finally:
            trainer.shutdown()
            trainer.shutdown()  # idempotent
    assert shm_left_since(before) == []  # another test beside this one may hold its own for a while


def assert_phases_cover_the_round(stats: dict[str, Any], workers: list[dict[str, float]]) -> None:
    """This round's phases, not a running total: the trainer's follow one another and fill its round; its pack
    and wait lie within its send; each worker's receive and load (an atomic commit) lie within the round."""
    phases, seconds = stats["phases"], stats["seconds"]
    steps = sum(phases[name] for name in ("plan", "start", "send", "commit"))
    assert 0.8 * seconds <= steps <= seconds, (phases, seconds)
    assert 0 < phases["pack"] and 0 < phases["wait"] and phases["pack"] + phases["wait"] <= phases["send"], phases
    for worker in workers:
        assert set(worker) == {"receive", "stage", "load", "finish"}, worker
        assert worker["receive"] + worker["stage"] <= phases["send"] and worker["load"] <= phases["commit"], (worker, phases)


@pytest.mark.parametrize(("backend", "extra"), [("shm", {}), ("gloo", {}), ("gloo", {"direct_min_bytes": 1024})],
                         ids=["shm", "gloo", "gloo-in-place"])
def test_a_digest_mismatch_fails_the_round_and_every_worker_keeps_its_weights(
    backend: str, extra: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers hash what they received and compare with the trainer's digests before the round
    commits: one wrong digest (what corruption in transit looks like to them) fails the round, and
    every worker still holds the last round's weights, compared value by value. (The trainer runs in
    this process, the workers in their own: only the trainer's digests are made wrong.)"""
    from wtransfer.engines.rounds.digests import RoundDigests

    model = build_model(MIXED, "float32", random=True)
    with pool_for(backend, MIXED) as pool:
        trainer = checksummed_trainer(backend, pool, model, extra)
        try:
            trainer.send_weights()
            kept = {name: p.detach().clone() for name, p in model.named_parameters()}
            mutate(model, 2)
            honest = RoundDigests.digests

            def one_wrong(self: RoundDigests) -> list[int]:
                values = honest(self)
                values[0] ^= 1  # embed.weight: split over many buckets
                return values

            monkeypatch.setattr(RoundDigests, "digests", one_wrong)
            with pytest.raises(TransferError, match="checksum mismatch for 'embed.weight'"):
                trainer.send_weights()
            from wtransfer.engines.wire import tensor_checksum

            expected = {name: tensor_checksum(tensor) for name, tensor in kept.items()}
            assert expected != digests(model)  # round 2 carried new values
            for rank, got in enumerate(pool.digests()):
                assert got == expected, f"worker {rank} changed"
            assert [s["weight_version"] for s in pool.stats()] == [1, 1]
        finally:
            trainer.shutdown()


class Recorder:
    def __init__(self) -> None:
        self.created: list[Any] = []
        self.finished: list[dict] = []
        self.failed: list[BaseException] = []

    @wtransfer.hookimpl
    def wtransfer_engine_created(self, engine: Any) -> None:
        self.created.append(engine)

    @wtransfer.hookimpl
    def wtransfer_update_finished(self, stats: dict) -> None:
        self.finished.append(stats)

    @wtransfer.hookimpl
    def wtransfer_update_failed(self, error: BaseException) -> None:
        self.failed.append(error)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_mismatched_manifest_is_rejected_before_anything_is_written(backend: str) -> None:
    from wtransfer._registry.manager import plugin_manager

    shapes = [["a.weight", [64, 8]], ["a.bias", [8]], ["b.weight", [4, 4]]]
    tensors = {"a.weight": torch.randn(64, 8), "a.bias": torch.randn(9), "b.weight": torch.randn(4, 4),
               "extra": torch.randn(3)}  # fmt: skip
    recorder = Recorder()
    plugin_manager().register(recorder)
    try:
        with pool_for(backend, shapes) as pool:
            zero = pool.digests()
            trainer = wtransfer.create_trainer(
                backend, client=pool, source=TensorSource(tensors),
                init_info={"world_size": pool.world_size, "bucket_bytes": 4096, "timeout_s": TIMEOUT},
            )
            assert recorder.created == [trainer]
            started = time.monotonic()
            with pytest.raises(ManifestMismatchError) as info:
                trainer.send_weights()
            assert time.monotonic() - started < 10
            message = str(info.value)
            assert "shape [9] != model [8] (1 tensor): 'a.bias'" in message and "unknown tensor, not" in message
            assert "worker 0" in message and "worker 1" in message
            assert pool.digests() == zero  # nothing written
            assert [s["weight_version"] for s in pool.stats()] == [0, 0]
            assert recorder.failed and isinstance(recorder.failed[-1], ManifestMismatchError)
            # A clean rejection leaves the engines usable: fix the source and go on.
            tensors["a.bias"] = torch.randn(8)
            del tensors["extra"]
            stats = trainer.send_weights()
            assert stats["version"] == 1 and recorder.finished == [stats]
            assert [s["weight_version"] for s in pool.stats()] == [1, 1]
            trainer.shutdown()
    finally:
        plugin_manager().unregister(recorder)


class KillingSource(WeightSource):
    """Signals a process (SIGKILL) while the trainer is mid-round, after ``at`` tensors of round ``round``."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], pid: int, at: int, round: int = 1, sig: int = signal.SIGKILL
    ) -> None:
        self.inner = TensorSource(tensors)
        self.pid, self.at, self.round, self.rounds, self.sig = pid, at, round, 0, sig

    def metadata(self) -> list[TensorEntry]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.rounds += 1
        for index, item in enumerate(self.inner):
            if index == self.at and self.rounds == self.round:
                os.kill(self.pid, self.sig)
            yield item


def _big_tensors(count: int = 40) -> dict[str, torch.Tensor]:
    return {f"w{i}.weight": torch.full((256, 256), float(i)) for i in range(count)}  # 256 KiB each


class RestartingClient:
    """A user's client that restarts its workers behind the same object (``reconnect()`` with no client)."""

    def __init__(self, pool: LocalWorkerPool) -> None:
        self.pool = pool

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Any:
        return self.pool.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> Any:
        return self.pool.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> Any:
        return self.pool.update_weights(update_info)

    def finish_weight_update(self) -> Any:
        return self.pool.finish_weight_update()


def _fds_with_process_helpers_running() -> int:
    """Open descriptors, once the fork server runs: it keeps a socket for good, and started by a pool inside a
    test (when it runs first) it would count as that test's leak."""
    from wtransfer._fork_server import _environment, _server

    _server(_environment())
    return open_fd_count()


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_worker_killed_mid_round_fails_the_trainer_within_the_timeout(backend: str) -> None:
    """...and the same trainer moves whole rounds again once its client's workers are back
    (``reconnect()``), after a reconnect that failed because they were not back yet."""
    fds_before = _fds_with_process_helpers_running()
    tensors = _big_tensors()
    shapes = [[name, list(t.shape)] for name, t in tensors.items()]
    with pool_for(backend, shapes) as pool:
        client = RestartingClient(pool)
        victim = pool.processes[1].pid
        source = KillingSource(tensors, victim, at=20, round=2)
        trainer = wtransfer.create_trainer(
            backend, client=client, source=source,
            init_info={"world_size": pool.world_size, "bucket_bytes": 256 * 1024, "timeout_s": TIMEOUT},
        )
        trainer.send_weights()
        started = time.monotonic()
        with pytest.raises(TransferError) as info:
            trainer.send_weights()
        assert time.monotonic() - started < TIMEOUT - 5, "noticed by the timeout, not by the death"
        assert "died" in str(info.value) or "disconnected" in str(info.value) or "gone" in str(info.value)
        assert trainer.weight_version == 1
        with pytest.raises(TransferError, match="unusable after an earlier failure.*reconnect"):
            trainer.send_weights()
    try:
        with pytest.raises(TransferError, match="pool was shut down"):  # workers not back: the rendezvous fails...
            trainer.reconnect()
        with pytest.raises(TransferError, match=r"reconnect\(\) failed.*call reconnect\(\)"):
            trainer.send_weights()  # ...and the trainer says so, still open
        with pool_for(backend, shapes) as restarted:  # the workers come back (new processes, zeros)
            client.pool = restarted
            trainer.reconnect()
            stats = trainer.send_weights()
            assert stats["version"] == 2  # the failed round took no version
            from wtransfer.engines.wire import tensor_checksum

            expected = {name: tensor_checksum(t) for name, t in tensors.items()}
            assert all(got == expected for got in restarted.digests())
    finally:
        trainer.shutdown()
    settled = time.monotonic() + 10  # a client call may still be winding down in its thread
    while open_fd_count() > fds_before and time.monotonic() < settled:
        time.sleep(0.1)
    assert open_fd_count() <= fds_before, "a transport of the failed round or reconnect was not released"
    with pytest.raises(TransferError, match="was shut down; create a new one"):
        trainer.reconnect()


class ImpatientClient(RestartingClient):
    """A user's client with its own, shorter deadline for a round's update call (an RPC timeout)."""

    def __init__(self, pool: LocalWorkerPool, patience_s: float) -> None:
        super().__init__(pool)
        self.patience_s = patience_s

    def update_weights(self, update_info: dict[str, Any]) -> Any:
        import concurrent.futures

        calls = concurrent.futures.ThreadPoolExecutor(1)
        try:
            return calls.submit(self.pool.update_weights, update_info).result(timeout=self.patience_s)
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError from Python 3.11 on only
            raise TimeoutError(f"the workers did not finish update_weights within {self.patience_s:g} s") from None
        finally:
            calls.shutdown(wait=False)


def _beyond_socket_buffers() -> int:
    """Bytes a round must carry so that a stopped worker's sockets (two gloo channels, send and receive
    buffers at their largest) cannot hold it all: the trainer then blocks sending to that worker."""
    largest = 0
    for name in ("tcp_wmem", "tcp_rmem"):
        try:
            with open(f"/proc/sys/net/ipv4/{name}") as sysctl:
                largest += int(sysctl.read().split()[-1])
        except OSError:  # not Linux: the kernel's defaults are far below 64 MiB
            pass
    return max(64 << 20, 2 * 2 * largest)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_round_ends_when_the_client_fails_even_if_no_socket_closes(backend: str, caplog) -> None:
    """A worker stops mid-round without closing anything (a hung process; a child holding its sockets), and
    the client says so after its own deadline: the trainer raises then (the client's deadline, a grace for
    the collective, the groups' release), not at its transport's timeout. Nothing stays open once the
    stopped worker is gone."""
    size = _beyond_socket_buffers()
    if size > 512 << 20:
        pytest.skip(f"this host's socket buffers hold {size >> 22} MiB a round: too large to outgrow here")
    tensors = {f"w{i}.weight": torch.full((256, 1024), float(i)) for i in range(size >> 20)}  # 1 MiB each
    shapes = [[name, list(t.shape)] for name, t in tensors.items()]
    fds_before = _fds_with_process_helpers_running()
    with pool_for(backend, shapes) as pool:
        victim = pool.processes[1].pid
        source = KillingSource(tensors, victim, at=8, round=2, sig=signal.SIGSTOP)
        trainer = wtransfer.create_trainer(
            backend, client=ImpatientClient(pool, patience_s=2.0), source=source,
            init_info={"world_size": pool.world_size, "bucket_bytes": 1 << 20, "timeout_s": TIMEOUT},
        )
        try:
            trainer.send_weights()
            started = time.monotonic()
            with pytest.raises((TransferError, TimeoutError)):
                trainer.send_weights()
            elapsed = time.monotonic() - started
            assert elapsed < TIMEOUT / 2, f"the trainer waited {elapsed:.1f} s: its transport's timeout, not the client"
            assert trainer.weight_version == 1
            if backend == "gloo":  # the trainer was blocked sending to the stopped worker, as meant
                assert "still closing" in caplog.text
        finally:
            os.kill(victim, signal.SIGKILL)  # the pool's call in flight ends
            trainer.shutdown()
            pool.shutdown(timeout=1.0)  # the survivor may wait on the stopped peer until its own timeout
    settled = time.monotonic() + 10  # the failed round's groups close once their send to the victim ends
    while open_fd_count() > fds_before and time.monotonic() < settled:
        time.sleep(0.1)
    assert open_fd_count() <= fds_before, "a transport of the failed round was not released"


# -- a trainer killed mid-round, with the user's own WeightSyncClient over a pipe -------------------------
class PipeClient:
    """A user's own control plane: JSON requests to the worker process, which answers after each step."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def _call(self, op: str, info: Any = None) -> Any:
        self.conn.send_bytes(json.dumps({"op": op, "info": info}).encode())
        reply = json.loads(self.conn.recv_bytes())
        if not reply["ok"]:
            raise TransferError(f"worker: {reply['error']}")
        return reply

    def init_weight_transfer_engine(self, init_info: dict) -> Any:
        return self._call("init", init_info)

    def start_weight_update(self) -> Any:
        return self._call("start")

    def update_weights(self, update_info: dict) -> Any:
        return self._call("update", update_info)

    def finish_weight_update(self) -> Any:
        return self._call("finish")


def _trainer_main(conn: Any, backend: str, kill: bool) -> None:
    """A trainer process: two good rounds, then (if ``kill``) SIGKILLs itself mid-way through the third."""
    tensors = _big_tensors()
    source = KillingSource(tensors, os.getpid(), at=20 if kill else 10**9, round=3)
    trainer = wtransfer.create_trainer(
        backend, client=PipeClient(conn), source=source,
        init_info={"world_size": 2, "bucket_bytes": 256 * 1024, "timeout_s": TIMEOUT},
    )
    assert isinstance(PipeClient(conn), wtransfer.WeightSyncClient)
    for round_index in range(3):
        for tensor in tensors.values():
            tensor.add_(1)
        trainer.send_weights()
    trainer.shutdown()
    conn.send_bytes(json.dumps({"op": "done"}).encode())


def _serve_worker(conn: Any, backend: str) -> tuple[Any, torch.nn.Module, list[BaseException]]:
    """The worker side of PipeClient, in this test process: a real engine and model."""
    tensors = _big_tensors()
    model = build_model([[name, list(t.shape)] for name, t in tensors.items()], "float32")
    engine = wtransfer.WeightTransferEngineFactory.create_engine(
        wtransfer.WeightTransferConfig(backend=backend), wtransfer.ParallelConfig()
    )
    load = wtransfer.module_loader(model)
    errors: list[BaseException] = []
    while conn.poll(TIMEOUT * 2):
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            break
        op, info = request["op"], request.get("info")
        if op == "done":
            break
        try:
            if op == "init":
                engine.init_transfer_engine(engine.parse_init_info(info))
            elif op == "start":
                engine.start_weight_update()
            elif op == "update":
                engine.receive_weights(engine.parse_update_info(info), load)
            elif op == "finish":
                engine.finish_weight_update()
            reply = {"ok": True}
        except Exception as exc:
            errors.append(exc)
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        try:
            conn.send_bytes(json.dumps(reply).encode())
        except OSError:
            break
    return engine, model, errors


@pytest.mark.parametrize("backend", ["shm", "gloo"])
@pytest.mark.parametrize("kill", [False, True], ids=["own-client", "trainer-killed"])
def test_own_client_and_a_trainer_killed_mid_round(backend: str, kill: bool) -> None:
    before = _shm_names()
    parent, child = multiprocessing.Pipe()
    trainer = worker_process(_trainer_main, (child, backend, kill))
    trainer.start()
    child.close()
    started = time.monotonic()
    try:
        engine, model, errors = _serve_worker(parent, backend)
    finally:
        trainer.join(TIMEOUT)
        if trainer.is_alive():
            trainer.kill()
    try:
        assert time.monotonic() - started < TIMEOUT * 2
        if kill:
            assert trainer.exitcode == -signal.SIGKILL
            assert len(errors) == 1 and isinstance(errors[0], TransferError), errors
            assert engine.weight_version == 2  # the interrupted round did not count
        else:
            assert trainer.exitcode == 0 and errors == []
            assert engine.weight_version == 3
            expected = {f"w{i}.weight": torch.full((256, 256), float(i + 3)) for i in range(40)}
            assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
    finally:
        engine.shutdown()
        engine.shutdown()
    assert shm_left_since(before) == []  # another test beside this one may hold its own for a while


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_hundred_rounds_keep_fds_and_memory_flat(backend: str) -> None:
    shapes = [[f"t{i}.weight", [64, 256]] for i in range(6)]
    model = build_model(shapes, "float32", random=True)
    with pool_for(backend, shapes, workers=1) as pool:
        trainer = wtransfer.create_trainer(
            backend, client=pool, source=model,
            init_info={"world_size": 2, "bucket_bytes": 64 * 1024, "timeout_s": TIMEOUT},
        )
        rss = PeakRss()
        samples: dict[int, tuple[int, int, list[dict]]] = {}
        for round_index in range(1, 101):
            mutate(model, round_index)
            trainer.send_weights()
            if round_index in (10, 100):
                samples[round_index] = (open_fd_count(), rss.current(), pool.stats())
        assert_workers_hold(pool, model)
        trainer.shutdown()
    (fds10, rss10, workers10), (fds100, rss100, workers100) = samples[10], samples[100]
    assert fds100 == fds10
    assert rss100 - rss10 < 16 << 20
    assert workers100[0]["fds"] == workers10[0]["fds"]
    assert workers100[0]["rss"] - workers10[0]["rss"] < 16 << 20
    assert workers100[0]["weight_version"] == 100


class ThreadClient:
    """Another user-style client: the worker engine lives in this process, each call runs to completion."""

    def __init__(self, backend: str, model: torch.nn.Module, load_weights: Any) -> None:
        self.engine = wtransfer.WeightTransferEngineFactory.create_engine(
            wtransfer.WeightTransferConfig(backend=backend), wtransfer.ParallelConfig()
        )
        self.load_weights = load_weights

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(json.loads(json.dumps(init_info))))

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.engine.receive_weights(self.engine.parse_update_info(json.loads(json.dumps(update_info))), self.load_weights)

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()


@pytest.mark.parametrize("commit", ["streaming", "atomic"])
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_worker_whose_loader_fails_stops_the_round_at_once_and_says_torn(backend: str, commit: str) -> None:
    """The loader raises at its third tensor: mid-round when streaming, during the commit when atomic.
    Either way part of the model was written, so the worker must say it is torn."""
    tensors = _big_tensors(12)
    model = build_model([[name, list(t.shape)] for name, t in tensors.items()], "float32")
    loader = wtransfer.module_loader(model)
    loaded = []

    def failing_loader(batch: list) -> None:
        for item in batch:
            if len(loaded) == 2:
                raise RuntimeError("disk full while loading")
            loader([item])
            loaded.append(item[0])

    failing_loader.validate_manifest = loader.validate_manifest  # type: ignore[attr-defined]
    client = ThreadClient(backend, model, failing_loader)
    trainer = wtransfer.create_trainer(
        backend, client=client, source=tensors, commit=commit,
        init_info={"world_size": 2, "bucket_bytes": 256 * 1024, "num_buffers": 2, "timeout_s": TIMEOUT,
                   **({"direct_min_bytes": None} if backend == "gloo" else {})},
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(WeightsTornError, match="disk full") as info:
        trainer.send_weights()
    assert "the model is torn" in str(info.value)
    assert time.monotonic() - started < 10
    written = [name for name, p in model.named_parameters() if torch.equal(p, tensors[name])]
    assert written == loaded and len(written) == 2  # exactly what the loader wrote before it failed
    assert client.engine.weight_version is None and client.engine.weights_torn
    assert trainer.weight_version == 0
    trainer.shutdown()
    client.engine.shutdown()


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_stalled_worker_times_out_instead_of_hanging(backend: str) -> None:
    tensors = _big_tensors(24)
    shapes = [[name, list(t.shape)] for name, t in tensors.items()]
    with pool_for(backend, shapes, workers=1) as pool:
        victim = pool.processes[0].pid
        source = KillingSource(tensors, victim, at=12, round=1, sig=signal.SIGSTOP)
        trainer = wtransfer.create_trainer(
            backend, client=pool, source=source,
            init_info={"world_size": 2, "bucket_bytes": 256 * 1024, "num_buffers": 2, "timeout_s": 3.0},
        )
        started = time.monotonic()
        try:
            with pytest.raises(TransferError) as info:
                trainer.send_weights()
            elapsed = time.monotonic() - started
        finally:
            os.kill(victim, signal.SIGCONT)
        # The trainer's own 3 s timeout fired (plus up to 3 s waiting for the client's own error),
        # long before the pool's 30 s one could.
        assert isinstance(info.value, wtransfer.TransferTimeoutError), repr(info.value)
        assert elapsed < 15, (elapsed, repr(info.value))
        trainer.shutdown()


def test_a_worker_refuses_wire_parameters_it_cannot_honour_at_init() -> None:
    shapes = [["a.weight", [4, 4]]]
    with pool_for("shm", shapes, workers=1, engine_options={"max_buffer_bytes": 1 << 20}) as pool:
        with pytest.raises(ValueError, match="max_buffer_bytes=1048576"):
            wtransfer.create_trainer(
                "shm", client=pool, source={"a.weight": torch.zeros(4, 4)},
                init_info={"world_size": 2, "bucket_bytes": 1 << 20, "num_buffers": 2, "timeout_s": TIMEOUT},
            )
        trainer = wtransfer.create_trainer(  # within the worker's limit: fine
            "shm", client=pool, source={"a.weight": torch.ones(4, 4)},
            init_info={"world_size": 2, "bucket_bytes": 1 << 19, "num_buffers": 2, "timeout_s": TIMEOUT},
        )
        trainer.send_weights()
        assert pool.stats()[0]["weight_version"] == 1
        trainer.shutdown()


def test_the_local_pool_explains_factories_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="module-level function"):
        LocalWorkerPool(1, lambda: torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="cannot import the model factory 'nowhere.models:make'"):
        LocalWorkerPool(1, "nowhere.models:make", start_timeout_s=TIMEOUT)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
@pytest.mark.parametrize("tensors", [{}, {"e": torch.empty(0, 3)}, {"s": torch.tensor(1.5)}], ids=["none", "empty", "0-dim"])
def test_degenerate_rounds(backend: str, tensors: dict[str, torch.Tensor]) -> None:
    model = torch.nn.Module()
    for name, tensor in tensors.items():
        model.register_parameter(name, torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False))
    client = ThreadClient(backend, model, wtransfer.module_loader(model))
    trainer = wtransfer.create_trainer(
        backend, client=client, source=tensors,
        init_info={"world_size": 2, "num_buffers": 1, "bucket_bytes": 4096, "timeout_s": TIMEOUT},
    )
    assert trainer.send_weights()["tensors"] == len(tensors)
    assert client.engine.weight_version == 1
    assert all(torch.equal(p, tensors[n]) for n, p in model.named_parameters())
    trainer.shutdown()
    client.engine.shutdown()


@pytest.mark.parametrize(
    ("backend", "reason"),
    [("shm", r"returned after 1 joined"), ("gloo", r"but 1 joined \(rank\(s\) \[1\]\) and no other in 10 s")],
)
def test_a_world_size_larger_than_the_workers_is_found_at_once(backend: str, reason: str) -> None:
    # One worker, world_size 5: waiting for timeout_s (120 s here) and then blaming ranks 2-4
    # would tell the user nothing. shm: the client's init call returns after one joined;
    # gloo: the worker blocks in the group, but no other joins.
    with pool_for(backend, MIXED[:1], workers=1) as pool:
        started = time.monotonic()
        with pytest.raises(TransferError, match=r"world_size=5 expects 4 worker\(s\).*" + reason):
            wtransfer.create_trainer(backend, client=pool, source={}, init_info={"world_size": 5, "timeout_s": 120})
        assert time.monotonic() - started < 30
        # the worker is not left hanging in the group either: it fails and can be re-used
        worker_error = pool.request("stats")[0]
        assert worker_error["weight_version"] == 0


class RecordingPool(LocalWorkerPool):
    """A pool that keeps the last ``init_info`` its workers were given (the rendezvous address, the token)."""

    seen: dict[str, Any] = {}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> list[dict[str, Any]]:
        self.seen = dict(init_info)
        return super().init_weight_transfer_engine(init_info)


def test_the_gloo_rendezvous_answers_only_holders_of_the_round_token() -> None:
    # torch's TCPStore would hand every key to anyone who connects (list_keys) and take
    # writes from them; the trainer's rendezvous must not.
    import datetime

    from torch.distributed import DistNetworkError, TCPStore

    from wtransfer.engines.channel.rendezvous import RendezvousClient

    model = build_model(MIXED, "float32", random=True, seed=3)
    with RecordingPool(1, FACTORY, backend="gloo", factory_kwargs={"shapes": MIXED, "dtype": "float32"},
                       timeout_s=TIMEOUT, torch_threads=1) as pool:  # fmt: skip
        with wtransfer.create_trainer("gloo", client=pool, source=model, init_info={"world_size": 2}) as trainer:
            address, port, token = pool.seen["master_address"], pool.seen["master_port"], pool.seen["token"]
            assert len(token) >= 32
            with pytest.raises(TransferError, match="does not hold this round's token"):
                RendezvousClient.connect(address, port, "0" * 32, timeout_s=5)
            # torch's own client is hung up on (a reset if its next message was already on the way)
            with pytest.raises(DistNetworkError, match="Connection was likely closed|Connection reset by peer"):
                TCPStore(address, port, None, False, datetime.timedelta(seconds=3)).list_keys()
            holder = RendezvousClient.connect(address, port, token, timeout_s=5)
            assert holder.check(["wtransfer/gloo//joined/1"])  # the holder of the token does see the group
            holder.close()
            mutate(model, 1)
            trainer.send_weights()  # the outsiders changed nothing
            assert_workers_hold(pool, model)


def _status(field: str) -> int:
    """This process's ``VmRSS`` (KiB) or ``Threads`` from /proc/self/status."""
    for line in open("/proc/self/status").read().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_strangers_at_the_gloo_rendezvous_cost_little_and_change_no_round() -> None:
    """40 connections to the trainer's rendezvous each announce a 64 MiB frame and send its bytes
    as fast as the trainer reads them; 8 more trickle a byte a second. Rounds sent meanwhile land
    bit-exact, and the trainer (this process) grows by a few MiB and 16 threads at most: before
    the limits it buffered every frame, +1.5 GiB and a thread per connection."""
    import socket
    import struct
    import threading

    model = build_model(MIXED, "float32", random=True, seed=4)
    with RecordingPool(2, FACTORY, backend="gloo", factory_kwargs={"shapes": MIXED, "dtype": "float32"},
                       timeout_s=TIMEOUT, torch_threads=1) as pool:  # fmt: skip
        with wtransfer.create_trainer("gloo", client=pool, source=model, init_info={"world_size": 3}) as trainer:
            trainer.send_weights()
            rss, threads = _status("VmRSS"), _status("Threads")
            stop = threading.Event()
            chunk = b"\0" * (1 << 20)

            def flood() -> None:
                with socket.create_connection((pool.seen["master_address"], pool.seen["master_port"]), timeout=5) as sock:
                    sock.settimeout(0.5)
                    try:
                        sock.sendall(struct.pack("!I", 64 << 20))
                        for _ in range(63):  # one MiB short of the frame: it never completes
                            if stop.is_set():
                                return
                            sock.sendall(chunk)
                    except OSError:
                        return  # dropped by the trainer: what should happen

            def trickle() -> None:
                with socket.create_connection((pool.seen["master_address"], pool.seen["master_port"]), timeout=5) as sock:
                    try:
                        while not stop.wait(1.0):
                            sock.sendall(b"{")
                    except OSError:
                        return

            attackers = [threading.Thread(target=flood) for _ in range(40)]
            attackers += [threading.Thread(target=trickle) for _ in range(8)]
            for thread in attackers:
                thread.start()
            try:
                for step in range(3):
                    mutate(model, step + 1)
                    trainer.send_weights()
                    assert_workers_hold(pool, model)
                grown_mib, more_threads = (_status("VmRSS") - rss) / 1024, _status("Threads") - threads
            finally:
                stop.set()
                for thread in attackers:
                    thread.join(30)
            print(f"trainer under 48 hostile connections: RSS +{grown_mib:.1f} MiB, threads +{more_threads} "
                  f"(attacker threads still running included)")
            assert grown_mib < 64, grown_mib
            assert more_threads <= 48 + 16 + 4, more_threads  # the attackers' threads + 16 handshakes + slack


def test_strangers_at_the_shm_rendezvous_are_dropped_and_the_round_goes_on(caplog: Any) -> None:
    """While the workers are asked to join, local processes that are not workers connect to the
    trainer's (visible) socket: an HTTP request, a stray op, ``ready`` from nobody, a frame
    announcing 64 MiB, one of 64 KiB (more than a stranger may send), a hello with a wrong token, and, run as root, a process of another user.
    Each is dropped and logged; the rendezvous completes and the round is bit-exact."""
    import logging
    import socket
    import struct

    def frame(message: dict[str, Any]) -> bytes:
        payload = json.dumps(message).encode()
        return struct.pack("!I", len(payload)) + payload

    junk = [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", frame({"op": "bogus"}), frame({"op": "ready"}),
            struct.pack("!I", 64 << 20) + b"\0" * 4096, struct.pack("!I", 64 << 10) + b"\0" * (64 << 10),
            frame({"op": "hello", "rank": 1, "token": "0" * 32, "protocol_version": 0})]
    other_user = os.getuid() == 0  # root can switch to another user; others cannot

    class HostilePool(LocalWorkerPool):
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> list[dict[str, Any]]:
            target = "\0" + init_info["address"][1:]
            sockets = []
            for data in junk:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(target)
                sock.sendall(data)
                sockets.append(sock)
            if other_user:  # a forked child turned into user 65534 ("nobody"): no exec, no file access needed
                child = os.fork()
                if child == 0:
                    try:
                        os.setuid(65534)
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        sock.connect(target)
                        sock.sendall(frame({"op": "ready"}))
                        sock.settimeout(10)
                        sock.recv(1)  # until the trainer closes it
                    finally:
                        os._exit(0)
                os.waitpid(child, 0)
            time.sleep(0.5)  # the trainer reads them while it waits for the workers
            try:
                return super().init_weight_transfer_engine(init_info)
            finally:
                for sock in sockets:
                    sock.close()

    model = build_model(MIXED, "float32", random=True, seed=5)
    with caplog.at_level(logging.WARNING, logger="wtransfer"):
        with HostilePool(2, FACTORY, backend="shm", factory_kwargs={"shapes": MIXED, "dtype": "float32"},
                         timeout_s=TIMEOUT, torch_threads=1) as pool:  # fmt: skip
            with wtransfer.create_trainer("shm", client=pool, source=model, init_info={"world_size": 3}) as trainer:
                mutate(model, 1)
                trainer.send_weights()
                assert_workers_hold(pool, model)
    dropped = [r.getMessage() for r in caplog.records if "dropped a connection" in r.getMessage()]
    assert len(dropped) == len(junk), dropped  # each stranger, once; none aborted the rendezvous
    assert any("sent a 65536-byte control frame" in d for d in dropped), dropped  # refused before it is read
    refused = [r.getMessage() for r in caplog.records if "refused a connection from user id 65534" in r.getMessage()]
    print(f"ran as uid {os.getuid()}: another user's connection {'refused' if refused else 'not tried'}")
    assert bool(refused) == other_user


def model_unless(marker: str) -> torch.nn.Module:
    """A worker's model that cannot be built once ``marker`` exists: a restart that fails."""
    if os.path.exists(marker):
        raise RuntimeError(f"{marker} exists")
    return torch.nn.Linear(4, 4)


def test_a_failed_restart_names_the_restarted_worker(tmp_path: Path) -> None:
    marker = tmp_path / "refuse"
    with LocalWorkerPool(2, model_unless, backend="shm", factory_kwargs={"marker": str(marker)}) as pool:
        marker.touch()
        with pytest.raises(TransferError, match=r"failed on 1 worker\(s\): worker 1: RuntimeError"):
            pool.restart(1)

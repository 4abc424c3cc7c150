"""``EngineConformance``: certify a weight-transfer engine with real trainer and worker processes.

Subclass it, name the engine, and give its options if it needs any::

    class TestMyEngine(EngineConformance):
        engine = "my-engine"

        @pytest.fixture
        def trainer_init_info(self):
            return {"master_address": "127.0.0.1"}   # merged into the trainer's init_info

Every round runs through ``create_trainer`` and ``WeightTransferEngineFactory.create_engine``, with the trainer in
this process and workers in spawned processes (``LocalWorkerPool``), on :func:`wtransfer.testing.models.matrix_model`
(bf16, fp8, bool, 0-dim, empty, non-contiguous, offset views, a tensor larger than a bucket), checked bit for bit,
in both commit modes (``atomic`` and ``streaming``). Every failure point compares the workers' weights, not only
their ``weight_version``: after a failed round a worker holds the previous version bit for bit (atomic), or says
it is torn (streaming). Faults in sequence are run by the seeded fault-schedule checker (``fault_schedules`` seeds).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from wtransfer.engines.rounds.source import ModuleSource
from wtransfer.testing.conformance._contract import require

MODEL_FACTORY = "wtransfer.testing.models:matrix_model"
BUCKET_BYTES = 1 << 20


class EngineConformance:
    """A battery of contract tests for a weight-transfer engine (set ``engine``)."""

    engine: str = ""
    num_workers: int = 2
    timeout_s: float = 20.0
    """Transfer timeout given to both sides; peer-death tests expect an error within it."""

    @pytest.fixture
    def engine_options(self) -> dict[str, Any]:
        """``WeightTransferConfig.options`` for the worker engines."""
        return {}

    @pytest.fixture
    def trainer_init_info(self) -> dict[str, Any]:
        """Extra trainer ``init_info`` keys (``world_size``, ``bucket_bytes``, ``timeout_s`` are set)."""
        return {}

    # -- helpers ---------------------------------------------------------------------------------
    @pytest.fixture(params=["atomic", "streaming"])
    def commit(self, request: Any) -> str:
        """The trainer's commit mode: the framework's job, so every engine must pass in both."""
        return str(request.param)

    @contextmanager
    def _pool(self, engine_options: dict[str, Any], variant: str = "default", **pool_options: Any) -> Iterator[Any]:
        from wtransfer.local import LocalWorkerPool

        require(self.engine, "EngineConformance subclasses name their engine", "engine = 'name'", "empty")
        with LocalWorkerPool(self.num_workers, MODEL_FACTORY, backend=self.engine,
                             factory_kwargs={"seed": 0, "variant": variant}, engine_options=engine_options,
                             timeout_s=self.timeout_s, torch_threads=1, **pool_options) as pool:
            yield pool

    def _trainer(
        self, pool: Any, source: Any, trainer_init_info: dict[str, Any], commit: str = "atomic",
        delta: bool = False, **init: Any
    ) -> Any:
        """``source``: the model or a WeightSource (``create_trainer`` takes either)."""
        from wtransfer.engines.trainer.create import create_trainer

        init_info = {"world_size": pool.world_size, "bucket_bytes": BUCKET_BYTES, "timeout_s": self.timeout_s,
                     **trainer_init_info, **init}
        return create_trainer(self.engine, client=pool, source=source, init_info=init_info, commit=commit,
                              delta=delta)

    @staticmethod
    def _require_honest(pool: Any, previous: dict[str, int], commit: str, what: str) -> None:
        """After a failed round: atomic workers hold ``previous`` bit for bit; a streaming worker does too or says
        it is torn. ``weight_version`` never names a version the weights are not."""
        for rank, (digests, stats) in enumerate(zip(pool.digests(), pool.stats())):
            changed = sorted(n for n in previous if digests.get(n) != previous[n])
            got = (f"worker {rank}: changed {changed[:5]}, weight_version {stats['weight_version']}, "
                   f"torn {stats['weights_torn']}")
            if commit == "atomic":
                require(not changed and stats["weight_version"] is not None and not stats["weights_torn"],
                        f"{what}: an atomic round that failed leaves every worker's weights bit-identical to the "
                        f"previous version", "unchanged weights, weight_version kept", got)
            else:
                require(not changed or (stats["weight_version"] is None and stats["weights_torn"]),
                        f"{what}: a streamed round that failed part-way leaves the worker torn, and it says so",
                        "unchanged weights, or weight_version None and weights_torn True", got)

    @staticmethod
    def _digests(model: Any) -> dict[str, int]:
        from wtransfer.engines.rounds.manifest import tensor_checksum

        return {name: tensor_checksum(p.detach()) for name, p in model.named_parameters()}

    def _require_every_worker_holds(self, pool: Any, model: Any, after: str, round_index: int) -> None:
        """Every worker's weights equal the trainer's, bit for bit (checksums of every tensor)."""
        expected = self._digests(model)
        for rank, digests in enumerate(pool.digests()):
            wrong = sorted(n for n in expected if digests.get(n) != expected[n])
            require(not wrong, f"every worker holds the trainer's weights bit for bit after {after}",
                    "identical checksums", f"round {round_index}, worker {rank}: differs in {wrong}")

    # -- the contract ------------------------------------------------------------------------------
    def test_info_parsing_errors_name_the_field(self, engine_options: dict[str, Any]) -> None:
        from wtransfer import ParallelConfig, WeightTransferConfig, WeightTransferEngineFactory

        engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend=self.engine, options=engine_options), ParallelConfig())
        for parse in (engine.parse_init_info, engine.parse_update_info):
            with pytest.raises(ValueError) as info:
                parse({"no_such_field": 1})
            require("no_such_field" in str(info.value) and type(engine).__name__ in str(info.value),
                    f"{parse.__name__} rejects unknown fields with a ValueError naming engine and field",
                    "a message naming the engine class and 'no_such_field'", str(info.value))
            with pytest.raises(ValueError):
                parse(["not", "a", "dict"])
        engine.shutdown()
        engine.shutdown()  # idempotent, even before init

    def test_rounds_are_bit_exact_on_the_dtype_shape_matrix(
        self, engine_options: dict[str, Any], trainer_init_info: dict[str, Any], commit: str
    ) -> None:
        import torch

        from wtransfer.testing.models import matrix_model

        model = matrix_model(seed=1)
        with self._pool(engine_options) as pool:
            trainer = self._trainer(pool, model, trainer_init_info, commit)
            try:
                for round_index in range(2):
                    if round_index:  # new weights, as after a training step
                        with torch.no_grad():
                            for name, p in matrix_model(seed=7).named_parameters():
                                getattr(model, name).copy_(p)
                    stats = trainer.send_weights()
                    self._require_every_worker_holds(pool, model, "a round", round_index)
                    total = sum(p.numel() * p.element_size() for p in model.parameters())
                    require(stats.get("bytes") == total, "send_weights() returns the round's stats",
                            f"stats['bytes'] == {total}", stats)
                versions = [s["weight_version"] for s in pool.stats()]
                require(versions == [stats["version"]] * self.num_workers, "a worker's weight_version is the "
                        "trainer's version of the round it holds (stats['version'])",
                        f"{[stats['version']] * self.num_workers}", versions)
            finally:
                trainer.shutdown()
                trainer.shutdown()  # idempotent

    def test_delta_rounds_rebuild_the_trainers_weights_bit_exactly(
        self, engine_options: dict[str, Any], trainer_init_info: dict[str, Any], commit: str
    ) -> None:
        """``delta=True`` over every engine: after a full round, a round changing a few bytes of most tensors (sent
        as ``positions`` payloads or XORs) and one tensor all over (whole), then a round with nothing changed, each
        lands bit for bit; the first moves fewer bytes than the model, the second no tensor at all."""
        import torch

        from wtransfer.testing.models import matrix_model

        model = matrix_model(seed=1)
        with self._pool(engine_options) as pool:
            trainer = self._trainer(pool, model, trainer_init_info, commit, delta=True)
            try:
                kinds = [trainer.send_weights()["delta"]]
                with torch.no_grad():
                    for parameter in model.parameters():
                        if parameter.is_contiguous() and parameter.numel():
                            parameter.data.view(-1).view(torch.uint8)[::997].bitwise_xor_(1)  # any dtype
                    model.bf16.add_(1.0)  # changed all over: it travels whole
                for round_index in (2, 3):
                    stats = trainer.send_weights()
                    kinds.append(stats["delta"])
                    self._require_every_worker_holds(pool, model, "a delta round", round_index)
                    moved = (stats["wire_bytes"] < stats["bytes"] and stats["sparse_tensors"] > 0 if round_index == 2
                             else stats["wire_bytes"] == 0)
                    require(moved, "a delta round moves only what changed, as payloads",
                            "round 2: wire_bytes < bytes and sparse_tensors > 0; round 3: wire_bytes == 0", stats)
                require(kinds == ["full", "delta", "delta"], "rounds after the first are deltas",
                        "['full', 'delta', 'delta']", [kinds, stats.get("delta_refused")])
            finally:
                trainer.shutdown()

    def test_manifest_mismatch_is_rejected_with_nothing_written(
        self, engine_options: dict[str, Any], trainer_init_info: dict[str, Any]
    ) -> None:
        from wtransfer.testing.models import matrix_model

        with self._pool(engine_options, variant="mismatch") as pool:
            before = pool.digests()
            trainer = self._trainer(pool, matrix_model(seed=1), trainer_init_info)
            try:
                with pytest.raises(Exception) as info:
                    trainer.send_weights()
                require("bf16" in str(info.value), "a mismatching manifest is refused, naming each mismatch",
                        "an error naming parameter 'bf16'", f"{type(info.value).__name__}: {info.value}")
                require(pool.digests() == before, "nothing is written when the manifest does not match",
                        "unchanged worker weights", "some weights changed")
                versions = [s["weight_version"] for s in pool.stats()]
                require(versions == [0] * self.num_workers, "a failed round does not advance weight_version",
                        f"{[0] * self.num_workers}", versions)
            finally:
                trainer.shutdown()

    def test_dead_worker_raises_within_the_timeout(
        self, engine_options: dict[str, Any], trainer_init_info: dict[str, Any]
    ) -> None:
        """A worker SIGKILLed mid-round, after half the tensors were handed to the engine (buckets are moving): the
        trainer raises within the timeout and the round does not count. (Killing it earlier tests only the pool.)"""
        from wtransfer.errors import WTransferError
        from wtransfer.testing.models import matrix_model

        from wtransfer._probes import open_fd_count

        with self._pool(engine_options) as pool:
            victim = pool.processes[-1]
            held = pool.digests()[:-1]  # what the survivors hold before the round
            fds_before, shm_before = open_fd_count(), _shm_names()
            source = _KillsMidRound(matrix_model(seed=1), victim.pid)
            trainer = self._trainer(pool, source, trainer_init_info, "atomic")
            try:
                start = time.monotonic()
                with pytest.raises(WTransferError) as info:
                    trainer.send_weights()
                elapsed = time.monotonic() - start
                require(source.killed, "the worker died mid-round (the engine pulled tensors from the source)",
                        "the source reached its middle tensor", "it did not: the round never read the source")
                require(elapsed < self.timeout_s + 15, "a peer dying mid-round raises within the timeout, never hangs",
                        f"an error within {self.timeout_s:g} s (+ slack)", f"{elapsed:.1f} s: {info.value}")
                require(trainer.weight_version == 0, "a failed round does not advance the trainer's weight_version",
                        0, trainer.weight_version)
            finally:
                trainer.shutdown()
            # The client's call may still be winding down in its thread (a wait() holds an epoll descriptor for a
            # moment): a leak is what is still open once everything settled.
            settled = time.monotonic() + 10
            while open_fd_count() > fds_before and time.monotonic() < settled:
                time.sleep(0.1)
            require(open_fd_count() <= fds_before, "a trainer shut down after a failed round leaks no descriptors",
                    f"at most {fds_before} open", open_fd_count())
            left = shm_left_since(shm_before)
            require(not left, "a failed round leaves nothing in /dev/shm", "no new names", left)
            pool.restart(self.num_workers - 1)  # the survivors answer only beside a live pool
            survivors = pool.digests()[:-1]
            require(survivors == held, "an atomic round a worker died in changes no surviving worker's model",
                    "the survivors' weights as before the round", "changed tensors: " + str(
                        [sorted(n for n in before if got.get(n) != before[n]) for got, before in zip(survivors, held)]))

    def test_reconnects_to_workers_that_restarted(
        self, engine_options: dict[str, Any], trainer_init_info: dict[str, Any]
    ) -> None:
        """``trainer.reconnect(client=...)`` releases the transport and prepares it again on the same trainer:
        workers in new processes, with other starting weights, get the next round bit for bit while the old
        workers still live (replacements come up before the old ones are torn down)."""
        from wtransfer.testing.models import matrix_model

        model = matrix_model(seed=1)
        with self._pool(engine_options) as pool:
            trainer = self._trainer(pool, model, trainer_init_info)
            try:
                trainer.send_weights()
                with self._pool(engine_options) as replacements:
                    trainer.reconnect(client=replacements)
                    stats = trainer.send_weights()
                    require(stats["version"] == 2, "reconnect() keeps the trainer's round count", 2,
                            stats["version"])
                    versions = [s["weight_version"] for s in replacements.stats()]
                    require(versions == [2] * self.num_workers, "workers that restarted hold the trainer's version "
                            "once its round lands, not a count of their own", [2] * self.num_workers, versions)
                    expected = self._digests(model)
                    for rank, digests in enumerate(replacements.digests()):
                        wrong = sorted(n for n in expected if digests.get(n) != expected[n])
                        require(not wrong, "a new worker receives the round after reconnect() bit for bit",
                                "every tensor equal to the trainer's", f"worker {rank}: differs in {wrong[:5]}")
            finally:
                trainer.shutdown()

    def test_dead_trainer_fails_the_workers_within_the_timeout(
        self, engine_options: dict[str, Any], trainer_init_info: dict[str, Any], commit: str
    ) -> None:
        """The trainer's process SIGKILLed mid-round two (new weights), when the engine asks for the last tensor:
        every worker raises a TransferError within the timeout, holds round one's weights bit for bit (atomic) or
        says it is torn (streaming), holds no more file descriptors than before, leaves nothing in /dev/shm, and
        takes a fresh trainer's round afterwards."""
        import multiprocessing

        from wtransfer._fork_server import worker_process
        from wtransfer.errors import TransferError
        from wtransfer.testing.models import matrix_model

        with self._pool(engine_options) as pool:
            fds_before = [s["fds"] for s in pool.stats()]
            shm_before = _shm_names()
            init_info = {"world_size": pool.world_size, "bucket_bytes": BUCKET_BYTES, "timeout_s": self.timeout_s,
                         **trainer_init_info}
            relay, child_end = multiprocessing.Pipe()
            trainer = worker_process(_trainer_killed_in_round_two, (child_end, self.engine, json.dumps(init_info), commit))
            trainer.start()
            child_end.close()
            failure: tuple[BaseException, float] | None = None
            try:
                # This process is the trainer's control plane: its client's calls reach the pool here.
                while relay.poll(self.timeout_s * 3 + 60):
                    try:
                        request = json.loads(relay.recv_bytes())
                    except EOFError:  # the trainer is gone
                        break
                    started = time.monotonic()
                    try:
                        getattr(pool, request["op"])(*request["args"])
                        reply = {"ok": True}
                    except Exception as exc:
                        failure = (exc, time.monotonic() - started)
                        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                    try:
                        relay.send_bytes(json.dumps(reply).encode())
                    except OSError:
                        break
            finally:
                trainer.join(30)
                if trainer.is_alive():
                    trainer.kill()
            require(trainer.exitcode == -signal.SIGKILL, "the trainer died mid-round (killed by its own source)",
                    "exit by SIGKILL", f"exit code {trainer.exitcode}")
            # The weights first: what a user would serve from.
            self._require_honest(pool, self._digests(matrix_model(seed=1)), commit, "the trainer died mid-round")
            require(failure is not None and isinstance(failure[0], TransferError)
                    and "did not answer" not in str(failure[0]),
                    "workers whose trainer died mid-round raise a TransferError (the engine's own, not the "
                    "local pool giving up on a worker stuck in receive_weights)",
                    "update_weights failing with the engines' TransferError", failure and repr(failure[0]))
            assert failure is not None
            require(failure[1] < self.timeout_s + 15, "a dead trainer fails the workers within the timeout",
                    f"an error within {self.timeout_s:g} s (+ slack)", f"{failure[1]:.1f} s")
            # A worker's node stager may still be closing the dead trainer's socket when the round's error
            # arrives: a leak is what is still open once the workers settled.
            settled = time.monotonic() + 10
            stats = pool.stats()
            while any(s["fds"] > b for s, b in zip(stats, fds_before)) and time.monotonic() < settled:
                time.sleep(0.2)
                stats = pool.stats()
            require(all(s["fds"] <= before for s, before in zip(stats, fds_before)),
                    "a failed round leaks no file descriptors on the workers",
                    f"at most {fds_before}", [s["fds"] for s in stats])
            left = shm_left_since(shm_before)
            require(not left, "a failed round leaves nothing in /dev/shm", "no new names", left)
            model = matrix_model(seed=5)
            fresh = self._trainer(pool, model, trainer_init_info, commit)
            try:
                version = fresh.send_weights()["version"]  # a new trainer numbers its rounds from 1
            finally:
                fresh.shutdown()
            expected = self._digests(model)
            require(all(d == expected for d in pool.digests()), "workers take a new trainer's round after a trainer "
                    "died, bit for bit", "the new trainer's weights", "some worker differs")
            states = [(s["weight_version"], s["weights_torn"]) for s in pool.stats()]
            require(states == [(version, False)] * self.num_workers, "a complete round after a failed one clears "
                    "the torn state, and the workers hold the new trainer's version", [(version, False)] * self.num_workers,
                    states)

    def test_a_live_but_silent_worker_fails_the_round_within_the_timeout(
        self, engine_options: dict[str, Any], trainer_init_info: dict[str, Any], commit: str
    ) -> None:
        """A worker stopped (SIGSTOP) mid-round, its sockets open: the trainer raises within ``timeout_s`` plus a
        little; once the worker runs again, every worker holds its old weights bit for bit or says it is torn."""
        from wtransfer.errors import WTransferError
        from wtransfer.testing.models import matrix_model

        timeout_s = 5.0
        with self._pool(engine_options) as pool:
            victim = pool.processes[-1]
            source = _KillsMidRound(matrix_model(seed=1), victim.pid, sig=signal.SIGSTOP)
            trainer = self._trainer(pool, source, trainer_init_info, commit, timeout_s=timeout_s)
            try:
                start = time.monotonic()
                with pytest.raises(WTransferError):
                    trainer.send_weights()
                elapsed = time.monotonic() - start
            finally:
                trainer.shutdown()
                os.kill(victim.pid, signal.SIGCONT)
            require(source.killed, "the worker was stopped mid-round", "the source reached its middle tensor",
                    "it did not")
            require(elapsed < timeout_s + 5, "a live but silent peer fails the round within timeout_s (+ 5 s)",
                    f"an error within {timeout_s + 5:g} s", f"{elapsed:.1f} s")
            # The worker that woke up finds its trainer gone; then the weights are what a user would serve.
            self._require_honest(pool, self._digests(matrix_model(seed=0)), commit, "a worker stalled mid-round")

    def test_one_worker_rejecting_leaves_every_worker_unchanged_and_the_trainer_usable(
        self, engine_options: dict[str, Any], trainer_init_info: dict[str, Any], commit: str
    ) -> None:
        """The last worker's 'bf16' has another shape, the others accept the round: no worker may load it, and the
        next round (which all accept) must land."""
        from wtransfer.engines.rounds.source import TensorSource
        from wtransfer.testing.models import matrix_model

        variants = [{}] * (self.num_workers - 1) + [{"variant": "mismatch"}]
        with self._pool(engine_options, strict=False, worker_factory_kwargs=variants) as pool:
            before = pool.digests()
            model = matrix_model(seed=1)
            tensors = dict(model.named_parameters())
            trainer = self._trainer(pool, TensorSource(tensors), trainer_init_info, commit)
            try:
                with pytest.raises(Exception) as info:
                    trainer.send_weights()
                require("bf16" in str(info.value), "the rejecting worker's reason reaches the trainer",
                        "an error naming 'bf16'", f"{type(info.value).__name__}: {info.value}")
                require(pool.digests() == before, "a round one worker rejected is loaded by no worker",
                        "every worker unchanged", "some worker's weights changed")
                del tensors["bf16"]  # a round every worker accepts (their loaders are not strict)
                trainer.send_weights()
            finally:
                trainer.shutdown()
            expected = self._digests(model)
            for rank, digests in enumerate(pool.digests()):
                wrong = sorted(n for n in tensors if digests.get(n) != expected[n])
                require(not wrong, "after a rejected round the same trainer's next round lands on every worker",
                        "the new weights", f"worker {rank} differs in {wrong}")

    fault_schedules: int = 3
    """Seeded fault schedules :meth:`test_labels_hold_under_random_schedules_of_faults` runs (the long command,
    ``python -m wtransfer.testing.conformance.schedules ENGINE``, runs 500)."""

    def test_labels_hold_under_random_schedules_of_faults(self, trainer_init_info: dict[str, Any]) -> None:
        """Whole, partial, delta and streaming rounds mixed with failing loads, restarted workers, replaced
        trainers, client timeouts and trainers dying mid-round: after every step each worker's label names
        exactly the weights it holds (:mod:`wtransfer.testing.conformance.schedules`)."""
        from wtransfer.testing.conformance.schedules import run_schedules

        run_schedules(self.engine, range(self.fault_schedules), init_info=trainer_init_info)

    def test_discovered_through_its_entry_point_in_a_fresh_interpreter(self) -> None:
        from wtransfer.testing.processes import run_python

        out = run_python(f"""
            import wtransfer
            cls = wtransfer.get_class("engines", {self.engine!r})
            listed = [i.name for i in wtransfer.list_components("engines")]
            print(cls.__name__, getattr(cls, "trainer_cls", None) is not None, {self.engine.rpartition(':')[2]!r} in listed)
        """)
        name, has_trainer, listed = out.stdout.split()
        require(listed == "True", "the engine is listed from its distribution's metadata",
                f"{self.engine!r} in list_components()", out.stdout)
        require(has_trainer == "True", "an engine names its trainer side", "a trainer_cls attribute", name)



def _shm_names() -> set[str]:
    """Names in /dev/shm, less multiprocessing's own semaphores (``sem.mp-*``), which any process may hold."""
    names = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    return {name for name in names if not name.startswith("sem.mp-")}


def shm_left_since(before: set[str], grace_s: float = 60.0) -> list[str]:
    """The /dev/shm names new since ``before`` still there after ``grace_s``: other processes' segments go when
    they finish, a leaked one stays."""
    left = _shm_names() - before
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left &= _shm_names()
    return sorted(left)


def _trainer_killed_in_round_two(conn: Any, engine: str, init_info_json: str, commit: str) -> None:
    """A trainer process whose client relays every call to the test process over ``conn`` (JSON): one round of
    ``matrix_model(seed=1)``, then new weights (seed 7), and its source SIGKILLs it half-way through round two."""
    import torch

    from wtransfer.engines.trainer.create import create_trainer
    from wtransfer.errors import TransferError
    from wtransfer.testing.models import matrix_model

    class RelayClient:
        def _call(self, op: str, *args: Any) -> None:
            conn.send_bytes(json.dumps({"op": op, "args": list(args)}).encode())
            reply = json.loads(conn.recv_bytes())
            if not reply["ok"]:
                raise TransferError(reply["error"])

        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            self._call("init_weight_transfer_engine", init_info)

        def start_weight_update(self) -> None:
            self._call("start_weight_update")

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self._call("update_weights", update_info)

        def finish_weight_update(self) -> None:
            self._call("finish_weight_update")

    model = matrix_model(seed=1)
    source = _KillsMidRound(model, os.getpid(), armed=False, last=True)  # the earlier buckets reached the workers
    trainer = create_trainer(engine, client=RelayClient(), source=source, init_info=json.loads(init_info_json),
                             commit=commit)
    trainer.send_weights()
    with torch.no_grad():  # round two carries other weights, so a torn worker shows in its digests
        for name, parameter in matrix_model(seed=7).named_parameters():
            getattr(model, name).copy_(parameter)
    source.armed = True
    trainer.send_weights()  # never returns: the source kills this process


class _KillsMidRound(ModuleSource):
    """The model's weights; signals ``pid`` (SIGKILL) when the engine asks for the middle tensor (once armed)."""

    def __init__(self, module: Any, pid: int, armed: bool = True, sig: int = signal.SIGKILL, last: bool = False) -> None:
        super().__init__(module)
        self.pid = pid
        self.armed = armed
        self.killed = False
        self.sig = sig
        self.last = last
        """Signal at the last tensor instead: every bucket before it has reached the workers."""

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        at = len(self.metadata()) - 1 if self.last else len(self.metadata()) // 2
        for index, item in enumerate(super().__iter__()):
            if index == at and self.armed and not self.killed:
                os.kill(self.pid, self.sig)
                self.killed = True
            yield item

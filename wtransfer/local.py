"""A local worker pool: N inference-worker processes (forked from a fork server) behind a ``WeightSyncClient``.

For the CLI (``wtransfer bench``), examples and tests. Each worker builds its own model with a user-given factory
(``"package.module:function"`` or a module-level function), creates a worker engine with
``ParallelConfig(rank, num_workers, 0)`` and serves the ``WeightSyncClient`` calls over a pipe. Only JSON travels on
the pipe: no user object is ever pickled.

    with LocalWorkerPool(2, "mypkg.models:make_model", backend="shm") as pool:
        trainer = wtransfer.create_trainer("shm", client=pool, source=ModuleSource(model),
                                           init_info={"world_size": pool.world_size})
        trainer.send_weights()
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from wtransfer._fork_server import reference, worker_process
from wtransfer.errors import ManifestMismatchError, TransferError, TransferTimeoutError, WeightsTornError

if TYPE_CHECKING:
    from types import TracebackType

logger = logging.getLogger("wtransfer")

# Errors a worker reports are rebuilt in the parent by name (never unpickled).
_ERROR_TYPES: dict[str, type[BaseException]] = {
    "ManifestMismatchError": ManifestMismatchError,
    "TransferTimeoutError": TransferTimeoutError,
    "WeightsTornError": WeightsTornError,
    "TransferError": TransferError,
    "ValueError": ValueError,
    "TypeError": TypeError,
}


def factory_reference(factory: Callable[..., Any] | str) -> str:
    """``"module:qualname"`` for a module-level function (what a forked worker can import)."""
    if isinstance(factory, str):
        if ":" not in factory:
            raise ValueError(f"model factory {factory!r} must look like 'package.module:function'")
        return factory
    return reference(factory)


def _resolve(reference: str) -> Callable[..., Any]:
    from wtransfer._registry.loading import import_target

    try:
        target: Any = import_target(reference)
    except (ImportError, AttributeError, ValueError) as exc:
        raise TypeError(
            f"the worker process cannot import the model factory {reference!r} ({exc}); define it at "
            f"module level in an importable module, or in a script run as a file whose main code is "
            f"under `if __name__ == '__main__':`"
        ) from exc
    return target


def _send(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _error_reply(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "type": type(exc).__name__, "message": str(exc)}


def _worker_main(
    conn: Connection,
    factory: str,
    factory_kwargs: str,
    backend: str,
    engine_options: str,
    rank: int,
    num_workers: int,
    strict: bool,
    torch_threads: int,
) -> None:
    """Entry point of one worker process: build the model and the engine, then serve requests."""
    import torch

    from wtransfer._probes import PeakRss, open_fd_count
    from wtransfer.config import ParallelConfig, WeightTransferConfig
    from wtransfer.engines.rounds.cast import served_dtypes
    from wtransfer.engines.worker.factory import WeightTransferEngineFactory
    from wtransfer.engines.worker.loader import ModuleLoader
    from wtransfer.engines.rounds.manifest import tensor_checksum

    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    class _FaultInjectingLoader(ModuleLoader):
        """The worker's loader; armed by ``LocalWorkerPool.fail_next_load``, its next load writes one tensor
        (or hands out one destination) and then fails, as running out of memory part-way would."""

        fail_next = False

        def _fail(self) -> None:
            self.fail_next = False
            raise RuntimeError(f"local worker {rank}: injected fault, the load failed part-way "
                               f"(LocalWorkerPool.fail_next_load)")

        def destination(self, name: str) -> torch.Tensor | None:
            target = super().destination(name)
            if self.fail_next and target is not None and getattr(self, "_handed", False):
                self._fail()
            self._handed = target is not None
            return target

        def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
            if self.fail_next and weights:
                super().__call__(weights[:1])
                self._fail()
            super().__call__(weights)

    try:
        model = _resolve(factory)(**json.loads(factory_kwargs))
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model factory {factory} returned {type(model).__name__}, not a torch.nn.Module")
        load_weights = _FaultInjectingLoader(model, strict=strict)
        rss = PeakRss()
        engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend=backend, options=json.loads(engine_options)),
            ParallelConfig(rank=rank, world_size=num_workers, data_parallel_index=0),
        )
        engine.served_dtypes = served_dtypes(model)  # the trainer sends each tensor in its parameter's dtype
    except BaseException as exc:
        _send(conn, _error_reply(exc))
        return
    _send(conn, {"ok": True, "pid": os.getpid()})

    def handle(op: str, info: Any) -> dict[str, Any]:
        if op == "init":
            engine.init_transfer_engine(engine.parse_init_info(info))
        elif op == "start":
            engine.start_weight_update()
        elif op == "update":
            engine.receive_weights(engine.parse_update_info(info), load_weights)
        elif op == "finish":
            engine.finish_weight_update()
        elif op == "fail_next_load":
            load_weights.fail_next, load_weights._handed = True, False
        elif op == "digests":
            seen: set[int] = set()
            digests = {}
            for name, tensor in model.state_dict(keep_vars=True).items():
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    digests[name] = tensor_checksum(tensor.detach())
            return {"digests": digests}
        elif op == "stats":
            return {
                "pid": os.getpid(),
                "rss": rss.current(),
                "peak_extra_rss": rss.extra(),
                "fds": open_fd_count(),
                "weight_version": engine.weight_version,
                "weights_torn": engine.weights_torn,
                "weights_identity": engine.weights_identity,
                "held_weights": engine.held_weights(),
                "round_seconds": engine.round_seconds,
                "devices": sorted({str(t.device) for t in model.state_dict().values()}),
            }
        else:
            raise ValueError(f"unknown local-pool request {op!r}")
        return {"weight_version": engine.weight_version}

    try:
        while True:
            try:
                request = json.loads(conn.recv_bytes())
            except EOFError:  # the parent is gone
                break
            op = request.get("op")
            if op == "shutdown":
                break
            try:
                reply = {"ok": True, **handle(op, request.get("info"))}
            except BaseException as exc:
                logger.debug("local worker %d: %s failed: %s", rank, op, exc)
                reply = _error_reply(exc)
            _send(conn, {**reply, "seq": request.get("seq")})
    finally:
        engine.shutdown()
        try:
            _send(conn, {"ok": True, "bye": True})
        except OSError:
            pass


class LocalWorkerPool:
    """``num_workers`` worker processes (forked from :mod:`wtransfer._fork_server`), driven as one
    :class:`WeightSyncClient`.

    ``engine_options`` become ``WeightTransferConfig.options`` in every worker; ``torch_threads`` > 0 pins each
    worker's intra-op threads; ``worker_factory_kwargs`` (one dict per worker) override ``factory_kwargs`` per worker,
    for workers whose models differ.
    """

    def __init__(
        self,
        num_workers: int,
        model_factory: Callable[..., Any] | str,
        *,
        backend: str = "shm",
        factory_kwargs: dict[str, Any] | None = None,
        worker_factory_kwargs: list[dict[str, Any]] | None = None,
        engine_options: dict[str, Any] | None = None,
        strict: bool = True,
        timeout_s: float = 300.0,
        start_timeout_s: float = 120.0,
        torch_threads: int = 0,
    ) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if worker_factory_kwargs is not None and len(worker_factory_kwargs) != num_workers:
            raise ValueError(f"worker_factory_kwargs needs one dict per worker ({num_workers}), "
                             f"got {len(worker_factory_kwargs)}")
        self.num_workers = num_workers
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self._seq = 0  # requests sent: each reply names its request, so a late one is never taken for the next
        reference = factory_reference(model_factory)
        self._start_timeout_s = start_timeout_s
        self._arguments = [  # what each worker process is started with (restart() starts it again)
            (reference, json.dumps({**(factory_kwargs or {}), **(worker_factory_kwargs or [{}] * num_workers)[rank]}),
             backend, json.dumps(engine_options or {}), rank, num_workers, strict, torch_threads)
            for rank in range(num_workers)
        ]
        self._conns: list[Connection] = []
        self._processes: list[Any] = []
        try:
            for rank in range(num_workers):
                conn, process = self._spawn(rank)
                self._conns.append(conn)
                self._processes.append(process)
            self.pids = [reply["pid"] for reply in self._collect("start", start_timeout_s)]
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, rank: int) -> tuple[Connection, Any]:
        parent, child = multiprocessing.Pipe()
        process = worker_process(_worker_main, (child, *self._arguments[rank]), name=f"wtransfer-worker-{rank}",
                                 start_timeout_s=self._start_timeout_s)
        process.start()
        child.close()
        return parent, process

    def restart(self, rank: int) -> None:
        """Start worker ``rank`` again (killing it first if needed): a fresh process and model, as after a crash. Its
        engine joins no trainer until one connects (``reconnect()``)."""
        with self._lock:
            old, conn = self._processes[rank], self._conns[rank]
            if old.is_alive():
                old.kill()
            old.join(10)
            conn.close()
            if old.exitcode is not None:
                old.close()  # its sentinel descriptor
            self._conns[rank], self._processes[rank] = self._spawn(rank)
            (reply,) = self._collect("start", self._start_timeout_s, ranks=[rank])  # the new worker's start alone
            self.pids[rank] = reply["pid"]

    @property
    def world_size(self) -> int:
        """Trainer + workers: the ``world_size`` a trainer's ``init_info`` needs."""
        return self.num_workers + 1

    @property
    def processes(self) -> list[Any]:
        return list(self._processes)

    # -- the WeightSyncClient protocol ---------------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> list[dict[str, Any]]:
        return self.request("init", init_info)

    def start_weight_update(self) -> list[dict[str, Any]]:
        return self.request("start")

    def update_weights(self, update_info: dict[str, Any]) -> list[dict[str, Any]]:
        return self.request("update", update_info)

    def finish_weight_update(self) -> list[dict[str, Any]]:
        return self.request("finish")

    # -- extras for benchmarks and tests --------------------------------------------------------
    def fail_next_load(self, rank: int) -> None:
        """Fault injection for tests: worker ``rank``'s next load into its model fails part-way (a real failure in
        its loader, after it wrote part of the model), as running out of memory would."""
        with self._lock:
            self._seq += 1
            _send(self._conns[rank], {"op": "fail_next_load", "seq": self._seq})
            self._collect("fail_next_load", self.timeout_s, ranks=[rank])

    def digests(self) -> list[dict[str, int]]:
        """Per worker: CRC32 of every tensor of its model (bit-exact verification)."""
        return [reply["digests"] for reply in self.request("digests")]

    def stats(self) -> list[dict[str, Any]]:
        """Per worker: pid, rss, peak_extra_rss (since the worker started), open fds, weight_version."""
        return self.request("stats")

    def request(self, op: str, info: Any = None) -> list[dict[str, Any]]:
        """Send one request to every worker and wait (bounded) for all replies."""
        if self._closed:
            raise TransferError("the local worker pool was shut down")
        with self._lock:
            dead = [rank for rank, process in enumerate(self._processes) if process.exitcode is not None]
            if dead:  # nothing is sent: a commit reaches every worker or none
                raise TransferError(f"local worker {dead[0]} died before {op!r} ({self._exit_status(dead[0])}); "
                                    f"no worker was asked to {op}")
            try:
                self._seq += 1
                for rank, conn in enumerate(self._conns):
                    try:
                        _send(conn, {"op": op, "info": info, "seq": self._seq})
                    except OSError as exc:
                        raise TransferError(f"local worker {rank} is gone ({self._exit_status(rank)})") from exc
                return self._collect(op, self.timeout_s)
            except ValueError as exc:  # shutdown() on another thread closed the process handles
                if self._closed:
                    raise TransferError(f"the local worker pool was shut down during {op!r}") from exc
                raise

    def _exit_status(self, rank: int) -> str:
        process = self._processes[rank]
        process.join(0.5)
        return f"pid {process.pid}, exit code {process.exitcode}"

    def _collect(self, op: str, timeout: float, ranks: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """The replies of workers ``ranks`` (default: all) to ``op``, in rank order."""
        ranks = range(len(self._conns)) if ranks is None else ranks
        replies: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        waiting = {self._conns[rank]: rank for rank in ranks}
        sentinels = {self._processes[rank].sentinel: rank for rank in waiting.values()}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeoutError(
                    f"local worker(s) {sorted(waiting.values())} did not answer {op!r} within {timeout:g} s"
                )
            ready = wait([*waiting, *sentinels], remaining)
            for item in ready:
                if item in waiting:
                    rank = waiting[item]  # type: ignore[index]
                    try:
                        reply = json.loads(item.recv_bytes())  # type: ignore[union-attr]
                    except (EOFError, OSError) as exc:
                        raise TransferError(
                            f"local worker {rank} died during {op!r} ({self._exit_status(rank)})"
                        ) from exc
                    if reply.get("seq") not in (None, self._seq):
                        continue  # the answer to an earlier request this pool stopped waiting for
                    del waiting[item]  # type: ignore[arg-type]
                    replies[rank] = reply
                elif item in sentinels:
                    rank = sentinels.pop(item)  # type: ignore[call-overload]
                    if any(r == rank for r in waiting.values()):
                        conn = self._conns[rank]
                        if conn.poll(0):  # it answered before exiting
                            continue
                        raise TransferError(f"local worker {rank} died during {op!r} ({self._exit_status(rank)})")
        failures = [(rank, reply) for rank, reply in sorted(replies.items()) if not reply.get("ok")]
        if failures:
            rank, first = failures[0]
            error_type = _ERROR_TYPES.get(first.get("type", ""), TransferError)
            details = "; ".join(f"worker {r}: {f.get('type')}: {f.get('message')}" for r, f in failures)
            raise error_type(f"{op!r} failed on {len(failures)} worker(s): {details}")
        return [replies[rank] for rank in ranks]

    # -- life cycle ----------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every worker (their engines shut down first); idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                _send(conn, {"op": "shutdown"})
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for process in self._processes:
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                logger.warning("local worker pid %s did not stop; killing it", process.pid)
                process.kill()
                process.join(5)
        for conn in self._conns:
            conn.close()
        for process in self._processes:  # its sentinel is a pipe held until closed (or collected)
            if process.exitcode is not None:
                process.close()

    def __enter__(self) -> LocalWorkerPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()


__all__ = ["LocalWorkerPool", "factory_reference"]

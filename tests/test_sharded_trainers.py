"""Sharded trainers for real: FSDP2 (``fully_shard``) over a gloo default group, one process per
trainer rank, every rank calling ``create_trainer(..., rank=R)``; rank 0 drives two workers.

Every round follows a real optimizer step, and the workers must then hold the unsharded state
(``full_tensor()`` of every parameter) bit for bit. A trainer rank that dies mid-round makes
every other rank and every worker raise within ``timeout_s``, and no worker's version moves; a
worker that dies does the same to every trainer rank, and the other worker keeps its weights. A
round longer than ``timeout_s`` goes on while the worker says it makes progress.
Rank 0 refusing a round (its trainer closed, its source failing) or failing its rendezvous makes
every rank raise at once, none left waiting in a gather, and the workers keep the last round's
weights (compared tensor by tensor, not by version).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from wtransfer.engines.rounds.source import WeightSource
from wtransfer._fork_server import worker_process
from wtransfer.testing.processes import loopback_port

TIMEOUT = 30.0
INIT_INFO = {"world_size": 3, "timeout_s": TIMEOUT, "bucket_bytes": 16384, "num_buffers": 2}
"""Small buckets: tensors split mid-row across buckets, and every buffer is reused many times a round."""
SLOW_INIT_INFO = {"world_size": 2, "timeout_s": 6.0, "bucket_bytes": 4096, "num_buffers": 2}
"""A round longer than its timeout: rank 1 writes each of its parts at SLOW_WRITE_S a part, longer
than the timeout in all, while rank 0 waits for its word."""
SLOW_WRITE_S = 1.0
LATE_TIMEOUT = 12.0
LATE_INIT_INFO = {**INIT_INFO, "timeout_s": LATE_TIMEOUT}
"""The late-rank-0 test waits out a whole timeout: a shorter one (a round here takes about a second)."""
LINGER_MAX_S = 120.0
"""After its failure rank 0 lives on, as a trainer that goes on would, until every other rank reported (at most
this long): a rank still waiting in a gather then is not freed by rank 0's process exiting, however slow the host."""


def _release_path(port: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"wtransfer-test-release-rank0-{port}")


def _linger(port: int) -> None:
    deadline = time.monotonic() + LINGER_MAX_S
    while not os.path.exists(_release_path(port)) and time.monotonic() < deadline:
        time.sleep(0.05)


class _DiesMidRound(WeightSource):
    """A WeightSource proxy that SIGKILLs its own process half-way through walk ``round_to_die``."""

    def __init__(self, source: Any, round_to_die: int) -> None:
        self.source, self.round_to_die, self.walks = source, round_to_die, 0

    def metadata(self) -> Any:
        return self.source.metadata()

    def __iter__(self) -> Iterator[Any]:
        self.walks += 1
        middle = len(self.source.metadata()) // 2
        for index, item in enumerate(self.source):
            if self.walks == self.round_to_die and index == middle:
                os.kill(os.getpid(), signal.SIGKILL)
            yield item


def _trainer_rank(rank: int, world: int, port: int, backend: str, rounds: int, victim: int, conn: Any,
                  fault: str = "") -> None:
    """One trainer rank: FSDP2 over gloo, optimizer steps, a round after each; reports JSON lines.

    ``fault`` (rank 0's): ``connect`` (its client refuses the rendezvous), ``closed`` (its trainer
    is shut down before round 2), ``metadata`` (its source fails before round 2's walk), ``late``
    (it reaches round 2 after the others stopped waiting for it), ``mid-walk`` (its source raises
    half-way through round 2's walk, on rank 0 alone; ``walk-start``: before reading any of it);
    ``second`` (every rank's): a
    new trainer replaces the first on the same training group before round 2; ``short-layout``
    (rank 1's, shm): it tells rank 0 it holds nothing of any tensor in round 2.
    """
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import wtransfer
    from wtransfer.engines.rounds.manifest import tensor_checksum
    from wtransfer.local import LocalWorkerPool
    from wtransfer.testing.models import tied_lm

    def say(**event: Any) -> None:
        conn.send_bytes(json.dumps({"rank": rank, **event}).encode())

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    model = tied_lm(seed=0)
    mesh = init_device_mesh("cpu", (world,))  # CPU ranks even where CUDA is there (fully_shard's default)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pool = None
    try:
        init_info = {"slow-writer": SLOW_INIT_INFO, "late": LATE_INIT_INFO}.get(fault, INIT_INFO)
        if rank == 0:
            served = {"dtype": "bfloat16"} if fault == "bf16-workers" else {}  # the ranks keep fp32 masters
            pool = LocalWorkerPool(init_info["world_size"] - 1, "wtransfer.testing.models:tied_lm", backend=backend,
                                   factory_kwargs={"seed": 1, **served}, timeout_s=TIMEOUT, torch_threads=1)
        source: Any = wtransfer.ModuleSource(model)
        if fault == "gathered":  # a wrapper of the user's: rank 0 gathers and sends every tensor
            source = _PassThrough(source)
        if rank == victim and fault == "gathered":
            source = _DiesMidRound(source, round_to_die=2)
        elif rank == victim:
            _die_writing_round(2, backend)
        if rank == 1 and fault == "short-layout":
            _claim_nothing_in_round(2)
        if rank == 1 and fault == "slow-writer":
            _write_slowly_in_round(2)
        if rank == 0 and fault == "worker-dies":
            _kill_a_worker_writing_round(2, pool.processes[1].pid)
        if rank == 0 and fault == "metadata":
            source = _MetadataFails(source)
        if rank == 0 and fault in ("mid-walk", "walk-start"):
            source = _RaisesMidWalk(source, round_to_fail=2, at_start=fault == "walk-start")
        client = _RefusingClient(pool) if rank == 0 and fault == "connect" else pool
        started = time.monotonic()
        try:
            trainer = wtransfer.create_trainer(
                backend, client=client, source=source, rank=rank,
                init_info=init_info if rank == 0 else None, checksums=fault == "checksums",
            )
        except Exception as exc:
            say(event="create_failed", type=type(exc).__name__, message=str(exc)[:2000],
                seconds=time.monotonic() - started)
            if rank == 0:
                _linger(port)
            return
        last: dict[str, int] = {}  # the digests of the last round the workers took
        for step in range(rounds):
            if rank == 0 and step == 1 and fault == "closed":
                trainer.shutdown()
            if step == 1 and fault == "second":  # every rank replaces its trainer: a new agreement
                trainer.shutdown()
                trainer = wtransfer.create_trainer(
                    backend, client=client, source=source, rank=rank,
                    init_info=init_info if rank == 0 else None,
                )
            if rank == 0 and step == 1 and fault == "metadata":
                source.failing = True
            ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))
            model(ids).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0 and step == 1 and fault == "late":
                time.sleep(LATE_TIMEOUT + 5)  # rank-0-only work (an eval) longer than the others wait
            if step == 1 and fault == "reject":  # every rank: a tensor the workers' models do not have
                model.extra = torch.nn.Parameter(torch.zeros(4))
            started = time.monotonic()
            try:
                stats = trainer.send_weights()
            except Exception as exc:
                if fault == "reject" and step == 1:  # refused before any byte moved: the next round goes on
                    say(event="refused", type=type(exc).__name__, message=str(exc)[:2000])
                    del model.extra
                    stats = trainer.send_weights()
                    say(event="retried", version=stats["version"])
                    continue
                versions = changed = None
                if pool is not None:
                    if fault == "worker-dies":  # worker 1 is gone: ask worker 0 alone
                        stats_ = [_ask_one_worker(pool, 0, "stats")]
                        digests = [_ask_one_worker(pool, 0, "digests")["digests"]]
                    else:
                        stats_, digests = pool.stats(), pool.digests()
                    versions = [s["weight_version"] for s in stats_]
                    changed = [sorted(n for n in last if d.get(n) != last[n]) for d in digests]
                say(event="error", type=type(exc).__name__, message=str(exc)[:2000],
                    seconds=time.monotonic() - started, worker_versions=versions, changed=changed)
                if rank == 0 and fault:
                    _linger(port)
                return
            full = {name: p.full_tensor() for name, p in model.named_parameters()}  # a collective: every rank
            if pool is not None:
                as_served = torch.bfloat16 if fault == "bf16-workers" else None
                expected = {name: tensor_checksum(t.detach().to(as_served or t.dtype)) for name, t in full.items()}
                last = expected
                workers = pool.digests()
                say(event="round", version=stats["version"], sender=True, seconds=time.monotonic() - started,
                    cast=stats["cast_tensors"], tensors=stats["tensors"],
                    wrong=[sorted(n for n in expected if d.get(n) != expected[n]) for d in workers],
                    worker_versions=[s["weight_version"] for s in pool.stats()])
            else:
                say(event="round", version=stats["version"], sender=False, tensors=stats["tensors"],
                    wrote_shards=stats["wrote_shards"])
        trainer.shutdown()
        say(event="done")
    except Exception as exc:  # outside a round (set-up, a training step): still reported, as a failure
        say(event="crash", type=type(exc).__name__, message=str(exc)[:2000])
        raise
    finally:
        if pool is not None:
            pool.shutdown()


class _PassThrough(WeightSource):
    """A user's wrapper that changes nothing (it could rename or convert: wtransfer cannot tell)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def metadata(self) -> Any:
        return self.source.metadata()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.source)


DIE_AT_PART = 3
"""A writing rank (shm) dies before the part of a tensor it writes in this place (counting from 0): it
has written some of its shards into the staged round, not all of them (the round is part-written)."""
DIE_AT_BUCKET = 6
"""gloo: a sending rank dies in the first bucket from this one on that it holds bytes of: with
INIT_INFO's 16 KiB buckets and 2 buffers, the workers have by then received buckets 0-4."""


def _claim_nothing_in_round(round_to_lie: int) -> None:
    """This shm rank reports holding nothing of any tensor in that round (a rank whose layout is not
    the others' would report other parts): its shards are then written nowhere."""
    from wtransfer.engines.shm import ring as _shm_ring

    seen = {"rounds": 0}
    described = _shm_ring.layout_rows

    def lying(parts: Any) -> list[int]:
        seen["rounds"] += 1
        words = described(parts)
        return [0] * len(words) if seen["rounds"] == round_to_lie else words

    _shm_ring.layout_rows = lying


def _before_each_bucket(owner: Any, name: str, act: Any) -> None:
    """Wrap ``owner.name`` (a function with a bucket among its arguments) so that ``act(round, bucket)``
    runs before it. Rounds count from 1; a new one starts whenever the bucket index goes back (a
    rank is asked only for the buckets it holds bytes of, so bucket 0 may never come)."""
    seen = {"rounds": 0, "last": -1}
    step = getattr(owner, name)

    def wrapped(*args: Any) -> Any:
        bucket = next(a for a in args if hasattr(a, "pieces"))
        if bucket.index <= seen["last"] or seen["rounds"] == 0:
            seen["rounds"] += 1
        seen["last"] = bucket.index
        act(seen["rounds"], bucket)
        return step(*args)

    setattr(owner, name, wrapped)


def _before_each_part(owner: Any, act: Any) -> None:
    """Wrap ``owner.write_part`` (an shm rank writes each part of a tensor it holds into the staged
    round) so that ``act(round, part)`` runs before it: rounds count ``owner.rank_parts`` calls (one
    per round), parts count from 0 in each round."""
    seen = {"rounds": 0, "parts": 0}
    plan, write = owner.rank_parts, owner.write_part

    def planning(*args: Any, **kwargs: Any) -> Any:
        seen["rounds"], seen["parts"] = seen["rounds"] + 1, 0
        return plan(*args, **kwargs)

    def writing(*args: Any) -> Any:
        act(seen["rounds"], seen["parts"])
        seen["parts"] += 1
        return write(*args)

    owner.rank_parts, owner.write_part = planning, writing


def _die_writing_round(round_to_die: int, backend: str) -> None:
    """SIGKILL this trainer rank as it writes (shm) or sends (gloo) its shards in that round: before its
    DIE_AT_PART-th part (shm; some of its shards are in the staged round), or in the first bucket from
    DIE_AT_BUCKET on that it holds bytes of (gloo; the workers have received the buckets before it)."""
    from wtransfer.engines.rounds import part_streams as _part_streams
    from wtransfer.engines.shm import ring as _shm_ring

    def die(round_: int, at: Any) -> None:
        if round_ == round_to_die and (at >= DIE_AT_PART if backend == "shm" else at.index >= DIE_AT_BUCKET):
            os.kill(os.getpid(), signal.SIGKILL)

    if backend == "shm":
        _before_each_part(_shm_ring, die)
    else:  # the sending loop asks which of its bytes each bucket holds, bucket by bucket
        _before_each_bucket(_part_streams.RankLayout, "runs", die)


def _kill_a_worker_writing_round(round_to_kill: int, pid: int) -> None:
    """Rank 0 (shm) SIGKILLs worker process ``pid`` as it writes its DIE_AT_PART-th part in that round:
    the staged round is part-written, and the other rank is writing its own shards."""
    from wtransfer.engines.shm import round as shm_round

    killed: list[int] = []

    def kill(round_: int, part: int) -> None:
        if round_ == round_to_kill and part >= DIE_AT_PART and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    _before_each_part(shm_round, kill)


def _write_slowly_in_round(slow_round: int) -> None:
    """This shm rank takes SLOW_WRITE_S over each part it writes in that round."""
    from wtransfer.engines.shm import ring as _shm_ring

    def slowly(round_: int, part: int) -> None:
        if round_ == slow_round:
            time.sleep(SLOW_WRITE_S)

    _before_each_part(_shm_ring, slowly)


def _ask_one_worker(pool: Any, rank: int, op: str) -> dict[str, Any]:
    """One worker's answer to a local-pool request, when another worker is dead (the pool's own
    requests go to every worker). Replies left from the failed round are skipped."""
    conn = pool._conns[rank]
    conn.send_bytes(json.dumps({"op": op}).encode())
    deadline = time.monotonic() + TIMEOUT
    while conn.poll(max(deadline - time.monotonic(), 0)):
        reply = json.loads(conn.recv_bytes())
        if reply.get("ok") and ("digests" in reply if op == "digests" else "pid" in reply):
            return reply
    raise AssertionError(f"local worker {rank} did not answer {op!r}")


class _RaisesMidWalk(WeightSource):
    """Rank 0's source wrapper that raises half-way through the walk of round ``round_to_fail``
    (on rank 0 alone: the other ranks' gathers go on)."""

    def __init__(self, source: Any, round_to_fail: int, at_start: bool = False) -> None:
        self.source, self.round_to_fail, self.walks, self.at_start = source, round_to_fail, 0, at_start

    def metadata(self) -> Any:
        return self.source.metadata()

    def __iter__(self) -> Iterator[Any]:
        self.walks += 1
        if self.at_start and self.walks == self.round_to_fail:  # before reading the module at all
            raise ValueError("converting a tensor failed on rank 0")
        middle = len(self.source.metadata()) // 2
        for index, item in enumerate(self.source):
            if self.walks == self.round_to_fail and index == middle:
                raise ValueError("converting a tensor failed on rank 0")
            yield item


class _RefusingClient:
    """Rank 0's control plane, refusing the rendezvous (the workers' server is down, say)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def init_weight_transfer_engine(self, info: Any) -> None:
        raise ConnectionRefusedError("the inference server refused the connection")


class _MetadataFails(WeightSource):
    """Rank 0's source whose ``metadata()`` raises once ``failing`` is set (before any gather)."""

    def __init__(self, source: Any) -> None:
        self.source, self.failing = source, False

    def metadata(self) -> Any:
        if self.failing:
            raise OSError("reading the parameter list failed")
        return self.source.metadata()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.source)


def run_ranks(world: int, backend: str, rounds: int, victim: int = -1, limit: float = 300,
              fault: str = "") -> list[dict[str, Any]]:
    """Start ``world`` trainer ranks; return every event they reported (each stamped on arrival)."""
    port = loopback_port()
    pipes, processes = [], []
    for rank in range(world):
        mine, theirs = multiprocessing.Pipe(duplex=False)
        process = worker_process(_trainer_rank, (rank, world, port, backend, rounds, victim, theirs, fault),
                                 daemon=False)  # rank 0 starts the pool's workers
        process.start()
        theirs.close()
        pipes.append(mine)
        processes.append(process)
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + limit
    open_pipes = list(pipes)
    ended = set()  # ranks that reported how they ended, or whose pipe closed
    try:
        while open_pipes and time.monotonic() < deadline:
            for ready in multiprocessing.connection.wait(open_pipes, timeout=1.0):
                rank = pipes.index(ready)  # type: ignore[arg-type]
                try:
                    event = json.loads(ready.recv_bytes())  # type: ignore[union-attr]
                except EOFError:
                    open_pipes.remove(ready)  # type: ignore[arg-type]
                    ended.add(rank)
                    continue
                event["at"] = time.monotonic()
                event["rank0_running"] = processes[0].is_alive()  # rank 0 lingers until every other rank ended
                events.append(event)
                if event["event"] in ("error", "create_failed", "crash"):
                    ended.add(rank)
            if ended >= set(range(1, world)):
                Path(_release_path(port)).touch()
    finally:
        Path(_release_path(port)).touch()  # rank 0 lingers no more
        for process in processes:
            process.join(max(deadline - time.monotonic(), 1))
            if process.is_alive():
                process.kill()
        os.unlink(_release_path(port))  # every rank ended: none reads it any more
    assert not open_pipes, f"trainer ranks still running after {limit} s: {events}"
    return events


@pytest.mark.parametrize(("world", "backend", "mode"), [(2, "shm", "writes"), (4, "shm", "writes"),
                                                       (2, "gloo", "writes"), (4, "gloo", "writes"),
                                                       (2, "shm", "checksums"), (4, "gloo", "checksums"),
                                                       (2, "shm", "gathers"), (2, "gloo", "gathers"),
                                                       (2, "shm", "bf16-workers"), (2, "gloo", "bf16-workers")])
def test_fsdp2_trainer_ranks_sync_the_unsharded_state_after_optimizer_steps(world: int, backend: str,
                                                                            mode: str) -> None:
    """``writes``: every rank sends its own shards (a ModuleSource on every rank): into shm's buffers,
    or on gloo groups of its own with the workers; ``gathers``: rank 0 gathers and sends (a wrapper
    of the user's); ``checksums``: every rank writes or sends its own shards, and the workers verify
    digests computed as the bytes moved; ``bf16-workers``: the ranks keep fp32 master shards, the
    workers load bf16, and every rank casts its own shards as it writes them (no gathers)."""
    events = run_ranks(world, backend, rounds=3, fault={"gathers": "gathered", "checksums": "checksums",
                                                "bf16-workers": "bf16-workers"}.get(mode, ""))
    assert [e for e in events if e["event"] in ("error", "crash")] == []
    sender = [e for e in events if e["event"] == "round" and e["sender"]]
    assert [e["version"] for e in sender] == [1, 2, 3]
    for event in sender:
        assert event["wrong"] == [[], []], f"round {event['version']}: workers differ in {event['wrong']}"
        assert event["worker_versions"] == [event["version"]] * 2
        assert event["cast"] == (event["tensors"] if mode == "bf16-workers" else 0)  # every parameter, or none
    others = [e for e in events if e["event"] == "round" and not e["sender"]]
    assert len(others) == 3 * (world - 1)  # every rank took part in every round
    assert all(e["wrote_shards"] == (mode != "gathers") for e in others), others
    if mode == "gathers":
        assert all(e["tensors"] == others[0]["tensors"] for e in others)
    assert len([e for e in events if e["event"] == "done"]) == world


@pytest.mark.parametrize(("world", "backend", "mode"), [(2, "shm", "writes"), (4, "shm", "writes"),
                                                       (2, "gloo", "writes"), (4, "gloo", "writes"),
                                                       (2, "shm", "gathers"), (4, "shm", "gathers")])
def test_a_trainer_rank_dying_mid_round_fails_every_rank_and_worker_within_the_timeout(world: int, backend: str,
                                                                                       mode: str) -> None:
    events = run_ranks(world, backend, rounds=3, victim=1, fault="gathered" if mode == "gathers" else "")
    assert [e for e in events if e["event"] == "crash"] == []
    assert [e["version"] for e in events if e["event"] == "round" and e["rank"] == 0] == [1]
    errors = {e["rank"]: e for e in events if e["event"] == "error"}
    survivors = [rank for rank in range(world) if rank != 1]
    assert sorted(errors) == survivors, events  # the victim says nothing: it was SIGKILLed
    for rank, error in errors.items():
        assert error["seconds"] < TIMEOUT, f"rank {rank} took {error['seconds']:.1f} s"
        assert error["type"] in ("TransferError", "TransferTimeoutError", "RuntimeError", "DistBackendError"), error
    assert errors[0]["worker_versions"] == [1, 1]  # the cut round counts nowhere
    assert errors[0]["changed"] == [[], []], "a cut round changed the workers' weights"


def test_a_worker_dying_mid_round_fails_every_trainer_rank_and_the_other_worker_keeps_its_weights() -> None:
    """shm, 2 ranks writing their own shards: rank 0 SIGKILLs worker 1 part-way through writing round 2.
    Every trainer rank raises within ``timeout_s`` (rank 1 hears it from rank 0), and worker 0 still
    holds round 1's weights, tensor by tensor."""
    events = run_ranks(2, "shm", rounds=3, fault="worker-dies", limit=180)
    assert [e for e in events if e["event"] in ("crash", "create_failed")] == [], events
    assert [e["version"] for e in events if e["event"] == "round" and e["rank"] == 0] == [1]
    errors = {e["rank"]: e for e in events if e["event"] == "error"}
    assert sorted(errors) == [0, 1], events
    for rank, error in errors.items():  # told by the closed sockets, not by a timeout
        assert error["seconds"] < TIMEOUT, f"rank {rank} took {error['seconds']:.1f} s"
        assert error["type"] == "TransferError", error
    # each names the dead worker (rank 1 in rank 0's words)
    assert "local worker 1 died" in errors[0]["message"], errors[0]
    assert "local worker 1 died" in errors[1]["message"], errors[1]
    assert errors[0]["changed"] == [[]], "a cut round changed the surviving worker's weights"
    assert errors[0]["worker_versions"] == [1]  # worker 0


def test_a_round_longer_than_the_timeout_goes_on_while_a_rank_says_it_makes_progress() -> None:
    """shm, 2 ranks: rank 1 writes its shards slowly, longer than ``timeout_s`` in all, while rank 0,
    done with its own, waits for it: rank 1's progress words (every ``timeout_s / 4``) keep rank 0
    from calling the round dead, and the round lands whole."""
    assert _rank_1_parts() * SLOW_WRITE_S > 1.5 * SLOW_INIT_INFO["timeout_s"]
    events = run_ranks(2, "shm", rounds=3, fault="slow-writer", limit=240)
    assert [e for e in events if e["event"] in ("error", "crash", "create_failed")] == [], events
    sender = [e for e in events if e["event"] == "round" and e["sender"]]
    assert [e["version"] for e in sender] == [1, 2, 3]
    for event in sender:
        assert event["wrong"] == [[]], f"round {event['version']}: the worker differs in {event['wrong']}"
    assert sender[1]["seconds"] > 1.5 * SLOW_INIT_INFO["timeout_s"], sender[1]  # the slow round was slow


def _rank_1_parts() -> int:
    """The tensors rank 1 holds a part of, for tied_lm over 2 ranks (``Shard(0)``: each rank holds half
    of every tensor's rows, rank 0 the first half): the parts it writes, slowly, in the slow round."""
    import wtransfer
    from wtransfer.engines.rounds.shards import _chunk
    from wtransfer.testing.models import tied_lm

    entries = wtransfer.ModuleSource(tied_lm(seed=0)).metadata()
    return sum(1 for entry in entries if entry.shape and _chunk(entry.shape[0], 2, 1)[1] > 0)


def _gather_check(rank: int, world: int, port: int, conn: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wtransfer.engines.rounds.source import gather_rows_in_slices

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    module = torch.nn.Module()
    generator = torch.Generator().manual_seed(5)
    shapes = {"even": (12, 5), "uneven": (101, 7), "fewer_rows_than_ranks": (2, 3), "vector": (13,), "empty": (0, 4)}
    for name, shape in shapes.items():
        module.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=generator)))
    fully_shard(module, mesh=init_device_mesh("cpu", (world,)))
    results = {}
    for name in shapes:
        parameter = getattr(module, name)
        sliced = gather_rows_in_slices(parameter, slice_bytes=64)  # many slices, a partial last one
        with torch.no_grad():
            whole = parameter.full_tensor()
        results[name] = sliced is not None and torch.equal(sliced, whole)
    conn.send_bytes(json.dumps(results).encode())


def test_row_sharded_parameters_are_gathered_slice_by_slice_exactly() -> None:
    # the slice-by-slice gather must equal full_tensor() for torch.chunk's layouts: uneven rows,
    # ranks with no rows, 1-D tensors, empty tensors, and slices that do not divide a shard
    port, pipes, processes = loopback_port(), [], []
    for rank in range(3):
        mine, theirs = multiprocessing.Pipe(duplex=False)
        process = worker_process(_gather_check, (rank, 3, port, theirs), daemon=False)
        process.start()
        theirs.close()
        pipes.append(mine)
        processes.append(process)
    try:
        for rank, pipe in enumerate(pipes):
            assert pipe.poll(120), f"rank {rank} sent nothing"
            assert json.loads(pipe.recv_bytes()) == {
                "even": True, "uneven": True, "fewer_rows_than_ranks": True, "vector": True, "empty": True}
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()


@pytest.mark.parametrize("fault", ["closed", "metadata", "mid-walk", "walk-start"])
def test_rank_0_refusing_a_round_fails_every_rank_at_once_and_the_workers_keep_their_weights(fault: str) -> None:
    """No rank is left in a gather rank 0 will not run: before the agreement, the other ranks waited
    in their first gather until the training group's timeout (120 s here). ``mid-walk``: rank 0's
    walk died inside the round, and rank 0 runs the remaining gathers itself."""
    events = run_ranks(3, "shm", rounds=3, fault=fault, limit=180)
    assert [e for e in events if e["event"] in ("crash", "create_failed")] == []
    assert [e["version"] for e in events if e["event"] == "round"] == [1, 1, 1]
    errors = {e["rank"]: e for e in events if e["event"] == "error"}
    assert sorted(errors) == [0, 1, 2], events
    for rank in (1, 2):
        assert errors[rank]["type"] == "TransferError", errors[rank]
        assert "trainer rank 0" in errors[rank]["message"], errors[rank]
        assert errors[rank]["rank0_running"], "freed by rank 0's exit, not told by rank 0"
    cause = {"closed": "shut down", "metadata": "reading the parameter list failed",
             "mid-walk": "converting a tensor failed on rank 0",
             "walk-start": "converting a tensor failed on rank 0"}[fault]
    assert all(cause in e["message"] for e in errors.values()), errors  # every rank names rank 0's cause
    assert errors[0]["worker_versions"] == [1, 1]
    assert errors[0]["changed"] == [[], []], "a refused round changed the workers' weights"


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_rank_0_failing_its_rendezvous_fails_every_rank_at_create_trainer(backend: str) -> None:
    """On gloo the other ranks are told before the workers' init (they join the workers' groups
    meanwhile): they must still fail at once, with rank 0's reason."""
    events = run_ranks(3, backend, rounds=1, fault="connect", limit=180)
    failed = {e["rank"]: e for e in events if e["event"] == "create_failed"}
    assert sorted(failed) == [0, 1, 2], events
    assert all("refused the connection" in e["message"] for e in failed.values()), failed
    assert all(failed[rank]["rank0_running"] for rank in (1, 2)), failed  # told by rank 0, not freed by its exit
    assert [e for e in events if e["event"] in ("round", "crash")] == []


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_round_the_workers_refuse_stops_every_rank_cleanly_and_the_next_round_goes_on(backend: str) -> None:
    """Every rank sends its own shards; the workers refuse a round whose tensor list they do not
    have: every rank raises with the workers' reason, nothing moved, and the same trainers (on
    gloo: the same process groups) carry the next rounds bit-exactly."""
    events = run_ranks(2, backend, rounds=3, fault="reject", limit=180)
    assert [e for e in events if e["event"] in ("crash", "create_failed", "error")] == [], events
    refused = {e["rank"]: e for e in events if e["event"] == "refused"}
    assert sorted(refused) == [0, 1], events
    assert all("extra" in e["message"] for e in refused.values()), refused  # the workers' reason, everywhere
    sender = [e for e in events if e["event"] == "round" and e["sender"]]
    assert [e["version"] for e in sender] == [1, 3]  # round 2 ran as the retry of the refused one
    for event in sender:
        assert event["wrong"] == [[], []], f"round {event['version']}: workers differ in {event['wrong']}"
    assert [e["version"] for e in events if e["event"] == "retried"] == [2, 2]


def test_rank_0_arriving_after_the_others_stopped_waiting_starts_no_round_anywhere() -> None:
    """The others give up after timeout_s and leave; rank 0, arriving later, must not enter a
    gather alone (it would wait there until the training group's timeout): every rank raises."""
    events = run_ranks(3, "shm", rounds=2, fault="late", limit=240)
    assert [e for e in events if e["event"] in ("crash", "create_failed")] == []
    assert [e["version"] for e in events if e["event"] == "round"] == [1, 1, 1]
    errors = {e["rank"]: e for e in events if e["event"] == "error"}
    assert sorted(errors) == [0, 1, 2], events
    for rank in (1, 2):
        assert LATE_TIMEOUT - 1 < errors[rank]["seconds"] < LATE_TIMEOUT + 10, errors[rank]
    assert errors[0]["seconds"] < 10, errors[0]  # at once: the others' side of the group is gone
    assert "did not start the round" in errors[0]["message"], errors[0]
    assert errors[0]["worker_versions"] == [1, 1] and errors[0]["changed"] == [[], []]


def test_a_second_sharded_trainer_on_the_same_group_takes_over() -> None:
    """Every rank replaces its trainer between rounds (a new rendezvous, a new agreement on the
    same training group and store): the new trainer's rounds land whole on the workers."""
    events = run_ranks(3, "shm", rounds=3, fault="second", limit=240)
    assert [e for e in events if e["event"] in ("error", "crash", "create_failed")] == [], events
    sender = [e for e in events if e["event"] == "round" and e["sender"]]
    assert len(sender) == 3 and [e["version"] for e in sender][0] == 1, sender
    for event in sender:
        assert event["wrong"] == [[], []], f"round {event['version']}: workers differ in {event['wrong']}"
    assert len([e for e in events if e["event"] == "round" and not e["sender"]]) == 3 * 2
    assert len([e for e in events if e["event"] == "done"]) == 3


def test_ranks_whose_shards_do_not_tile_a_bucket_stop_the_round_before_any_byte_is_written() -> None:
    """shm: rank 0 checks that the ranks' parts tile every tensor before it writes any byte. Rank 1
    says it holds nothing in round 2 (as a rank whose mesh or placements differ would report
    other parts): every rank raises, naming the tensor, and no worker's weights change."""
    events = run_ranks(2, "shm", rounds=3, fault="short-layout", limit=180)
    assert [e for e in events if e["event"] in ("crash", "create_failed")] == [], events
    assert [e["version"] for e in events if e["event"] == "round" and e["rank"] == 0] == [1]
    errors = {e["rank"]: e for e in events if e["event"] == "error"}
    assert sorted(errors) == [0, 1], events
    assert "do not tile the round" in errors[0]["message"], errors[0]
    assert errors[0]["worker_versions"] == [1, 1]
    assert errors[0]["changed"] == [[], []], "a round stopped before any byte was written changed the weights"

"""verl's checkpoint-engine sequence, run by hand in separate processes, with verl 0.9's own classes.

What ``CheckpointEngineManager.update_weights`` does for each sync (its Ray plumbing aside): ``prepare()``
on every actor and rollout worker, ``build_topology()`` in the driver, ``init_process_group()`` on every
worker, the actor's ``send_weights()`` and every rollout worker's ``receive_weights()`` at once, then
``finalize()``. Each worker is its own process that finds ``wtransfer:BACKEND`` in verl's registry through
the ``verl.plugins`` entry point. Steps 1-3 sync; in step 4 the actor's rank 0 is killed part-way through
the round; a new actor (ranks 0 and 1) then syncs steps 5 and 6. Prints one JSON report.

usage: python verl_protocol.py BACKEND OUT.json
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

ACTORS, ROLLOUTS = 2, 2
KILL_STEP = 3
CONFIGS = {
    "dense": {"dtype": "bfloat16", "checksums": True, "timeout_s": 60, "init_info": {"bucket_bytes": 1 << 16}},
    "delta": {"dtype": "bfloat16", "checksums": True, "delta": True, "timeout_s": 60,
              "init_info": {"bucket_bytes": 1 << 16}},
    "rebuild": {"rebuild_group": True, "delta": True, "timeout_s": 60, "init_info": {"bucket_bytes": 1 << 16}},
}
SHAPES = {"embed.weight": ((64, 128), "float32"), "layers.0.weight": ((128, 128), "float32"),
          "layers.0.bias": ((128,), "bfloat16"), "layers.1.weight": ((128, 256), "float32"),
          "position_ids": ((256,), "int64"), "head.weight": ((96, 128), "float32")}


def step_weights(step: int) -> list[tuple[str, Any]]:
    """The actor's weights at ``step``: a fixed base; the even-numbered tensors have a few elements changed each
    step (delta's case), the others never change."""
    import torch

    out = []
    for index, (name, (shape, dtype)) in enumerate(SHAPES.items()):
        generator = torch.Generator().manual_seed(index)
        changes = step if index % 2 == 0 else 0
        if dtype == "int64":
            tensor = torch.arange(shape[0], dtype=torch.int64) + changes
        else:
            tensor = torch.randn(shape, generator=generator).to(getattr(torch, dtype))
            flat = tensor.view(-1)
            for k in range(changes):
                flat[(k * 7919 + index) % flat.numel()] += 1.0
        out.append((name, tensor))
    return out


def expected(step: int, cast: bool = True) -> dict[str, str]:
    """What a rollout worker must be handed for ``step``: floating tensors cast to bf16 (the cast option)."""
    import torch

    return {name: digest(t.to(torch.bfloat16) if cast and t.is_floating_point() else t)
            for name, t in step_weights(step)}


def digest(tensor: Any) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest()[:16]


def worker(conn: Any, role: str, backend: str, is_master: bool, engine_kwargs: dict[str, Any]) -> None:
    """One verl worker process: builds the engine as verl's workers do, then runs the driver's calls."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    if role == "actor":  # verl.workers.engine_workers: is_master is torch.distributed rank 0
        engine = CheckpointEngineRegistry.new(backend, is_master=is_master, bucket_size=1 << 20, **engine_kwargs)
    else:  # verl.checkpoint_engine.base.CheckpointEngineWorker
        engine = CheckpointEngineRegistry.new(backend, bucket_size=1 << 20, **engine_kwargs)

    async def receive(step: int, stop_after: int | None) -> dict[str, Any]:
        handed: dict[str, str] = {}
        weights = engine.receive_weights(global_steps=step)
        try:
            async for name, tensor in weights:
                handed[name] = digest(tensor)
                if stop_after is not None and len(handed) >= stop_after:
                    break  # verl's loader failed part-way: it takes no more of this round
        except Exception as exc:
            return {"handed": handed, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            await weights.aclose()
        return {"handed": handed}

    def send(step: int, die_at: int | None) -> dict[str, Any]:
        def weights():
            for index, item in enumerate(step_weights(step)):
                if die_at is not None and index == die_at:
                    time.sleep(0.5)  # earlier buckets are on the wire
                    os.kill(os.getpid(), signal.SIGKILL)
                yield item
        return asyncio.run(engine.send_weights(weights(), global_steps=step))

    while True:
        request = json.loads(conn.recv_bytes())
        op, args = request["op"], request.get("args", {})
        try:
            if op == "prepare":
                reply = {"metadata": engine.prepare()}
            elif op == "init":
                engine.init_process_group(**args)
                reply = {}
            elif op == "send":
                reply = {"metrics": send(args["step"], args.get("die_at"))}
            elif op == "receive":
                reply = asyncio.run(receive(args["step"], args.get("stop_after")))
            elif op == "finalize":
                engine.finalize()
                reply = {}
            elif op == "exit":
                engine.shutdown()
                conn.send_bytes(b"{}")
                return
            else:
                raise ValueError(op)
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send_bytes(json.dumps(reply).encode())


class Group:
    """Worker processes driven together: a call goes to every one, then every answer is read."""

    def __init__(self, role: str, count: int, backend: str, engine_kwargs: dict[str, Any]) -> None:
        context = multiprocessing.get_context("fork")
        self.pipes, self.processes = [], []
        for rank in range(count):
            mine, theirs = context.Pipe()
            process = context.Process(target=worker, args=(theirs, role, backend, role == "actor" and rank == 0,
                                                                   engine_kwargs))
            process.start()
            self.pipes.append(mine)
            self.processes.append(process)

    def send(self, op: str, args: list[dict[str, Any]] | None = None) -> None:
        for rank, pipe in enumerate(self.pipes):
            pipe.send_bytes(json.dumps({"op": op, "args": (args or [{}] * len(self.pipes))[rank]}).encode())

    def collect(self, timeout: float = 120.0) -> list[dict[str, Any]]:
        replies = []
        for rank, pipe in enumerate(self.pipes):
            if not pipe.poll(timeout):
                replies.append({"error": f"rank {rank}: no answer within {timeout} s"})
                continue
            try:
                replies.append(json.loads(pipe.recv_bytes()))
            except EOFError:
                replies.append({"error": f"rank {rank}: the process died (exit {self.processes[rank].exitcode})"})
        return replies

    def close(self) -> None:
        for pipe, process in zip(self.pipes, self.processes):
            if process.is_alive():
                try:
                    pipe.send_bytes(b'{"op": "exit"}')
                    pipe.poll(30) and pipe.recv_bytes()
                except (OSError, EOFError):
                    pass
            process.join(30)
            if process.is_alive():
                process.kill()


def kwargs_per_rank(kwargs: dict[str, list[Any]], count: int) -> list[dict[str, Any]]:
    return [{key: values[rank] for key, values in kwargs.items()} for rank in range(count)]


def sync(engine_cls: Any, actors: Group, rollouts: Group, step: int, die_at: int | None = None,
         stop_after: int | None = None) -> dict[str, Any]:
    """One sync, in CheckpointEngineManager.update_weights's order."""
    actors.send("prepare"), rollouts.send("prepare")
    prepared = actors.collect() + rollouts.collect()
    if any("error" in r for r in prepared):
        return {"step": step, "failed_in": "prepare", "replies": prepared}
    actor_kwargs, rollout_kwargs = engine_cls.build_topology(ACTORS, ROLLOUTS, [r["metadata"] for r in prepared])
    actors.send("init", kwargs_per_rank(actor_kwargs, ACTORS))
    rollouts.send("init", kwargs_per_rank(rollout_kwargs, ROLLOUTS))
    inits = actors.collect() + rollouts.collect()
    if any("error" in r for r in inits):
        return {"step": step, "failed_in": "init_process_group", "replies": inits}
    actors.send("send", [{"step": step, "die_at": die_at if rank == 0 else None} for rank in range(ACTORS)])
    rollouts.send("receive", [{"step": step, "stop_after": stop_after if rank == 0 else None}
                              for rank in range(ROLLOUTS)])
    sent, received = actors.collect(), rollouts.collect()
    if die_at is None:
        actors.send("finalize"), rollouts.send("finalize")
        actors.collect(), rollouts.collect()
    return {"step": step, "sent": sent, "received": received}


def main() -> int:
    backend, out = f"wtransfer:{sys.argv[1]}", sys.argv[2]
    import verl  # noqa: F401 - loads the verl.plugins entry points, as every verl process does
    from verl.checkpoint_engine import CheckpointEngineRegistry

    engine_cls = CheckpointEngineRegistry.get(backend)
    report: dict[str, Any] = {"backend": backend, "registered": sorted(n for n in CheckpointEngineRegistry._registry
                                                                       if n.startswith("wtransfer:")),
                              "engine_class": f"{engine_cls.__module__}.{engine_cls.__qualname__}"}
    for config, engine_kwargs in CONFIGS.items():
        rollouts = Group("rollout", ROLLOUTS, backend, engine_kwargs)
        actors = Group("actor", ACTORS, backend, engine_kwargs)
        steps = report[config] = []
        try:
            if config == "dense":
                for step in (0, 1, 1, 2):
                    steps.append(sync(engine_cls, actors, rollouts, step))
                steps.append(sync(engine_cls, actors, rollouts, KILL_STEP, die_at=len(SHAPES) - 2))
                actors.close()  # rank 1 is left waiting: a new actor replaces both ranks, as a restarted job would
                actors = Group("actor", ACTORS, backend, engine_kwargs)
                for step in (KILL_STEP, KILL_STEP + 1):
                    steps.append(sync(engine_cls, actors, rollouts, step))
            elif config == "delta":
                for step in (0, 1, 2, 3):
                    steps.append(sync(engine_cls, actors, rollouts, step, stop_after=1 if step == 1 else None))
            else:
                for step in (0, 1, 1):
                    steps.append(sync(engine_cls, actors, rollouts, step))
        finally:
            actors.close()
            rollouts.close()
    report["expected"] = {str(step): expected(step) for step in range(KILL_STEP + 2)}
    report["expected_uncast"] = {str(step): expected(step, cast=False) for step in (0, 1)}
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fault-schedule checker: seeded random sequences of ordinary events, the labels checked after every step.

One fault at a time is not what users meet: a load fails on one worker, the next round is partial, a worker is
replaced, the trainer is restarted from a checkpoint. Each schedule drives a real trainer and a
:class:`~wtransfer.local.LocalWorkerPool` of worker processes through such a sequence and, after every step,
reads every worker's weights and checks the labels against them:

* **a label names one state**: every worker that reports version ``v`` holds the same weights (bit for bit), at
  every step, and one content identity never names two states;
* **it is what the trainer sent**: a worker at ``v`` holds every tensor round ``v`` carried; a whole round's
  holder holds nothing else, a partial round's holder kept the rest from what it held before (a torn or
  restarted worker only takes a partial round that carries every tensor), and from the base the trainer knows
  (a trainer's partial round carries what changed since what every worker held when it was created, then
  since its own last round, even after every worker restarted); version 0 is the start-up weights;
* **labels only go up** on every worker process;
* **a round that returned is held by every worker**;
* **a model stays where it lives**: a worker's parameters stay on the device its model was built on (``device=
  "cuda"`` builds the trainer's tensors and every worker's model on the GPU).

A failure names the seed and the schedule so far; ``python -m wtransfer.testing.conformance.schedules ENGINE
--schedules N`` runs many (``--seed S`` replays one).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from wtransfer.engines.rounds.source import TensorSource

MODEL_FACTORY = "wtransfer.testing.conformance.schedules:schedule_model"
EVENTS = ("round", "round", "round", "failing_load", "timeout_before", "timeout_after", "restart_worker",
          "restart_workers", "new_trainer", "trainer_dies")
KINDS = ("whole", "partial", "delta")
COMMITS = ("atomic", "streaming")


def schedule_model(seed: int = 0, device: str = "cpu") -> Any:
    """The model every schedule syncs: six small tensors, so a round takes milliseconds."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 24), torch.nn.Linear(24, 8))
    return model.to(device)


class ScheduleFailure(AssertionError):
    """An invariant broke; the message names the seed, the schedule and what each worker held."""


class ClientTimeout(Exception):
    """What an HTTP client raises when a call times out (not an ``OSError``, like httpx's)."""


class FlakyClient:
    """The pool as a ``WeightSyncClient`` whose next ``finish_weight_update`` times out: before it reaches the
    workers (nothing committed) or after (every worker committed; the trainer never hears it)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.timeout: str | None = None

    def init_weight_transfer_engine(self, info: dict[str, Any]) -> Any:
        return self.pool.init_weight_transfer_engine(info)

    def start_weight_update(self) -> Any:
        return self.pool.start_weight_update()

    def update_weights(self, info: dict[str, Any]) -> Any:
        return self.pool.update_weights(info)

    def finish_weight_update(self) -> Any:
        when, self.timeout = self.timeout, None
        if when == "before":
            raise ClientTimeout("finish_weight_update timed out (injected; it never reached the workers)")
        result = self.pool.finish_weight_update()
        if when == "after":
            raise ClientTimeout("finish_weight_update timed out (injected; the workers committed)")
        return result


class RoundSource(TensorSource):
    """The tensors of one round, failing after ``die_after`` of them if set (a trainer dying mid-round)."""

    def __init__(self, tensors: dict[str, Any], die_after: int | None = None) -> None:
        super().__init__(tensors)
        self.die_after = die_after

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for index, (name, tensor) in enumerate(self.tensors.items()):
            if self.die_after is not None and index >= self.die_after:
                raise RuntimeError("the trainer died mid-round (injected)")
            yield name, tensor


@dataclass
class _Worker:
    pid: int
    version: int | None = 0
    digests: dict[str, int] | None = None
    highest: int = 0  # the highest label this process reported: it never reports a lower one


@dataclass
class ScheduleRun:
    """One seeded schedule against ``engine``; :meth:`run` raises :class:`ScheduleFailure` on a broken label."""

    engine: str
    seed: int
    steps: int = 12
    num_workers: int = 2
    init_info: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 20.0
    device: str = "cpu"
    log: list[str] = field(default_factory=list)

    def run(self) -> list[str]:
        import torch

        from wtransfer.local import LocalWorkerPool

        self.rng = random.Random(self.seed)
        self.truth = schedule_model(0, self.device)
        self.sent: dict[int, tuple[bool, dict[str, int]]] = {}  # version -> (partial, digests of what it carried)
        self.by_version: dict[int, dict[str, int]] = {}
        self.by_identity: dict[str, dict[str, int]] = {}
        with LocalWorkerPool(self.num_workers, MODEL_FACTORY, backend=self.engine, timeout_s=self.timeout_s,
                             factory_kwargs={"device": self.device}, torch_threads=1) as pool:
            self.pool, self.client = pool, FlakyClient(pool)
            startup = pool.digests()[0]
            self.devices = [str(torch.empty(0, device=self.device).device)]  # "cuda" as "cuda:0"
            if pool.stats()[0]["devices"] != self.devices:
                self._fail("the workers' models are not where they were asked to be",
                           f"{pool.stats()[0]['devices']}, not {self.devices}")
            self.by_version[0] = self.by_identity["startup"] = startup
            self.workers = [_Worker(pid, 0, startup) for pid in pool.pids]
            self.trainer: Any = None
            try:
                self._new_trainer()
                for step in range(self.steps):
                    event = self.rng.choice(EVENTS)
                    self._step(step, event, torch)
            finally:
                if self.trainer is not None:
                    self.trainer.shutdown()
        return self.log

    # -- events --------------------------------------------------------------------------------
    def _new_trainer(self) -> None:
        from wtransfer.engines.trainer.create import create_trainer

        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None
        self.kind, self.commit = self.rng.choice(KINDS), self.rng.choice(COMMITS)
        # A label above every one a live worker holds or began to commit is remembered by nobody once the trainer
        # that gave it is gone: a new trainer may give it again (docs: pass first_version= then). Forget those.
        held = [s["held_weights"] for s in self.pool.stats()]
        remembered = max(max(h["version"] or 0, h["spent"]) for h in held)
        self.by_version = {v: d for v, d in self.by_version.items() if v <= remembered}
        init_info = {"world_size": self.pool.world_size, "timeout_s": self.timeout_s, "bucket_bytes": 4096,
                     **self.init_info}
        self.log.append(f"new trainer: {self.kind}, {self.commit}")
        self.attempted: int | None = None
        """The version of the step's round, if this trainer sent one."""
        states = list(zip(self.pool.stats(), self.pool.digests()))
        held = [digests for stats, digests in states if not stats["weights_torn"]]
        self.left: dict[str, int] | None = (
            held[0] if len(held) == len(states) and all(d == held[0] for d in held) else None)
        """The base this trainer knows: what every worker holds as it is created, then what its last round left on
        the workers that hold it (None: none it may take)."""
        self.trainer = create_trainer(self.engine, client=self.client, source=RoundSource({}), init_info=init_info,
                                      commit=self.commit, delta=self.kind == "delta", partial=self.kind == "partial")

    def _step(self, step: int, event: str, torch: Any) -> None:
        returned = None
        if event in ("restart_worker", "restart_workers"):
            ranks = [self.rng.randrange(self.num_workers)] if event == "restart_worker" else range(self.num_workers)
            who = f"worker {ranks[0]}" if event == "restart_worker" else "every worker"
            self.log.append(f"step {step}: {who} restarted, trainer reconnects")
            for rank in ranks:
                self.pool.restart(rank)
                self.workers[rank] = _Worker(self.pool.pids[rank], 0, self.by_version[0])
            self._quietly(self.trainer.reconnect)
        elif event == "new_trainer":
            self._new_trainer()
        else:
            if event == "failing_load":
                self.pool.fail_next_load(self.rng.randrange(self.num_workers))
            elif event in ("timeout_before", "timeout_after"):
                self.client.timeout = event.removeprefix("timeout_")
            returned = self._round(step, event, torch)
            if event == "trainer_dies":
                self._new_trainer()
            elif returned is None and self.trainer._broken is not None:
                self.log.append(f"step {step}: the trainer is unusable; reconnect()")
                self._quietly(self.trainer.reconnect)
        self._check(step, returned)
        held = [w.digests for w in self.workers if w.version == self.attempted and w.digests is not None]
        if held:  # the trainer's round reached some worker: its next partial round is relative to it
            self.left = held[0]
        self.attempted = None

    def _round(self, step: int, event: str, torch: Any) -> int | None:
        names = [name for name, _ in self.truth.named_parameters()]
        if self.kind == "partial" and self.rng.random() < 0.75:
            carried = sorted(self.rng.sample(names, self.rng.randint(1, len(names) - 1)))
        else:
            carried = names
        with torch.no_grad():
            for name in carried if self.kind != "delta" else self.rng.sample(names, 2):
                tensor = self.truth.get_parameter(name)
                # a delta round's tensor changes all over (sent whole) or in a few elements (as positions)
                few = self.kind == "delta" and self.rng.random() < 0.5
                where = torch.rand(tensor.shape, generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
                tensor.add_(torch.randn_like(tensor) * 0.01 * ((where < 0.015) if few else 1))
        tensors = {name: self.truth.get_parameter(name).detach() for name in carried}
        die_after = self.rng.randrange(len(carried)) if event == "trainer_dies" else None
        # a source that keeps its tensors, unless it is to fail part-way: a delta round then leaves the
        # tensors it sends whole pending (copied into its base as it is sent), as it does for a trainer's module
        self.trainer.source = RoundSource(tensors, die_after) if die_after is not None else TensorSource(tensors)
        version = max(self.trainer.weight_version, self.trainer._version_floor) + 1
        self.sent[version] = (len(carried) < len(names), _digests(tensors))
        self.attempted = version
        try:
            stats = self.trainer.send_weights()
        except Exception as exc:
            self.log.append(f"step {step}: {event} ({len(carried)}/{len(names)} tensors) -> failed: "
                            f"{type(exc).__name__}: {str(exc)[:160]}")
            return None
        self.log.append(f"step {step}: {event} ({len(carried)}/{len(names)} tensors) -> version {stats['version']}")
        return int(stats["version"])

    def _quietly(self, call: Any) -> None:
        try:
            call()
        except Exception as exc:
            self.log.append(f"  ... {getattr(call, '__name__', call)} failed: {type(exc).__name__}: {exc}")

    # -- the invariants ------------------------------------------------------------------------
    def _fail(self, what: str, details: str) -> None:
        schedule = "\n  ".join(self.log)
        raise ScheduleFailure(f"{self.engine}, seed {self.seed}: {what}\n  {details}\nschedule:\n  {schedule}\n"
                              f"replay: python -m wtransfer.testing.conformance.schedules {self.engine} "
                              f"--seed {self.seed} --steps {self.steps} --device {self.device}")

    def _check(self, step: int, returned: int | None) -> None:
        states = list(zip(self.pool.stats(), self.pool.digests()))
        said = ", ".join(f"worker {r}: version {s['weight_version']}, torn {s['weights_torn']}"
                         for r, (s, _) in enumerate(states))
        self.log.append(f"  workers: {said}")
        for rank, (stats, digests) in enumerate(states):
            worker, version = self.workers[rank], stats["weight_version"]
            if stats["pid"] != worker.pid:
                self._fail("a worker process changed without a restart", f"worker {rank}")
            if stats["devices"] != self.devices:
                self._fail("a worker's model moved", f"worker {rank}: {self.devices} -> {stats['devices']}")
            if version is None:  # torn, and it says so: nothing to check but that it holds no label
                if returned is not None:
                    self._fail("a round that returned is not held by every worker",
                               f"round {returned} returned; worker {rank} is torn")
                if not stats["weights_torn"]:
                    self._fail("weight_version None without weights_torn", f"worker {rank}")
                worker.version, worker.digests = None, None
                continue
            if version < worker.highest:
                self._fail("a worker's version went down", f"worker {rank}: {worker.highest} -> {version}")
            worker.highest = version
            if returned is not None and version != returned:
                self._fail("a round that returned is not held by every worker",
                           f"round {returned} returned; worker {rank} holds {version}")
            known = self.by_version.setdefault(version, digests)
            if known != digests:
                self._fail(f"two states carry label {version}", f"worker {rank} differs in {_diff(known, digests)}")
            identity = stats.get("weights_identity")
            if identity is not None and self.by_identity.setdefault(identity, digests) != digests:
                self._fail(f"content identity {identity} names two states", f"worker {rank}, version {version}")
            if version and version != worker.version:  # a round landed here since the last step
                if version not in self.sent:
                    self._fail(f"worker {rank} reports version {version}, which no trainer sent", f"sent {sorted(self.sent)}")
                partial, carried = self.sent[version]
                wrong = [n for n, d in carried.items() if digests.get(n) != d]
                if wrong:
                    self._fail(f"worker {rank} at version {version} lacks what round {version} carried", f"{wrong}")
                if partial and self.left is not None and version == self.attempted:
                    drifted = [n for n, d in digests.items() if n not in carried and self.left.get(n) != d]
                    if drifted:
                        self._fail(f"partial round {version} landed on worker {rank} on top of other weights than "
                                   f"the base its trainer knows", f"kept {drifted} differ from that base")
                if partial:
                    kept = {n: d for n, d in digests.items() if n not in carried}
                    before = worker.digests
                    if before is None or any(before.get(n) != d for n, d in kept.items()):
                        self._fail(f"partial round {version} landed on worker {rank} on top of other weights "
                                   f"than it held (torn, restarted or another version)",
                                   f"kept {sorted(kept)} differ from what it held ({worker.version})")
            worker.version, worker.digests = version, digests


def _digests(tensors: dict[str, Any]) -> dict[str, int]:
    from wtransfer.engines.rounds.manifest import tensor_checksum

    return {name: tensor_checksum(t) for name, t in tensors.items()}


def _diff(a: dict[str, int], b: dict[str, int]) -> list[str]:
    return sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))


def run_schedules(engine: str, seeds: range | list[int], *, steps: int = 12,
                  init_info: dict[str, Any] | None = None, device: str = "cpu") -> int:
    """Run one schedule per seed; raise :class:`ScheduleFailure` at the first broken invariant. Returns the count."""
    for seed in seeds:
        ScheduleRun(engine, seed, steps, init_info=dict(init_info or {}), device=device).run()
    return len(seeds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wtransfer.testing.conformance.schedules",
                                     description="Seeded fault schedules against a weight-transfer engine.")
    parser.add_argument("engine", help="an installed engine name (shm, gloo, or a plugin's)")
    parser.add_argument("--schedules", type=int, default=500, help="how many seeds to run (from --first)")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--seed", type=int, default=None, help="replay this one seed, printing its schedule")
    parser.add_argument("--steps", type=int, default=12, help="events per schedule")
    parser.add_argument("--init-info", default=None, help="extra trainer init_info keys, as JSON")
    parser.add_argument("--device", default="cpu", help="where the trainer's tensors and the workers' models live")
    args = parser.parse_args(argv)
    import json

    init_info = json.loads(args.init_info) if args.init_info else (
        {"master_address": "127.0.0.1"} if args.engine == "gloo" else {})
    seeds = [args.seed] if args.seed is not None else range(args.first, args.first + args.schedules)
    started = time.perf_counter()
    for count, seed in enumerate(seeds, 1):
        try:
            log = ScheduleRun(args.engine, seed, args.steps, init_info=init_info, device=args.device).run()
        except ScheduleFailure as exc:
            print(exc, file=sys.stderr)
            return 1
        if args.seed is not None:
            print("\n".join(log))
        if count % 25 == 0 or count == len(seeds):
            print(f"{args.engine}: {count} schedule(s) of {args.steps} steps passed in "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

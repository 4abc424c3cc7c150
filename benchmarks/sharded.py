"""Sharded trainers vs unsharded, side by side: the same model synced from one trainer process,
then from FSDP2 ranks (``fully_shard`` over a gloo default group, CPU), to the same number of
local workers; GB/s of the whole round as rank 0 waits for it, and peak extra RSS of every
trainer rank. Two sharded designs are measured: every rank writing its own shards (``writes``:
what a ``ModuleSource`` gets on a backend with senders) and rank 0 gathering and sending every
tensor (``gathers``: a source wrapper, or a backend without senders), with the FSDP gathers alone
as that design's floor. Targets: writers >= 1.0x unsharded throughput on shm (more writers, same
bytes), >= 0.8x on other engines (each rank streams its own bytes), every writer rank's peak
extra RSS <= what the transport holds (buffers x bucket, or on shm the node's one staged copy of the
round, which every rank maps) + 64 MiB; gathers >= 0.8x, <= the same + the largest parameter. Every round is verified bit-exactly on every worker against the trainer's
unsharded state. Every configuration runs ``--repeats`` times, in turns, in fresh processes: on
a small host the same configuration varies from one set of processes to the next (the unsharded
shm sync gave 6.2 to 8.6 GB/s in single runs on a 2-core AMD EPYC), so the row is the run with
the median GB/s (the lower middle one for an even count), and every run's figure is beside it.
Beside the throughput, each row says how busy the worker was and how long the worker and the
trainer ranks were runnable but not running (the kernel's run delay): hints at
whether a round is bound by the worker, by the hand-offs between processes, or by a host with
fewer cores than busy processes, not a proof of which.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from typing import Any

from benchmarks.tables import median_item, table
from wtransfer._bench.report import add_report_arguments, figures_report
from wtransfer._fork_server import worker_process

TARGET_RATIO = {"writes": 0.8, "gathers": 0.8}
WRITES_TARGET_ON_SHM = 1.0
"""shm's ranks write into the buffers the workers read: more writers of the same bytes."""
SLACK = 64 << 20
from wtransfer.engines.channel.protocol import MIB  # noqa: E402
from wtransfer.engines.rounds.source import WeightSource  # noqa: E402  (imports no torch)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default="shm", help="engine to measure")
    parser.add_argument("--model", default="0.5B", help="parameter count (0.5B, 100M) or shapes (4096x4096,896*24)")
    parser.add_argument("--dtype", default="bf16", help="tensor dtype (bf16, fp16, fp32)")
    parser.add_argument("--ranks", default="2,4", help="trainer ranks of the sharded runs (writers; comma-separated)")
    parser.add_argument("--gathers", type=int, default=2, help="trainer ranks of the run where rank 0 gathers (0: none)")
    parser.add_argument("--workers", type=int, default=1, help="local worker processes")
    parser.add_argument("--no-checksums", dest="checksums", action="store_false",
                        help="skip the rows with checksums=True (unsharded, and the first --ranks count)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run (the median is reported)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of every configuration, in turns (fresh processes each); the run with the median "
                             "GB/s is reported, with every run's GB/s beside it")
    parser.add_argument("--timeout", type=float, default=300.0, help="timeout_s of every wait")
    add_report_arguments(parser)


class _Wrapped(WeightSource):
    """A source wrapper that changes nothing; wtransfer cannot tell, so rank 0 gathers and sends."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def metadata(self) -> Any:
        return self.source.metadata()

    def __iter__(self) -> Any:
        return iter(self.source)


def _rank_main(rank: int, ranks: int, port: int, options: str, conn: Any) -> None:
    """One trainer rank: build the model (sharded when ranks > 1), sync it, report JSON."""
    import datetime

    import torch

    from wtransfer._bench.weights import DTYPES
    from benchmarks.probes import cpu_seconds, run_queue_seconds
    from wtransfer._probes import PeakRss
    from wtransfer.testing.models import build_model, parse_model, worker_model
    from wtransfer.engines.rounds.source import ModuleSource
    from wtransfer.engines.trainer.create import create_trainer
    from wtransfer.local import LocalWorkerPool

    args = json.loads(options)
    torch.set_num_threads(1)
    shapes = [[name, shape] for name, shape in parse_model(args["model"])]
    dtype = DTYPES[args["dtype"]]
    model = build_model(shapes, dtype, random=True)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    if ranks > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        timeout = datetime.timedelta(seconds=args["timeout"])
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # the bench's (run_trainer)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks, timeout=timeout)
        fully_shard(model, mesh=init_device_mesh("cpu", (ranks,)))  # CPU ranks even where CUDA is there
    pool = None
    report: dict[str, Any] = {"rank": rank, "largest_parameter": largest, "rounds": []}
    try:
        if rank == 0:
            pool = LocalWorkerPool(args["workers"], worker_model, backend=args["engine"],
                                   factory_kwargs={"shapes": shapes, "dtype": dtype}, timeout_s=args["timeout"],
                                   torch_threads=1)
        _return_free_memory()  # set-up's freed memory must not hide the rounds' own peaks
        rss, peak_extra = PeakRss(), 0
        source: Any = ModuleSource(model)
        if args["mode"] == "gathers":
            source = _Wrapped(source)
        trainer = create_trainer(
            args["engine"], client=pool, source=source, rank=rank if ranks > 1 else None,
            init_info={"world_size": args["workers"] + 1, "timeout_s": args["timeout"]} if rank == 0 else None,
            checksums=args["checksums"],
        )
        if rank == 0:
            # what the transport holds: a ring, or the node's staged copy (mapped by every rank that writes)
            held = getattr(trainer, "staged_bytes", 0) or trainer.num_buffers * trainer.bucket_bytes  # type: ignore[union-attr]
            report["budget"] = held + SLACK + (largest if args["mode"] == "gathers" else 0)
            report["wrote_shards"] = trainer.parallel_senders  # type: ignore[union-attr]
        for index in range(args["rounds"]):
            with torch.no_grad():
                for parameter in model.parameters():  # new weights, shard by shard
                    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
                    mutate_tensor(local, index)
            if index:  # round 1 counts from before the trainer existed (its buffers included);
                rss.reset()  # later ones from the memory held between rounds (checks left out)
            cpu, workers_cpu = time.process_time(), _pool_sum(cpu_seconds, pool)
            waited_here, workers_waited = run_queue_seconds(os.getpid()), _pool_sum(run_queue_seconds, pool)
            stats = trainer.send_weights()
            # seconds this rank was ready to run but every core was taken (the workers, other ranks)
            report.setdefault("round_rank_wait", []).append(_since(waited_here, run_queue_seconds(os.getpid())))
            # CPU seconds this round took here (every thread), and on rank 0 in the workers too
            workers_cpu = _pool_sum(cpu_seconds, pool) - workers_cpu
            report.setdefault("round_cpu", []).append(time.process_time() - cpu + workers_cpu)
            report.setdefault("round_worker_cpu", []).append(workers_cpu / args["workers"])
            # seconds the workers were ready to run but every core was taken (trainer ranks, each other)
            workers_waited = _since(workers_waited, _pool_sum(run_queue_seconds, pool))
            report.setdefault("round_worker_wait", []).append(
                None if workers_waited is None else workers_waited / args["workers"])
            report.setdefault("round_peaks", []).append(rss.extra())
            peak_extra = max(peak_extra, rss.extra())
            expected = unsharded_digests(model)  # a collective on every rank, one parameter at a time
            if pool is not None:
                if any(got != expected for got in pool.digests()):
                    raise SystemExit(f"round {index + 1}: a worker differs from the trainer's unsharded state")
                report["rounds"].append({"gb_per_s": stats["gb_per_s"], "seconds": stats["seconds"],
                                         "bytes": stats["bytes"]})
            _return_free_memory()
        report["peak_extra_rss"] = peak_extra
        if args["mode"] == "gathers":  # the floor: the same gathers with nothing sent, timed the same way
            walks = []
            for _ in range(args["rounds"]):
                started = time.perf_counter()
                for _name, tensor in ModuleSource(model):
                    del tensor
                walks.append(time.perf_counter() - started)
            report["gather_only_seconds"] = statistics.median(walks)
        trainer.shutdown()
    finally:
        if pool is not None:
            pool.shutdown()
    conn.send_bytes(json.dumps(report).encode())


def _pool_sum(probe: Any, pool: Any) -> Any:
    """``probe(pid)`` summed over the pool's worker processes so far: 0 without a pool, None
    where the probe has no figure for one of them."""
    if pool is None:
        return 0.0
    values = [probe(pid) for pid in pool.pids]
    return None if None in values else sum(values)


def _since(before: float | None, after: float | None) -> float | None:
    """``after - before``, or None where either reading is missing."""
    return None if before is None or after is None else after - before


def _return_free_memory() -> None:
    """Give freed heap memory back to the OS (glibc), so RSS peaks measure what a round adds."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def mutate_tensor(tensor: Any, round_index: int) -> None:
    """Change a tensor a little (1 byte in 4093), in place: each round carries new weights."""
    if tensor.numel() == 0:
        return
    import torch

    raw = tensor.view(-1).view(torch.uint8)
    raw[(round_index * 131) % min(4093, raw.numel()) :: 4093].add_(1)


def unsharded_digests(model: Any) -> dict[str, int]:
    """CRC32 of every parameter's whole value; sharded ones gathered and dropped one by one."""
    from wtransfer.engines.rounds.manifest import tensor_checksum

    digests = {}
    for name, parameter in model.named_parameters():
        whole = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
        digests[name] = tensor_checksum(whole.detach())
        del whole
    return digests


def run_trainer(ranks: int, args: argparse.Namespace, mode: str = "writes", checksums: bool = False) -> list[dict[str, Any]]:
    """Run one configuration (1 = unsharded) in fresh processes; every rank's report.

    The ranks meet at a TCP store this process holds on a port the system picks as it binds: a port probed and
    handed to rank 0 could be taken by another process while the ranks build their models, and a file store
    polls its file (every 10 ms in torch's source) inside the timed rounds, where the ranks agree on each one."""
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,  # held until every rank reported
                     timeout=datetime.timedelta(seconds=args.timeout)) if ranks > 1 else None
    return _run_ranks(ranks, args, mode, checksums, store.port if store is not None else 0)


def _run_ranks(ranks: int, args: argparse.Namespace, mode: str, checksums: bool, port: int) -> list[dict[str, Any]]:
    options = json.dumps({"model": args.model, "dtype": args.dtype, "workers": args.workers, "mode": mode,
                          "checksums": checksums,
                          "rounds": args.rounds, "engine": args.engine, "timeout": args.timeout})
    pipes, processes = [], []
    for rank in range(ranks):
        mine, theirs = multiprocessing.Pipe(duplex=False)
        process = worker_process(_rank_main, (rank, ranks, port, options, theirs), daemon=False)  # it starts workers
        process.start()
        theirs.close()
        pipes.append(mine)
        processes.append(process)
    reports = []
    for rank, (pipe, process) in enumerate(zip(pipes, processes)):
        if not pipe.poll(args.timeout * (args.rounds + 2)):
            raise SystemExit(f"trainer rank {rank} sent no report")
        try:
            reports.append(json.loads(pipe.recv_bytes()))
        except EOFError:
            raise SystemExit(f"trainer rank {rank} died (exit code {process.exitcode})") from None
    for process in processes:
        process.join(30)
    return reports


def run(args: argparse.Namespace) -> int:
    writers = [int(r) for r in str(args.ranks).split(",") if r.strip()]
    if any(r < 2 for r in writers) or (args.gathers and args.gathers < 2):
        raise SystemExit("--ranks and --gathers take rank counts >= 2 (each is compared with one unsharded trainer)")
    if args.repeats < 1:
        raise SystemExit("--repeats takes a count >= 1")
    configurations = [("unsharded", 1, "writes", False)]  # (row, ranks, mode, checksums)
    configurations += [("writes", ranks, "writes", False) for ranks in writers]
    if args.gathers:
        configurations.append(("gathers", args.gathers, "gathers", False))
    if args.checksums:  # digests computed as the bytes move, verified by the workers before commit
        configurations.append(("unsharded+checksums", 1, "writes", True))
        if writers:
            configurations.append(("writes+checksums", writers[0], "writes", True))
    with figures_report(args, "sharded", markdown) as figures:
        print(f"{args.repeats} turn(s) of: one trainer process and FSDP2 trainer ranks (gloo default group), "
              f"{args.workers} worker(s), {args.rounds} rounds of {args.model} {args.dtype} over {args.engine}")
        runs: dict[tuple[str, int], list[list[dict[str, Any]]]] = {}
        for turn in range(args.repeats):  # in turns, so that a slow spell of the host hits every row alike
            for row, ranks, mode, checksums in configurations:
                print(f"turn {turn + 1}: {_LABELS[row]}, {ranks} rank(s)")
                runs.setdefault((row, ranks), []).append(run_trainer(ranks, args, mode, checksums))
        figures.update(summarize(args, [(row, ranks, sets) for (row, ranks), sets in runs.items()]))
        if not args.json and args.markdown is None:
            for line in markdown(figures):
                print(line)
    return 0 if figures["ok"] else 1


def summarize(args: argparse.Namespace, repeated: list[tuple[str, int, list[list[dict[str, Any]]]]]) -> dict[str, Any]:
    """Rows from every configuration's runs (each: every rank's reports): the run with the median
    GB/s stands for its configuration; memory is the worst of all runs."""
    def rate(reports: list[dict[str, Any]]) -> float:
        return statistics.median(r["gb_per_s"] for r in reports[0]["rounds"])

    def cores_busy(reports: list[dict[str, Any]]) -> float:
        """CPU seconds of every process of a round (trainer ranks, workers) per second of the round."""
        rounds = reports[0]["rounds"]
        return statistics.median(sum(r["round_cpu"][i] for r in reports) / rounds[i]["seconds"]
                                 for i in range(len(rounds)))

    def worker_busy(reports: list[dict[str, Any]]) -> float:
        """CPU seconds of one worker (the mean of them) per second of the round: near 1, the worker
        is the round's bottleneck and no trainer-side design can make the round faster."""
        rounds = reports[0]["rounds"]
        return statistics.median(reports[0]["round_worker_cpu"][i] / rounds[i]["seconds"] for i in range(len(rounds)))

    def worker_waiting(reports: list[dict[str, Any]]) -> float | None:
        """Thread-seconds one worker (the mean of them) was ready to run but found every core taken,
        per second of the round. For a worker that works on one thread (``shm``), busy + waiting
        near 1 means it never lacked buckets, only a core; what is left, it waited for buckets."""
        rounds, waits = reports[0]["rounds"], reports[0]["round_worker_wait"]
        if any(w is None for w in waits):
            return None
        return statistics.median(waits[i] / rounds[i]["seconds"] for i in range(len(rounds)))

    def ranks_waiting(reports: list[dict[str, Any]]) -> float | None:
        """Thread-seconds the trainer ranks together were ready to run but found every core taken,
        per second of the round: what a design that needs every rank at each bucket loses on a
        host with fewer cores than busy processes."""
        rounds = reports[0]["rounds"]
        if any(w is None for r in reports for w in r["round_rank_wait"]):
            return None
        return statistics.median(sum(r["round_rank_wait"][i] for r in reports) / rounds[i]["seconds"]
                                 for i in range(len(rounds)))

    runs = [(mode, ranks, median_item(sets, rate)) for mode, ranks, sets in repeated]
    every_rate = {(mode, ranks): [rate(reports) for reports in sets] for mode, ranks, sets in repeated}
    plain_rate = rate(runs[0][2])
    rows, memory = [], []
    for mode, ranks, reports in runs:
        first = reports[0]
        ratio = rate(reports) / plain_rate
        target = WRITES_TARGET_ON_SHM if mode == "writes" and args.engine == "shm" else TARGET_RATIO.get(mode)
        if mode.startswith("writes") and not first.get("wrote_shards"):
            raise SystemExit(f"the {args.engine} engine has no senders: its sharded ranks gathered (use --ranks '' "
                             f"and --gathers N to measure it)")
        rows.append({"mode": mode, "ranks": ranks, "gb_per_s": rate(reports), "runs": every_rate[(mode, ranks)],
                     "ratio": ratio, "target": target,
                     "cores_busy": cores_busy(reports), "worker_busy": worker_busy(reports),
                     "worker_waiting": worker_waiting(reports), "ranks_waiting": ranks_waiting(reports),
                     "ok": target is None or ratio >= target})
        if mode == "gathers":
            gather_rate = first["rounds"][0]["bytes"] / first["gather_only_seconds"] / 1e9
            rows.append({"mode": "gather-only", "ranks": ranks, "gb_per_s": gather_rate, "runs": None,
                         "ratio": gather_rate / plain_rate, "target": None, "cores_busy": None, "worker_busy": None,
                         "worker_waiting": None, "ranks_waiting": None,
                         "ok": True})
    for mode, ranks, sets in repeated:  # the worst of every run, rank by rank
        budget = sets[0][0]["budget"]
        for rank in range(ranks):
            held = [reports[rank] for reports in sets]
            peak = max(report["peak_extra_rss"] for report in held)
            memory.append({"mode": mode, "ranks": ranks, "rank": rank, "budget": budget, "peak_extra_rss": peak,
                           "first_round": max(report["round_peaks"][0] for report in held),
                           "later_rounds": max(max(report["round_peaks"][1:] or report["round_peaks"])
                                               for report in held),
                           "ok": peak <= budget})
    first = runs[0][2][0]
    return {
        "setup": (f"{args.model} parameters, {args.dtype}, {first['rounds'][0]['bytes'] / 1e9:.2f} GB, "
                  f"{args.engine}, {args.workers} worker(s), {args.rounds} rounds a run, {args.repeats} run(s) each in turns; "
                  f"largest parameter {first['largest_parameter'] / MIB:.0f} MiB"),
        "unsharded_gb_per_s": plain_rate, "rows": rows, "memory": memory,
        "ratio_ok": all(r["ok"] for r in rows), "memory_ok": all(m["ok"] for m in memory),
        "ok": all(r["ok"] for r in rows) and all(m["ok"] for m in memory),
    }


_LABELS = {"unsharded": "unsharded (one process)", "writes": "sharded, every rank sends its own shards",
           "gathers": "sharded, rank 0 gathers and sends", "gather-only": "FSDP gathers alone, nothing sent",
           "unsharded+checksums": "unsharded, checksums=True",
           "writes+checksums": "sharded, every rank sends its own shards, checksums=True"}


def markdown(figures: dict[str, Any]) -> list[str]:
    def target(row: dict[str, Any]) -> str:
        if row["target"] is None:
            return ""
        return f">= {row['target']}× {'ok' if row['ok'] else 'MISSED'}"

    return [
        figures["setup"] + ".", "",
        *table("throughput (whole rounds as rank 0 waits for them, medians of the rounds, from the run with the "
               "median GB/s; each run's GB/s beside it; cores busy: CPU seconds of every "
               "trainer rank and worker per second of the round; worker busy: the same for one worker, whose "
               "receiving and commit bound every design once it nears 1; waiting for a core: thread-seconds that "
               "worker's threads, and the trainer ranks' threads together, were ready to run but found every "
               "core taken, per second of the round, from the kernel's schedstat: above 1 when several threads "
               "waited at once, as gloo's own threads do)",
               ["trainer", "ranks", "GB/s", "each run's GB/s", "vs unsharded", "target", "cores busy", "worker busy",
                "worker waiting for a core", "ranks waiting for a core"],
               [[_LABELS[r["mode"]], str(r["ranks"]), f"{r['gb_per_s']:.2f}",
                 "" if r["runs"] is None else ", ".join(f"{value:.2f}" for value in r["runs"]),
                 f"{r['ratio']:.2f}×", target(r),
                 "" if r["cores_busy"] is None else f"{r['cores_busy']:.2f} of {os.cpu_count()}",
                 "" if r["worker_busy"] is None else f"{r['worker_busy']:.2f}",
                 "" if r["worker_waiting"] is None else f"{r['worker_waiting']:.2f}",
                 "" if r["ranks_waiting"] is None else f"{r['ranks_waiting']:.2f}"]
                for r in figures["rows"]]),
        "",
        *table("peak extra RSS per trainer rank (MiB, the most of any run; round 1 counts the trainer's buffers and "
               "one-time set-up)",
               ["trainer", "ranks", "rank", "round 1", "later rounds", "budget"],
               [[_LABELS[m["mode"]], str(m["ranks"]), str(m["rank"]), f"{m['first_round'] / MIB:.0f}",
                 f"{m['later_rounds'] / MIB:.0f}", f"{m['budget'] / MIB:.0f} {'ok' if m['ok'] else 'OVER'}"]
                for m in figures["memory"]]),
    ]

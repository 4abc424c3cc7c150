"""Sharded trainer vs unsharded, side by side: the same model synced from one trainer process,
then from N FSDP2 ranks (``fully_shard`` over a gloo default group, CPU), to the same number of
local workers; GB/s of the whole round as rank 0 waits for it, and peak extra RSS of every
trainer rank. Target: sharded >= 0.8x unsharded throughput, and every rank's peak extra RSS
<= buffers x bucket + the largest parameter + 64 MiB, whatever the model size. Every round is
verified bit-exactly on every worker against the trainer's unsharded state.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import time
from typing import Any

from wtransfer._bench.report import add_report_arguments, figures_report, table

TARGET_RATIO = 0.8
SLACK = 64 << 20
from wtransfer.engines._protocol import MIB  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default="shm", help="engine to measure")
    parser.add_argument("--model", default="0.5B", help="parameter count (0.5B, 100M) or shapes (4096x4096,896*24)")
    parser.add_argument("--dtype", default="bf16", help="tensor dtype (bf16, fp16, fp32)")
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks of the sharded run")
    parser.add_argument("--workers", type=int, default=1, help="local worker processes")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run (the median is reported)")
    parser.add_argument("--timeout", type=float, default=300.0, help="timeout_s of every wait")
    add_report_arguments(parser)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank_main(rank: int, ranks: int, port: int, options: str, conn: Any) -> None:
    """One trainer rank: build the model (sharded when ranks > 1), sync it, report JSON."""
    import datetime

    import torch

    from wtransfer._bench.weights import DTYPES
    from wtransfer.testing.models import build_model, parse_model, worker_model
    from wtransfer.engines._source import ModuleSource
    from wtransfer.engines._trainer import create_trainer
    from wtransfer.local import LocalWorkerPool, PeakRss

    args = json.loads(options)
    torch.set_num_threads(1)
    shapes = [[name, shape] for name, shape in parse_model(args["model"])]
    dtype = DTYPES[args["dtype"]]
    model = build_model(shapes, dtype, random=True)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    if ranks > 1:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                                timeout=datetime.timedelta(seconds=args["timeout"]))
        fully_shard(model)
    pool = None
    report: dict[str, Any] = {"rank": rank, "largest_parameter": largest, "rounds": []}
    try:
        if rank == 0:
            pool = LocalWorkerPool(args["workers"], worker_model, backend=args["engine"],
                                   factory_kwargs={"shapes": shapes, "dtype": dtype}, timeout_s=args["timeout"],
                                   torch_threads=1)
        _return_free_memory()  # set-up's freed memory must not hide the rounds' own peaks
        rss, peak_extra = PeakRss(), 0
        trainer = create_trainer(
            args["engine"], client=pool, source=ModuleSource(model), rank=rank if ranks > 1 else None,
            init_info={"world_size": args["workers"] + 1, "timeout_s": args["timeout"]} if rank == 0 else None,
        )
        if rank == 0:
            report["budget"] = trainer.num_buffers * trainer.bucket_bytes + largest + SLACK  # type: ignore[union-attr]
        for index in range(args["rounds"]):
            with torch.no_grad():
                for parameter in model.parameters():  # new weights, shard by shard
                    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
                    mutate_tensor(local, index)
            if index:  # round 1 counts from before the trainer existed (its buffers included);
                rss.reset()  # later ones from the memory held between rounds (checks left out)
            stats = trainer.send_weights()
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
        if ranks > 1:  # the floor: the same gathers with nothing sent, timed the same way on rank 0
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
    from wtransfer.engines._manifest import tensor_checksum

    digests = {}
    for name, parameter in model.named_parameters():
        whole = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
        digests[name] = tensor_checksum(whole.detach())
        del whole
    return digests


def run_trainer(ranks: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run one configuration (1 = unsharded) in fresh processes; every rank's report."""
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    options = json.dumps({"model": args.model, "dtype": args.dtype, "workers": args.workers,
                          "rounds": args.rounds, "engine": args.engine, "timeout": args.timeout})
    pipes, processes = [], []
    for rank in range(ranks):
        mine, theirs = context.Pipe(duplex=False)
        process = context.Process(target=_rank_main, args=(rank, ranks, port, options, theirs))
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
    if args.ranks < 2:
        raise SystemExit("--ranks must be >= 2 (the sharded run is compared with one unsharded trainer)")
    with figures_report(args, "sharded", markdown) as figures:
        print(f"unsharded: one trainer process, {args.workers} worker(s), {args.rounds} rounds of {args.model} "
              f"{args.dtype} over {args.engine}")
        unsharded = run_trainer(1, args)
        print(f"sharded: {args.ranks} FSDP2 trainer ranks (gloo default group)")
        sharded = run_trainer(args.ranks, args)
        figures.update(summarize(args, unsharded, sharded))
        if not args.json and args.markdown is None:
            for line in markdown(figures):
                print(line)
    return 0 if figures["ok"] else 1


def summarize(args: argparse.Namespace, unsharded: list[dict[str, Any]], sharded: list[dict[str, Any]]) -> dict[str, Any]:
    plain_rate = statistics.median(r["gb_per_s"] for r in unsharded[0]["rounds"])
    sharded_rate = statistics.median(r["gb_per_s"] for r in sharded[0]["rounds"])
    gather_rate = sharded[0]["rounds"][0]["bytes"] / sharded[0]["gather_only_seconds"] / 1e9
    budget = sharded[0]["budget"]
    def row(run: str, report: dict[str, Any]) -> dict[str, Any]:
        later = report["round_peaks"][1:] or report["round_peaks"]
        return {"run": run, "rank": report["rank"], "peak_extra_rss": report["peak_extra_rss"],
                "first_round": report["round_peaks"][0], "later_rounds": max(later)}

    ranks = [row("unsharded", unsharded[0])] + [row("sharded", r) for r in sharded]
    ratio = sharded_rate / plain_rate
    memory_ok = all(r["peak_extra_rss"] <= budget for r in ranks)
    return {
        "setup": (f"{args.model} parameters, {args.dtype}, {sharded[0]['rounds'][0]['bytes'] / 1e9:.2f} GB, "
                  f"{args.engine}, {args.workers} worker(s), {args.rounds} rounds, {args.ranks} sharded ranks; "
                  f"largest parameter {sharded[0]['largest_parameter'] / MIB:.0f} MiB"),
        "unsharded_gb_per_s": plain_rate, "sharded_gb_per_s": sharded_rate, "ratio": ratio,
        "gather_only_gb_per_s": gather_rate, "ratio_to_gather_only": sharded_rate / gather_rate,
        "ratio_target": TARGET_RATIO, "budget": budget, "ranks": ranks,
        "ok": ratio >= TARGET_RATIO and memory_ok,
        "ratio_ok": ratio >= TARGET_RATIO, "memory_ok": memory_ok,
    }


def markdown(figures: dict[str, Any]) -> list[str]:
    return [
        figures["setup"] + ".", "",
        *table("throughput (whole rounds as rank 0 waits for them, medians)", ["trainer", "GB/s", "vs unsharded", "target"],
               [["unsharded (one process)", f"{figures['unsharded_gb_per_s']:.2f}", "1.00×", ""],
                ["sharded (FSDP2 ranks)", f"{figures['sharded_gb_per_s']:.2f}", f"{figures['ratio']:.2f}×",
                 f">= {figures['ratio_target']}× {'ok' if figures['ratio_ok'] else 'MISSED'}"],
                ["FSDP gathers alone, nothing sent (the sharded floor)", f"{figures['gather_only_gb_per_s']:.2f}",
                 f"{figures['gather_only_gb_per_s'] / figures['unsharded_gb_per_s']:.2f}×",
                 f"sharded runs at {figures['ratio_to_gather_only']:.2f}× this"]]),
        "",
        *table("peak extra RSS per trainer rank (MiB; round 1 counts the trainer's buffers and one-time set-up)",
               ["run", "rank", "round 1", "later rounds", "budget"],
               [[r["run"], str(r["rank"]), f"{r['first_round'] / MIB:.0f}", f"{r['later_rounds'] / MIB:.0f}",
                 f"{figures['budget'] / MIB:.0f} {'ok' if r['peak_extra_rss'] <= figures['budget'] else 'OVER'}"]
                for r in figures["ranks"]]),
    ]

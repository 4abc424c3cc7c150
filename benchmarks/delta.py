"""Delta rounds vs dense rounds, side by side, on a real transformers Llama trained by AdamW.

One trainer process trains a bf16 Llama (built from a config, nothing downloaded) with AdamW at
the learning rates RL uses and, after every optimizer step (and before the first), syncs the same
weights three times, each to its own worker: with ``delta=True``, with a dense trainer and with
``delta="auto"``, each going first, second and last in turn (the round right after a training step can run slower;
a single step has one order, the repeated step and the sums see every place). All see exactly the same
updates; every round is checked bit-exactly on the delta and auto workers against the trainer's model.
A last step changes every element (each bf16 value moved by one unit in the last place), the
case where a delta must cost no more than dense; it runs ``--repeats`` times, and each side's median
is reported.

Runs: ``shm`` on this host, then ``gloo`` (``--link-engine``) between two network namespaces
joined by a veth pair whose both ends ``tc`` (token bucket) shapes to each ``--links`` rate: the
trainer runs in one, its worker process enters the other before it builds anything, so every byte
between them crosses a link of that rate, as between two hosts (the worker's control pipe to the
trainer is a local pipe, as the bench's worker pool has). Needs root, ``ip`` and ``tc`` for the
shaped runs; without them those rows say why they are missing.

Targets (on steps with <= 2 % of elements changed): wire bytes <= 0.1x dense; at 1 Gbit/s the
round >= 8x faster than dense; with every element changed, a delta round <= 1.05x dense time.
``delta="auto"``: each round it sends as a delta or full round <= 1.05x dense time (the repeated step: its
median), the rounds it sends dense (the dense trainer's code) <= 1.05x in their median ratio, and at 1 Gbit/s
its delta rounds with <= 2 % changed >= 8x faster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.tables import table
from wtransfer._bench.report import add_report_arguments, figures_report

WIRE_TARGET = 0.1
SPEEDUP_TARGET_AT_1GBIT = 8.0
ALL_CHANGED_TARGET = 1.05
SPARSE_STEPS_AT_MOST = 0.02
"""The steps the wire and speed targets are about: at most this fraction of elements changed."""
AUTO_TARGET = 1.05
"""``delta="auto"``: every round at most this many times a dense round's time."""
KINDS = {"dense": False, "delta": True, "auto": "auto"}
"""The trainers synced after every step, by their ``delta`` option."""
FIRST = object()
"""The step of every trainer's first round (nothing trained yet)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1536, help="Llama hidden size")
    parser.add_argument("--layers", type=int, default=14, help="Llama layers")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--lrs", default="1e-6,1e-7,1e-6,1e-5",
                        help="AdamW learning rate of each step (comma-separated; one round per step). The "
                             "first step changes the most elements (about 1.8 %% at 1e-6, near the 2 %% "
                             "the targets are stated for)")
    parser.add_argument("--links", default="1gbit,10gbit",
                        help="tc rates of the shaped runs (comma-separated; '' for none)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of the every-element step (each side's median is reported)")
    parser.add_argument("--link-engine", default="gloo", help="engine of the shaped runs")
    parser.add_argument("--timeout", type=float, default=600.0, help="timeout_s of every wait")
    parser.add_argument("--inside", default=None, help=argparse.SUPPRESS)  # a shaped run's own process
    parser.add_argument("--worker-netns", default=None, help=argparse.SUPPRESS)  # where its workers run
    parser.add_argument("--master-address", default=None, help=argparse.SUPPRESS)  # the trainer's address there
    add_report_arguments(parser)


def measure(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train, and after every step sync dense and delta; the rounds' figures."""
    import torch

    from benchmarks.probes import cpu_seconds
    from wtransfer.engines.trainer.create import create_trainer
    from wtransfer.local import LocalWorkerPool
    from wtransfer.testing.models import digests, tiny_llama

    shape = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}
    model = tiny_llama(seed=0, **shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    where = {"netns": args.worker_netns} if args.worker_netns else {}
    factory = "benchmarks.delta:llama_in_netns" if where else "wtransfer.testing.models:tiny_llama"
    pools = _start_pools(lambda: LocalWorkerPool(1, factory, backend=engine, timeout_s=args.timeout, torch_threads=1,
                                                 factory_kwargs={"seed": 1, **shape, **where}))
    trainers: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []
    try:
        for kind, pool in pools.items():
            reach = {"master_address": args.master_address} if args.master_address else {}
            trainers[kind] = create_trainer(engine, client=pool, source=model, delta=KINDS[kind],
                                            init_info={"world_size": 2, "timeout_s": args.timeout, **reach})
        lrs = [float(lr) for lr in str(args.lrs).split(",") if lr.strip()]
        for step, lr in enumerate([FIRST, *lrs, *[None] * max(1, args.repeats)]):
            if lr is FIRST:  # every trainer's first round: the whole model
                pass
            elif lr is None:  # every element moves one unit in the last place
                with torch.no_grad():
                    for parameter in model.parameters():
                        bits = parameter.data.view(-1).view(torch.int16)
                        bits.add_(1)
            else:
                for group in optimizer.param_groups:
                    group["lr"] = lr
                ids = torch.randint(0, args.vocab, (1, 32), generator=torch.Generator().manual_seed(step))
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            row: dict[str, Any] = {"step": "every element" if lr is None else
                                   "first round" if lr is FIRST else f"AdamW lr {lr:g}"}
            # each trainer takes each place in turn (the round right after a training step may run slower): the
            # repeated step's medians and the summed rows see every place; a single row has one order
            order = ["delta", "dense", "auto"][step % 3:] + ["delta", "dense", "auto"][:step % 3]
            for kind in order:
                # CPU seconds during the round, every thread: the trainer's process (the other trainers' too: they
                # wait between their rounds) and this trainer's worker
                cpu, worker_cpu = time.process_time(), sum(cpu_seconds(pid) for pid in pools[kind].pids)
                stats = trainers[kind].send_weights()
                row[kind] = {"seconds": stats["seconds"], "wire_bytes": stats["wire_bytes"], "bytes": stats["bytes"],
                             "sent_as": stats.get("delta", "dense"), "why": stats.get("delta_choice"),
                             "phases": stats["phases"],
                             "cpu_s": {"trainer": time.process_time() - cpu,
                                       "worker": sum(cpu_seconds(pid) for pid in pools[kind].pids) - worker_cpu}}
                if kind == "delta":
                    row["changed"] = stats["changed_fraction"]
            expected = digests(model)
            row["bit_exact"] = all(got == expected for kind in ("delta", "auto") for got in pools[kind].digests())
            steps.append(row)
            print(f"  {row['step']}: {row['changed']:.3%} changed; dense {row['dense']['seconds']:.2f} s, delta "
                  f"{row['delta']['seconds']:.2f} s ({row['delta']['wire_bytes'] / 1e6:.1f} MB on the wire), auto "
                  f"{row['auto']['seconds']:.2f} s ({row['auto']['sent_as']}: {row['auto']['why']}); "
                  f"bit-exact {row['bit_exact']}", file=sys.stderr)
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
        for pool in pools.values():
            pool.shutdown()
    return {"engine": engine, "model_bytes": steps[0]["dense"]["bytes"], "steps": _median_of_repeats(steps),
            "each_round": steps}


def _start_pools(start: Callable[[], Any]) -> dict[str, Any]:
    """A pool per kind of trainer (``start()`` makes one), started together: each worker imports and builds its model
    while the others do. A small run (``--hidden 64 --layers 1 --vocab 256 --repeats 2``, every link) took 50-59 s so,
    against 66-73 s starting them one after another (3 runs each, interleaved; a 2-core AMD EPYC). If any start
    fails, those that started are shut down before its error is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(KINDS)) as starting:
        futures = {kind: starting.submit(start) for kind in KINDS}
    errors = {kind: future.exception() for kind, future in futures.items()}
    pools = {kind: futures[kind].result() for kind, error in errors.items() if error is None}
    failed = [error for error in errors.values() if error is not None]
    if failed:
        for pool in pools.values():
            pool.shutdown()
        raise failed[0]
    return pools


def _median_of_repeats(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The repeated 'every element' step as one row: each side's median time (this host is noisy;
    one round of each is a coin toss within a few per cent), bit-exact only if every repeat was."""
    repeats = [row for row in steps if row["step"] == "every element"]
    if len(repeats) < 2:
        return steps
    merged = {**repeats[0], "step": f"every element, median of {len(repeats)}",
              "bit_exact": all(row["bit_exact"] for row in repeats),
              "changed": statistics.median(row["changed"] for row in repeats)}
    for kind in KINDS:
        sent = [row[kind]["sent_as"] for row in repeats]  # auto may change its choice between repeats
        middle = sorted(repeats, key=lambda row: row[kind]["seconds"])[len(repeats) // 2][kind]
        merged[kind] = {**repeats[0][kind], "seconds": statistics.median(row[kind]["seconds"] for row in repeats),
                        "each": [row[kind]["seconds"] for row in repeats],
                        "middle": middle,  # one whole round: its phases, time and CPU together
                        "sent_as": sent[0] if len(set(sent)) == 1 else ", ".join(sent)}
    return [row for row in steps if row["step"] != "every element"] + [merged]


def llama_in_netns(netns: str, **kwargs: Any) -> Any:
    """A worker's model factory: enter network namespace ``netns`` first (the worker's "host")."""
    import ctypes

    from wtransfer.testing.models import tiny_llama

    clone_newnet = 0x40000000
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {netns}")
    finally:
        os.close(fd)
    return tiny_llama(**kwargs)


def _shaped(rate: str, args: argparse.Namespace) -> dict[str, Any]:
    """A run of this suite between two new network namespaces joined by a veth shaped to ``rate``."""
    label = f"{args.link_engine}, {rate} link"
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return {"link": label, "error": "needs root, ip and tc"}
    tag = f"{os.getpid() % 100000}"
    trainer_ns, worker_ns = f"wtbt{tag}", f"wtbw{tag}"

    def ip(*words: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", *words], capture_output=True, text=True)

    try:
        for ns in (trainer_ns, worker_ns):
            made = ip("netns", "add", ns)
            if made.returncode:
                return {"link": label, "error": f"cannot create a network namespace: {made.stderr.strip()}"}
        made = ip("link", "add", f"{trainer_ns}v", "type", "veth", "peer", "name", f"{worker_ns}v")
        if made.returncode:
            return {"link": label, "error": f"cannot create a veth pair: {made.stderr.strip()}"}
        for ns, address in ((trainer_ns, "10.213.9.1"), (worker_ns, "10.213.9.2")):
            ip("link", "set", f"{ns}v", "netns", ns)
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", f"{ns}v")
            ip("-n", ns, "link", "set", f"{ns}v", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            # both directions shaped; the queue is bounded by latency, a burst holds a few packets
            shaped = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", f"{ns}v", "root", "tbf", "rate", rate,
                                     "burst", "1mb", "latency", "100ms"], capture_output=True, text=True)
            if shaped.returncode:
                return {"link": label, "error": f"tc cannot shape the link: {shaped.stderr.strip()}"}
        command = [sys.executable, "-m", "benchmarks", "delta", "--inside", args.link_engine,
                   "--worker-netns", worker_ns, "--master-address", "10.213.9.1", "--hidden", str(args.hidden), "--layers", str(args.layers),
                   "--vocab", str(args.vocab), "--lrs", str(args.lrs), "--repeats", str(args.repeats),
                   "--timeout", str(args.timeout)]
        run = subprocess.run(["ip", "netns", "exec", trainer_ns, *command], capture_output=True, text=True)
        sys.stderr.write(run.stderr)
        if run.returncode:
            return {"link": label, "error": f"the shaped run failed (exit {run.returncode})"}
        return {"link": label, "rate": rate, **json.loads(run.stdout)}
    finally:
        for ns in (trainer_ns, worker_ns):
            ip("netns", "del", ns)  # the veth goes with them


def run(args: argparse.Namespace) -> int:
    if args.inside:
        print(json.dumps(measure(args.inside, args)))
        return 0
    with figures_report(args, "delta", markdown) as figures:
        print(f"shm: dense and delta rounds after each AdamW step (Llama hidden {args.hidden}, {args.layers} layers)")
        runs = [{"link": "shm, this host", **measure("shm", args)}]
        for rate in [r.strip() for r in str(args.links).split(",") if r.strip()]:
            print(f"{args.link_engine} between two network namespaces, a veth shaped to {rate}")
            runs.append(_shaped(rate, args))
        figures.update(summarize(runs))
        if not args.json and args.markdown is None:
            for line in markdown(figures):
                print(line)
    return 0 if figures["ok"] else 1


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rows, ok = [], True
    for run in runs:
        if "error" in run:
            rows.append({"link": run["link"], "error": run["error"]})
            ok = False
            continue
        for step in run["steps"]:
            dense, delta, auto = step["dense"], step["delta"], step["auto"]
            one = delta.get("middle", delta)  # the round whose phases are shown (a repeated step: its middle one)
            wire = delta["wire_bytes"] / max(dense["wire_bytes"], 1)
            speedup = dense["seconds"] / delta["seconds"]
            auto_cost = auto["seconds"] / dense["seconds"]
            # a round auto sent dense is a dense round (the same code): its time is judged in the link's sum
            checks = [] if auto["sent_as"] == "dense" else [("auto", auto_cost <= AUTO_TARGET,
                                                              f"auto <= {AUTO_TARGET}× dense")]
            if run.get("rate") == "1gbit" and auto["sent_as"] == "delta" and step["changed"] <= SPARSE_STEPS_AT_MOST:
                checks.append(("auto speed", 1 / auto_cost >= SPEEDUP_TARGET_AT_1GBIT,
                               f"auto >= {SPEEDUP_TARGET_AT_1GBIT:g}× faster"))
            if step["step"] == "first round":
                pass  # the delta trainer's first round fills its base: no target of its own
            elif step["changed"] <= SPARSE_STEPS_AT_MOST:
                checks.append(("wire", wire <= WIRE_TARGET, f"wire <= {WIRE_TARGET}×"))
                if run.get("rate") == "1gbit":
                    checks.append(("speed", speedup >= SPEEDUP_TARGET_AT_1GBIT, f">= {SPEEDUP_TARGET_AT_1GBIT:g}× faster"))
            if step["step"].startswith("every element"):
                checks.append(("cost", 1 / speedup <= ALL_CHANGED_TARGET, f"time <= {ALL_CHANGED_TARGET}× dense"))
            verdict = "; ".join(f"{label} {'ok' if good else 'MISSED'}" for _, good, label in checks)
            good = all(g for _, g, _ in checks) and step["bit_exact"]
            ok = ok and good
            rows.append({"link": run["link"], "step": step["step"], "changed": step["changed"],
                         "dense_s": dense["seconds"], "delta_s": delta["seconds"],
                         "dense_gb_per_s": dense["bytes"] / dense["seconds"] / 1e9,
                         "delta_gb_per_s": delta["bytes"] / delta["seconds"] / 1e9,
                         "wire_bytes": delta["wire_bytes"], "wire_ratio": wire, "speedup": speedup,
                         "auto_gb_per_s": auto["bytes"] / auto["seconds"] / 1e9, "auto_sent_as": auto["sent_as"],
                         "auto_why": auto["why"], "auto_cost": auto_cost, "delta_phases": one["phases"],
                         "delta_round_s": one["seconds"], "delta_cpu_s": one["cpu_s"],
                         "bit_exact": step["bit_exact"], "verdict": verdict or "(no target)", "ok": good})
        rows.append(_summed(run["link"], run["each_round"]))
        ok = ok and rows[-1]["ok"]
    model_bytes = next((run["model_bytes"] for run in runs if "model_bytes" in run), 0)
    return {"model_bytes": model_bytes, "rows": rows, "ok": ok}


def _summed(link: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A link's rounds together (every repeat counted). Its verdict is on the rounds auto sent dense: the same
    code as the dense trainer's, so any cost of auto's own shows as their median ratio (one slow round of the
    host's, in either trainer, does not); auto's full and delta rounds are judged on their own rows."""
    seconds = {kind: sum(step[kind]["seconds"] for step in steps) for kind in KINDS}
    model = sum(step["dense"]["bytes"] for step in steps)
    wire = sum(step["delta"]["wire_bytes"] for step in steps)
    auto_cost = seconds["auto"] / seconds["dense"]
    dense_ratios = [step["auto"]["seconds"] / step["dense"]["seconds"] for step in steps
                    if step["auto"]["sent_as"] == "dense"]
    median = statistics.median(dense_ratios) if dense_ratios else None
    good = median is None or median <= AUTO_TARGET
    verdict = ("auto sent no round dense" if median is None else
               f"auto's dense rounds: median {median:.2f}× dense; <= {AUTO_TARGET}× {'ok' if good else 'MISSED'}")
    return {"link": link, "step": "all rounds, summed", "changed": None, "dense_s": seconds["dense"],
            "delta_s": seconds["delta"], "dense_gb_per_s": model / seconds["dense"] / 1e9,
            "delta_gb_per_s": model / seconds["delta"] / 1e9, "wire_bytes": wire, "wire_ratio": wire / model,
            "speedup": seconds["dense"] / seconds["delta"], "auto_gb_per_s": model / seconds["auto"] / 1e9,
            "auto_sent_as": "", "auto_why": None, "auto_cost": auto_cost,
            "bit_exact": all(step["bit_exact"] for step in steps),
            "verdict": verdict, "ok": good}


def markdown(figures: dict[str, Any]) -> list[str]:
    def cells(row: dict[str, Any]) -> list[str]:
        if "error" in row:
            return [row["link"], "not measured", "", "", "", "", "", "", "", "", "", row["error"]]
        changed = "" if row["changed"] is None else f"{row['changed']:.3%}"
        return [row["link"], row["step"], changed, f"{row['dense_gb_per_s']:.2f}",
                f"{row['delta_gb_per_s']:.2f}", f"{row['wire_bytes'] / 1e6:.1f}", f"{row['wire_ratio']:.4f}×",
                f"{row['speedup']:.2f}×", f"{row['auto_gb_per_s']:.2f}", row["auto_sent_as"],
                f"{row['auto_cost']:.2f}×", ("bit-exact; " if row["bit_exact"] else "NOT bit-exact; ") + row["verdict"]]

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def phases(row: dict[str, Any]) -> list[str]:
        took, whole, cpu = row["delta_phases"], row["delta_round_s"], row["delta_cpu_s"]
        parts = [took.get("encode", 0.0), took.get("send", 0.0), took.get("commit", 0.0)]
        return [row["link"], row["step"], f"{row['dense_s']:.3f}", f"{row['dense_s'] / SPEEDUP_TARGET_AT_1GBIT:.3f}",
                f"{whole:.3f}", *(f"{part:.3f}" for part in parts), f"{whole - sum(parts):.3f}",
                f"{cpu['trainer']:.2f}", f"{cpu['worker']:.2f}", f"{(cpu['trainer'] + cpu['worker']) / cores:.3f}"]

    return [
        f"A transformers Llama of {figures['model_bytes'] / 1e9:.2f} GB (bf16), one AdamW step per round, "
        f"synced to one worker each by a dense, a delta=True and a delta=\"auto\" trainer (the same updates).",
        "",
        *table("dense, delta and auto rounds (GB/s: model bytes per second of the whole round, encoding included)",
               ["link", "step", "changed", "dense GB/s", "delta GB/s", "delta wire MB", "wire vs dense",
                "delta speed-up", "auto GB/s", "auto sent", "auto time vs dense", "verdict"],
               [cells(row) for row in figures["rows"]]),
        "",
        *table("where a delta=True round's time goes (seconds): the encoding before the round's first byte, the "
               "send (the changed bytes on the link, the encoding's deferred part, and the wait for the worker to rebuild, "
               "check and stage them), "
               "the commit, and the rest (plan, start, the client's calls); the CPU seconds the trainer's process and "
               f"its worker's took during it (every thread), and their sum over the {cores} cores the run may use: "
               "a lower bound on the round as it ran",
               ["link", "step", "dense round", f"dense ÷ {SPEEDUP_TARGET_AT_1GBIT:g}", "delta round", "encode",
                "send", "commit", "rest", "trainer CPU", "worker CPU", "CPU ÷ cores"],
               [phases(row) for row in figures["rows"] if "delta_phases" in row]),
    ]

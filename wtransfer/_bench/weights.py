"""Weight sync, trainer -> N local workers, verified bit-exactly every round; with --compare,
the peers a user would otherwise pick, measured in the same run on the same tensors."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wtransfer._bench.machine import LoadWatch
from wtransfer._bench.ring_peer import RING_PIPELINE, RingPipeline
from wtransfer._bench.report import MarkdownLines, MarkdownTable, add_report_arguments, figures_report
from wtransfer.engines.channel.protocol import MIB
from wtransfer._fork_server import worker_process

if TYPE_CHECKING:
    import torch

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64",
          "fp8": "float8_e4m3fn", "int8": "int8"}  # fmt: skip
RSS_SLACK = 64 * MIB


# -- measurements --------------------------------------------------------------------------------
@dataclass
class EngineResult:
    engine: str
    """The row's name: the engine, and its commit mode (``shm atomic``), or a labelled variant."""
    rounds: list[dict[str, Any]] = field(default_factory=list)
    trainer_extra_rss: int = 0
    worker_extra_rss: list[int] = field(default_factory=list)
    rss_budget: int = 0
    staging_segments: int = 0
    """Distinct host staging copies the workers mapped (atomic rounds: one per node)."""
    staging_bytes: int = 0

    @property
    def gb_per_s(self) -> float:
        return statistics.median(r["gb_per_s"] for r in self.rounds)

    def paired_ratio(self, peer: str) -> float | None:
        """Median over rounds of (round GB/s / that peer's GB/s measured right after the round)."""
        pairs = self.round_ratios(peer)
        return statistics.median(pairs) if pairs else None

    def round_ratios(self, peer: str) -> list[float]:
        """Each round's GB/s over ``peer``'s measured right after it (the rounds that measured it)."""
        return [r["gb_per_s"] / r["peers_gb_per_s"][peer] for r in self.rounds if peer in r.get("peers_gb_per_s", {})]

    def paired_peers(self) -> dict[str, float]:
        """Median GB/s of every peer measured alongside this engine's rounds."""
        names = {name for r in self.rounds for name in r.get("peers_gb_per_s", {})}
        return {name: statistics.median(r["peers_gb_per_s"][name] for r in self.rounds) for name in sorted(names)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineResult:
        return cls(data["engine"], data["rounds"], data["trainer_peak_extra_rss"], data["worker_peak_extra_rss"],
                   data["rss_budget"], data.get("staging_segments", 0), data.get("staging_bytes", 0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "median_gb_per_s": self.gb_per_s,
            "rounds": self.rounds,
            "trainer_peak_extra_rss": self.trainer_extra_rss,
            "worker_peak_extra_rss": self.worker_extra_rss,
            "rss_budget": self.rss_budget,
            "staging_segments": self.staging_segments,
            "staging_bytes": self.staging_bytes,
        }


STAGED_FLOOR = "memcpy into staging, then into the model"
"""shm's atomic floor: the model's bytes copied twice (into the node's staged copy, then into the model) at the
memcpy rate measured right after the round."""
GLOO_STAGED_FLOOR = "gloo raw at its best, then memcpy into the model"
"""gloo's atomic floor: the round received into the staged copy at raw gloo's best rate, then copied into the
model at the memcpy rate, one after the other (the commit waits for the round)."""


def run_engine(
    engine: str,
    model: torch.nn.Module,
    shapes: list[list[Any]],
    args: argparse.Namespace,
    advance: Callable[[str], None],
    references: dict[str, Callable[[], float]] | None = None,
    commit: str = "streaming",
    label: str | None = None,
    checksums: bool = False,
    share_source: bool = False,
) -> EngineResult:
    """Sync ``model`` ``args.rounds`` times, verifying every worker after each round.

    ``references`` (peer name -> GB/s on the same tensors) are measured right after each round, so a change of the
    machine's load during the run skews both alike."""
    from wtransfer._probes import PeakRss, staging_segments
    from wtransfer.engines.rounds.source import ModuleSource
    from wtransfer.engines.trainer.create import create_trainer
    from wtransfer.local import LocalWorkerPool
    from wtransfer.testing.models import digests, mutate, worker_model

    label = label or f"{engine} {commit}" + (" + checksums" if checksums else "") + (
        " + shared source" if share_source else "")
    result = EngineResult(label)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    kwargs = {"shapes": shapes, "dtype": DTYPES[args.dtype]}
    with LocalWorkerPool(
        args.workers, worker_model, backend=engine, factory_kwargs=kwargs, timeout_s=args.timeout,
        torch_threads=args.worker_threads,
    ) as pool:
        advance(f"{label}: {args.workers} worker(s) started")
        init_info: dict[str, Any] = {"world_size": pool.world_size, "timeout_s": args.timeout, **_geometry(args)}
        if share_source:
            init_info["share_source"] = True
        rss = PeakRss()
        trainer = create_trainer(engine, client=pool, source=ModuleSource(model), init_info=init_info, commit=commit,
                                 checksums=checksums)
        try:
            # atomic: a worker may also hold (map) its node's staged copy of the model
            staged = total if commit == "atomic" else 0
            ring = 0 if getattr(trainer, "staged_bytes", 0) else trainer.num_buffers * trainer.bucket_bytes
            result.rss_budget = ring + RSS_SLACK + staged  # the staged copy: shm's trainer holds it, workers map it
            for index in range(args.rounds):
                mutate(model, index + 1)
                stats = trainer.send_weights()
                expected = digests(model)
                for rank, got in enumerate(pool.digests()):
                    if got != expected:
                        bad = [n for n in expected if got.get(n) != expected[n]]
                        raise SystemExit(f"round {index + 1}: worker {rank} differs in {len(bad)} tensor(s), e.g. {bad[:3]}")
                stats["verified_workers"] = args.workers
                stats["worker_phases"] = _slowest_phases([s["round_seconds"] for s in pool.stats()])
                if references:  # the peers' own memory must not count as the engine's
                    result.trainer_extra_rss = max(result.trainer_extra_rss, rss.extra())
                    stats["peers_gb_per_s"] = {name: measure() for name, measure in references.items()}
                    measured = stats["peers_gb_per_s"]
                    if commit == "atomic" and "memcpy" in measured:
                        measured[STAGED_FLOOR] = measured["memcpy"] / 2
                        raw = [measured[p] for p in _BEST_OF[RAW_BEST] if p in measured]
                        if raw:
                            measured[GLOO_STAGED_FLOOR] = 1 / (1 / max(raw) + 1 / measured["memcpy"])
                    rss.restart_peak()
                result.rounds.append(stats)
                advance(f"{label} round {index + 1}: {stats['gb_per_s']:.2f} GB/s, verified")
            result.trainer_extra_rss = max(result.trainer_extra_rss, rss.extra())
            result.worker_extra_rss = [s["peak_extra_rss"] for s in pool.stats()]
            segments = staging_segments(pool.pids)
            result.staging_segments, result.staging_bytes = len(segments), sum(segments.values())
        finally:
            trainer.shutdown()
            rss.close()
            if share_source:  # the next rows read the model from the trainer's own memory again
                import torch

                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.data = parameter.data.clone()
    return result


def _slowest_phases(workers: list[dict[str, float]]) -> dict[str, float]:
    """Per phase, the slowest worker's seconds: the round waits for the last one."""
    return {name: max(w.get(name, 0.0) for w in workers) for name in {n for w in workers for n in w}}


def _best_copies(tensors: list[torch.Tensor], sets: int) -> tuple[list[list[Any]], Callable[[list[Any]], None]]:
    """``sets`` sets of resident destinations for ``tensors`` as byte views (allocated and touched here, before any
    engine runs, so they never count in an engine's peak RSS), and a copy of every tensor into one set done as well
    as this machine can: into memory nothing reads back soon, past the caches (``copy_out``), as wtransfer's own
    copies into a model are made. The views are made once, outside the timed copies."""
    from wtransfer.engines.rounds.kernels import copy_out
    from wtransfer.engines.rounds.packing import host_bytes

    sources = [host_bytes(t) for t in tensors]
    if any(source is None for source in sources):
        raise ValueError("the copy peers copy contiguous CPU tensors only")

    def copy_all(into: list[Any]) -> None:
        for dst, src in zip(into, sources):
            copy_out(dst, src)

    return [[host_bytes(t.clone()) for t in tensors] for _ in range(sets)], copy_all


def memcpy_reference(tensors: list[torch.Tensor]) -> Callable[[], float]:
    """A callable measuring GB/s of one copy of every tensor into resident memory, at its best (:func:`_best_copies`)."""
    (destinations,), copy_all = _best_copies(tensors, 1)
    total = sum(t.numel() * t.element_size() for t in tensors)

    def measure() -> float:
        start = time.perf_counter()
        copy_all(destinations)
        return total / (time.perf_counter() - start) / 1e9

    return measure


TWO_COPIES = "two memcpys at once (two threads)"
"""shm streaming's bound where memory bandwidth, not a core, limits: its trainer packs each bucket while its worker
copies the last one out, so the model's bytes are copied twice at the same time."""


def two_copies_reference(tensors: list[torch.Tensor]) -> Callable[[], float]:
    """GB/s of the model, copied twice at once: each of two threads copies every tensor into its own resident
    destinations, at its best (:func:`_best_copies`), timed until both are done."""
    import threading

    destinations, copy_all = _best_copies(tensors, 2)
    total = sum(t.numel() * t.element_size() for t in tensors)

    def measure() -> float:
        other = threading.Thread(target=copy_all, args=(destinations[1],))
        start = time.perf_counter()
        other.start()
        copy_all(destinations[0])
        other.join()
        return total / (time.perf_counter() - start) / 1e9

    return measure


def _geometry(args: argparse.Namespace) -> dict[str, int]:
    """The trainer ``init_info`` entries ``--bucket-mb`` and ``--num-buffers`` set (none: the engine's defaults)."""
    given = {"bucket_bytes": int(args.bucket_mb * MIB) // 64 * 64 if args.bucket_mb else 0,
             "num_buffers": args.num_buffers or 0}
    return {key: value for key, value in given.items() if value}


def _shm_ring_geometry(args: argparse.Namespace) -> tuple[int, int]:
    """The ``shm`` trainer's bucket bytes and buffer count in this run: the flags', else its defaults."""
    import dataclasses

    from wtransfer.engines.shm.trainer import SharedMemoryInitOptions

    geometry = {f.name: f.default for f in dataclasses.fields(SharedMemoryInitOptions)} | _geometry(args)
    return geometry["bucket_bytes"], geometry["num_buffers"]


def safetensors_reference(tensors: list[torch.Tensor]) -> Callable[[], float]:
    """GB/s of ``safetensors`` save to /dev/shm, load back and copy into the resident model (the engines' figures
    include that copy too); the file is removed after every measurement."""
    from safetensors.torch import load_file, save_file

    from wtransfer.engines.rounds.packing import copy_tensor

    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"wtransfer-bench-{os.getpid()}.safetensors")
    named = {f"t{i}": t for i, t in enumerate(tensors)}
    destinations = {name: t.clone() for name, t in named.items()}
    total = sum(t.numel() * t.element_size() for t in tensors)

    def measure() -> float:
        start = time.perf_counter()
        try:
            save_file(named, path)
            for name, tensor in load_file(path).items():
                copy_tensor(destinations[name], tensor)
        finally:
            if os.path.exists(path):
                os.unlink(path)
        return total / (time.perf_counter() - start) / 1e9

    return measure


def peer_share_memory(tensors: list[torch.Tensor], repeats: int) -> float:
    """``torch.multiprocessing`` style: a fresh ``share_memory_()`` copy per update, then loaded."""
    from wtransfer.engines.rounds.packing import copy_tensor

    destinations = [t.clone() for t in tensors]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for dst, src in zip(destinations, tensors):
            shared = src.clone().share_memory_()
            copy_tensor(dst, shared)
            del shared
        times.append(time.perf_counter() - start)
    return statistics.median(times)


_STOP, _ONE_TENSOR, _PER_TENSOR, _PER_TENSOR_LOOP, _CHUNKED = 0, 1, 2, 3, 4


def raw_geometry() -> tuple[int, int, int]:
    """The gloo engine's default (channels, bucket bytes, buffers): the raw peer uses the same."""
    from wtransfer.engines.gloo import GlooTrainer

    defaults = {row["name"]: row["default"] for row in GlooTrainer.describe_init_options()}
    return defaults["channels"], defaults["bucket_bytes"], defaults["num_buffers"]


def chunked_broadcast(backend: Any, groups: list[Any], flat: torch.Tensor, chunk: int, in_flight: int) -> None:
    """Raw gloo at its best: ``flat`` in ``chunk``-byte async broadcasts, round-robin over ``groups``, at most
    ``in_flight`` outstanding (the engine's channels and ring, no packing)."""
    works: list[Any] = []
    for index, start in enumerate(range(0, flat.numel(), chunk)):
        if len(works) >= in_flight:
            works.pop(0).wait()
        works.append(backend.broadcast(groups[index % len(groups)], flat[start : start + chunk]))
    for work in works:
        work.wait()


def _gloo_peer_receiver(port: int, spec: str, timeout_s: float, rank: int, size: int) -> None:
    """Helper process for :class:`GlooPeer`: receives whatever the command broadcast asks for."""
    import torch
    from torch.distributed import PrefixStore, TCPStore

    from wtransfer.engines.rounds.manifest import dtype_from_name
    from wtransfer.engines.rounds.packing import copy_tensor
    from wtransfer.engines.torch_distributed.backend import TorchDistributedBackend

    torch.set_num_threads(1)
    shapes, dtype = json.loads(spec)
    store = TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=timeout_s))
    backend = TorchDistributedBackend()
    group = backend.make_process_group(PrefixStore("bench/", store), rank, size, timeout_s)
    channels, chunk, in_flight = raw_geometry()
    groups = backend.make_groups(PrefixStore("bench-raw/", store), rank, size, timeout_s, channels)
    tensors = [torch.zeros(s, dtype=dtype_from_name(dtype)) for s in shapes]
    flat = torch.zeros(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)
    command = torch.zeros(1, dtype=torch.int64)
    while True:
        backend.broadcast(group, command).wait()
        op = int(command.item())
        if op == _STOP:
            break
        if op == _PER_TENSOR:
            for tensor in tensors:
                backend.broadcast(group, tensor).wait()
        elif op == _PER_TENSOR_LOOP:
            for tensor in tensors:  # as vLLM's unpacked path: a fresh tensor, then load_weights
                received = torch.empty(tensor.shape, dtype=tensor.dtype)
                backend.broadcast(group, received).wait()
                copy_tensor(tensor, received)
                del received
        elif op == _CHUNKED:
            chunked_broadcast(backend, groups, flat, chunk, in_flight)
        else:
            backend.broadcast(group, flat).wait()
    del group, groups


class GlooPeer:
    """The plain gloo alternatives, against ``receivers`` helper processes (one per engine worker) holding the same
    tensors; it has its own groups, so it can be measured between an engine's rounds.

    ``per_tensor()``: one synchronous broadcast per tensor, received in place (no allocation, no load step);
    ``per_tensor_loop()``: the same as vLLM's unpacked path runs it, into a fresh tensor, then loaded into the model;
    ``one_tensor()``: a single broadcast of all the bytes, on one group;
    ``chunked()``: raw gloo at its best with the engine's geometry (bucket-sized async broadcasts over as many groups
    as it has channels, as many in flight as it has buffers; no packing, no manifest). The engine's ceiling is the
    better of the last two.
    """

    def __init__(
        self, tensors: list[torch.Tensor], shapes: list[list[Any]], dtype: str, timeout_s: float = 1800.0,
        receivers: int = 1,
    ) -> None:
        import torch
        from torch.distributed import PrefixStore, TCPStore

        from wtransfer.engines.torch_distributed.backend import TorchDistributedBackend

        self.tensors = tensors
        self.total = sum(t.numel() * t.element_size() for t in tensors)
        self.flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
        self._backend = TorchDistributedBackend()
        self._store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        spec = json.dumps([[shape for _, shape, *_ in shapes], dtype])
        size = receivers + 1
        self._helpers = [
            worker_process(_gloo_peer_receiver, (int(self._store.port), spec, timeout_s, rank, size))
            for rank in range(1, size)
        ]
        for helper in self._helpers:
            helper.start()
        self._group: Any = self._backend.make_process_group(PrefixStore("bench/", self._store), 0, size, timeout_s)
        self.channels, self._chunk, self._in_flight = raw_geometry()
        self._groups: list[Any] = self._backend.make_groups(
            PrefixStore("bench-raw/", self._store), 0, size, timeout_s, self.channels
        )
        self._command = torch.zeros(1, dtype=torch.int64)

    def _order(self, op: int) -> None:
        self._command.fill_(op)
        self._backend.broadcast(self._group, self._command).wait()

    def one_tensor(self) -> float:
        self._order(_ONE_TENSOR)
        start = time.perf_counter()
        self._backend.broadcast(self._group, self.flat).wait()
        return self.total / (time.perf_counter() - start) / 1e9

    def chunked(self) -> float:
        self._order(_CHUNKED)
        start = time.perf_counter()
        chunked_broadcast(self._backend, self._groups, self.flat, self._chunk, self._in_flight)
        return self.total / (time.perf_counter() - start) / 1e9

    def per_tensor(self) -> float:
        return self._each_tensor(_PER_TENSOR)

    def per_tensor_loop(self) -> float:
        return self._each_tensor(_PER_TENSOR_LOOP)

    def _each_tensor(self, op: int) -> float:
        self._order(op)
        start = time.perf_counter()
        for tensor in self.tensors:
            self._backend.broadcast(self._group, tensor).wait()
        return self.total / (time.perf_counter() - start) / 1e9

    def close(self) -> None:
        try:
            self._order(_STOP)
        finally:
            self._group = None
            self._groups = []
            for helper in self._helpers:
                helper.join(30)
                if helper.is_alive():
                    helper.kill()
                    helper.join(5)


# -- the command ------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default="shm", help="engine(s) to measure, comma-separated")
    parser.add_argument("--model", default="0.5B", help="parameter count (0.5B, 100M) or shapes (4096x4096,896*24)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="tensor dtype")
    parser.add_argument("--workers", type=int, default=1, help="number of local worker processes")
    parser.add_argument("--rounds", type=int, default=10, help="update rounds per engine")
    parser.add_argument("--commit", default="streaming,atomic",
                        help="commit mode(s) to measure, comma-separated: streaming (buffers only) and atomic "
                             "(staged in one host copy per node, loaded at commit): each gets its own rows")
    parser.add_argument("--bucket-mb", type=float, default=None, help="bucket size in MiB (None: the engine's)")
    parser.add_argument("--num-buffers", type=int, default=None, help="buffers in rotation (None: the engine's)")
    parser.add_argument("--compare", action="store_true", help="also measure memcpy, per-tensor gloo, safetensors, share_memory_")
    parser.add_argument("--small-model", default="8192*2048",
                        help="with --compare and gloo: the many-small-tensors model for the per-tensor comparison "
                             "(8192*2048: 2048 tensors of 8192 elements)")
    parser.add_argument("--ring-peer", action="store_true",
                        help="also measure shm streaming's pipeline without wtransfer: the engine's buckets through a "
                             "ring of the same geometry into one helper process, after every shm round (--workers 1)")
    parser.add_argument("--timeout", type=float, default=120.0, help="timeout_s of every wait")
    parser.add_argument("--share-source", action="store_true",
                        help="also run shm atomic with share_source=True (the trainer's tensors live in the staged "
                             "copy, so a round copies once, into the workers' models), side by side")
    parser.add_argument("--checksums", action="store_true",
                        help="also run every engine and commit with checksums=True, side by side (its cost)")
    parser.add_argument("--strict-targets", action="store_true",
                        help="exit 1 when a speed or memory target is missed (for CI); without it a missed target "
                             "is reported in words and the exit status says only whether every round was verified")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the trainer process, for the engine and every peer alike (0 = torch's)")
    parser.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker (0 = torch's)")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="measure nothing: read what an earlier run printed with --json (here or on another "
                             "host), work its targets out again from its rounds, and print its tables and verdicts")
    add_report_arguments(parser)


def _console(quiet: bool) -> Any:
    """Where tables go: stdout for people, stderr under --json or --markdown; whole tables in a log or a pipe."""
    from rich.console import Console

    console = Console(stderr=quiet)
    return console if console.is_terminal else Console(stderr=quiet, width=200)


def run(args: argparse.Namespace) -> int:
    if args.from_json is not None:
        return _from_json(args)
    watch = LoadWatch()  # before anything of the run's own loads the machine
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from wtransfer.errors import WTransferError
    from wtransfer._registry.registry import get_class
    from wtransfer.testing.models import build_model, parse_model

    quiet = args.json or args.markdown is not None  # tables go to stdout only for people
    console = _console(quiet)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    for engine in engines:  # names first: a typo must not cost a model build and a worker start
        try:
            get_class("engines", engine)
        except WTransferError as exc:
            console.print(f"[red]error:[/red] {exc}")
            return 2
    if args.workers < 1 or args.rounds < 1:
        console.print("[red]--workers and --rounds must be >= 1[/red]")
        return 2
    if args.ring_peer and args.workers != 1:
        console.print("[red]--ring-peer measures the pipeline into one process: use it with --workers 1[/red]")
        return 2
    commits = [c.strip() for c in args.commit.split(",") if c.strip()]
    if not commits or any(c not in ("streaming", "atomic") for c in commits):
        console.print(f"[red]--commit takes streaming and/or atomic, got {args.commit!r}[/red]")
        return 2
    shapes = [[name, shape] for name, shape in parse_model(args.model)]
    dtype = DTYPES[args.dtype]
    model = build_model(shapes, dtype, random=True)
    tensors = [p.data for p in model.parameters()]
    total = sum(t.numel() * t.element_size() for t in tensors)
    console.print(
        f"model: {len(tensors)} tensors, {sum(t.numel() for t in tensors) / 1e6:.0f}M parameters, "
        f"{total / 1e9:.2f} GB {dtype}; {args.workers} worker(s), {args.rounds} round(s)"
    )
    small_gloo = args.compare and "gloo" in engines
    steps = len(engines) * len(commits) * (args.rounds + 1) * (2 if args.checksums else 1) + (2 if args.compare else 1) + (
        args.rounds + 1 if args.share_source and "shm" in engines and "atomic" in commits else 0) + (args.rounds + 2 if small_gloo else 0)
    results: list[EngineResult] = []
    peers: dict[str, float] = {}
    gloo_peer: GlooPeer | None = None
    references: dict[str, Callable[[], float]] = {}
    # memcpy is always measured (the engine is checked against it in every run); every reference allocates its
    # memory now, before any engine's RSS is measured.
    references["memcpy"] = memcpy_reference(tensors)
    if args.compare:
        references["safetensors save+load (/dev/shm)"] = safetensors_reference(tensors)
        references[TWO_COPIES] = two_copies_reference(tensors)
        gloo_peer = GlooPeer(tensors, shapes, dtype, receivers=args.workers)
        references["gloo one-tensor broadcast"] = gloo_peer.one_tensor
        references[RAW_CHUNKED] = gloo_peer.chunked
        references["gloo per-tensor broadcast"] = gloo_peer.per_tensor
        references["gloo per-tensor, new tensor + load (vLLM loop)"] = gloo_peer.per_tensor_loop
    ring_peer = None
    if args.ring_peer and "shm" in engines:  # the engine's streamed pipeline, without the engine
        ring_peer = RingPipeline(tensors, *_shm_ring_geometry(args), timeout_s=args.timeout)
        references[RING_PIPELINE] = ring_peer.measure
    with Progress(  # a bar on a terminal; in a log or a pipe only the lines below
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=False, disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task("starting", total=steps)

        def advance(message: str) -> None:
            progress.update(task, advance=1, description=message)
            if not quiet or not console.is_terminal:  # without a bar, the lines say where it is
                progress.console.print(f"  {message}")

        try:
            for engine in engines:
                paired = {name: references[name] for name in _PAIRED.get(engine, ()) if name in references}
                for commit in commits:  # the modes' rows side by side: what safety costs
                    results.append(run_engine(engine, model, shapes, args, advance, paired, commit))
                    if args.checksums:  # and what checking every byte end to end costs on top
                        results.append(run_engine(engine, model, shapes, args, advance, paired, commit, checksums=True))
                    if args.share_source and engine == "shm" and commit == "atomic":  # one copy a round, not two
                        results.append(run_engine(engine, model, shapes, args, advance, paired, commit,
                                                  share_source=True))
            for name, measure in references.items():  # peers not paired with any engine: once, now
                if not any(name in r.paired_peers() for r in results):
                    results_for_peer = [measure() for _ in range(max(2, min(args.rounds, 3)))]
                    peers[name] = statistics.median(results_for_peer)
            for result in results:
                for name, rate in result.paired_peers().items():
                    peers.setdefault(name, rate)
            advance("peers: " + ", ".join(f"{name} {rate:.2f} GB/s" for name, rate in peers.items()))
            if args.compare:
                peers["share_memory_() per update"] = total / peer_share_memory(tensors, max(2, min(args.rounds, 3))) / 1e9
                advance(f"share_memory_(): {peers['share_memory_() per update']:.2f} GB/s")
        finally:
            if gloo_peer is not None:
                gloo_peer.close()
            if ring_peer is not None:
                ring_peer.close()
        if small_gloo:
            small_shapes = [[name, shape] for name, shape in parse_model(args.small_model)]
            small = build_model(small_shapes, dtype, random=True, seed=1)
            small_peer = GlooPeer([p.data for p in small.parameters()], small_shapes, dtype, receivers=args.workers)
            name = "gloo per-tensor broadcast (small tensors)"
            try:
                small_result = run_engine("gloo", small, small_shapes, args, advance, {name: small_peer.per_tensor},
                                          commits[0], label=f"gloo {commits[0]} (small tensors)")
            finally:
                small_peer.close()
            results.append(small_result)
            peers[name] = small_result.paired_peers()[name]
            advance(f"gloo per-tensor broadcast, small tensors: {peers[name]:.2f} GB/s")

    run_facts = {
        "model": {"spec": args.model, "tensors": len(tensors), "bytes": total, "dtype": dtype,
                  "parameters": sum(t.numel() for t in tensors)},
        "workers": args.workers,
        "rounds": args.rounds,
        "machine": watch.finish().to_dict(),  # how much of the machine the run had, for the verdicts
    }
    return _report(args, console, run_facts, results, peers)


def _report(args: argparse.Namespace, console: Any, run_facts: dict[str, Any], results: list[EngineResult],
            peers: dict[str, float]) -> int:
    """The run's targets worked out from its rounds, reported as ``args`` asks; the exit status."""
    from rich.table import Table

    targets = _targets(results, peers)
    with figures_report(args, "weights", markdown) as document:
        document.update({**run_facts, "engines": [r.to_dict() for r in results], "peers_gb_per_s": peers,
                         "targets": targets, "strict_targets": args.strict_targets})
        if not args.json and args.markdown is None:
            _print_tables(console, results, peers, targets, Table)
            for line in _verdicts(targets, args.strict_targets, document.get("machine")):
                console.print(line, soft_wrap=True)  # one line each, whatever the width: grep and logs read them
    # Every round was verified bit-exact (run_engine raises otherwise): that is the exit status by default.
    # Targets are ratios on a shared, noisy machine: fatal only when asked.
    missed = [t for t in targets if t["applies"] and not t["ok"]]
    return 1 if missed and args.strict_targets else 0


def _from_json(args: argparse.Namespace) -> int:
    """``--from-json``: a saved run's tables and verdicts, its targets worked out again from its rounds (so a run
    from before a target changed, or from another host, reads as today's code judges it); nothing is measured."""
    import sys
    from pathlib import Path

    if args.markdown is not None:  # its provenance line would name this machine, not the one that measured
        print("error: --from-json writes no --markdown block: a block names the machine that measured it; run "
              "the block's command there", file=sys.stderr)
        return 2
    try:
        text = Path(args.from_json).read_text()
    except OSError as exc:
        print(f"error: cannot read {args.from_json}: {exc}", file=sys.stderr)
        return 2
    try:
        saved = json.loads(text)
        _check_saved_run(saved)
    except ValueError as exc:
        print(f"error: {args.from_json} is not what `wtransfer bench weights --json` prints: {exc}", file=sys.stderr)
        return 2
    results = [EngineResult.from_dict(engine) for engine in saved["engines"]]
    run_facts = {key: saved[key] for key in ("model", "workers", "rounds", "machine") if key in saved}
    return _report(args, _console(args.json), run_facts, results, saved["peers_gb_per_s"])


def _check_saved_run(saved: Any) -> None:
    """Raise ``ValueError`` naming the first field a saved run lacks, of those its tables and targets read."""

    def rates(value: Any, where: str) -> None:
        if not isinstance(value, dict) or not all(_positive(rate) for rate in value.values()):
            raise ValueError(f"{where} must map names to positive GB/s")

    if not isinstance(saved, dict) or not isinstance(saved.get("engines"), list) or not saved["engines"]:
        raise ValueError("no 'engines' rows")
    rates(saved.get("peers_gb_per_s"), "'peers_gb_per_s'")
    for row in saved["engines"]:
        name = row.get("engine") if isinstance(row, dict) else None
        if not isinstance(name, str):
            raise ValueError("an 'engines' row without its 'engine' name")
        if not isinstance(row.get("rounds"), list) or not row["rounds"]:
            raise ValueError(f"row {name!r} has no rounds")
        for index, measured in enumerate(row["rounds"]):
            if not isinstance(measured, dict) or not all(_positive(measured.get(k)) for k in ("gb_per_s", "bytes",
                                                                                            "seconds")):
                raise ValueError(f"row {name!r}, round {index + 1}: needs positive 'gb_per_s', 'bytes', 'seconds'")
            rates(measured.get("peers_gb_per_s", {}), f"row {name!r}, round {index + 1}: 'peers_gb_per_s'")
            for side in ("phases", "worker_phases"):
                phases = measured.get(side, {})
                if not isinstance(phases, dict) or not all(_number(v) for v in phases.values()):
                    raise ValueError(f"row {name!r}, round {index + 1}: {side!r} must map phases to seconds")
        workers = row.get("worker_peak_extra_rss")
        if not (isinstance(row.get("trainer_peak_extra_rss"), int) and isinstance(row.get("rss_budget"), int)
                and isinstance(workers, list) and all(isinstance(w, int) for w in workers)):
            raise ValueError(f"row {name!r}: 'trainer_peak_extra_rss', 'rss_budget' (bytes) and "
                             f"'worker_peak_extra_rss' (a list of bytes) are needed")
        if not all(isinstance(row.get(key, 0), int) and row.get(key, 0) >= 0 for key in ("staging_segments",
                                                                                          "staging_bytes")):
            raise ValueError(f"row {name!r}: 'staging_segments' and 'staging_bytes' must be counts")
    if "machine" in saved and not (isinstance(saved["machine"], dict) and isinstance(saved["machine"].get("words"), str)):
        raise ValueError("'machine' without its 'words'")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return _number(value) and value > 0


def markdown(document: dict[str, Any]) -> list[str]:
    """The run as BENCHMARKS.md shows it: model, the three tables, the verdicts in words."""
    model = document["model"]
    out = MarkdownLines()
    out.print(
        f"Model: {model['tensors']} tensors, {model['parameters'] / 1e6:.0f}M parameters, "
        f"{model['bytes'] / 1e9:.2f} GB {model['dtype']}; {document['workers']} worker(s), "
        f"{document['rounds']} round(s); ratios are medians of per-round pairs."
    )
    results = [EngineResult.from_dict(engine) for engine in document["engines"]]
    _print_tables(out, results, document["peers_gb_per_s"], document["targets"], MarkdownTable)
    out.print("\n".join(f"- {line}" for line in _verdicts(document["targets"], document.get("strict_targets", False),
                                                            document.get("machine"))))
    return out.lines


RAW_CHUNKED = "gloo raw, engine's groups/buckets/in-flight"
RAW_BEST = "gloo raw at its best"
_BEST_OF = {RAW_BEST: ("gloo one-tensor broadcast", RAW_CHUNKED)}
"""A target against the better of several peers: the lowest of the engine's ratios to them."""

_PAIRED = {  # the references measured right after each round of an engine (those its targets use)
    "shm": ("memcpy", "safetensors save+load (/dev/shm)", TWO_COPIES, RING_PIPELINE),
    "gloo": ("memcpy", "gloo one-tensor broadcast", RAW_CHUNKED, "gloo per-tensor broadcast"),
}

_RATIO_TARGETS = {  # row -> (peer, minimum ratio, does the target apply to this model?)
    "shm streaming": [("memcpy", 0.6, True), (TWO_COPIES, 0.9, True), (RING_PIPELINE, 0.9, True),
                      ("safetensors save+load (/dev/shm)", 4.0, True)],
    "shm atomic": [(STAGED_FLOOR, 0.9, True), ("safetensors save+load (/dev/shm)", 4.0, True)],
    # share_source: the trainer copies nothing, so a round is the workers' one copy into their models
    "shm atomic + shared source": [("memcpy", 0.9, True)],
    # The 3x per-tensor target is for many-small-tensor models: where the bytes sit in large matrices, per-tensor
    # broadcast already runs near one flat broadcast, so the ratio is reported, not held against the engine.
    "gloo streaming": [(RAW_BEST, 0.85, True), ("gloo per-tensor broadcast", 3.0, False)],
    "gloo atomic": [(GLOO_STAGED_FLOOR, 0.9, True), ("gloo per-tensor broadcast", 3.0, False)],
    "gloo streaming (small tensors)": [("gloo per-tensor broadcast (small tensors)", 3.0, True)],
    "gloo atomic (small tensors)": [("gloo per-tensor broadcast (small tensors)", 3.0, True)],
}


def _targets(results: list[EngineResult], peers: dict[str, float]) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []
    for result in results:
        if " atomic" in result.engine:
            checks.append({"what": f"{result.engine} host staging copies per node", "engine": result.engine,
                           "peer": "staging", "value": result.staging_segments, "target": "== 1",
                           "ok": result.staging_segments == 1, "applies": True})
        for peer, minimum, applies in _RATIO_TARGETS.get(result.engine, []):
            candidates = _BEST_OF.get(peer, (peer,))
            ratios = [_ratio(result, p, peers) for p in candidates]
            if None in ratios:
                continue  # a peer this run did not measure
            ratio = min(ratios)  # type: ignore[type-var]
            check = {"what": f"{result.engine} / {peer}", "engine": result.engine, "peer": peer, "value": ratio,
                     "target": f">= {minimum}", "ok": ratio >= minimum, "applies": applies}
            rounds = result.round_ratios(candidates[ratios.index(ratio)])  # the value is their median
            if len(rounds) > 1:  # paired round by round: how far the ratio moved between rounds, and how often it met
                check.update(minimum=minimum, rounds=rounds)
            checks.append(check)
        streamed = next((r for r in results if r.engine == result.engine.replace(" atomic", " streaming")), None)
        if result.engine == "shm atomic" and streamed is not None:  # what the guarantee costs, side by side
            ratio = result.gb_per_s / streamed.gb_per_s
            checks.append({"what": "shm atomic / shm streaming", "engine": result.engine, "peer": "shm streaming",
                           "value": ratio, "target": ">= 0.9", "ok": ratio >= 0.9, "applies": True})
        if result.engine == "shm atomic + shared source":  # one copy a round instead of two, side by side
            plain = next((r for r in results if r.engine == "shm atomic"), None)
            if plain is not None:
                ratio = result.gb_per_s / plain.gb_per_s
                checks.append({"what": "shm atomic + shared source / shm atomic", "engine": result.engine,
                               "peer": "shm atomic", "value": ratio, "target": ">= 1.5", "ok": ratio >= 1.5,
                               "applies": True})
        if result.engine.endswith(" + checksums"):  # what end-to-end integrity costs, side by side
            plain = next((r for r in results if r.engine == result.engine.removesuffix(" + checksums")), None)
            if plain is not None:
                ratio = result.gb_per_s / plain.gb_per_s
                checks.append({"what": f"{result.engine} / {plain.engine}", "engine": result.engine,
                               "peer": plain.engine, "value": ratio, "target": ">= 0.95", "ok": ratio >= 0.95,
                               "applies": True})
        worst = max([result.trainer_extra_rss, *result.worker_extra_rss])
        checks.append({"what": f"{result.engine} peak extra RSS (MiB, worst side)", "engine": result.engine,
                       "peer": None, "value": worst / MIB, "target": f"<= {result.rss_budget / MIB:.0f}",
                       "ok": worst <= result.rss_budget, "applies": True})
    return checks


def _ratio(result: EngineResult, peer: str, peers: dict[str, float]) -> float | None:
    """The engine's ratio to ``peer``: the median of paired ratios, else against the run's figure."""
    paired = result.paired_ratio(peer)
    if paired is not None:
        return paired
    return result.gb_per_s / peers[peer] if peer in peers else None


def _verdicts(targets: list[dict[str, Any]], strict: bool = False, machine: dict[str, Any] | None = None) -> list[str]:
    """The result in words: each engine against each reference and target, and the exit status.

    A miss on a busy machine (``machine``, from :class:`LoadWatch`) may be the machine's, so a rerun is advised; on
    an idle one it is how wtransfer ran on this host. A target paired with its peer round by round also gives its
    rounds' lowest and highest ratio and how many met it: a median near the target with rounds on both sides reads
    differently from one no round met."""
    lines = []
    for t in targets:
        engine, peer = t["engine"], t["peer"]
        if peer is None:  # the memory budget
            state = "within" if t["ok"] else "OVER"
            lines.append(f"{engine}: peak extra RSS {t['value']:.0f} MiB, {state} its budget ({t['target']} MiB)")
            continue
        if peer == "staging":
            lines.append(f"{engine}: {t['value']} host staging cop{'y' if t['value'] == 1 else 'ies'} on the node, "
                         f"shared by its workers (target {t['target']}: {'met' if t['ok'] else 'MISSED'})")
            continue
        if not t["applies"]:
            verdict = f"reported only: the {t['target']}x target applies to many-small-tensor models"
        else:
            verdict = f"target {t['target']}x {'met' if t['ok'] else 'MISSED'}"
        rounds = t.get("rounds")
        if rounds and t["applies"]:
            met = sum(ratio >= t["minimum"] for ratio in rounds)
            verdict += f"; rounds {min(rounds):.2f}x to {max(rounds):.2f}x, {met} of {len(rounds)} at the target"
        lines.append(f"{engine} runs at {t['value']:.2f}x {peer} ({verdict})")
    missed = [t["what"] for t in targets if t["applies"] and not t["ok"]]
    words = f"machine {machine['words']}" if machine else "machine load not measured"
    if not missed:
        lines.append(f"every round verified bit-exact; all targets that apply are met (exit 0); {words}")
        return lines
    status = "exit 1 (--strict-targets)" if strict else "every round verified bit-exact (exit 0)"
    if machine is None:  # a document from before the load was measured
        advice = "a paired target's line says how many of its rounds met it"
    elif machine.get("busy"):
        advice = ("other processes shared the machine, and ratios measured side by side can miss for that alone: "
                  "rerun when it is idle")
    else:
        # not "not noise": a paired ratio of the same code ran from 0.64 to 1.06 over the ten rounds of one run on an
        # idle 2-core AMD EPYC (other processes 0.3 % of its CPU); each target's line gives its rounds
        advice = ("the machine was idle, so these misses are how wtransfer ran on this host; a paired target's line "
                  "says how many of its rounds met it")
    lines.append(f"{status}; missed {', '.join(missed)}; {words}; {advice}"
                 + ("" if strict else "; pass --strict-targets to make a miss fail the command"))
    return lines


def _print_tables(console: Any, results: list[EngineResult], peers: dict[str, float], targets: list[dict[str, Any]], table_cls: Any) -> None:
    summary = table_cls(title="weight sync")
    for column in ("engine, commit", "median GB/s", "rounds (GB/s)", "trainer extra RSS", "worker extra RSS",
                   "host staging (node)", "budget"):
        summary.add_column(column, no_wrap=column == "engine, commit")  # the row's name stays whole
    for r in results:
        staging = f"{r.staging_segments} x {r.staging_bytes / r.staging_segments / MIB:.0f} MiB" if r.staging_segments else "-"
        summary.add_row(
            r.engine, f"{r.gb_per_s:.2f}", " ".join(f"{x['gb_per_s']:.2f}" for x in r.rounds),
            f"{r.trainer_extra_rss / MIB:.0f} MiB", ", ".join(f"{x / MIB:.0f}" for x in r.worker_extra_rss) + " MiB",
            staging, f"{r.rss_budget / MIB:.0f} MiB",
        )
    console.print(summary)
    console.print(_phase_table(results, peers, table_cls))
    if peers:
        comparison = table_cls(title="peers (same tensors, same run; paired peers measured after every round)")
        comparison.add_column("peer", no_wrap=True)
        comparison.add_column("GB/s")
        main = [r for r in results if "small" not in r.engine]
        for r in main:
            comparison.add_column(f"{r.engine} ÷ peer")
        for peer, rate in peers.items():
            if "small" in peer:
                continue
            ratios = [r.paired_ratio(peer) or r.gb_per_s / rate for r in main]
            comparison.add_row(peer, f"{rate:.2f}", *(f"{ratio:.2f}×" for ratio in ratios))
        console.print(comparison)
    checks = table_cls(title="targets")
    for column in ("check", "measured", "target", ""):
        checks.add_column(column, no_wrap=column == "check")
    for t in targets:
        state = ("[green]ok[/green]" if t["ok"] else "[red]MISSED[/red]") if t["applies"] else "reported only"
        checks.add_row(t["what"], f"{t['value']:.2f}", t["target"], state)
    console.print(checks)


PHASES = (  # column -> (side, phases summed); the trainer's send holds its pack and wait
    ("plan + start", "trainer", ("plan", "start")),
    ("pack", "trainer", ("pack",)),
    ("wait", "trainer", ("wait",)),
    ("send, rest", "trainer", ("send", "-pack", "-wait")),
    ("commit", "trainer", ("commit",)),
    ("worker receive", "worker", ("receive",)),
    ("worker stage", "worker", ("stage",)),
    ("worker load", "worker", ("load",)),
)
_FLOORS = {  # row -> the floor its target holds it to
    "shm streaming": "memcpy", "shm atomic": STAGED_FLOOR, "gloo streaming": RAW_BEST, "gloo atomic": GLOO_STAGED_FLOOR,
    "shm atomic + shared source": "memcpy",
}


def _phase_seconds(round_stats: dict[str, Any], side: str, names: tuple[str, ...]) -> float:
    phases = round_stats.get("phases" if side == "trainer" else "worker_phases", {})
    return sum(-phases.get(n[1:], 0.0) if n.startswith("-") else phases.get(n, 0.0) for n in names)


def _floor_seconds(result: EngineResult, peers: dict[str, float]) -> float | None:
    """The row's floor as seconds per round: the model's bytes at the rate of the reference its target uses."""
    floor = _FLOORS.get(result.engine)
    if floor is None or not result.rounds:
        return None
    rates = [result.paired_peers().get(p, peers.get(p)) for p in _BEST_OF.get(floor, (floor,))]
    rates = [r for r in rates if r]
    return result.rounds[0]["bytes"] / max(rates) / 1e9 if rates else None


def _phase_table(results: list[EngineResult], peers: dict[str, float], table_cls: Any) -> Any:
    """Where each row's round time goes (medians over rounds, ms), beside the floor its target uses: the trainer's
    phases follow one another; the worker's run meanwhile (its receive is the trainer's wait)."""
    table = table_cls(title="where the time goes (median ms per round; the worker's phases overlap the trainer's)")
    for column in ("engine, commit", "round", "floor", *(name for name, _, _ in PHASES)):
        table.add_column(column, no_wrap=column == "engine, commit")
    for r in results:
        floor = _floor_seconds(r, peers)
        cells = [statistics.median(_phase_seconds(x, side, names) for x in r.rounds) for _, side, names in PHASES]
        table.add_row(r.engine, f"{statistics.median(x['seconds'] for x in r.rounds) * 1e3:.0f}",
                      "-" if floor is None else f"{floor * 1e3:.0f}", *(f"{c * 1e3:.0f}" for c in cells))
    return table

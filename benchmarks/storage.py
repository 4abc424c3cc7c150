"""KV storage connector: save and load GB/s through the real connector (scheduler metadata as JSON,
worker I/O threads, atomic writes, header and wsum64 checksum checks) against plain ``safetensors`` save_file /
load_file of the same blocks from the same paged cache, in the same run (target >= 0.8x); and the
cost of the chained block hashes per block.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.tables import ratio_rows, table
from wtransfer._bench.report import add_report_arguments, figures_report

TARGET_RATIO = 0.8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=32, help="KV layers per block")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--heads", type=int, default=8, help="KV heads")
    parser.add_argument("--head-size", type=int, default=128, help="elements per head")
    parser.add_argument("--dtype", default="bfloat16", help="KV dtype")
    parser.add_argument("--blocks", type=int, default=64, help="blocks saved and loaded per round")
    parser.add_argument("--io-threads", type=int, default=2, help="the connector's io_threads option")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds (best is reported)")
    parser.add_argument("--dir", default=None, help="where files go (None: a temp dir in /dev/shm if present)")
    parser.add_argument("--hash-blocks", type=int, default=20_000, help="blocks hashed for the hash-chain cost")
    add_report_arguments(parser)


def run(args: argparse.Namespace) -> int:
    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = tempfile.mkdtemp(prefix="wtransfer-bench-storage-", dir=base)
    with figures_report(args, "storage", markdown) as figures:
        try:
            ok = bench_io(args, root, figures)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        figures["hash_us_per_block"] = bench_hashes(args)
        figures["block_size"], figures["hash_blocks"] = args.block_size, args.hash_blocks
        figures["targets_met"] = ok
    return 0 if ok else 1


def bench_io(args: argparse.Namespace, root: str, figures: dict[str, Any]) -> bool:
    import torch
    from safetensors.torch import load_file, save_file

    from wtransfer.config import KVTransferConfig
    from wtransfer.connectors._base import KVConnectorRole
    from wtransfer._dtypes import dtype_from_name
    from wtransfer.connectors._factory import KVConnectorFactory
    from wtransfer.connectors._hashing import request_block_hashes
    from wtransfer.connectors._request import KVRequest, ScheduledRequest, SchedulerStep
    from wtransfer.kvcache import KVCacheSpec

    layers = tuple(f"layer.{i}" for i in range(args.layers))
    spec = KVCacheSpec(layers, args.block_size, args.heads, args.head_size, args.dtype, "bench-storage")
    n = args.blocks
    shape = (2, 2 * n, args.block_size, args.heads, args.head_size)  # save from [0, n), load into [n, 2n)
    caches = {name: torch.randn(shape).to(dtype_from_name(args.dtype)) for name in layers}
    src_ids, dst_ids = list(range(n)), list(range(n, 2 * n))
    block_bytes = caches[layers[0]][:, 0].numel() * caches[layers[0]].element_size() * len(layers)
    nbytes = block_bytes * n
    tokens = [(7 * i) % 50_000 for i in range(n * args.block_size + 1)]  # + 1: n full blocks can match
    hashes = request_block_hashes(spec, tokens)

    raw_dir, store_dir = os.path.join(root, "raw"), os.path.join(root, "store")
    config = KVTransferConfig("storage", kv_connector_extra_config={"path": store_dir, "io_threads": args.io_threads})
    scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, spec)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, spec)
    worker.register_kv_caches(caches)
    rounds = iter(range(1, 1 << 30))

    def to_worker(step: SchedulerStep) -> None:
        worker.bind_connector_metadata(
            type(worker).metadata_cls.from_json(scheduler.build_connector_meta(step).to_json())
        )

    # The baseline gets the connector's I/O threads: one block per task on a pool of io_threads.
    pool = ThreadPoolExecutor(args.io_threads, thread_name_prefix="bench-safetensors")

    def raw_save_one(block: int, block_hash: str) -> None:
        data = torch.stack([caches[name][:, block] for name in layers])
        save_file({"kv": data}, os.path.join(raw_dir, f"{block_hash}.safetensors"))

    def raw_load_one(block: int, block_hash: str) -> None:
        data = load_file(os.path.join(raw_dir, f"{block_hash}.safetensors"))["kv"]
        for index, name in enumerate(layers):
            caches[name][:, block].copy_(data[index])

    def raw_save() -> None:
        os.makedirs(raw_dir, exist_ok=True)
        list(pool.map(raw_save_one, src_ids, hashes))

    def raw_load() -> None:
        list(pool.map(raw_load_one, dst_ids, hashes))

    def connector_save() -> None:
        rid = f"save-{next(rounds)}"
        request = KVRequest(rid, tokens, hashes, 0)
        to_worker(SchedulerStep(0, [ScheduledRequest(request, src_ids + [2 * n - 1], len(tokens))]))
        worker.start_load_kv()
        worker.wait_for_save()
        worker.clear_connector_metadata()
        delay, _ = scheduler.request_finished(request, src_ids)
        assert delay, "storage connector did not delay the free of blocks it saves"
        to_worker(SchedulerStep(1, [], [rid]))
        deadline = time.monotonic() + 120
        while not (worker.get_finished({rid})[0] or set()) & {rid}:
            if time.monotonic() > deadline:
                raise TimeoutError("storage saves did not finish within 120 s")
            time.sleep(0.0005)
        worker.clear_connector_metadata()

    def connector_load() -> None:
        request = KVRequest(f"load-{next(rounds)}", tokens, hashes, 0)
        matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
        if matched != n * args.block_size:
            raise RuntimeError(f"storage connector matched {matched} tokens, expected {n * args.block_size}")
        scheduler.update_state_after_alloc(request, dst_ids + [2 * n - 1], matched)
        to_worker(SchedulerStep(0, []))
        worker.start_load_kv()
        worker.wait_for_layer_load(layers[0])
        if worker.get_block_ids_with_load_errors():
            raise RuntimeError("storage connector reported load errors")
        worker.clear_connector_metadata()

    def clear_files() -> None:
        shutil.rmtree(raw_dir, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)

    figures["setup"] = (
        f"KV storage connector: {args.layers} layers x {args.block_size} tokens x {args.heads} heads x "
        f"{args.head_size} ({args.dtype}) = {block_bytes / 2**20:.2f} MiB per block, {n} blocks "
        f"({nbytes / 2**20:.0f} MiB) per round, files in {os.path.dirname(root)}, connector "
        f"io_threads={args.io_threads}, best of {args.repeats}"
    )
    figures["baseline"] = (
        f"baseline: safetensors save_file/load_file per block on {args.io_threads} thread(s) (the connector's "
        "io_threads), gathering from / copying into the same paged cache"
    )
    print(figures["setup"])
    print(figures["baseline"])
    try:
        ok = True
        print(f"{'direction':<10} {'safetensors GB/s':>17} {'storage GB/s':>13} {'ratio':>7}  target")
        results: dict[str, tuple[list[float], list[float]]] = {"save": ([], []), "load": ([], [])}
        for _ in range(args.repeats + 1):  # the first round warms files and page tables up; dropped
            clear_files()
            results["save"][0].append(_timed(raw_save))
            results["save"][1].append(_timed(connector_save))
            results["load"][0].append(_timed(raw_load))
            results["load"][1].append(_timed(connector_load))
        for direction, (plain_s, ours_s) in results.items():
            plain_best, ours_best = min(plain_s[1:]), min(ours_s[1:])
            ratio = plain_best / ours_best
            ok &= ratio >= TARGET_RATIO
            figures[direction] = {"safetensors_gb_per_s": nbytes / plain_best / 1e9,
                                  "storage_gb_per_s": nbytes / ours_best / 1e9, "ratio": ratio,
                                  "target": TARGET_RATIO, "ok": ratio >= TARGET_RATIO}
            print(
                f"{direction:<10} {nbytes / plain_best / 1e9:>17.2f} {nbytes / ours_best / 1e9:>13.2f} "
                f"{ratio:>6.2f}x  >= {TARGET_RATIO}x {'ok' if ratio >= TARGET_RATIO else 'MISSED'}"
            )
        # the speed means nothing unless the loaded blocks are the saved ones, bit for bit
        for name in layers:
            caches[name][:, dst_ids] = 0
        connector_load()
        figures["bit_exact"] = all(torch.equal(caches[name][:, src_ids], caches[name][:, dst_ids]) for name in layers)
        if not figures["bit_exact"]:
            print("ERROR: blocks loaded through the connector differ from the blocks saved")
            ok = False
        return ok
    finally:
        pool.shutdown()
        scheduler.shutdown()
        worker.shutdown()


def bench_hashes(args: argparse.Namespace) -> float:
    from wtransfer.connectors._hashing import block_hashes

    namespace = "00" * 32
    tokens = [(31 * i) % 128_000 for i in range(args.hash_blocks * args.block_size)]
    best = min(_timed(lambda: block_hashes(namespace, tokens, args.block_size)) for _ in range(3))
    per_block_us = best / args.hash_blocks * 1e6
    print(f"\n{hash_line(per_block_us, args.block_size, args.hash_blocks)}")
    return per_block_us


def hash_line(per_block_us: float, block_size: int, blocks: int) -> str:
    return (f"Hash chain: {per_block_us:.2f} us per block of {block_size} tokens "
            f"({blocks} blocks, sha256 over parent + int64 tokens + extra keys, best of 3)")


def markdown(figures: dict[str, Any]) -> list[str]:
    rows = ratio_rows(figures, ("save", "load"), "safetensors_gb_per_s", "storage_gb_per_s")
    return [
        figures["setup"] + ".", figures["baseline"] + ".", "",
        *table("storage connector vs safetensors", ["direction", "safetensors GB/s", "storage GB/s", "ratio", "target"],
               rows),
        "",
        f"Loaded blocks bit-exact to the saved ones: {figures.get('bit_exact')}. "
        + hash_line(figures["hash_us_per_block"], figures["block_size"], figures["hash_blocks"]) + ".",
    ]


def _timed(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started

"""The built-in cpu spec: sizing, the tier allocated once, bit-exact async block copies, errors."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

import wtransfer
from wtransfer import KVCacheSpec, KVTransferConfig, OffloadingSpecFactory
from wtransfer.specs._base import LoadStoreSpec, OffloadingHandler, OffloadingSpec
from wtransfer.specs.cpu import BlockCopyHandler, CPUOffloadingSpec
from wtransfer.specs._manager import BlockTableManager

LAYERS = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn")


def kv_spec(dtype: str = "float32", block_size: int = 4) -> KVCacheSpec:
    return KVCacheSpec(LAYERS, block_size, 2, 8, dtype, "test-model")


def make_caches(spec: KVCacheSpec, num_blocks: int = 12) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    return {
        name: torch.randn(shape, generator=generator).to(getattr(torch, spec.dtype)) for name in spec.layer_names
    }


def config(**extra: object) -> KVTransferConfig:
    return KVTransferConfig("offloading", kv_connector_extra_config=dict(extra))


@pytest.fixture
def cpu_spec(request: pytest.FixtureRequest) -> Iterator[CPUOffloadingSpec]:
    spec = OffloadingSpecFactory.create_spec(config(num_cpu_blocks=6, block_size=8), kv_spec())
    assert isinstance(spec, CPUOffloadingSpec)
    yield spec
    spec.shutdown()


def test_factory_default_alias_and_public_names() -> None:
    spec = OffloadingSpecFactory.create_spec(config(num_cpu_blocks=3), kv_spec())
    assert type(spec) is CPUOffloadingSpec and spec.block_size_factor == 1
    alias = OffloadingSpecFactory.create_spec(config(spec_name="CPUOffloadingSpec", num_cpu_blocks=3), kv_spec())
    assert type(alias) is CPUOffloadingSpec
    assert wtransfer.OffloadingSpec is OffloadingSpec
    assert wtransfer.OffloadingManager is not None and wtransfer.OffloadingHandler is OffloadingHandler
    manager = spec.get_manager()
    assert isinstance(manager, BlockTableManager) and spec.get_manager() is manager
    assert manager.num_blocks == 3 and manager.block_size == 4


def test_tier_sized_by_bytes_with_a_larger_offloaded_block() -> None:
    spec = OffloadingSpecFactory.create_spec(
        config(cpu_bytes_to_use=10_000, block_size=8, eviction_policy="arc"), kv_spec()
    )
    # 3 layers x K/V x 8 tokens x 2 heads x 8 dims x 4 bytes = 3072 bytes per offloaded block
    assert spec.bytes_per_block == 3072 and spec.num_blocks == 3 and spec.block_size_factor == 2
    assert type(spec.get_manager().policy).__name__ == "ARCPolicy"
    assert spec.get_manager().block_size == 8


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "needs a size.*cpu_bytes_to_use.*num_cpu_blocks"),
        ({"cpu_bytes_to_use": 100}, "would hold 0 blocks"),
        ({"num_cpu_blocks": 4, "block_size": 6}, "multiple of the engine's block size"),
        ({"num_cpu_blocks": 4, "eviction_policy": "lfu"}, "Unknown policy 'lfu'.*Available policies: arc, lru"),
        # a misspelled size is an unknown key (with a hint), not "needs a size"
        ({"num_cpu_block": 4}, "unknown option\\(s\\) 'num_cpu_block' \\(did you mean 'num_cpu_blocks'\\?\\).*valid options"),
    ],
)
def test_configuration_errors_say_what_to_do(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OffloadingSpecFactory.create_spec(config(**extra), kv_spec())


def test_needs_a_kv_cache_spec() -> None:
    with pytest.raises(ValueError, match="needs the engine's KVCacheSpec"):
        OffloadingSpecFactory.create_spec(config(num_cpu_blocks=4), None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_store_then_load_is_bit_exact(dtype: str) -> None:
    spec = OffloadingSpecFactory.create_spec(config(num_cpu_blocks=5, block_size=8, staging_blocks=3), kv_spec(dtype))
    try:
        caches = make_caches(spec.kv_cache_spec)
        original = {name: cache.clone() for name, cache in caches.items()}
        handlers = {(src, dst): h for src, dst, h in spec.get_handlers(caches)}
        assert set(handlers) == {("device", "cpu"), ("cpu", "device")}
        store, load = handlers[("device", "cpu")], handlers[("cpu", "device")]
        # 3 offloaded blocks = 6 engine blocks, scattered; more rows than the staging chunk
        engine_ids = (7, 2, 11, 0, 5, 9)
        assert store.transfer_async(1, (LoadStoreSpec("device", engine_ids), LoadStoreSpec("cpu", (4, 0, 2))))
        store.wait([1])
        (result,) = store.get_finished()
        assert result.success and result.job_id == 1
        assert result.num_bytes == 6 * 3 * 2 * 4 * 2 * 8 * caches[LAYERS[0]].element_size()
        tier = spec.tier
        assert tier is not None
        for layer, name in enumerate(LAYERS):
            assert torch.equal(tier[layer, :, 8:10], caches[name].view(2, 12, -1)[:, [7, 2]])
        for cache in caches.values():
            cache.zero_()
        assert load.transfer_async(2, (LoadStoreSpec("cpu", (2, 4, 0)), LoadStoreSpec("device", (1, 3, 4, 6, 8, 10))))
        load.wait([2])
        assert [r.success for r in load.get_finished()] == [True]
        for name in LAYERS:
            back = caches[name][:, [1, 3, 4, 6, 8, 10]]
            assert torch.equal(back, original[name][:, [5, 9, 7, 2, 11, 0]])
    finally:
        spec.shutdown()


def test_tier_is_allocated_once(cpu_spec: CPUOffloadingSpec) -> None:
    assert cpu_spec.tier is None  # the scheduler side never allocates it
    caches = make_caches(cpu_spec.kv_cache_spec)
    first = list(cpu_spec.get_handlers(caches))
    tier = cpu_spec.tier
    assert tier is not None and tier.shape == (3, 2, 12, 4 * 2 * 8)
    assert list(cpu_spec.get_handlers(caches)) == first
    assert cpu_spec.tier.data_ptr() == tier.data_ptr()


class GatedHandler(BlockCopyHandler):
    """Holds each copy until the test opens the gate; records which thread copied."""

    gate = threading.Event()
    copier_threads: list[int] = []

    def _copy(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        GatedHandler.copier_threads.append(threading.get_ident())
        if not GatedHandler.gate.wait(timeout=10):
            raise RuntimeError("gate never opened")
        super()._copy(src_rows, dst_rows)


class GatedSpec(CPUOffloadingSpec):
    handler_cls = GatedHandler


def test_transfers_run_on_a_worker_thread_and_wait_times_out() -> None:
    GatedHandler.gate.clear()
    GatedHandler.copier_threads.clear()
    spec = GatedSpec(config(num_cpu_blocks=4, transfer_timeout_s=5), kv_spec())
    caches = make_caches(spec.kv_cache_spec)
    (_, _, store), (_, _, load) = spec.get_handlers(caches)
    try:
        assert store.transfer_async(7, (LoadStoreSpec("device", (1,)), LoadStoreSpec("cpu", (0,))))
        assert store.get_finished() == []  # transfer_async returned while the copy is held
        with pytest.raises(wtransfer.TransferTimeoutError, match=r"jobs \[7\].*transfer_timeout_s"):
            store.wait([7], timeout=0.05)
        with pytest.raises(ValueError, match="already in flight"):
            store.transfer_async(7, (LoadStoreSpec("device", (2,)), LoadStoreSpec("cpu", (1,))))
        GatedHandler.gate.set()
        store.wait([7])
        assert [r.job_id for r in store.get_finished()] == [7]
        assert GatedHandler.copier_threads and threading.get_ident() not in GatedHandler.copier_threads
        store.wait([7])  # already reported: returns at once
    finally:
        GatedHandler.gate.set()
        spec.shutdown()
    assert not store._thread.is_alive() and not load._thread.is_alive()
    assert store.transfer_async(8, (LoadStoreSpec("device", (1,)), LoadStoreSpec("cpu", (0,)))) is False


class FailingHandler(BlockCopyHandler):
    def _copy(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        raise OSError("tier device went away")


class FailingSpec(CPUOffloadingSpec):
    handler_cls = FailingHandler


def test_a_failed_copy_is_reported_not_lost() -> None:
    spec = FailingSpec(config(num_cpu_blocks=4), kv_spec())
    try:
        (_, _, store), _ = spec.get_handlers(make_caches(spec.kv_cache_spec))
        assert store.transfer_async(1, (LoadStoreSpec("device", (1,)), LoadStoreSpec("cpu", (0,))))
        store.wait([1])
        (result,) = store.get_finished()
        assert not result.success and "tier device went away" in (result.error or "")
    finally:
        spec.shutdown()


def test_bad_jobs_and_caches_are_rejected(cpu_spec: CPUOffloadingSpec) -> None:
    caches = make_caches(cpu_spec.kv_cache_spec)
    with pytest.raises(ValueError, match="expects \\[2, 12, 4, 2, 8\\]"):
        list(cpu_spec.get_handlers({**caches, LAYERS[1]: torch.zeros(2, 12, 4, 2, 9)}))
    with pytest.raises(ValueError, match="no layer 'model.layers.2.attn'"):
        list(cpu_spec.get_handlers({n: c for n, c in caches.items() if n != LAYERS[2]}))
    (_, _, store), _ = cpu_spec.get_handlers(caches)
    with pytest.raises(ValueError, match="copies device -> cpu"):
        store.transfer_async(1, (LoadStoreSpec("cpu", (0,)), LoadStoreSpec("device", (1, 2))))
    with pytest.raises(ValueError, match="do not match"):
        store.transfer_async(1, (LoadStoreSpec("device", (1,)), LoadStoreSpec("cpu", (0,))))  # factor is 2
    with pytest.raises(ValueError, match="out of range on cpu"):
        store.transfer_async(1, (LoadStoreSpec("device", (1, 2)), LoadStoreSpec("cpu", (6,))))
    assert LoadStoreSpec.from_dict(LoadStoreSpec("cpu", (3, 1)).to_dict()) == LoadStoreSpec("cpu", (3, 1))


def test_bench_offload_runs_and_checks_its_copies() -> None:
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([
        sys.executable, "-m", "benchmarks", "offload", "--layers", "2", "--engine-blocks", "16", "--job-blocks", "8",
        "--factor", "2", "--heads", "2", "--head-size", "16", "--repeats", "1", "--manager-ops", "400",
        "--manager-capacity", "64",
    ], cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 1) and "Traceback" not in run.stderr, run.stderr  # 1: a target missed
    out = run.stdout
    assert "ERROR" not in out
    for line in ("store ", "load ", "lru ", "arc "):
        assert any(row.startswith(line) for row in out.splitlines()), out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("staging", [{}, {"staging_blocks": 1}], ids=["default-chunks", "one-block-chunks"])
def test_round_trip_with_the_engine_cache_on_a_gpu(staging: dict) -> None:
    spec = OffloadingSpecFactory.create_spec(config(num_cpu_blocks=4, block_size=8, **staging), kv_spec("bfloat16"))
    try:
        caches = {name: t.cuda() for name, t in make_caches(spec.kv_cache_spec).items()}
        original = {name: cache.clone() for name, cache in caches.items()}
        (_, _, store), (_, _, load) = spec.get_handlers(caches)
        assert spec.tier is not None and spec.tier.is_pinned()
        # the host side of each copy is pinned: from pageable memory the copy goes through a bounce buffer
        assert store._dst_staging.is_pinned() and load._src_staging.is_pinned()
        assert store.transfer_async(1, (LoadStoreSpec("device", (3, 8, 1, 0)), LoadStoreSpec("cpu", (2, 0))))
        store.wait([1])
        assert [r.success for r in store.get_finished()] == [True]
        for cache in caches.values():
            cache.zero_()
        assert load.transfer_async(2, (LoadStoreSpec("cpu", (0, 2)), LoadStoreSpec("device", (4, 5, 6, 7))))
        load.wait([2])
        assert [r.success for r in load.get_finished()] == [True]
        for name in LAYERS:
            assert torch.equal(caches[name][:, [4, 5, 6, 7]].cpu(), original[name][:, [1, 0, 3, 8]].cpu())
    finally:
        spec.shutdown()

"""The ``storage`` connector end to end on the tiny engine: reuse, partial hits, bad files, processes."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import wtransfer
from wtransfer import KVConnectorFactory, KVConnectorRole, KVTransferConfig
from wtransfer.connectors._blockfile import BlockLayout
from wtransfer.connectors._hashing import request_block_hashes
from wtransfer.kvcache import KVCacheSpec
from wtransfer.testing.conformance import ConnectorConformance
from wtransfer.testing.paged_engine import PagedKVEngine, reference_kv
from wtransfer.testing.processes import run_python

SPEC = KVCacheSpec(
    ("layer.0", "layer.1", "layer.2"),
    block_size=4,
    num_kv_heads=2,
    head_size=8,
    dtype="bfloat16",
    model_fingerprint="storage-test",
)
PROMPT = [(3 * i + 7) % 500 for i in range(18)]  # 4 full blocks + 2 tokens
SUFFIX = [11, 12, 13, 14, 15]


class TestStorageConformance(ConnectorConformance):
    """The built-in passes the suite third-party connector authors run."""

    connector = "storage"
    persistent = True

    @pytest.fixture
    def connector_options(self, tmp_path: Path) -> dict[str, Any]:
        return {"path": str(tmp_path / "kv")}


def _config(path: Path, role: str = "kv_both", **options: Any) -> KVTransferConfig:
    return KVTransferConfig("storage", kv_role=role, kv_connector_extra_config={"path": str(path), **options})


def _engine(config: KVTransferConfig, spec: KVCacheSpec = SPEC, num_blocks: int = 16) -> PagedKVEngine:
    return PagedKVEngine(spec, num_blocks, kv_transfer_config=config, capture_kv=True)


def _block_files(root: Path, suffix: str = ".safetensors") -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(suffix))


def _assert_bit_exact(spec: KVCacheSpec, out: Any) -> None:
    reference = reference_kv(spec, out.prompt_token_ids)
    for layer, kv in out.kv.items():
        assert torch.equal(kv, reference[layer][:, : kv.shape[1]]), layer


def _save_prompt(path: Path, prompt: list[int] = PROMPT, spec: KVCacheSpec = SPEC) -> None:
    with _engine(_config(path), spec) as engine:
        assert engine.generate({"producer": prompt})["producer"].num_external_tokens == 0


def test_restart_then_reuse_the_stored_full_block_prefix_bit_exactly(tmp_path: Path) -> None:
    _save_prompt(tmp_path)
    files = _block_files(tmp_path)
    assert len(files) == len(PROMPT) // 4
    assert not _block_files(tmp_path, ".tmp")  # atomic writes leave no temporaries
    with _engine(_config(tmp_path)) as engine:  # a fresh engine: empty cache
        out = engine.generate({"consumer": PROMPT + SUFFIX})["consumer"]
        stats = engine.worker_connector.get_kv_connector_stats()
    assert out.num_local_hit_tokens == 0
    assert out.num_external_tokens == 16  # every stored full block, not the partial one
    assert stats["loaded_blocks"] == 4
    _assert_bit_exact(SPEC, out)
    plain = PagedKVEngine(SPEC, 16).generate({"x": PROMPT + SUFFIX})["x"]
    assert plain.output_token_ids == out.output_token_ids


def test_files_are_plain_safetensors_with_a_checked_header(tmp_path: Path) -> None:
    _save_prompt(tmp_path)
    first_hash = request_block_hashes(SPEC, PROMPT)[0]
    (path,) = [p for p in _block_files(tmp_path) if p.stem == first_hash]
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
        kv = handle.get_tensor("kv")
    assert meta["block_hash"] == first_hash and meta["model_fingerprint"] == "storage-test"
    assert json.loads(meta["layer_names"]) == list(SPEC.layer_names) and meta["dtype"] == "bfloat16"
    assert kv.dtype == torch.bfloat16 and list(kv.shape) == [3, 2, 4, 2, 8]
    reference = reference_kv(SPEC, PROMPT)
    assert torch.equal(kv[1], reference["layer.1"][:, :4])


def test_partial_hits_stop_at_the_first_missing_block(tmp_path: Path) -> None:
    _save_prompt(tmp_path)
    third = request_block_hashes(SPEC, PROMPT)[2]
    next(p for p in _block_files(tmp_path) if p.stem == third).unlink()
    with _engine(_config(tmp_path)) as engine:
        out = engine.generate({"c": PROMPT + SUFFIX})["c"]
    assert out.num_external_tokens == 8
    _assert_bit_exact(SPEC, out)
    assert third in {p.stem for p in _block_files(tmp_path)}  # recomputed, then saved again


def test_local_hits_and_external_hits_add_up(tmp_path: Path) -> None:
    _save_prompt(tmp_path)
    with _engine(_config(tmp_path)) as engine:
        engine.generate({"short": PROMPT[:9]})  # blocks 0-1 in the local prefix cache (loaded)
        out = engine.generate({"long": PROMPT + SUFFIX})["long"]
    assert (out.num_local_hit_tokens, out.num_external_tokens) == (8, 8)
    _assert_bit_exact(SPEC, out)


@pytest.mark.parametrize("damage", ["truncate", "garbage-header", "other-block"])
def test_bad_files_found_at_lookup_are_misses_and_reported(tmp_path: Path, damage: str, caplog: Any) -> None:
    _save_prompt(tmp_path)
    hashes = request_block_hashes(SPEC, PROMPT)
    target = next(p for p in _block_files(tmp_path) if p.stem == hashes[1])
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-7])
    elif damage == "garbage-header":
        target.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\0" * 400)
    else:  # a valid file of another block under this block's name
        other = next(p for p in _block_files(tmp_path) if p.stem == hashes[3])
        target.write_bytes(other.read_bytes())
    with _engine(_config(tmp_path)) as engine:
        out = engine.generate({"c": PROMPT + SUFFIX})["c"]
        stats = engine.scheduler_connector.get_kv_connector_stats()
    assert out.num_external_tokens == 4  # block 0 only
    assert stats["corrupt_blocks"] == 1
    assert "treating" in caplog.text and target.name in caplog.text
    assert Path(f"{target}.corrupt").exists()  # moved aside, and the block re-saved in its place
    _assert_bit_exact(SPEC, out)


def _make_hostile(target: Path, kind: str, tmp_path: Path) -> Any:
    """Put something that is not a regular file where a block file should be."""
    import socket

    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        cwd = os.getcwd()
        os.chdir(target.parent)  # bind by a short relative name: socket paths are limited to ~108 bytes
        try:
            server.bind(target.name)
        finally:
            os.chdir(cwd)
        server.listen(1)
        return server
    elif kind == "symlink-to-fifo":
        os.mkfifo(tmp_path / "elsewhere.fifo")
        target.symlink_to(tmp_path / "elsewhere.fifo")
    elif kind == "device":  # a device node, through a symlink (no mknod needed): reads never end
        target.symlink_to("/dev/zero")
    elif kind == "empty-device":
        target.symlink_to("/dev/null")
    return None


@pytest.mark.parametrize("kind", ["fifo", "socket", "symlink-to-fifo", "device", "empty-device"])
def test_non_regular_files_in_the_store_are_misses_and_never_block(tmp_path: Path, kind: str) -> None:
    # Opening a FIFO for reading blocks until a writer appears: a plain open() hangs this test
    # forever (run_python's timeout turns that into a failure instead of a hung suite).
    _save_prompt(tmp_path)
    target = next(p for p in _block_files(tmp_path) if p.stem == request_block_hashes(SPEC, PROMPT)[1])
    keep = _make_hostile(target, kind, tmp_path)
    try:
        code = f"""
import json
from test_kv_storage import PROMPT, SUFFIX, SPEC, _config, _engine, _assert_bit_exact
from pathlib import Path
with _engine(_config(Path({str(tmp_path)!r}))) as engine:
    out = engine.generate({{"c": PROMPT + SUFFIX}})["c"]
    stats = engine.scheduler_connector.get_kv_connector_stats()
_assert_bit_exact(SPEC, out)
print(json.dumps({{"external": out.num_external_tokens, "corrupt": stats["corrupt_blocks"]}}))
"""
        result = run_python(code, path=[Path(__file__).parent], timeout=60).stdout
    finally:
        if keep is not None:
            keep.close()
    got = json.loads(result.strip().splitlines()[-1])
    assert got == {"external": 4, "corrupt": 1}  # block 0 loaded, the hostile entry a counted miss


def test_corrupt_data_is_never_loaded_and_the_block_is_recomputed(tmp_path: Path) -> None:
    _save_prompt(tmp_path)
    target = next(p for p in _block_files(tmp_path) if p.stem == request_block_hashes(SPEC, PROMPT)[1])
    raw = bytearray(target.read_bytes())
    raw[-5] ^= 0x40  # one flipped bit in the data: size and header still look fine
    target.write_bytes(bytes(raw))
    with _engine(_config(tmp_path)) as engine:
        out = engine.generate({"c": PROMPT + SUFFIX})["c"]
        stats = engine.worker_connector.get_kv_connector_stats()
    assert stats["load_errors"] == 1 and stats["corrupt_blocks"] == 1
    assert out.num_load_errors == 1
    assert out.num_external_tokens == 4  # block 0 loaded, the rest recomputed
    _assert_bit_exact(SPEC, out)
    with _engine(_config(tmp_path)) as engine:  # the re-saved block is good again
        assert engine.generate({"d": PROMPT + SUFFIX})["d"].num_external_tokens == 20


def test_another_model_fingerprint_never_matches(tmp_path: Path) -> None:
    _save_prompt(tmp_path)
    other = dataclasses.replace(SPEC, model_fingerprint="storage-test-v2")
    with _engine(_config(tmp_path), other) as engine:
        out = engine.generate({"c": PROMPT + SUFFIX})["c"]
    assert out.num_external_tokens == 0
    _assert_bit_exact(other, out)


VLLM_CPU = dataclasses.replace(SPEC, layout="vllm-cpu")


def test_the_vllm_cpu_layout_round_trips_and_files_hold_its_block_shape(tmp_path: Path) -> None:
    _save_prompt(tmp_path, spec=VLLM_CPU)
    (path,) = [p for p in _block_files(tmp_path) if p.stem == request_block_hashes(VLLM_CPU, PROMPT)[0]]
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata()["layout"] == "vllm-cpu"
        assert list(handle.get_tensor("kv").shape) == [3, 2, 4, 16]  # [layers, heads, block_size, 2 * head_size]
    with _engine(_config(tmp_path), VLLM_CPU) as engine:
        out = engine.generate({"c": PROMPT + SUFFIX})["c"]
    assert out.num_external_tokens == 16
    _assert_bit_exact(VLLM_CPU, out)


def test_a_block_stored_under_one_layout_is_never_read_as_another(tmp_path: Path) -> None:
    _save_prompt(tmp_path)  # the "wtransfer" layout
    with _engine(_config(tmp_path), VLLM_CPU) as engine:  # same model, same tokens, other layout
        out = engine.generate({"c": PROMPT + SUFFIX})["c"]
    assert out.num_external_tokens == 0  # the namespace covers the layout: different hashes
    _assert_bit_exact(VLLM_CPU, out)
    # Even a file planted under the other layout's hash is refused by its header, never copied in.
    theirs = request_block_hashes(SPEC, PROMPT)[0]
    ours = request_block_hashes(VLLM_CPU, PROMPT)[0]
    (source,) = [p for p in _block_files(tmp_path) if p.stem == theirs]
    planted = next(p for p in _block_files(tmp_path) if p.stem == ours)
    planted.write_bytes(source.read_bytes())
    with _engine(_config(tmp_path), VLLM_CPU) as engine:
        out = engine.generate({"d": PROMPT + SUFFIX})["d"]
        stats = engine.worker_connector.get_kv_connector_stats()
    assert out.num_external_tokens == 0 and stats.get("loaded_blocks", 0) == 0
    _assert_bit_exact(VLLM_CPU, out)


def test_roles_producer_only_saves_consumer_only_loads(tmp_path: Path) -> None:
    with _engine(_config(tmp_path, "kv_consumer")) as engine:
        engine.generate({"a": PROMPT})
    assert not _block_files(tmp_path)
    with _engine(_config(tmp_path, "kv_producer")) as engine:
        engine.generate({"a": PROMPT})
        assert engine.generate({"b": PROMPT + SUFFIX}, max_new_tokens=1)["b"].num_external_tokens == 0
    assert len(_block_files(tmp_path)) == 5
    with _engine(_config(tmp_path, "kv_consumer")) as engine:
        assert engine.generate({"c": PROMPT + SUFFIX})["c"].num_external_tokens == 20


def test_a_working_set_larger_than_the_cache_comes_back_through_the_store(tmp_path: Path) -> None:
    prompts = {f"p{i}": [(i * 37 + 5 * t) % 500 for t in range(17)] for i in range(4)}  # 4 full blocks each
    with _engine(_config(tmp_path), num_blocks=10) as engine:
        engine.generate(prompts)
        assert engine.allocator.num_evictions > 0
        again = engine.generate({f"{k}-again": v + [1] for k, v in prompts.items()})
    assert all(o.num_local_hit_tokens + o.num_external_tokens == 16 for o in again.values())
    assert sum(o.num_external_tokens for o in again.values()) > 0
    for out in again.values():
        _assert_bit_exact(SPEC, out)


def test_bad_options_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs option\(s\) 'path' in kv_connector_extra_config"):
        KVConnectorFactory.create_connector(KVTransferConfig("storage"), KVConnectorRole.WORKER, SPEC)
    with pytest.raises(ValueError, match="unknown option"):
        KVConnectorFactory.create_connector(_config(tmp_path, pth="x"), KVConnectorRole.WORKER, SPEC)
    with pytest.raises(ValueError, match="KVCacheSpec"):
        KVConnectorFactory.create_connector(_config(tmp_path), KVConnectorRole.WORKER, None)
    # 768 bytes of data, 1288 with the header: a store of 1000 bytes would keep no block either
    with pytest.raises(ValueError, match=r"capacity_bytes=1000 is less than one block file \(1288 bytes here"):
        KVConnectorFactory.create_connector(_config(tmp_path, capacity_bytes=1000), KVConnectorRole.WORKER, SPEC)
    worker = KVConnectorFactory.create_connector(_config(tmp_path), KVConnectorRole.WORKER, SPEC)
    with pytest.raises(ValueError, match="float32"):
        worker.register_kv_caches({n: torch.zeros(2, 4, 4, 2, 8) for n in SPEC.layer_names})
    worker.shutdown()


def test_a_producer_process_and_a_consumer_process_share_a_directory(tmp_path: Path) -> None:
    common = f"""
        import json, torch
        from wtransfer import KVTransferConfig
        from wtransfer.kvcache import KVCacheSpec
        from wtransfer.testing.paged_engine import PagedKVEngine, reference_kv
        spec = KVCacheSpec.from_dict({json.dumps(SPEC.to_dict())})
        prompt = {PROMPT!r}
    """
    producer = (
        common
        + f"""
        config = KVTransferConfig("storage", kv_role="kv_producer",
                                  kv_connector_extra_config={{"path": {str(tmp_path)!r}}})
        with PagedKVEngine(spec, 16, kv_transfer_config=config) as engine:
            out = engine.generate({{"p": prompt}})["p"]
        print(json.dumps({{"external": out.num_external_tokens}}))
    """
    )
    consumer = (
        common
        + f"""
        config = KVTransferConfig("storage", kv_role="kv_consumer",
                                  kv_connector_extra_config={{"path": {str(tmp_path)!r}}})
        with PagedKVEngine(spec, 16, kv_transfer_config=config, capture_kv=True) as engine:
            out = engine.generate({{"c": prompt + {SUFFIX!r}}})["c"]
        ref = reference_kv(spec, out.prompt_token_ids)
        exact = all(torch.equal(out.kv[n], ref[n]) for n in ref)
        print(json.dumps({{"external": out.num_external_tokens, "exact": exact}}))
    """
    )
    produced = json.loads(run_python(producer, timeout=120).stdout)
    consumed = json.loads(run_python(consumer, timeout=120).stdout)
    assert produced == {"external": 0}
    assert consumed == {"external": 16, "exact": True}
    assert os.listdir(tmp_path)  # the directory really was the channel


def test_failed_saves_are_reported_and_never_stop_the_engine(tmp_path: Path, caplog: Any) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the store's directory should go")
    with _engine(_config(blocker)) as engine:
        out = engine.generate({"a": PROMPT}, max_new_tokens=2)["a"]
        stats = engine.worker_connector.get_kv_connector_stats()
    assert len(out.output_token_ids) == 2
    assert stats["save_errors"] == 4 and "saved_blocks" not in stats
    assert "could not save block" in caplog.text


def test_fsync_and_single_io_thread_options(tmp_path: Path) -> None:
    _save_prompt(tmp_path)
    with _engine(_config(tmp_path, io_threads=1, fsync=True)) as engine:
        out = engine.generate({"c": PROMPT + SUFFIX})["c"]
    assert out.num_external_tokens == 16
    _assert_bit_exact(SPEC, out)


class _GatedLoads:
    """Storage whose reads wait for the test (a filesystem that stalls)."""

    GATE: Any = None

    def _load_block(self, *args: Any) -> bool:
        assert self.GATE.wait(timeout=20), "test never opened the gate"
        return super()._load_block(*args)  # type: ignore[misc]


def test_a_load_its_step_gave_up_on_is_a_failed_load_and_never_writes_into_the_cache(tmp_path: Path) -> None:
    """REVIEW §2.9: a load past ``io_timeout_s`` used to be abandoned while still running, and
    wrote into a cache block the engine had since given to another request."""
    import threading

    from wtransfer.connectors.storage import BlockTransfer, StorageConnector, StorageConnectorMetadata

    class GatedStorage(_GatedLoads, StorageConnector):
        GATE = threading.Event()

    _save_prompt(tmp_path)
    config = _config(tmp_path, io_timeout_s=0.3)
    worker = GatedStorage(config, KVConnectorRole.WORKER, SPEC)
    caches = {name: torch.zeros(SPEC.cache_shape(8), dtype=torch.bfloat16) for name in SPEC.layer_names}
    worker.register_kv_caches(caches)
    hashes = request_block_hashes(SPEC, PROMPT)
    worker.bind_connector_metadata(StorageConnectorMetadata(
        loads=[BlockTransfer("late", index, 2 + index, hashes[index]) for index in range(2)], saves=[]))
    worker.start_load_kv()
    worker.wait_for_layer_load("layer.0")  # gives up after io_timeout_s, without raising
    assert worker.get_block_ids_with_load_errors() == {2, 3}  # the engine recomputes (or fails) them
    GatedStorage.GATE.set()  # the stalled reads finish now, after their step moved on
    worker.shutdown()  # waits for the I/O threads
    assert all(not cache.any() for cache in caches.values()), "an abandoned load wrote into the cache"
    stats = worker.get_kv_connector_stats()
    assert stats["loads_abandoned"] == 2 and "loaded_blocks" not in stats


class _GatedSaves:
    """Storage whose writes wait for the test (a network mount that hangs)."""

    GATE: Any = None

    def _write_block(self, *args: Any) -> None:
        assert self.GATE.wait(timeout=30), "test never opened the gate"
        super()._write_block(*args)  # type: ignore[misc]


def test_shutdown_gives_up_on_a_hung_save_after_io_timeout_s(tmp_path: Path, caplog: Any) -> None:
    """Before, shutdown() logged that it abandoned the saves still running after io_timeout_s, then waited for
    them all the same: a save hung on a network mount held vLLM's shutdown for good."""
    import threading
    import time

    from wtransfer.connectors.storage import BlockTransfer, StorageConnector, StorageConnectorMetadata

    class GatedStorage(_GatedSaves, StorageConnector):
        GATE = threading.Event()

    worker = GatedStorage(_config(tmp_path, io_timeout_s=0.3), KVConnectorRole.WORKER, SPEC)
    worker.register_kv_caches({name: torch.ones(SPEC.cache_shape(8), dtype=torch.bfloat16)
                               for name in SPEC.layer_names})
    worker.bind_connector_metadata(StorageConnectorMetadata(
        loads=[], saves=[BlockTransfer("r", 0, 1, request_block_hashes(SPEC, PROMPT)[0])]))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    closing = threading.Thread(target=worker.shutdown, daemon=True)
    began = time.monotonic()
    closing.start()
    closing.join(15)
    took = time.monotonic() - began
    GatedStorage.GATE.set()  # the hung save goes on now (the process's exit would wait for it)
    deadline = time.monotonic() + 15
    while any(t.name.startswith("wtransfer-storage") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not closing.is_alive(), "shutdown() still waits for the hung save"
    assert took < 5, took
    assert "1 block saves still running after 0.3s (io_timeout_s); abandoning them" in caplog.text
    assert not _block_files(tmp_path, ".tmp")  # the late save landed whole or not at all


def test_a_save_that_cannot_start_never_holds_its_request(tmp_path: Path, caplog: Any) -> None:
    """Before, a save counted as in flight before its blocks were copied out: a copy that failed (out of memory)
    left it counted for good, so ``get_finished`` never reported the request and vLLM never freed its blocks."""
    from wtransfer.connectors.storage import BlockTransfer, StorageConnector, StorageConnectorMetadata

    class OutOfMemory(StorageConnector):
        def _copy_out(self, block_ids: list[int]) -> Any:
            raise MemoryError("cannot allocate the copies")

    worker = OutOfMemory(_config(tmp_path), KVConnectorRole.WORKER, SPEC)
    worker.register_kv_caches({name: torch.ones(SPEC.cache_shape(8), dtype=torch.bfloat16)
                               for name in SPEC.layer_names})
    hashes = request_block_hashes(SPEC, PROMPT)
    worker.bind_connector_metadata(StorageConnectorMetadata(
        loads=[], saves=[BlockTransfer("r", index, 1 + index, hashes[index]) for index in range(2)]))
    worker.wait_for_save()  # the step goes on
    worker.clear_connector_metadata()
    assert worker.get_finished({"r"}) == ({"r"}, None)
    assert worker.get_kv_connector_stats()["save_errors"] == 2 and "2 block saves not started" in caplog.text
    worker.shutdown()
    assert not _block_files(tmp_path)


def _store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_a_hundred_rl_cycles_keep_the_store_under_its_capacity(tmp_path: Path) -> None:
    """Each cycle is what an RL loop does: new weights (a new model fingerprint: a new namespace
    nobody will read again once the next cycle starts), then prompts. Unbounded, the store grows
    by every cycle; with ``capacity_bytes`` it stays flat, the newest blocks are kept, and the
    blocks of the current weights keep being reused."""
    capacity = 64 * 1024
    prompts = {f"p{k}": [(k * 29 + 5 * i) % 500 for i in range(17)] for k in range(3)}  # 4 blocks each
    sizes, evicted = [], 0
    for cycle in range(100):
        spec = dataclasses.replace(SPEC, model_fingerprint=f"weights-after-update-{cycle}")
        with _engine(_config(tmp_path, capacity_bytes=capacity), spec) as engine:
            engine.generate(dict(prompts))
            again = engine.generate({f"{k}-again": v for k, v in prompts.items()})
            stats = engine.worker_connector.get_kv_connector_stats()
        if cycle % 10 == 0:
            # within a cycle the store serves what it just saved
            assert all(out.num_external_tokens + out.num_local_hit_tokens == 16 for out in again.values())
        sizes.append(_store_bytes(tmp_path))
        evicted += stats.get("evicted_blocks", 0)
    per_cycle = sizes[0]  # the first cycles stay below the capacity: what one cycle writes
    assert per_cycle > 0 and per_cycle * 100 > 20 * capacity  # unbounded, 100 cycles would take 20x the cap
    assert max(sizes) <= capacity, f"the store reached {max(sizes)} bytes, capacity {capacity}"
    assert sizes[-1] >= per_cycle  # eviction keeps the newest blocks, it does not wipe the store
    namespaces = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(namespaces) < 20, "namespaces of old weights were not reclaimed"
    assert evicted > 0  # counted in the stats (those of evictions at a cycle's shutdown come after them)


def test_writes_abandoned_by_a_killed_writer_count_against_the_capacity_and_go_first(tmp_path: Path) -> None:
    """A writer killed between writing a block and renaming it into place leaves its temporary file. Before, every
    scan skipped temporaries: never counted against ``capacity_bytes``, never evicted, on a shared store crash after
    crash. Now one not written to for ``ABANDONED_WRITE_S`` counts and goes first; a younger one (a write in
    progress, perhaps another process's) is left alone."""
    import time as clock

    from wtransfer.connectors._budget import ABANDONED_WRITE_S

    capacity = 28 * 1024  # 22 block files of 1288 bytes
    killed = run_python(f"""
        import dataclasses, os, signal, sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_kv_storage import PROMPT, SPEC, _config, _engine
        os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # killed before its rename
        spec = dataclasses.replace(SPEC, model_fingerprint="killed-writer")
        with _engine(_config(Path({str(tmp_path)!r}), io_threads=1), spec) as engine:
            engine.generate({{"p": PROMPT}})
    """, check=False)
    assert killed.returncode == -9, killed.stderr
    (left,) = _block_files(tmp_path, ".tmp")  # its first save, whole but never renamed
    old = clock.time() - 2 * ABANDONED_WRITE_S
    os.utime(left, (old, old))
    in_progress = left.with_name(left.name.replace(".tmp", ".1.tmp"))
    in_progress.write_bytes(left.read_bytes())  # a write going on now
    with _engine(_config(tmp_path, capacity_bytes=capacity)) as engine:  # fills the store past its capacity
        engine.generate({f"f{k}": [(k * 31 + 3 * i) % 500 for i in range(17)] for k in range(6)})
    assert not left.exists(), "an abandoned write outlived an eviction"
    assert in_progress.exists(), "a write in progress was evicted"
    assert _store_bytes(tmp_path) <= capacity


def test_an_abandoned_write_is_evicted_before_older_blocks(tmp_path: Path) -> None:
    """Leftovers go first: an abandoned write younger than every block file is still the first file evicted."""
    import time as clock

    from wtransfer.connectors._budget import ABANDONED_WRITE_S, StoreBudget

    namespace = tmp_path / "ns"
    namespace.mkdir()
    now = clock.time()
    for index in range(4):  # blocks last used long ago, oldest first
        block = namespace / f"{index:064x}.safetensors"
        block.write_bytes(b"b" * 1000)
        os.utime(block, (now - 10 * ABANDONED_WRITE_S + index, now - 10 * ABANDONED_WRITE_S + index))
    abandoned = namespace / f"{9:064x}.safetensors.4242.1.0.tmp"
    abandoned.write_bytes(b"t" * 1000)
    os.utime(abandoned, (now - 2 * ABANDONED_WRITE_S, now - 2 * ABANDONED_WRITE_S))
    budget = StoreBudget(str(tmp_path), 4600, lambda name, amount: None)  # 5000 bytes: one file must go
    assert budget.added(0)
    budget.evict()
    assert not abandoned.exists()
    assert len(list(namespace.glob("*.safetensors"))) == 4  # every block stays


def test_eviction_goes_by_last_use_across_processes_sharing_the_store(tmp_path: Path) -> None:
    """"kept" is saved first, "old" after it, then "kept" is read: by last use "old" is now the
    oldest. Another process then fills the store past its capacity: "old" goes, "kept" stays
    (by save time alone it would be the other way round)."""
    import time as clock

    capacity = 28 * 1024  # 22 block files of 1288 bytes: the filler's last ones push out 3 or 4
    old_prompt, kept_prompt = PROMPT, [(5 * i + 1) % 500 for i in range(17)]
    with _engine(_config(tmp_path, capacity_bytes=capacity)) as engine:
        engine.generate({"kept": kept_prompt})
    clock.sleep(1.1)  # a hit marks a file used only if its last use is over 1 s old
    with _engine(_config(tmp_path, capacity_bytes=capacity)) as engine:
        engine.generate({"old": old_prompt})
    clock.sleep(1.1)  # a hit marks a file used only if its last use is over 1 s old
    with _engine(_config(tmp_path, capacity_bytes=capacity)) as engine:
        assert engine.generate({"kept-again": kept_prompt})["kept-again"].num_external_tokens == 16
    clock.sleep(1.1)  # a hit marks a file used only if its last use is over 1 s old
    filler = run_python(f"""
        import dataclasses, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_kv_storage import SPEC, _config, _engine
        from pathlib import Path
        spec = dataclasses.replace(SPEC, model_fingerprint="other-weights")
        with _engine(_config(Path({str(tmp_path)!r}), capacity_bytes={capacity}), spec) as engine:
            engine.generate({{f"f{{k}}": [(k * 31 + 3 * i) % 500 for i in range(17)] for k in range(4)}})
    """)
    assert filler.returncode == 0, filler.stderr
    assert _store_bytes(tmp_path) <= capacity
    with _engine(_config(tmp_path)) as engine:
        outs = engine.generate({"kept-3": kept_prompt, "old-3": old_prompt})
    assert outs["kept-3"].num_external_tokens == 16  # read last: kept
    assert outs["old-3"].num_external_tokens < 16  # saved later, never read: evicted first


def test_a_namespace_no_instance_uses_is_evicted_before_older_blocks_in_use(tmp_path: Path) -> None:
    """An instance serving some weights saved its blocks first and is still running; another
    instance saved blocks of other weights after it and shut down (a weight sync: those weights
    are served nowhere now). A third fills the store past its capacity: the dead namespace's
    newer blocks go, the live one's older blocks stay (by last use alone it would be the
    other way round)."""
    import time as clock

    capacity = 28 * 1024  # block files of 1288 bytes: the 23rd passes it, and evicting to 0.9x frees 3
    served, old, filler = (dataclasses.replace(SPEC, model_fingerprint=name) for name in ("served", "old", "filler"))
    with _engine(_config(tmp_path, capacity_bytes=capacity), served) as live:
        live.generate({"kept": [(5 * i + 1) % 500 for i in range(17)]})
        clock.sleep(0.05)
        with _engine(_config(tmp_path, capacity_bytes=capacity), old) as engine:
            engine.generate({"old": PROMPT})
        clock.sleep(0.05)
        namespaces = {p.name: len(_block_files(p)) for p in tmp_path.iterdir()}
        assert sorted(namespaces.values()) == [4, 4], namespaces
        with _engine(_config(tmp_path, capacity_bytes=capacity), filler) as engine:
            engine.generate({f"f{k}": [(k * 31 + 3 * i) % 500 for i in range(17)] for k in range(4)})
        after = {p.name: len(_block_files(p)) for p in tmp_path.iterdir()}
    assert _store_bytes(tmp_path) <= capacity
    # every file evicted was the dead namespace's; the live one's four, saved first, all stayed
    served_dir, old_dir, filler_dir = (BlockLayout.for_spec(spec).namespace[:16] for spec in (served, old, filler))
    assert (after[served_dir], after.get(old_dir, 0) < 4, after[filler_dir]) == (4, True, 16), (namespaces, after)


def test_the_store_is_bounded_by_default(tmp_path: Path) -> None:
    """Without ``capacity_bytes`` the store holds 64 GiB at most, or a quarter of its filesystem."""
    stat = os.statvfs(tmp_path)
    expected = min(64 << 30, stat.f_blocks * stat.f_frsize // 4)
    connector = KVConnectorFactory.create_connector(_config(tmp_path), KVConnectorRole.SCHEDULER, SPEC)
    try:
        assert connector.budget is not None and connector.budget.capacity_bytes == expected
    finally:
        connector.shutdown()
    unbounded = KVConnectorFactory.create_connector(_config(tmp_path, capacity_bytes=None), KVConnectorRole.SCHEDULER, SPEC)
    assert unbounded.budget is None
    unbounded.shutdown()


def test_with_tensor_parallel_parts_a_block_is_stored_only_once_every_part_is(tmp_path: Path) -> None:
    """Each TP worker saves its own part of a block (its heads) to its own file; a lookup counts
    the block only when every part is there, and each worker reads back its own part only."""
    part = {shard: dataclasses.replace(SPEC, shard=shard, num_shards=2) for shard in (0, 1)}
    with _engine(_config(tmp_path), part[0]) as engine:
        engine.generate({"w0": PROMPT})
    assert len(_block_files(tmp_path)) == 4  # part 0 of 4 blocks
    with _engine(_config(tmp_path), part[0]) as engine:
        assert engine.generate({"r": PROMPT})["r"].num_external_tokens == 0, "half a block counted as stored"
    with _engine(_config(tmp_path), part[1]) as engine:
        engine.generate({"w1": PROMPT})
    files = _block_files(tmp_path)
    assert len(files) == 8 and sorted({f.name.split(".")[1] for f in files}) == ["0of2", "1of2"]
    for shard in (0, 1):
        with _engine(_config(tmp_path), part[shard]) as engine:
            out = engine.generate({"r": PROMPT + SUFFIX})["r"]
        assert out.num_external_tokens == 16
        _assert_bit_exact(part[shard], out)
    # a part filed under the other part's name is refused by its header, never loaded as the other's
    import shutil

    for path in _block_files(tmp_path):
        if ".0of2." in path.name:
            shutil.copyfile(path, str(path).replace(".0of2.", ".1of2."))
    with _engine(_config(tmp_path), part[1]) as engine:
        assert engine.generate({"r2": PROMPT})["r2"].num_external_tokens == 0
        assert engine.scheduler_connector.get_kv_connector_stats()["corrupt_blocks"] >= 1

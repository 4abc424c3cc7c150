"""The ``multi`` connector over two ``storage`` directories (and a parameter-returning child)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from wtransfer import KVConnectorBase, KVConnectorFactory, KVConnectorMetadata, KVConnectorRole, KVTransferConfig
from wtransfer.connectors.storage import StorageConnector
from wtransfer.kvcache import KVCacheSpec
from wtransfer.testing.conformance import ConnectorConformance
from wtransfer.testing.paged_engine import PagedKVEngine, reference_kv

SPEC = KVCacheSpec(
    ("layer.0", "layer.1"), block_size=4, num_kv_heads=2, head_size=8, dtype="float16", model_fingerprint="multi-test"
)
PROMPT = [(11 * i + 3) % 500 for i in range(18)]  # 4 full blocks + 2 tokens


def _child(path: Path, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "storage", "kv_connector_extra_config": {"path": str(path), **extra}}


def _multi(*children: dict[str, Any]) -> KVTransferConfig:
    return KVTransferConfig("multi", kv_connector_extra_config={"connectors": list(children)})


def _files(root: Path) -> set[str]:
    return {p.name for p in root.rglob("*.safetensors")}


class TestMultiConformance(ConnectorConformance):
    connector = "multi"
    persistent = True

    @pytest.fixture
    def connector_options(self, tmp_path: Path) -> dict[str, Any]:
        return {"connectors": [_child(tmp_path / "a"), _child(tmp_path / "b")]}


def test_saves_to_every_child_and_loads_from_the_first_hit(tmp_path: Path) -> None:
    fast, shared = tmp_path / "fast", tmp_path / "shared"
    config = _multi(_child(fast), _child(shared))
    with PagedKVEngine(SPEC, 16, kv_transfer_config=config) as engine:
        engine.generate({"a": PROMPT}, max_new_tokens=3)
    assert len(_files(fast)) == 5 and _files(fast) == _files(shared)

    shutil.rmtree(fast)  # the first child lost everything: the second one serves
    with PagedKVEngine(SPEC, 16, kv_transfer_config=config, capture_kv=True) as engine:
        out = engine.generate({"b": PROMPT + [1, 2, 3]})["b"]
        stats = engine.worker_connector.get_kv_connector_stats()
    assert out.num_external_tokens == 16  # prompt blocks 0-3 (block 4 held generated tokens)
    assert stats["1:storage"]["loaded_blocks"] == 4 and "loaded_blocks" not in stats["0:storage"]
    reference = reference_kv(SPEC, out.prompt_token_ids)
    assert all(torch.equal(out.kv[n], reference[n]) for n in reference)


def test_each_child_hears_its_own_workers_reports(tmp_path: Path) -> None:
    """An offloading child's stores count only once its worker reports them landed; through
    multi that report must reach it, or the CPU tier would never serve a load."""
    offload = {"kv_connector": "offloading", "kv_connector_extra_config": {"spec_name": "cpu", "num_cpu_blocks": 16}}
    config = _multi(offload, _child(tmp_path / "disk"))
    with PagedKVEngine(SPEC, 16, kv_transfer_config=config, enable_prefix_caching=False, capture_kv=True) as engine:
        engine.generate({"a": PROMPT}, max_new_tokens=1)
        out = engine.generate({"b": PROMPT}, max_new_tokens=1)["b"]
        stats = engine.worker_connector.get_kv_connector_stats()
    assert out.num_external_tokens == 16
    assert stats["0:offloading"]["load_jobs"] >= 1  # the tier served it, ahead of the disk
    assert "loaded_blocks" not in stats["1:storage"]
    reference = reference_kv(SPEC, out.prompt_token_ids)
    assert all(torch.equal(out.kv[n][:, :16], reference[n][:, :16]) for n in reference)


class SlowSender(StorageConnector):
    """A child that, like an asynchronous sender (``offloading``), keeps a finished request's
    blocks until its transfer is done: here, until the test opens a gate."""

    GATE = threading.Event()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        super().request_finished(request, block_ids)
        return True, None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        waiting = self.__dict__.setdefault("waiting", set())
        waiting |= finished_req_ids
        if not self.GATE.is_set():
            return None, None
        done = set(waiting)
        waiting.clear()
        return done or None, None


def test_a_request_is_done_only_when_every_child_finished_sending(tmp_path: Path, isolated_registry: None) -> None:
    KVConnectorFactory.register_connector("slow-sender", __name__, "SlowSender")
    SlowSender.GATE.clear()
    slow = {"kv_connector": "slow-sender", "kv_connector_extra_config": {"path": str(tmp_path / "slow")}}
    with PagedKVEngine(SPEC, 16, kv_transfer_config=_multi(_child(tmp_path / "fast"), slow)) as engine:
        engine.add_request("a", PROMPT)
        deadline = time.monotonic() + 10  # the fast child writes on an I/O thread: give it time on a busy machine
        for _ in range(5):
            engine.step()
        while not _files(tmp_path / "fast") and time.monotonic() < deadline:
            engine.step()
            time.sleep(0.01)
        assert engine.has_unfinished()  # blocks held: the slow child has not reported its request
        assert _files(tmp_path / "fast")
        SlowSender.GATE.set()
        engine.run(timeout_s=20)
        assert not engine.has_unfinished()
    assert _files(tmp_path / "slow") == _files(tmp_path / "fast")


def test_conflicting_kv_transfer_params_are_refused(isolated_registry: None) -> None:
    KVConnectorFactory.register_connector("params-a", __name__, "ParamsA")
    KVConnectorFactory.register_connector("params-b", __name__, "ParamsB")
    from wtransfer.connectors._request import KVRequest

    request = KVRequest("r", list(range(8)))
    agree = KVConnectorFactory.create_connector(
        _multi({"kv_connector": "params-a"}, {"kv_connector": "params-a"}), KVConnectorRole.SCHEDULER, SPEC
    )
    assert agree.request_finished(request, [0, 1]) == (False, {"remote_host": "a"})
    clash = KVConnectorFactory.create_connector(
        _multi({"kv_connector": "params-a"}, {"kv_connector": "params-b"}), KVConnectorRole.SCHEDULER, SPEC
    )
    with pytest.raises(ValueError, match="remote_host.*distinct keys"):
        clash.request_finished(request, [0, 1])


def test_bad_configs_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs option\(s\) 'connectors' in kv_connector_extra_config"):
        KVConnectorFactory.create_connector(KVTransferConfig("multi"), KVConnectorRole.WORKER, SPEC)
    with pytest.raises(ValueError, match="child #1"):
        KVConnectorFactory.create_connector(_multi(_child(tmp_path), {"path": "x"}), KVConnectorRole.WORKER, SPEC)


class ParamsA(KVConnectorBase):
    """A minimal real connector that matches nothing and hands back transfer params."""

    value = "a"

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, step: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, {"remote_host": self.value}

    def start_load_kv(self, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any = None, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class ParamsB(ParamsA):
    value = "b"


@pytest.mark.parametrize("first_child", ["storage", "offloading"])
def test_no_child_saves_kv_computed_on_top_of_another_childs_failed_load(tmp_path: Path, first_child: str) -> None:
    """The second child's load of block 1 fails; the step computes on top of it before the engine rolls back. The
    first child, which loaded nothing, must store none of that step's KV (under the multi connector it hears of the
    failure only through ``skip_saves``)."""
    from safetensors import safe_open

    from wtransfer.connectors._hashing import request_block_hashes

    first, second = tmp_path / "first", tmp_path / "second"
    with PagedKVEngine(SPEC, 16, kv_transfer_config=_multi(_child(second))) as engine:
        engine.generate({"a": PROMPT})  # blocks 0-3 in the second store only
    hashes = request_block_hashes(SPEC, PROMPT + [1, 2, 3])
    damaged = next(p for p in second.rglob("*.safetensors") if p.stem == hashes[1])
    raw = bytearray(damaged.read_bytes())
    raw[-2] ^= 0x10  # the data checksum fails only when the block is loaded
    damaged.write_bytes(bytes(raw))

    if first_child == "storage":
        first_config = _child(first)
    else:
        first_config = {"kv_connector": "offloading", "kv_connector_extra_config": {"num_cpu_blocks": 16}}
    config = _multi(first_config, _child(second))
    with PagedKVEngine(SPEC, 16, kv_transfer_config=config, enable_prefix_caching=False, capture_kv=True) as engine:
        out = engine.generate({"b": PROMPT + [1, 2, 3]})["b"]
        again = engine.generate({"c": PROMPT + [1, 2, 3]})["c"]  # loads from the first child that has it
        scheduler_stats = engine.scheduler_connector.get_kv_connector_stats()
        worker_stats = engine.worker_connector.get_kv_connector_stats()
    assert out.num_load_errors == 1
    reference = reference_kv(SPEC, out.prompt_token_ids)
    assert all(torch.equal(out.kv[n], reference[n]) for n in reference)
    assert again.num_external_tokens == 20 and again.num_load_errors == 0
    assert all(torch.equal(again.kv[n], reference[n]) for n in reference), "a child served KV of a failed load"
    if first_child == "offloading":  # it refused that step's stores, so the disk served "c", freshly recomputed
        assert scheduler_stats["0:offloading"]["failed_store_blocks"] > 0
        assert worker_stats["0:offloading"]["load_jobs"] == 0 and worker_stats["1:storage"]["loaded_blocks"] > 0
        return
    saved = {p.stem: p for p in first.rglob("*.safetensors")}
    assert set(saved) == set(hashes[1:5])  # recomputed blocks only, each one correct
    for index, block_hash in enumerate(hashes[:5]):
        if block_hash in saved:
            with safe_open(str(saved[block_hash]), framework="pt") as handle:
                kv = handle.get_tensor("kv")
            for layer, name in enumerate(SPEC.layer_names):
                assert torch.equal(kv[layer], reference[name][:, index * 4 : (index + 1) * 4]), (index, name)

"""The tiny paged engine: honest model, prefix cache with LRU eviction, and the connector call order."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from wtransfer import KVConnectorBase, KVConnectorMetadata, KVConnectorRole, KVTransferConfig
from wtransfer.errors import TransferError, TransferTimeoutError
from wtransfer.kvcache import KVCacheSpec
from wtransfer.testing.paged_engine import PagedKVEngine, reference_kv

SPEC = KVCacheSpec(
    ("layer.0", "layer.1"), block_size=4, num_kv_heads=2, head_size=8, dtype="bfloat16", model_fingerprint="engine-test"
)
PROMPT = [(5 * i + 1) % 500 for i in range(14)]


def _equal_kv(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_kv_is_a_deterministic_function_of_the_prefix_however_it_is_chunked() -> None:
    engine = PagedKVEngine(SPEC, 16, capture_kv=True)
    out = engine.generate({"a": PROMPT}, max_new_tokens=4)["a"]  # prefill, then 3 decode steps
    assert out.kv is not None
    tokens = PROMPT + out.output_token_ids[:-1]
    assert _equal_kv(out.kv, reference_kv(SPEC, tokens))
    other_model = PagedKVEngine(KVCacheSpec(**{**SPEC.to_dict(), "model_fingerprint": "x"}), 16, capture_kv=True)
    assert not _equal_kv(other_model.generate({"a": PROMPT})["a"].kv or {}, reference_kv(SPEC, PROMPT))


def test_the_model_reads_its_cache_so_a_wrong_block_changes_later_kv() -> None:
    engine = PagedKVEngine(SPEC, 16, capture_kv=True)
    engine.add_request("a", PROMPT[:8], max_new_tokens=2)
    engine.step()  # prefill: blocks 0-1 full
    blocks = engine.block_ids("a")
    for cache in engine.kv_caches.values():
        cache[:, blocks[0]] += 1  # corrupt the first block: attention carries it to every later token
    out = engine.run()["a"]
    reference = reference_kv(SPEC, PROMPT[:8] + out.output_token_ids[:1])
    assert out.kv is not None
    assert not torch.equal(out.kv["layer.0"][:, 8], reference["layer.0"][:, 8])


def test_local_prefix_cache_and_lru_eviction() -> None:
    engine = PagedKVEngine(SPEC, 8, capture_kv=True)
    engine.generate({"a": PROMPT})  # 4 blocks, 3 full ones registered
    hit = engine.generate({"a2": PROMPT + [9, 9]})["a2"]
    assert hit.num_local_hit_tokens == 12
    assert _equal_kv(hit.kv or {}, reference_kv(SPEC, PROMPT + [9, 9]))
    other = [(7 * i + 2) % 500 for i in range(30)]  # 8 blocks: every cached block is evicted
    engine.generate({"b": other})
    assert engine.allocator.num_evictions > 0
    assert engine.generate({"a3": PROMPT + [9, 9]})["a3"].num_local_hit_tokens == 0


def test_outputs_are_returned_once_and_ids_can_be_reused_after() -> None:
    engine = PagedKVEngine(SPEC, 16)
    engine.add_request("a", PROMPT)
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", PROMPT)
    first = engine.run()  # finished by the manual steps, returned here
    assert list(first) == ["a"] and engine.run() == {}
    again = engine.generate({"a": PROMPT})["a"]
    assert again.num_local_hit_tokens == 12 and again.output_token_ids == first["a"].output_token_ids


def test_requests_wait_for_blocks_instead_of_failing() -> None:
    engine = PagedKVEngine(SPEC, 5)
    outputs = engine.generate({f"r{i}": [i + 1] * 13 for i in range(3)}, max_new_tokens=2)  # 4 blocks each
    assert sorted(outputs) == ["r0", "r1", "r2"]
    with pytest.raises(ValueError, match="needs 7 blocks"):
        engine.add_request("big", [1] * 26)


# --------------------------------------------------------------------------- call order
@dataclass
class RecordingMetadata(KVConnectorMetadata):
    step: int = 0
    loads: list[list[Any]] = field(default_factory=list)


class RecordingConnector(KVConnectorBase):
    """Records every call (shared log) and serves block 0 of a known prompt from ``SOURCE``."""

    metadata_cls = RecordingMetadata
    LOG: list[str] = []
    SOURCE: dict[str, torch.Tensor] = {}
    LOAD_ASYNC = False

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, spec: KVCacheSpec | None = None) -> None:
        super().__init__(config, role, spec)
        self.caches: dict[str, torch.Tensor] = {}
        self.pending: list[list[Any]] = []
        self.thread: threading.Thread | None = None
        self.received: set[str] = set()

    def _log(self, entry: str) -> None:
        self.LOG.append(f"{self.role.name[0]}:{entry}")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._log("get_num_new_matched_tokens")
        known = bool(self.SOURCE) and request.token_ids[:4] == PROMPT[:4]
        return (4 if known else 0), self.LOAD_ASYNC

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        self._log(f"update_state_after_alloc:{num_external_tokens}")
        if num_external_tokens:
            self.pending.append([request.request_id, block_ids[0]])

    def build_connector_meta(self, step: Any) -> RecordingMetadata:
        self._log("build_connector_meta")
        meta = RecordingMetadata(step=step.step, loads=self.pending)
        self.pending = []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._log("request_finished")
        return False, {"served_by": "recording"}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._log("register_kv_caches")
        self.caches = kv_caches

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, RecordingMetadata)  # rebuilt from JSON by metadata_cls
        self._log("bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def _copy(self, loads: list[list[Any]]) -> None:
        for _, block in loads:
            for name, cache in self.caches.items():
                cache[:, block].copy_(self.SOURCE[name][:, 0:4])

    def start_load_kv(self, **kwargs: Any) -> None:
        self._log("start_load_kv")
        loads = self._get_connector_metadata().loads  # type: ignore[attr-defined]
        if self.LOAD_ASYNC and loads:
            self.thread = threading.Thread(target=self._copy, args=(loads,))
            self.thread.start()
            self.received |= {rid for rid, _ in loads}
        else:
            self._copy(loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._log(f"wait_for_layer_load:{layer_name}")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None, **kw: Any) -> None:
        assert kv_layer is self.caches[layer_name]
        self._log(f"save_kv_layer:{layer_name}")

    def wait_for_save(self) -> None:
        self._log("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._log("get_finished")
        if self.thread is not None:
            self.thread.join(timeout=10)
            self.thread = None
            done, self.received = self.received, set()
            return None, done
        return None, None

    def clear_connector_metadata(self) -> None:
        self._log("clear_connector_metadata")
        super().clear_connector_metadata()

    def shutdown(self) -> None:
        self._log("shutdown")


@pytest.fixture
def recording() -> type[RecordingConnector]:
    RecordingConnector.LOG = []
    RecordingConnector.SOURCE = {}
    RecordingConnector.LOAD_ASYNC = False
    return RecordingConnector


def _pair(cls: type[KVConnectorBase]) -> tuple[KVConnectorBase, KVConnectorBase]:
    config = KVTransferConfig("recording")
    return cls(config, KVConnectorRole.SCHEDULER, SPEC), cls(config, KVConnectorRole.WORKER, SPEC)


def test_connector_call_order_of_one_step(recording: type[RecordingConnector]) -> None:
    engine = PagedKVEngine(SPEC, 16, connectors=_pair(recording))
    out = engine.generate({"a": PROMPT})["a"]
    engine.shutdown()
    assert out.kv_transfer_params == {"served_by": "recording"}
    assert recording.LOG == [
        "W:register_kv_caches",
        "S:get_num_new_matched_tokens",
        "S:update_state_after_alloc:0",
        "S:build_connector_meta",
        "W:bind_connector_metadata",
        "W:start_load_kv",
        "W:wait_for_layer_load:layer.0",
        "W:save_kv_layer:layer.0",
        "W:wait_for_layer_load:layer.1",
        "W:save_kv_layer:layer.1",
        "W:wait_for_save",
        "S:request_finished",
        "W:get_finished",
        "W:clear_connector_metadata",
        # the next step tells the worker which requests finished; nothing is computed in it
        "S:build_connector_meta",
        "W:bind_connector_metadata",
        "W:start_load_kv",
        "W:wait_for_save",
        "W:get_finished",
        "W:clear_connector_metadata",
        "W:shutdown",
        "S:shutdown",
    ]
    assert json.loads(engine.last_metadata_json or "") == {"step": 2, "loads": []}


@pytest.mark.parametrize("load_async", [False, True])
def test_external_tokens_are_loaded_not_computed(recording: type[RecordingConnector], load_async: bool) -> None:
    recording.SOURCE = reference_kv(SPEC, PROMPT)
    recording.LOAD_ASYNC = load_async
    engine = PagedKVEngine(SPEC, 16, connectors=_pair(recording), capture_kv=True)
    out = engine.generate({"a": PROMPT}, max_new_tokens=2)["a"]
    engine.shutdown()
    assert out.num_external_tokens == 4
    assert _equal_kv(out.kv or {}, reference_kv(SPEC, PROMPT + out.output_token_ids[:1]))
    if load_async:  # parked for a step: loads finish outside the forward pass
        first_forward = recording.LOG.index("W:wait_for_layer_load:layer.0")
        assert recording.LOG.index("W:get_finished") < first_forward


def test_metadata_that_is_not_json_safe_fails_loudly(recording: type[RecordingConnector]) -> None:
    class Leaky(RecordingConnector):
        def build_connector_meta(self, step: Any) -> RecordingMetadata:
            return RecordingMetadata(step=step.step, loads=[[object(), 1]])

    engine = PagedKVEngine(SPEC, 16, connectors=_pair(Leaky))
    engine.add_request("a", PROMPT)
    with pytest.raises(TypeError, match="not JSON-safe"):
        engine.step()


def test_a_connector_claiming_the_whole_prompt_is_a_contract_error(recording: type[RecordingConnector]) -> None:
    class Greedy(RecordingConnector):
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            return request.num_tokens, False

    engine = PagedKVEngine(SPEC, 16, connectors=_pair(Greedy))
    engine.add_request("a", PROMPT)
    with pytest.raises(TransferError, match="at least one prompt token"):
        engine.step()


def test_a_connector_that_never_reports_times_out_instead_of_hanging(recording: type[RecordingConnector]) -> None:
    class Forgetful(RecordingConnector):
        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
            return True, None  # delays the free, but get_finished never reports it

    engine = PagedKVEngine(SPEC, 16, connectors=_pair(Forgetful))
    engine.add_request("a", PROMPT)
    with pytest.raises(TransferTimeoutError, match="never reported"):
        engine.run(timeout_s=0.3)

"""A third-party connector, found only through its distribution's entry point, runs through the
tiny engine in a fresh process: no registration call, no module path in the config."""

from __future__ import annotations

import json
from pathlib import Path

from wtransfer.testing.distributions import write_distribution
from wtransfer.testing.processes import run_python

# An in-process block store: scheduler and worker instances live in one process and
# share it, the way a CPU-memory tier would. Metadata is JSON-safe (lists of ints/strs).
CONNECTOR_SOURCE = '''
    from dataclasses import dataclass, field
    from typing import Any

    from wtransfer import KVConnectorBase, KVConnectorMetadata

    STORE: dict[str, Any] = {}


    @dataclass
    class MemMeta(KVConnectorMetadata):
        loads: list[list[Any]] = field(default_factory=list)   # [block_hash, block_id]
        saves: list[list[Any]] = field(default_factory=list)


    class MemStoreConnector(KVConnectorBase):
        """Keeps full blocks in a dict keyed by their chained hash."""

        metadata_cls = MemMeta

        def __init__(self, config, role, kv_cache_spec=None):
            super().__init__(config, role, kv_cache_spec)
            self.bs = self.require_spec().block_size
            self.loads, self.matched, self.caches = [], {}, {}

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            start = num_computed_tokens // self.bs
            limit = (request.num_tokens - 1) // self.bs
            n = 0
            while start + n < limit and request.block_hashes[start + n] in STORE:
                n += 1
            self.matched[request.request_id] = start
            return n * self.bs, False

        def update_state_after_alloc(self, request, block_ids, num_external_tokens):
            start = self.matched.pop(request.request_id, 0)
            for i in range(start, start + num_external_tokens // self.bs):
                self.loads.append([request.block_hashes[i], block_ids[i]])

        def build_connector_meta(self, step):
            saves = []
            for s in step.scheduled:
                before, after = s.request.num_computed_tokens, s.num_computed_after_step
                for i in range(before // self.bs, after // self.bs):
                    saves.append([s.request.block_hashes[i], s.block_ids[i]])
            meta, self.loads = MemMeta(loads=self.loads, saves=saves), []
            return meta

        def register_kv_caches(self, kv_caches):
            self.caches = kv_caches

        def start_load_kv(self, **kwargs):
            for block_hash, block_id in self._get_connector_metadata().loads:
                for name, cache in self.caches.items():
                    cache[:, block_id].copy_(STORE[block_hash][name])

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None, **kwargs):
            pass

        def wait_for_save(self):
            for block_hash, block_id in self._get_connector_metadata().saves:
                STORE[block_hash] = {n: c[:, block_id].clone() for n, c in self.caches.items()}
'''

ENGINE_RUN = """
    import json, torch, wtransfer
    from wtransfer import KVTransferConfig
    from wtransfer.kvcache import KVCacheSpec
    from wtransfer.testing.paged_engine import PagedKVEngine, reference_kv

    listed = {c.name: c.distribution for c in wtransfer.list_components("connectors")}
    spec = KVCacheSpec(("l0", "l1"), 4, 2, 8, "bfloat16", "plugin-test")
    prompt = [(13 * i + 2) % 500 for i in range(14)]
    config = KVTransferConfig("acme-kv:memstore")   # qualified: distribution:name
    with PagedKVEngine(spec, 8, kv_transfer_config=config) as first:
        first.generate({"a": prompt})
        cls = type(first.worker_connector)
    with PagedKVEngine(spec, 8, kv_transfer_config=config, capture_kv=True) as second:
        out = second.generate({"b": prompt + [1, 2, 3]}, max_new_tokens=2)["b"]
    ref = reference_kv(spec, out.prompt_token_ids + out.output_token_ids[:1])
    # It indexes blocks as cache[:, block_id]: written for the default layout, never declared
    # another, so an engine with vLLM-CPU's layout is refused instead of misread.
    try:
        PagedKVEngine(KVCacheSpec(**{**spec.to_dict(), "layout": "vllm-cpu"}), 8, kv_transfer_config=config)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    print(json.dumps({
        "refused": "does not support the 'vllm-cpu' KV cache layout" in refused and "'wtransfer'" in refused,
        "provider": listed.get("memstore"),
        "class": f"{cls.__module__}.{cls.__name__}",
        "external": out.num_external_tokens,
        "exact": all(torch.equal(out.kv[n], ref[n]) for n in ref),
    }))
"""


def test_entry_point_connector_runs_through_the_tiny_engine_in_a_subprocess(tmp_path: Path) -> None:
    site = tmp_path / "site"
    write_distribution(
        site,
        "acme-kv",
        "0.3",
        entry_points={"wtransfer.connectors": {"memstore": "acme_kv.connector:MemStoreConnector"}},
        modules={"acme_kv.connector": CONNECTOR_SOURCE},
    )
    result = json.loads(run_python(ENGINE_RUN, path=[site], timeout=120).stdout)
    assert result == {
        "refused": True,
        "provider": "acme-kv",
        "class": "acme_kv.connector.MemStoreConnector",
        "external": 12,
        "exact": True,
    }

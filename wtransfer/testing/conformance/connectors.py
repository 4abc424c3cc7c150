"""``ConnectorConformance``: certify a KV connector end to end on the tiny paged engine.

Subclass it, name the connector and give its options (``tmp_path`` is available)::

    class TestMyConnector(ConnectorConformance):
        connector = "my-store"
        persistent = True   # what it saves survives new connector instances (a store, a disk)

        @pytest.fixture
        def connector_options(self, tmp_path):
            return {"path": str(tmp_path / "kv")}

The engine runs with its own prefix cache off, so every reused token comes through the connector, and every
reloaded block is checked bit-exactly against recomputation.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from wtransfer.testing.conformance._contract import BLOCK_SIZE, layout_spec, require

PROMPT = [(7 * i + 3) % 500 for i in range(14)]  # 3 full blocks + 2 tokens
"""Never a multiple of the block size: the engine always has a prompt token left to compute."""


class ConnectorConformance:
    """A battery of end-to-end contract tests for a KV connector (set ``connector``)."""

    connector: str = ""
    persistent: bool = False
    """True if saved KV survives new connector instances with the same config (e.g. files)."""
    num_engine_blocks: int = 32

    @pytest.fixture
    def connector_options(self, tmp_path: Any) -> dict[str, Any]:
        """``kv_connector_extra_config`` for the connector under test."""
        return {}

    @pytest.fixture(params=["wtransfer", "vllm-cpu"])
    def kv_cache_spec(self, request: Any) -> Any:
        """The engine's cache, once per known layout (a layout the connector does not declare is skipped)."""
        return layout_spec("connectors", self.connector, request.param)

    @pytest.fixture
    def kv_transfer_config(self, connector_options: dict[str, Any]) -> Any:
        from wtransfer import KVTransferConfig

        require(self.connector, "ConnectorConformance subclasses name their connector",
                "class attribute connector = 'name'", "empty")
        return KVTransferConfig(kv_connector=self.connector, kv_role="kv_both",
                                kv_connector_extra_config=dict(connector_options))

    def _engine(self, paged_engine: Any, spec: Any, config: Any) -> Any:
        return paged_engine(spec, self.num_engine_blocks, kv_transfer_config=config,
                            enable_prefix_caching=False, capture_kv=True)

    def _check_bit_exact(self, spec: Any, output: Any) -> None:
        import torch

        from wtransfer.testing.paged_engine import reference_kv

        expected = reference_kv(spec, output.prompt_token_ids)
        for layer, kv in output.kv.items():
            n = kv.shape[1]
            require(torch.equal(kv, expected[layer][:, :n]), "reloaded KV is bit-exact",
                    f"layer {layer} equal to recomputed KV", "different values")

    # -- the contract -------------------------------------------------------------------------
    def test_created_for_both_roles(self, kv_transfer_config: Any, kv_cache_spec: Any) -> None:
        from wtransfer import KVConnectorBase, KVConnectorFactory, KVConnectorRole

        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            instance = KVConnectorFactory.create_connector(kv_transfer_config, role, kv_cache_spec)
            require(isinstance(instance, KVConnectorBase), "connectors subclass KVConnectorBase",
                    "a KVConnectorBase", type(instance))
            require(instance.role is role, "one instance per role", f"role {role}", instance.role)
            instance.shutdown()
            instance.shutdown()  # idempotent

    def test_save_then_reload_bit_exact(self, paged_engine: Any, kv_transfer_config: Any, kv_cache_spec: Any) -> None:
        engine = self._engine(paged_engine, kv_cache_spec, kv_transfer_config)
        first = engine.generate({"a": PROMPT})["a"]
        require(first.num_external_tokens == 0, "nothing is matched before anything was saved",
                "0 external tokens", first.num_external_tokens)
        json.loads(engine.last_metadata_json)  # what crossed to the worker is JSON
        extended = PROMPT + [11, 12, 13, 14, 15, 16]
        second = engine.generate({"b": extended})["b"]
        full_blocks = len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE
        require(second.num_external_tokens == full_blocks,
                "a request whose first k blocks were saved gets k * block_size tokens",
                f"{full_blocks} external tokens", second.num_external_tokens)
        self._check_bit_exact(kv_cache_spec, second)
        plain = paged_engine(kv_cache_spec, self.num_engine_blocks, enable_prefix_caching=False)
        require(plain.generate({"b": extended})["b"].output_token_ids == second.output_token_ids,
                "loaded KV gives the same tokens as computing it", "identical output tokens", "different tokens")

    def test_partial_prefix_hit(self, paged_engine: Any, kv_transfer_config: Any, kv_cache_spec: Any) -> None:
        engine = self._engine(paged_engine, kv_cache_spec, kv_transfer_config)
        engine.generate({"a": PROMPT})
        diverging = PROMPT[: 2 * BLOCK_SIZE] + [499 - t for t in PROMPT[2 * BLOCK_SIZE:]]
        out = engine.generate({"c": diverging})["c"]
        require(out.num_external_tokens == 2 * BLOCK_SIZE, "matching is per block, up to the first difference",
                f"{2 * BLOCK_SIZE} external tokens", out.num_external_tokens)
        self._check_bit_exact(kv_cache_spec, out)

    def test_another_model_never_matches(self, paged_engine: Any, kv_transfer_config: Any, kv_cache_spec: Any) -> None:
        import dataclasses

        engine = self._engine(paged_engine, kv_cache_spec, kv_transfer_config)
        engine.generate({"a": PROMPT})
        other_spec = dataclasses.replace(kv_cache_spec, model_fingerprint="another-model")
        if self.persistent:
            other = self._engine(paged_engine, other_spec, kv_transfer_config)
            out = other.generate({"x": PROMPT + [1, 2]})["x"]
            require(out.num_external_tokens == 0, "KV saved under another model fingerprint never matches",
                    "0 external tokens", out.num_external_tokens)
        # The same connector instance and tokens, hashed as another model's (as after a weight update): a plugin
        # keying blocks by tokens, or by its own idea of the model instead of the request's hashes, matches here.
        from wtransfer.connectors._hashing import kv_namespace

        engine.namespace = kv_namespace(other_spec)
        out = engine.generate({"y": PROMPT + [3, 4]})["y"]
        require(out.num_external_tokens == 0,
                "blocks are identified by the request's block hashes (model fingerprint included), "
                "never by tokens alone", "0 external tokens", out.num_external_tokens)

    def test_survives_a_restart(self, paged_engine: Any, kv_transfer_config: Any, kv_cache_spec: Any) -> None:
        if not self.persistent:
            pytest.skip("connector declares persistent = False (what it saves lives in its instance)")
        first = self._engine(paged_engine, kv_cache_spec, kv_transfer_config)
        first.generate({"a": PROMPT})
        first.shutdown()
        restarted = self._engine(paged_engine, kv_cache_spec, kv_transfer_config)
        out = restarted.generate({"a2": PROMPT + [42]})["a2"]
        full_blocks = len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE
        require(out.num_external_tokens == full_blocks, "saved KV is found by a new engine with the same config",
                f"{full_blocks} external tokens", out.num_external_tokens)
        self._check_bit_exact(kv_cache_spec, out)

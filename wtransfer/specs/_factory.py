"""``OffloadingSpecFactory``: vLLM's API, backed by the generic registry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from wtransfer._registry.create import create
from wtransfer._registry.kinds import SPECS
from wtransfer._registry.registry import registry_for
from wtransfer.config import KVTransferConfig
from wtransfer.kvcache import check_layout

if TYPE_CHECKING:
    from wtransfer.kvcache import KVCacheSpec
    from wtransfer.specs._base import OffloadingSpec

DEFAULT_SPEC = "cpu"
SEED_ALIASES = {"CPUOffloadingSpec": DEFAULT_SPEC}
"""vLLM configs name the CPU spec by class name; keep them working."""


class OffloadingSpecFactory:
    """Creates KV offloading specs; the name comes from ``kv_connector_extra_config``."""

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        """Register a spec for this process (lazy import). ``ValueError`` if taken."""
        registry_for(SPECS).register(name, module_path, class_name)

    @classmethod
    def create_spec(
        cls, config: KVTransferConfig, kv_cache_spec: KVCacheSpec | None = None
    ) -> OffloadingSpec:
        """Instantiate ``extra_config["spec_name"]`` (default ``cpu``; fallback ``spec_module_path``)."""
        extra = config.kv_connector_extra_config
        spec_name = extra.get("spec_name", DEFAULT_SPEC)
        module_path = extra.get("spec_module_path")
        if not module_path:
            spec_name = SEED_ALIASES.get(spec_name, spec_name)
        return create(SPECS, spec_name, module_path, config, kv_cache_spec,
                      check=lambda cls: check_layout(kv_cache_spec, cls, "offloading spec"))

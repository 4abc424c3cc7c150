"""``WeightTransferEngineFactory``: vLLM's API, backed by the generic registry."""

from __future__ import annotations

from wtransfer._registry.create import create
from wtransfer._registry.kinds import ENGINES
from wtransfer._registry.registry import registry_for
from wtransfer.config import ParallelConfig, WeightTransferConfig
from wtransfer.engines.worker.base import WeightTransferEngine


class WeightTransferEngineFactory:
    """Creates worker-side engines by name. Installed engines need no registration."""

    @classmethod
    def register_engine(
        cls,
        name: str,
        module_path_or_cls: str | type[WeightTransferEngine],
        class_name: str | None = None,
    ) -> None:
        """Register an engine for this process: ``(name, "pkg.mod", "Class")`` or ``(name, Class)``.

        Other processes do not see runtime registrations; ship an entry point for that.
        Raises ``ValueError`` if the name is taken.
        """
        registry_for(ENGINES).register(name, module_path_or_cls, class_name)

    @classmethod
    def create_engine(
        cls, config: WeightTransferConfig, parallel_config: ParallelConfig | None = None
    ) -> WeightTransferEngine:
        """Instantiate ``config.backend`` (falling back to ``config.module_path``)."""
        parallel = parallel_config if parallel_config is not None else ParallelConfig()
        return create(ENGINES, config.backend, config.module_path, config, parallel)

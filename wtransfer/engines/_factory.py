"""``WeightTransferEngineFactory``: vLLM's API, backed by the generic registry."""

from __future__ import annotations

import logging

from wtransfer.config import ParallelConfig, WeightTransferConfig
from wtransfer.engines._base import WeightTransferEngine
from wtransfer._registry.kinds import ENGINES
from wtransfer._registry.manager import notify
from wtransfer._registry.registry import registry_for

logger = logging.getLogger("wtransfer")


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
        engine_cls = registry_for(ENGINES).get_class(config.backend, config.module_path)
        logger.info("Creating weight transfer engine %s (%s)", config.backend, engine_cls.__name__)
        engine = engine_cls(config, parallel_config if parallel_config is not None else ParallelConfig())
        notify(ENGINES.created_hook, engine=engine)
        return engine

"""The ``vllm.general_plugins`` entry point: wtransfer's engines into vLLM's factories.

vLLM calls :func:`register` in every process it starts. It reads entry-point metadata only:
each name is registered with vLLM's own lazy ``register_engine(name, module, attribute)``,
where the module is this package's adapter module and the attribute the wtransfer name, so
no engine module is imported until vLLM creates that engine. Nothing here may break vLLM's
start-up: any failure is logged and vLLM runs without wtransfer's engines.
"""

from __future__ import annotations

import logging
from typing import Any

from wtransfer_vllm.naming import Registration, registration_plan

logger = logging.getLogger("wtransfer_vllm")

_done = False
REGISTERED: list[Registration] = []
"""The engine names registered in vLLM's factory (its unknown-name error lists them)."""
REGISTERED_CONNECTORS: list[Registration] = []
"""The connector names registered in vLLM's ``KVConnectorFactory``."""


def register() -> None:
    """Register every installed wtransfer engine in vLLM (idempotent, never raises)."""
    global _done
    if _done:
        return
    _done = True
    try:
        _register_engines()
    except Exception:  # a broken environment must not stop vLLM
        logger.exception("wtransfer-vllm: could not register wtransfer's engines; vLLM runs without them")
    try:
        _register_connectors()
    except Exception:
        logger.exception("wtransfer-vllm: could not register wtransfer's KV connectors; vLLM runs without them")


def _existing_names(factory: Any) -> set[str]:
    # vLLM has no public listing; its registry dict is read only to skip taken bare names
    # (registering one would raise anyway, which is handled below too).
    return set(getattr(factory, "_registry", {}) or {})


def _register_engines() -> None:
    import wtransfer
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    rows = [(c.name, c.distribution, c.status) for c in wtransfer.list_components("engines")]
    plan, skipped = registration_plan(rows, _existing_names(WeightTransferEngineFactory))
    for item in skipped:
        logger.info("wtransfer-vllm: bare engine name %r not registered: %s", item.name, item.reason)
    for factory, module, key in (
        (WeightTransferEngineFactory, "wtransfer_vllm.engine", "engine"),
        (WeightTransferTrainerFactory, "wtransfer_vllm.trainer", "trainer"),
    ):
        for item in plan:
            try:
                factory.register_engine(item.vllm_name, module, item.wtransfer_name)
            except ValueError as exc:  # taken after all (another plugin got there first)
                logger.info("wtransfer-vllm: %s name %r not registered: %s", key, item.vllm_name, exc)
                continue
            if factory is WeightTransferEngineFactory:
                REGISTERED.append(item)
    _explain_unknown_backends(WeightTransferEngineFactory)
    logger.debug("wtransfer-vllm: registered %s", [r.vllm_name for r in REGISTERED])


def _register_connectors() -> None:
    """Every wtransfer connector into vLLM's ``KVConnectorFactory``, under the same naming rule."""
    import wtransfer
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    rows = [(c.name, c.distribution, c.status) for c in wtransfer.list_components("connectors")]
    plan, skipped = registration_plan(rows, _existing_names(KVConnectorFactory))
    for item in skipped:
        logger.info("wtransfer-vllm: bare connector name %r not registered: %s", item.name, item.reason)
    for item in plan:
        try:
            KVConnectorFactory.register_connector(item.vllm_name, "wtransfer_vllm.connector", item.wtransfer_name)
        except ValueError as exc:
            logger.info("wtransfer-vllm: connector name %r not registered: %s", item.vllm_name, exc)
            continue
        REGISTERED_CONNECTORS.append(item)


def _explain_unknown_backends(factory: Any) -> None:
    """Make vLLM's "invalid backend" error list wtransfer's names, with a did-you-mean.

    vLLM's own message lists its dict's keys; a user who typed ``shmm`` should read that
    ``shm`` exists, and that ``nccl`` from wtransfer is spelled ``wtransfer-nccl:nccl``.
    Only the unknown-name path changes: a known name goes straight to vLLM's code.
    """
    original = factory.create_engine.__func__
    if getattr(original, "_wtransfer_wrapped", False):
        return

    def create_engine(cls: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        known = getattr(cls, "_registry", None)
        backend = getattr(config, "backend", None)
        if isinstance(known, dict) and isinstance(backend, str) and backend not in known:
            raise UnknownVLLMBackendError(unknown_backend_message(backend, sorted(known)))
        return original(cls, config, *args, **kwargs)

    create_engine._wtransfer_wrapped = True  # type: ignore[attr-defined]
    factory.create_engine = classmethod(create_engine)


class UnknownVLLMBackendError(ValueError):
    """``weight_transfer_config.backend`` names no engine vLLM or wtransfer knows."""


def unknown_backend_message(backend: str, vllm_names: list[str]) -> str:
    import difflib

    ours = sorted({r.vllm_name for r in REGISTERED})
    theirs = [n for n in vllm_names if n not in ours]
    close = difflib.get_close_matches(backend, vllm_names, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"Invalid weight transfer backend: {backend!r}.{hint} vLLM's engines: {', '.join(theirs) or '(none)'}; "
        f"wtransfer's engines (from installed packages): {', '.join(ours) or '(none)'}. "
        f"`wtransfer list engines` shows what is installed; a wtransfer engine is also reachable "
        f"as distribution:name."
    )

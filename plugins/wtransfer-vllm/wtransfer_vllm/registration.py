"""The ``vllm.general_plugins`` entry point: wtransfer's engines and KV connectors into vLLM's factories.

vLLM calls :func:`register` in every process it starts. It reads entry-point metadata only:
each name is registered with vLLM's own lazy ``register_engine(name, module, attribute)``,
where the module is this package's adapter module and the attribute the wtransfer name, so
no engine module is imported until vLLM creates that engine. KV connectors go the same way
into ``KVConnectorFactory.register_connector`` (adapter module :mod:`wtransfer_vllm.connector`). Nothing here may break vLLM's
start-up: any failure is logged and vLLM runs without wtransfer's engines. It also arranges for
vLLM's prefix cache to be reset after every wtransfer round (:mod:`wtransfer_vllm.engine_core`).
"""

from __future__ import annotations

import logging
from typing import Any

from wtransfer.errors import UnknownComponentError
from wtransfer_vllm.naming import Registration, registration_plan
from wtransfer_vllm.vllm_internals import check_before_engine_config, registered_names, registry, wrap_factory_method

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
        from wtransfer_vllm.amx import allow_amx

        allow_amx()  # before any kernel of this process needs AMX (see wtransfer_vllm.amx)
    except Exception:
        logger.exception("wtransfer-vllm: could not ask Linux for AMX tile permission")
    try:
        # The engine core's side first: it raises the failures workers report as replies and resets
        # vLLM's caches after each round. Without it a failed round would look like a success, so
        # no engine is registered then.
        from wtransfer_vllm.engine_core import install

        install(lambda backend: backend in {r.vllm_name for r in REGISTERED})
    except Exception:
        logger.exception("wtransfer-vllm: could not hook vLLM's engine core (a vLLM version this bridge does not "
                         "know?); wtransfer's weight-transfer engines are not registered")
    else:
        try:
            _register_engines()
        except Exception:  # a broken environment must not stop vLLM
            logger.exception("wtransfer-vllm: could not register wtransfer's engines; vLLM runs without them")
    try:
        _register_connectors()
    except Exception:
        logger.exception("wtransfer-vllm: could not register wtransfer's KV connectors; vLLM runs without them")
    try:
        check_before_engine_config(_check_names)
    except Exception:
        logger.exception("wtransfer-vllm: could not hook vLLM's config; an unknown backend name fails in a worker")


def _register_engines() -> None:
    import wtransfer
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    rows = [(c.name, c.distribution, c.status) for c in wtransfer.list_components("engines")]
    plan, skipped = registration_plan(rows, registered_names(WeightTransferEngineFactory))
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
    plan, skipped = registration_plan(rows, registered_names(KVConnectorFactory))
    for item in skipped:
        logger.info("wtransfer-vllm: bare connector name %r not registered: %s", item.name, item.reason)
    for item in plan:
        try:
            KVConnectorFactory.register_connector(item.vllm_name, "wtransfer_vllm.connector", item.wtransfer_name)
        except ValueError as exc:
            logger.info("wtransfer-vllm: connector name %r not registered: %s", item.vllm_name, exc)
            continue
        REGISTERED_CONNECTORS.append(item)
    _explain_unknown_connectors(KVConnectorFactory)


def _explain_unknown_backends(factory: Any) -> None:
    """Make vLLM's "invalid backend" error list wtransfer's names, with a did-you-mean.

    vLLM's own message lists its dict's keys; a user who typed ``shmm`` should read that
    ``shm`` exists, and that ``nccl`` from wtransfer is spelled ``wtransfer-nccl:nccl``.
    Only the unknown-name path changes: a known name goes straight to vLLM's code.
    """
    _explain_unknown(factory, "create_engine", lambda config: getattr(config, "backend", None),
                     "weight transfer backend", "engines", REGISTERED)


def _explain_unknown_connectors(factory: Any) -> None:
    """The same for ``kv_connector`` names (a ``kv_connector_module_path`` goes to vLLM's code)."""

    def name_of(config: Any) -> str | None:
        return None if getattr(config, "kv_connector_module_path", None) else getattr(config, "kv_connector", None)

    _explain_unknown(factory, "get_connector_class", name_of, "KV connector", "connectors", REGISTERED_CONNECTORS)


def _explain_unknown(factory: Any, method: str, name_of: Any, what: str, kind: str, ours: list[Registration]) -> None:
    def wrapper_for(original: Any) -> Any:
        def wrapped(cls: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
            known = registry(cls)
            name = name_of(config)
            if known is not None and isinstance(name, str) and name not in known:
                raise UnknownVLLMBackendError(unknown_name_message(what, kind, name, sorted(known), ours))
            return original(cls, config, *args, **kwargs)

        return wrapped

    wrap_factory_method(factory, method, wrapper_for)  # vLLM's lookup itself (see vllm_internals)


def _check_names(engine_args: Any) -> None:
    """In the process that built ``LLM(...)`` or started ``vllm serve``, before any worker: an
    unknown weight-transfer backend or KV connector name fails here, as the last thing printed.
    Anything else going wrong in the check is logged: the worker's own check still runs."""
    try:
        _check_names_now(engine_args)
    except UnknownVLLMBackendError:
        raise
    except Exception:
        logger.exception("wtransfer-vllm: could not check the backend names before start-up (this vLLM version?)")


def _check_names_now(engine_args: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    def field(config: Any, key: str) -> Any:
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    weights, kv = engine_args.weight_transfer_config, engine_args.kv_transfer_config
    checks = [(weights, "backend", WeightTransferEngineFactory, "weight transfer backend", "engines", REGISTERED)]
    if kv is not None and not field(kv, "kv_connector_module_path"):
        checks.append((kv, "kv_connector", KVConnectorFactory, "KV connector", "connectors", REGISTERED_CONNECTORS))
    for config, key, factory, what, kind, ours in checks:
        name, known = field(config, key) if config is not None else None, registry(factory)
        if known is not None and isinstance(name, str) and name not in known:
            raise UnknownVLLMBackendError(unknown_name_message(what, kind, name, sorted(known), ours))


class UnknownVLLMBackendError(UnknownComponentError):
    """A ``weight_transfer_config.backend`` or ``kv_connector`` names nothing vLLM or wtransfer knows."""


def unknown_name_message(what: str, kind: str, name: str, vllm_names: list[str], registered: list[Registration]) -> str:
    import difflib

    ours = sorted({r.vllm_name for r in registered})
    theirs = [n for n in vllm_names if n not in ours]
    close = difflib.get_close_matches(name, vllm_names, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"Invalid {what}: {name!r}.{hint} vLLM's {kind}: {', '.join(theirs) or '(none)'}; "
        f"wtransfer's {kind} (from installed packages): {', '.join(ours) or '(none)'}. "
        f"`wtransfer list {kind}` shows what is installed; a wtransfer component is also reachable "
        f"as distribution:name."
    )

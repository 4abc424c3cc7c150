"""The KV connector contract: vLLM V1's method names and meanings, with no engine types.

A connector moves KV-cache blocks between an engine's paged cache and something outside it (a shared store,
another instance, a slower tier). As in vLLM V1 it is created twice, once per role, usually in two processes:

* the **scheduler** instance decides *what* to load and save: it answers lookups, learns which blocks the engine
  allocated, and describes each step's work in a :class:`KVConnectorMetadata`;
* the **worker** instance does the moving: it holds the KV tensors and executes the bound metadata around the
  forward pass.

Metadata crosses from scheduler to worker as a JSON-safe dict, never a pickle (``metadata.to_dict()``, then
``connector.metadata_cls.from_dict``).

Call order for one engine step (``wtransfer.testing.paged_engine`` implements it)::

    # scheduler process, for each request it considers admitting
    n_ext, load_async = sched.get_num_new_matched_tokens(request, num_local_computed)
    ... engine allocates blocks ...
    sched.update_state_after_alloc(request, block_ids, n_ext)
    meta = sched.build_connector_meta(step)           # once per step, resets per-step state
    # worker process
    worker.bind_connector_metadata(Meta.from_dict(meta_dict))
    worker.start_load_kv()
    for layer in layers:
        worker.wait_for_layer_load(layer)
        ... compute the layer, writing its KV into kv_caches[layer] ...
        worker.save_kv_layer(layer, kv_caches[layer])
    worker.wait_for_save()
    failed = worker.get_block_ids_with_load_errors()    # those blocks are recomputed
    # scheduler, for each request that ended in this step (before freeing its blocks)
    delay_free, params = sched.request_finished(request, block_ids)
    # worker; finished_req_ids are the requests ended in the previous step
    sending, receiving = worker.get_finished(step.finished_req_ids)
    report = worker.build_connector_worker_meta()       # JSON-safe, or None
    worker.clear_connector_metadata()
    # scheduler: what the workers said (the only way back from worker to scheduler)
    sched.update_connector_output(KVConnectorOutput(sending, receiving, failed, [report]))

Blocks of a request whose ``request_finished`` returned ``delay_free=True`` stay allocated until the worker reports
the request in ``sending``; a request whose lookup returned ``load_async=True`` is not computed until it appears in
``receiving``. This module imports no torch: the registry imports it to check plugin classes.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from wtransfer import options as _options
from wtransfer.connectors._request import JSONDataclass
from wtransfer.kvcache import KVComponent

if TYPE_CHECKING:
    import torch

    from wtransfer.config import KVTransferConfig
    from wtransfer.connectors._request import KVConnectorOutput, KVRequest, SchedulerStep
    from wtransfer.kvcache import KVCacheSpec

logger = logging.getLogger("wtransfer")


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is: one instance per role, as in vLLM V1."""

    SCHEDULER = 0
    WORKER = 1


@dataclasses.dataclass
class KVConnectorMetadata(JSONDataclass):
    """What the scheduler instance tells the worker instance to do in one step.

    Subclass it as a dataclass of JSON-safe fields (str, int, float, bool, None, lists and str-keyed dicts of those);
    the default :meth:`to_dict`/:meth:`from_dict` handle flat dataclasses, override both for nested ones. The engine
    sends metadata through JSON even inside one process, so an unsafe field fails in tests, not in production.
    """


class KVConnectorBase(KVComponent, ABC):
    """Base class of KV connectors (vLLM V1's ``KVConnectorBase_V1`` contract, engine-neutral).

    Declare the connector's options (``config.kv_connector_extra_config``) in ``options_cls`` and read the parsed
    ``self.options``; what else a connector class declares: :class:`~wtransfer.kvcache.KVComponent`. Block hashes in
    requests are rooted in ``kv_cache_spec`` (:mod:`wtransfer.connectors._hashing`).
    """

    metadata_cls: ClassVar[type[KVConnectorMetadata]] = KVConnectorMetadata
    """The metadata class the worker rebuilds from the scheduler's dict."""

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_spec: KVCacheSpec | None = None,
    ) -> None:
        self.config = config
        self.role = role
        self.kv_cache_spec = kv_cache_spec
        self._connector_metadata: KVConnectorMetadata | None = None
        self.options: Any = self.parse_options(config.kv_connector_extra_config)
        """The parsed ``options_cls`` instance (or a copy of the dict as given, if undeclared)."""

    @classmethod
    def parse_options(cls, raw: Mapping[str, Any] | None) -> Any:
        """Check ``kv_connector_extra_config`` against ``options_cls`` once, at creation, in both roles: a typo or a
        wrong type fails here, naming the option and the valid ones. Connectors that pass part of the dict on
        (``offloading``) override this to parse only their own keys."""
        owner = cls.options_owner or f"KV connector {cls.__name__}"
        return _options.parse_declared(cls.options_cls, raw, owner=owner, where="kv_connector_extra_config")

    # ------------------------------------------------------------------ helpers
    @property
    def extra_config(self) -> dict[str, Any]:
        return self.config.kv_connector_extra_config

    def require_spec(self) -> KVCacheSpec:
        """The engine's :class:`KVCacheSpec`, or a clear error for connectors that need one."""
        if self.kv_cache_spec is None:
            raise ValueError(
                f"{type(self).__name__} needs the engine's KVCacheSpec: pass kv_cache_spec to "
                "KVConnectorFactory.create_connector(config, role, kv_cache_spec)"
            )
        return self.kv_cache_spec

    # ------------------------------------------------------------ worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Engine, worker, before the forward pass: the metadata the next calls execute."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Engine, worker, after the step: forget the metadata so it cannot be executed twice."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        """The bound metadata; a clear error if the engine forgot to bind it or bound another class's."""
        meta = self._connector_metadata
        if meta is None:
            raise RuntimeError(
                f"{type(self).__name__}: no connector metadata bound; the engine must call "
                "bind_connector_metadata() before start_load_kv()/save_kv_layer()"
            )
        if not isinstance(meta, self.metadata_cls):
            raise TypeError(
                f"{type(self).__name__}: bound metadata is {type(meta).__name__}, expected {self.metadata_cls.__name__}"
            )
        return meta

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:  # noqa: B027 - optional
        """Engine, worker, once after allocating its cache: layer name -> paged KV tensor in ``kv_cache_spec.layout``
        (see :data:`wtransfer.kvcache.KV_LAYOUTS`, :func:`wtransfer.kvcache.block_view`). The connector keeps
        references and reads or writes blocks in place; it must not resize or replace them."""

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Engine, worker, before the forward pass: begin loading this step's external blocks. May return before the
        data arrives (``wait_for_layer_load`` is the barrier). Failed loads are reported through
        :meth:`get_block_ids_with_load_errors`, never raised: one bad entry must not fail the batch."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Engine, worker, before computing ``layer_name``: block until that layer's loads are in."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None, **kwargs: Any) -> None:
        """Engine, worker, after computing ``layer_name``: start saving the due blocks (the metadata says which) of
        ``kv_layer``, the layer's whole paged cache. May return before they are saved; must not modify ``kv_layer``."""

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:  # noqa: B027 - optional hook
        """Engine, worker, before the step's forward pass and ``bind_connector_metadata``: the scheduler preempted
        ``SchedulerStep.preempted_req_ids`` (its scheduler side puts what the worker needs in the metadata). Their
        blocks are already free and this forward may overwrite them; the engine does not wait for ``get_finished``.
        A connector still reading such blocks (an asynchronous save) must finish those reads here; one whose
        ``wait_for_save`` copies everything out before returning has nothing to do."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Engine, worker, after the forward pass: when this returns the engine may hand any block of the step to
        another request. So every read of the step's blocks is done, except of blocks the engine keeps for it:
        those of finished requests whose free it delayed until :meth:`get_finished` reports them, and those of
        preempted requests until :meth:`handle_preemptions` returns."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Engine, worker, after each step: ``(done_sending, done_receiving)`` request ids, ``None`` for nothing.
        ``finished_req_ids``: the requests finished since the last step. A request is in ``done_sending`` once
        finished *and* its asynchronous saves completed (the engine then frees its blocks), in ``done_receiving``
        once its asynchronous loads completed. Each id is reported once."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine, worker, after the step: cache blocks whose load failed since the last call (reported once). The
        engine recomputes them and everything after them in the request; a connector must not save what a request
        computed on top of its own failed loads."""
        return set()

    def skip_saves(self, request_ids: set[str]) -> None:  # noqa: B027 - optional hook
        """Composite connectors (or engines), worker, before ``save_kv_layer``/``wait_for_save``: these requests
        computed this step on top of blocks that failed to load *elsewhere*; save none of their blocks from it. A
        wtransfer addition to vLLM's contract: otherwise one child of a composite would store KV derived from
        another child's failed load under valid hashes."""

    def build_connector_worker_meta(self) -> dict[str, Any] | None:
        """Engine, worker, after ``get_finished`` each step: JSON-safe facts the scheduler must learn (stores that
        landed or failed), or ``None``. The engine passes it to :meth:`update_connector_output` in
        ``KVConnectorOutput.worker_meta``: the only channel from worker to scheduler."""
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027 - optional hook
        """Engine, scheduler, after each step: what the workers reported (finished transfers, failed loads, and each
        worker's :meth:`build_connector_worker_meta`)."""

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Anyone: JSON-safe counters (hits, misses, bytes, corrupt entries) for logs and metrics."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Engine, either role, at teardown: finish or abandon in-flight work; idempotent, leaves no thread running."""

    # ---------------------------------------------------------- scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Engine, scheduler, for a waiting request: ``(count, load_async)``, how many tokens past
        ``num_computed_tokens`` (the local prefix hits) the connector can provide. ``count`` ``None``: not known yet
        (asked again in a later step). ``load_async``: the loads complete outside the forward pass and the request
        waits for ``done_receiving``. Must not load anything nor assume admission: the engine may still lack blocks."""

    @abstractmethod
    def update_state_after_alloc(self, request: KVRequest, block_ids: list[int], num_external_tokens: int) -> None:
        """Engine, scheduler, after allocating blocks for an admitted request: ``block_ids`` are all its blocks, in
        token order; the external tokens start at ``request.num_computed_tokens``. Remember what to load for the
        next :meth:`build_connector_meta`."""

    @abstractmethod
    def build_connector_meta(self, step: SchedulerStep) -> KVConnectorMetadata:
        """Engine, scheduler, once per step after scheduling: this step's loads and saves. Resets the per-step state
        from ``update_state_after_alloc`` so nothing loads twice; touches no KV data."""

    def request_finished(self, request: KVRequest, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Engine, scheduler, when a request finishes or is aborted, before its blocks are freed:
        ``(delay_free, kv_transfer_params)``. ``delay_free`` keeps the blocks until the worker reports the request in
        ``done_sending``; ``kv_transfer_params`` (JSON-safe) go back to the client with the response."""
        return False, None

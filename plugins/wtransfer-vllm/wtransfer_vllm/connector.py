"""vLLM's ``KVConnectorBase_V1``, wrapping any wtransfer KV connector.

vLLM creates ``connector_cls(vllm_config, role, kv_cache_config)`` once per role, the
scheduler instance in the engine-core process and the worker instance in each worker.
Which wtransfer connector to wrap is the class's ``wtransfer_backend``; one subclass per
registered name is made on demand by this module's ``__getattr__``.

What the adapter translates, and nothing more:

* vLLM's ``KVCacheConfig`` becomes a :class:`wtransfer.KVCacheSpec`: the one full-attention
  group's layers, block size, heads, head size and dtype, vLLM-CPU's cache layout, and a
  model fingerprint of the checkpoint vLLM loaded (:func:`checkpoint_fingerprint`);
* vLLM's ``Request`` becomes a :class:`wtransfer.KVRequest`, with block hashes computed
  by wtransfer's own chained scheme (vLLM's hashes are per process and not rooted in the
  model, so they cannot name blocks in a store shared across restarts and hosts);
* vLLM's ``SchedulerOutput`` becomes a :class:`wtransfer.SchedulerStep` (new, running and
  resumed requests, their block tables and how many tokens this step computes);
* the wtransfer metadata crosses to the workers as its JSON text inside a tiny vLLM
  metadata object, and the workers' reports (``build_connector_worker_meta``: stores that
  landed or failed) come back the same way to ``update_connector_output``; the worker side
  otherwise passes vLLM's calls straight through.

Requests the hashes cannot describe (multimodal inputs, prompt embeddings) are neither
looked up nor saved. Adapter options (:class:`AdapterOptions`), taken out of
``kv_connector_extra_config`` before the rest goes to the wtransfer connector (which checks
its own): ``model_fingerprint`` (a string that replaces the checkpoint fingerprint, e.g. one
per weight version).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import wtransfer
from wtransfer.options import option, parse_options
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from wtransfer_vllm.adapters import adapter_classes
from wtransfer_vllm.checkpoint import checkpoint_fingerprint, model_identity

logger = logging.getLogger("vllm.wtransfer_vllm")


@dataclass(frozen=True)
class AdapterOptions:
    """The ``kv_connector_extra_config`` keys the adapter itself reads (not passed to the connector)."""

    model_fingerprint: str | None = option(
        None, doc="replaces the checkpoint's fingerprint in block hashes (e.g. one per weight version)"
    )


ADAPTER_OPTIONS = tuple(f.name for f in fields(AdapterOptions))
"""``kv_connector_extra_config`` keys the adapter itself reads (not passed to the connector)."""


def split_adapter_options(extra: dict[str, Any] | None) -> tuple[AdapterOptions, dict[str, Any]]:
    """``(the adapter's parsed options, the rest for the wtransfer connector)``.

    The adapter's keys are checked here (a fingerprint that is not a string would silently
    name every block differently); unknown keys are left for the connector, which knows them.
    """
    rest = dict(extra or {})
    own = {key: rest.pop(key) for key in ADAPTER_OPTIONS if key in rest}
    parsed = parse_options(AdapterOptions, own, owner="wtransfer-vllm KV connector adapter",
                           where="kv_connector_extra_config")
    return parsed, rest


@dataclass
class WTransferKVMetadata(KVConnectorMetadata):
    """One step's wtransfer connector metadata, as the JSON text the worker rebuilds it from,
    and the model fingerprint it was planned under (it changes when vLLM resets the cache)."""

    text: str = "{}"
    fingerprint: str = ""


@dataclass
class WTransferWorkerReports(KVConnectorWorkerMetadata):
    """What the workers' wtransfer connectors reported this step, as JSON texts (one per worker)."""

    texts: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WTransferWorkerReports:
        return WTransferWorkerReports(self.texts + list(getattr(other, "texts", [])))


@dataclass
class _Tracked:
    """What the scheduler instance remembers of one live request between vLLM's calls."""

    request: Any  # vLLM's Request: its all_token_ids grow as tokens are generated
    local_computed: int = 0  # tokens from vLLM's own prefix cache, as given to the lookup
    block_ids: list[int] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)


def kv_cache_spec_for(vllm_config: Any, kv_cache_config: Any, fingerprint: str | None = None,
                      worker: bool = False) -> wtransfer.KVCacheSpec:
    """vLLM's KV cache description as a wtransfer ``KVCacheSpec``; a clear error where none fits.

    With tensor parallelism each worker holds its share of the heads of every block: its spec
    says which part (``shard``) of how many; the scheduler's says how many parts make a block.
    """
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if int(getattr(parallel, "pipeline_parallel_size", 1)) > 1:
        raise ValueError("wtransfer connectors do not support pipeline parallelism yet (each stage holds other "
                         "layers); run with pipeline_parallel_size=1")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(parallel, name, 1) or 1) > 1:
            raise ValueError(f"wtransfer connectors do not support context parallelism yet ({name} > 1 splits each "
                             "block's tokens across workers); run without it")
    num_shards = int(getattr(parallel, "tensor_parallel_size", 1))
    shard = _tensor_parallel_rank(parallel, num_shards) if worker else 0

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ValueError(
            f"wtransfer connectors need a model whose layers share one full-attention KV cache group; "
            f"this one has {len(groups)} groups (hybrid, sliding-window or cross-attention models are "
            "not supported yet)"
        )
    group = groups[0]
    spec = group.kv_cache_spec
    kind = type(spec).__name__
    if kind != "FullAttentionSpec" or getattr(spec, "sliding_window", None) is not None:
        raise ValueError(f"wtransfer connectors need full-attention layers; vLLM describes these as {kind}")
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise ValueError("wtransfer connectors need keys and values of the same head size")
    if not current_platform.is_cpu():
        raise ValueError(
            "wtransfer connectors know vLLM's CPU cache layout only; on this platform vLLM's attention "
            "backend lays blocks out differently (run vLLM-CPU, or use a connector built for the device)"
        )
    return wtransfer.KVCacheSpec(
        layer_names=tuple(group.layer_names),
        block_size=int(spec.block_size),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        dtype=wtransfer.dtype_name(spec.dtype),
        model_fingerprint=fingerprint or checkpoint_fingerprint(vllm_config.model_config),
        layout="vllm-cpu",
        shard=shard,
        num_shards=num_shards,
    )


def _tensor_parallel_rank(parallel: Any, num_shards: int) -> int:
    """This worker's tensor-parallel rank (vLLM's group once it exists, else from its global rank)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception as exc:  # the group is not up (it is, where vLLM creates a worker's connector)
        rank = int(getattr(parallel, "rank", 0)) % num_shards
        logger.warning("wtransfer-vllm: vLLM's tensor-parallel rank is unknown here (%s); taking part %d of %d from "
                       "the worker's global rank", exc, rank, num_shards)
        return rank


class WTransferKVConnectorAdapter(KVConnectorBase_V1):
    """A vLLM KV connector backed by the wtransfer connector ``wtransfer_backend``."""

    wtransfer_backend: ClassVar[str] = ""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config  # what the base class keeps (it refuses None above)
        self.adapter_options, extra = split_adapter_options(transfer.kv_connector_extra_config)
        fingerprint = self.adapter_options.model_fingerprint
        self.kv_cache_spec = kv_cache_spec_for(vllm_config, kv_cache_config, fingerprint,
                                               worker=role != KVConnectorRole.SCHEDULER)
        self._model_identity = fingerprint or model_identity(vllm_config.model_config)
        self._committed_weights: str | None = None  # named by the engine core just before its reset
        self._config = wtransfer.KVTransferConfig(
            kv_connector=self.wtransfer_backend,
            kv_role=transfer.kv_role or "kv_both",
            kv_connector_extra_config=extra,
            engine_id=str(transfer.engine_id),
        )
        self._inner_role = (
            wtransfer.KVConnectorRole.SCHEDULER if role == KVConnectorRole.SCHEDULER else wtransfer.KVConnectorRole.WORKER
        )
        self.inner = wtransfer.KVConnectorFactory.create_connector(self._config, self._inner_role, self.kv_cache_spec)
        self._namespace = wtransfer.kv_namespace(self.kv_cache_spec)
        self._owed_sending: set[str] = set()  # worker: finished saves of a connector replaced at a reset
        self._kv_caches: dict[str, Any] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._steps = itertools.count()
        self._skipped_kinds: set[str] = set()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        logger.info(
            "wtransfer-vllm: KV connector %s (%s) for the %s, layout %s, model fingerprint %s",
            self.wtransfer_backend, type(self.inner).__name__, role.name.lower(),
            self.kv_cache_spec.layout, self.kv_cache_spec.model_fingerprint[:16],
        )

    # ================================================================ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._describable(request):
            return 0, False
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        tracked.local_computed = num_computed_tokens
        with self._timed("lookup"):
            count, load_async = self.inner.get_num_new_matched_tokens(
                self._kv_request(tracked, num_computed_tokens), num_computed_tokens
            )
        return count, bool(load_async and count)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:  # not describable: the lookup answered 0
            return
        block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        if block_ids:
            tracked.block_ids = block_ids
        self.inner.update_state_after_alloc(
            self._kv_request(tracked, tracked.local_computed), list(tracked.block_ids), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> WTransferKVMetadata:
        scheduled: list[wtransfer.ScheduledRequest] = []
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            scheduled.append(self._scheduled(tracked, new.num_computed_tokens, counts.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for index, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[index]
            if new_blocks is not None:
                # a resumed request got a whole new block table; a running one grew
                tracked.block_ids = list(new_blocks[0]) if req_id in resumed else tracked.block_ids + list(new_blocks[0])
            scheduled.append(self._scheduled(tracked, cached.num_computed_tokens[index], counts.get(req_id, 0)))
        step = wtransfer.SchedulerStep(
            step=next(self._steps),
            scheduled=scheduled,
            finished_req_ids=sorted(scheduler_output.finished_req_ids),
            preempted_req_ids=sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()),
        )
        with self._timed("build_meta"):
            return WTransferKVMetadata(self.inner.build_connector_meta(step).to_json(),
                                       self.kv_cache_spec.model_fingerprint)

    def weights_committed(self, weights: str | None) -> None:
        """A wtransfer round named ``weights`` (a digest of what it delivered) was committed on
        every worker; the cache reset that follows keys blocks to the new weights. ``None``
        forgets a name whose reset did not happen."""
        self._committed_weights = weights

    def reset_cache(self) -> bool:
        """vLLM's cache reset (``reset_prefix_cache(reset_connector=True)``, ``pause_generation``
        with ``clear_cache``), which vLLM's RL flow runs after a weight update. From now on
        blocks are named under a new fingerprint, so nothing stored before matches again:

        * after a wtransfer round that delivered every checkpoint tensor with checksums, the
          fingerprint names the model (name, config, dtype) and the round's content: every
          instance at those weights computes the same one, whatever it held before;
        * after another wtransfer round, a digest of the previous fingerprint and the engine's
          content identity (which names every round since the start-up weights): instances that
          started from the same checkpoint and took the same rounds share it;
        * after any other reset (vLLM's own weight updates, a reset by hand, ``pause_generation``
          clearing caches) the weights are unknown: the fingerprint is unique to this reset.

        KV of any other weights never matches.

        The store itself is left alone: other engines may share it. The workers follow with the
        next step's metadata.
        """
        import hashlib
        import uuid

        weights, self._committed_weights = self._committed_weights, None
        # a whole round names the weights alone; anything else is on top of what the model held
        whole = weights is not None and weights.startswith("weights:")
        base = self._model_identity if whole else self.kv_cache_spec.model_fingerprint
        name = weights or f"reset:{uuid.uuid4().hex}"
        self._switch_fingerprint(hashlib.sha256(f"{base}|{name}".encode()).hexdigest())
        for tracked in self._tracked.values():
            tracked.hashes = []
        logger.info("wtransfer-vllm: KV connector %s reset: stored blocks no longer match (fingerprint %s)",
                    self.wtransfer_backend, self.kv_cache_spec.model_fingerprint[:24])
        return True

    def _switch_fingerprint(self, fingerprint: str) -> None:
        """Replace the wtransfer connector by one rooted in ``fingerprint``. The old one finishes
        its work first (``shutdown``); on the worker, the requests whose saves it then reports
        done are passed on by the next ``get_finished``, since vLLM holds their blocks until then."""
        import dataclasses

        self.kv_cache_spec = dataclasses.replace(self.kv_cache_spec, model_fingerprint=fingerprint)
        old, self.inner = self.inner, wtransfer.KVConnectorFactory.create_connector(
            self._config, self._inner_role, self.kv_cache_spec)
        self._namespace = wtransfer.kv_namespace(self.kv_cache_spec)
        old.shutdown()
        if self._inner_role is wtransfer.KVConnectorRole.WORKER:
            self._owed_sending |= old.get_finished(set())[0] or set()
            self.inner.register_kv_caches(self._kv_caches)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' step results, including their reports (stores that landed or failed)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        reports = [json.loads(text) for text in getattr(meta, "texts", [])]
        self.inner.update_connector_output(wtransfer.KVConnectorOutput(
            finished_sending=sorted(connector_output.finished_sending or ()),
            finished_recving=sorted(connector_output.finished_recving or ()),
            invalid_block_ids=sorted(connector_output.invalid_block_ids or ()),
            worker_meta=reports,
        ))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        kv = self._kv_request(tracked, request.num_computed_tokens)
        return self.inner.request_finished(kv, list(block_ids))

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._kv_caches = dict(kv_caches)
        self.inner.register_kv_caches(self._kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, WTransferKVMetadata):
            raise TypeError(
                f"wtransfer-vllm: the worker got {type(connector_metadata).__name__} metadata; the scheduler "
                "and the workers must run the same connector"
            )
        if connector_metadata.fingerprint and connector_metadata.fingerprint != self.kv_cache_spec.model_fingerprint:
            self._switch_fingerprint(connector_metadata.fingerprint)  # the scheduler reset the cache
        self.inner.bind_connector_metadata(self.inner.metadata_cls.from_json(connector_metadata.text))

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.inner.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM calls this before each forward: stores still reading preempted requests' blocks finish."""
        if type(self.inner).handle_preemptions is wtransfer.KVConnectorBase.handle_preemptions:
            return  # the base hook does nothing: no need to parse the step's metadata twice
        if isinstance(kv_connector_metadata, WTransferKVMetadata):
            self.inner.handle_preemptions(self.inner.metadata_cls.from_json(kv_connector_metadata.text))
        elif "handle_preemptions" not in self._skipped_kinds:  # a vLLM that passes something else
            self._skipped_kinds.add("handle_preemptions")
            logger.warning("wtransfer-vllm: handle_preemptions got %s, not this connector's metadata; stores of "
                           "preempted requests are not waited for (a vLLM version this bridge does not know?)",
                           type(kv_connector_metadata).__name__)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        with self._timed("start_load"):
            self.inner.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        with self._timed("wait_load"):
            self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        with self._timed("wait_for_save"):
            self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, receiving = self.inner.get_finished(set(finished_req_ids))
        if self._owed_sending:  # requests whose saves the connector replaced at a reset finished
            sending, self._owed_sending = (sending or set()) | self._owed_sending, set()
        return sending, receiving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.inner.get_block_ids_with_load_errors())

    def build_connector_worker_meta(self) -> WTransferWorkerReports | None:
        report = self.inner.build_connector_worker_meta()
        return None if report is None else WTransferWorkerReports([json.dumps(report, allow_nan=False)])

    def shutdown(self) -> None:
        stats = self.inner.get_kv_connector_stats()
        if stats or self.seconds:
            logger.info("wtransfer-vllm: KV connector %s stats: %s; seconds in: %s", self.wtransfer_backend, stats,
                        {k: round(v, 4) for k, v in self.seconds.items()})
        self.inner.shutdown()

    # ================================================================ helpers
    @contextlib.contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        """Wall seconds spent in the wrapped connector, per call kind (logged at shutdown)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] += time.perf_counter() - started

    def _describable(self, request: Any) -> bool:
        """False for requests whose KV depends on more than token ids and the salt."""
        kind = "multimodal" if getattr(request, "mm_features", None) else None
        if getattr(request, "prompt_embeds", None) is not None:
            kind = "prompt-embedding"
        if kind is None:
            return True
        if kind not in self._skipped_kinds:
            self._skipped_kinds.add(kind)
            logger.info("wtransfer-vllm: %s requests are not looked up or saved (their KV is not "
                        "determined by token ids)", kind)
        return False

    def _kv_request(self, tracked: _Tracked, num_computed_tokens: int, num_tokens: int | None = None) -> wtransfer.KVRequest:
        request = tracked.request
        tokens = list(request.all_token_ids)
        if num_tokens is not None:
            tokens = tokens[:num_tokens]
        tracked.hashes = wtransfer.block_hashes(
            self._namespace, tokens, self.kv_cache_spec.block_size,
            parent_hashes=tracked.hashes[: len(tokens) // self.kv_cache_spec.block_size],
            extra_keys=_extra_keys(request),
        )
        return wtransfer.KVRequest(
            request_id=request.request_id,
            token_ids=tokens,
            block_hashes=list(tracked.hashes),
            num_computed_tokens=num_computed_tokens,
            kv_transfer_params=getattr(request, "kv_transfer_params", None),
        )

    def _scheduled(self, tracked: _Tracked, num_computed: int, num_scheduled: int) -> wtransfer.ScheduledRequest:
        # Only tokens whose KV exists after this step: later ones may be placeholders.
        kv = self._kv_request(tracked, num_computed, num_computed + num_scheduled)
        return wtransfer.ScheduledRequest(kv, list(tracked.block_ids), num_scheduled)


def _extra_keys(request: Any) -> dict[str, Any] | None:
    """What besides the tokens changes a request's KV: vLLM's cache salt and the LoRA adapter."""
    keys: dict[str, Any] = {}
    if getattr(request, "cache_salt", None):
        keys["cache_salt"] = request.cache_salt
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        keys["lora"] = getattr(lora, "lora_name", str(lora))
    return keys or None


__getattr__ = adapter_classes(WTransferKVConnectorAdapter, __name__)

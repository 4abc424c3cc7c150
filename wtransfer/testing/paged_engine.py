"""A tiny, honest paged-KV inference engine on CPU that drives any KV connector through the contract.

Connector authors use it to test their plugin end to end without vLLM:

    engine = PagedKVEngine(spec, num_blocks=64, kv_transfer_config=KVTransferConfig("storage", ...))
    out = engine.generate({"a": prompt}, max_new_tokens=4)["a"]
    assert out.kv == reference_kv(spec, out.prompt_token_ids)   # bit-exact, layer by layer

What is real here
-----------------
* **Paged cache.** One tensor per layer in the spec's layout and dtype (``KVCacheSpec.cache_shape``; keys and
  values via :func:`kv_planes`). These exact tensors go to the worker's ``register_kv_caches``.
* **Block allocator with prefix caching.** Full blocks are found by chained hash
  (:mod:`wtransfer.connectors._hashing`); a finished request's blocks stay findable until evicted. Allocation takes
  never-used blocks first, then the least recently freed cached block (a request's tail before its head), so a
  working set larger than the cache pushes earlier prefixes out, and a connector can bring them back.
* **A model that reads its cache.** Per layer and token, attention over every earlier token's K and V as read back
  from the cache: ``a_t = softmax(K_{<t} (x_t Wq)) V_{<t}``, ``k_t = tanh(x_t Wk + a_t U)``,
  ``v_t = tanh(x_t Wv + k_t)``, next ``x = x + v``. KV is a deterministic function of the whole prefix, computed
  with the same one-row operations however the work is chunked, so a wrongly loaded block changes every later KV
  and the generated tokens. :func:`reference_kv` recomputes from scratch for bit-exact checks.

One :meth:`PagedKVEngine.step` (the call order of :mod:`wtransfer.connectors._base`)
-----------------------------------------------------------------------------------
1. Running requests are scheduled for their remaining tokens (1 when decoding); requests waiting for
   asynchronous loads stay parked until reported received.
2. Waiting requests, in arrival order: local prefix hits ``n_local`` (full blocks, at least one prompt token left)
   -> ``sched.get_num_new_matched_tokens(request, n_local)`` (``None``: ask again next step) -> blocks for the
   whole request (if short, admission stops) -> ``sched.update_state_after_alloc`` with
   ``request.num_computed_tokens == n_local``. With ``load_async`` the request is parked.
3. ``sched.build_connector_meta(SchedulerStep(...))``; its ``to_json()`` always crosses to the worker, even
   in-process, and is bound there.
4. ``start_load_kv``; per layer ``wait_for_layer_load``, compute, ``save_kv_layer`` (a step with nothing
   scheduled skips the layers but still runs the rest, so asynchronous transfers progress); ``wait_for_save``.
5. Requests with a block in ``get_block_ids_with_load_errors()`` roll back to it and recompute (no token sampled).
6. Tokens are sampled, newly full blocks join the prefix cache, requests at ``max_new_tokens`` finish through
   ``sched.request_finished`` (with ``delay_free`` their blocks stay allocated).
7. ``worker.get_finished``: ``sending`` frees delayed blocks, ``receiving`` un-parks requests; then
   ``build_connector_worker_meta``, ``clear_connector_metadata``, and ``sched.update_connector_output`` through JSON.

:meth:`PagedKVEngine.run` steps until every request is done (delayed frees included), raising
:class:`~wtransfer.errors.TransferTimeoutError` instead of hanging when a connector never reports.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from wtransfer._dtypes import dtype_from_name as torch_dtype
from wtransfer.config import KVTransferConfig
from wtransfer.connectors._base import KVConnectorBase, KVConnectorRole
from wtransfer.connectors._hashing import block_hashes, kv_namespace
from wtransfer.connectors._request import KVConnectorOutput, KVRequest, ScheduledRequest, SchedulerStep
from wtransfer.errors import TransferError, TransferTimeoutError
from wtransfer.kvcache import KVCacheSpec

logger = logging.getLogger("wtransfer")

__all__ = [
    "BlockAllocator",
    "PagedKVEngine",
    "RequestOutput",
    "TinyModel",
    "reference_kv",
    "torch_dtype",
]


class TinyModel:
    """Deterministic weights seeded from the model fingerprint; one-row ops for bit-exact replays."""

    def __init__(self, spec: KVCacheSpec, vocab_size: int = 512) -> None:
        self.spec = spec
        self.vocab_size = vocab_size
        self.hidden = spec.num_kv_heads * spec.head_size
        seed = int.from_bytes(hashlib.sha256(spec.model_fingerprint.encode()).digest()[:8], "little")
        gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        self.scale = 1.0 / math.sqrt(self.hidden)
        self.embed = torch.randn(vocab_size, self.hidden, generator=gen)
        # per layer: Wq, Wk, Wv, U (the attention read-out into the key)
        self.layers = [
            tuple(torch.randn(self.hidden, self.hidden, generator=gen) * self.scale for _ in range(4))
            for _ in spec.layer_names
        ]

    def embed_token(self, token_id: int) -> torch.Tensor:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} outside the tiny model's vocabulary [0, {self.vocab_size})")
        return self.embed[token_id : token_id + 1]

    def layer_step(
        self, layer: int, x: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token through one layer given the earlier tokens' ``[t, hidden]`` K and V: ``(k, v, next_x)``, each
        ``[1, hidden]`` float32."""
        wq, wk, wv, u = self.layers[layer]
        pre_k = x @ wk
        if past_k.shape[0]:
            scores = (past_k * (x @ wq)).sum(dim=1) * self.scale
            attended = (torch.softmax(scores, dim=0).unsqueeze(1) * past_v).sum(dim=0, keepdim=True)
            pre_k = pre_k + attended @ u
        k = torch.tanh(pre_k)
        v = torch.tanh(x @ wv + k)
        return k, v, x + v

    def sample(self, x: torch.Tensor) -> int:
        return int(torch.argmax(x @ self.embed.T, dim=-1).item())


class BlockAllocator:
    """Fixed pool of cache blocks with reference counts and an LRU prefix cache of freed full blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._fresh: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._hash_of_block: dict[int, str] = {}
        self._block_of_hash: dict[str, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._fresh) + len(self._cached_free)

    def cached_prefix(self, hashes: Sequence[str]) -> list[int]:
        """Blocks holding the longest prefix of ``hashes`` (not yet referenced by the caller)."""
        blocks: list[int] = []
        for block_hash in hashes:
            block = self._block_of_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def is_cached(self, block_hash: str) -> bool:
        return block_hash in self._block_of_hash

    def touch(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self.ref_counts[block] == 0:
                self._cached_free.pop(block, None)
            self.ref_counts[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks with reference 1, or ``None`` (nothing taken) if the pool is short."""
        if count > self.num_free:
            return None
        blocks: list[int] = []
        for _ in range(count):
            if self._fresh:
                block = self._fresh.popleft()
            else:
                block, _ = self._cached_free.popitem(last=False)
                self._forget(block)
                self.num_evictions += 1
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block, tail first, so a prefix's head is evicted last."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            if self.ref_counts[block] == 0:
                if block in self._hash_of_block:
                    self._cached_free[block] = None
                else:
                    self._fresh.append(block)

    def register(self, block: int, block_hash: str) -> None:
        """Make a full, computed block findable by its hash (first holder of a hash wins)."""
        if block in self._hash_of_block or block_hash in self._block_of_hash:
            return
        self._hash_of_block[block] = block_hash
        self._block_of_hash[block_hash] = block

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None:
            self._block_of_hash.pop(block_hash, None)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED_PENDING_FREE = "finished_pending_free"
    DONE = "done"


@dataclass
class RequestOutput:
    """What a finished request produced, and where its prompt's KV came from."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_local_hit_tokens: int
    num_external_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    kv: dict[str, torch.Tensor] | None = None
    """With ``capture_kv``: layer -> ``[2, num_tokens_with_kv, heads, head_size]`` copied at finish."""
    num_load_errors: int = 0


@dataclass
class _Request:
    kv: KVRequest
    prompt_len: int
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_local_hit_tokens: int = 0
    num_external_tokens: int = 0
    num_load_errors: int = 0
    arrival: int = 0

    @property
    def num_kv_tokens(self) -> int:
        """Tokens that ever get KV: the prompt plus every generated token but the last."""
        return self.prompt_len + self.max_new_tokens - 1


class PagedKVEngine:
    """The tiny engine. Pass a ``KVTransferConfig`` (connectors created through ``KVConnectorFactory``), ready
    ``connectors=(scheduler_instance, worker_instance)``, or neither."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        *,
        kv_transfer_config: KVTransferConfig | None = None,
        connectors: tuple[KVConnectorBase, KVConnectorBase] | None = None,
        enable_prefix_caching: bool = True,
        capture_kv: bool = False,
        vocab_size: int = 512,
    ) -> None:
        self.spec = spec
        self.namespace = kv_namespace(spec)
        self.model = TinyModel(spec, vocab_size)
        self.allocator = BlockAllocator(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.capture_kv = capture_kv
        dtype = torch_dtype(spec.dtype)
        shape = spec.cache_shape(num_blocks)  # in the spec's layout: connectors must handle it
        self.kv_caches: dict[str, torch.Tensor] = {name: torch.zeros(shape, dtype=dtype) for name in spec.layer_names}
        if kv_transfer_config is not None and connectors is not None:
            raise ValueError("pass either kv_transfer_config or connectors, not both")
        if kv_transfer_config is not None:
            from wtransfer.connectors._factory import KVConnectorFactory

            connectors = (
                KVConnectorFactory.create_connector(kv_transfer_config, KVConnectorRole.SCHEDULER, spec),
                KVConnectorFactory.create_connector(kv_transfer_config, KVConnectorRole.WORKER, spec),
            )
        self.scheduler_connector, self.worker_connector = connectors or (None, None)
        if (self.scheduler_connector is None) != (self.worker_connector is None):
            raise ValueError("connectors must be a (scheduler instance, worker instance) pair")
        if self.worker_connector is not None:
            self.worker_connector.register_kv_caches(self.kv_caches)
        self._requests: dict[str, _Request] = {}
        self._outputs: dict[str, RequestOutput] = {}
        self._finished_since_last_step: list[str] = []
        self._arrivals = 0
        self.step_index = 0
        self.last_metadata_json: str | None = None
        self._closed = False

    # ------------------------------------------------------------------ public API
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_new_tokens: int = 1,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        if request_id in self._requests or request_id in self._outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for token in prompt_token_ids:
            self.model.embed_token(int(token))  # validates the range early
        tokens = [int(t) for t in prompt_token_ids]
        kv = KVRequest(
            request_id=request_id,
            token_ids=tokens,
            block_hashes=block_hashes(self.namespace, tokens, self.spec.block_size),
            kv_transfer_params=kv_transfer_params,
        )
        request = _Request(kv=kv, prompt_len=len(tokens), max_new_tokens=max_new_tokens, arrival=self._arrivals)
        blocks_needed = self._blocks_for(request.num_kv_tokens)
        if blocks_needed > self.allocator.num_blocks:
            raise ValueError(
                f"request {request_id!r} needs {blocks_needed} blocks but the engine has only "
                f"{self.allocator.num_blocks}; raise num_blocks or shorten the request"
            )
        self._arrivals += 1
        self._requests[request_id] = request

    def has_unfinished(self) -> bool:
        return any(r.status is not RequestStatus.DONE for r in self._requests.values())

    def run(self, *, timeout_s: float = 60.0, max_steps: int = 100_000) -> dict[str, RequestOutput]:
        """Step until every request is done (delayed frees included); return every output not returned before."""
        deadline = time.monotonic() + timeout_s
        for _ in range(max_steps):
            if not self.has_unfinished() and not self._finished_since_last_step:
                break
            progressed = self.step()
            if time.monotonic() > deadline:
                raise TransferTimeoutError(self._stuck_message(timeout_s))
            if not progressed:
                time.sleep(0.001)  # only connector completions can move things on
        else:
            raise TransferTimeoutError(f"engine did not finish within {max_steps} steps: {self._stuck_message(None)}")
        for request_id in [r for r, q in self._requests.items() if q.status is RequestStatus.DONE]:
            del self._requests[request_id]
        outputs, self._outputs = self._outputs, {}
        return outputs

    def generate(
        self, prompts: Mapping[str, Sequence[int]], *, max_new_tokens: int = 1, timeout_s: float = 60.0
    ) -> dict[str, RequestOutput]:
        for request_id, prompt in prompts.items():
            self.add_request(request_id, prompt, max_new_tokens=max_new_tokens)
        return self.run(timeout_s=timeout_s)

    def block_ids(self, request_id: str) -> list[int]:
        """The cache blocks a live request holds, in token order."""
        return list(self._requests[request_id].block_ids)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for connector in (self.worker_connector, self.scheduler_connector):
            if connector is not None:
                connector.shutdown()

    def __enter__(self) -> PagedKVEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ one step
    def step(self) -> bool:
        """One scheduler + worker step (see the module docstring). True if any token was computed."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        self.step_index += 1
        scheduled = self._schedule()
        step = SchedulerStep(self.step_index, scheduled, self._finished_since_last_step)
        self._finished_since_last_step = []
        worker = self.worker_connector
        if self.scheduler_connector is not None and worker is not None:
            payload = self.scheduler_connector.build_connector_meta(step).to_json()
            self.last_metadata_json = payload
            worker.bind_connector_metadata(type(worker).metadata_cls.from_json(payload))
            worker.start_load_kv()
        final_x = self._forward(scheduled) if scheduled else {}
        failed: set[int] = set()
        if worker is not None:
            worker.wait_for_save()
            failed = set(worker.get_block_ids_with_load_errors())
        self._update_after_forward(scheduled, final_x, failed)
        if worker is not None:
            sending, receiving = worker.get_finished(set(step.finished_req_ids))
            self._handle_finished_transfers(sending or set(), receiving or set())
            report = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            output = KVConnectorOutput(sorted(sending or ()), sorted(receiving or ()), sorted(failed),
                                       [report] if report else [])
            assert self.scheduler_connector is not None
            self.scheduler_connector.update_connector_output(KVConnectorOutput.from_json(output.to_json()))
        return bool(scheduled)

    def _schedule(self) -> list[ScheduledRequest]:
        scheduled: list[ScheduledRequest] = []
        for request in self._by_arrival(RequestStatus.RUNNING):
            remaining = request.kv.num_tokens - request.kv.num_computed_tokens
            scheduled.append(ScheduledRequest(request.kv, list(request.block_ids), remaining))
        for request in self._by_arrival(RequestStatus.WAITING):
            admitted = self._admit(request)
            if admitted is None:
                continue
            if admitted is False:
                break  # out of blocks: keep arrival order, try again next step
            scheduled.append(admitted)
        return scheduled

    def _admit(self, request: _Request) -> ScheduledRequest | bool | None:
        """Scheduled entry, ``None`` (connector not ready / parked), or ``False`` (no blocks)."""
        bs = self.spec.block_size
        kv = request.kv
        hits: list[int] = []
        if self.enable_prefix_caching:
            hits = self.allocator.cached_prefix(kv.block_hashes[: (request.prompt_len - 1) // bs])
        n_local = len(hits) * bs
        n_ext, load_async = 0, False
        kv.num_computed_tokens = n_local
        if self.scheduler_connector is not None:
            answer, load_async = self.scheduler_connector.get_num_new_matched_tokens(kv, n_local)
            if answer is None:
                return None
            n_ext = int(answer)
            if n_ext < 0 or n_local + n_ext > request.prompt_len - 1:
                raise TransferError(
                    f"{type(self.scheduler_connector).__name__}.get_num_new_matched_tokens returned {n_ext} "
                    f"for request {kv.request_id!r} with {n_local} local hits and {request.prompt_len} prompt "
                    "tokens; it must leave at least one prompt token to compute"
                )
        self.allocator.touch(hits)
        new_blocks = self.allocator.allocate(self._blocks_for(request.num_kv_tokens) - len(hits))
        if new_blocks is None:
            self.allocator.free(hits)
            return False
        request.block_ids = hits + new_blocks
        request.num_local_hit_tokens = n_local
        request.num_external_tokens = n_ext
        if self.scheduler_connector is not None:
            self.scheduler_connector.update_state_after_alloc(kv, list(request.block_ids), n_ext)
        if load_async and n_ext > 0:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return None
        kv.num_computed_tokens = n_local + n_ext
        request.status = RequestStatus.RUNNING
        return ScheduledRequest(kv, list(request.block_ids), request.prompt_len - kv.num_computed_tokens)

    # ------------------------------------------------------------------ the model
    def _forward(self, scheduled: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
        """Compute every scheduled token, layer by layer, writing KV into the paged cache."""
        bs = self.spec.block_size
        xs: dict[str, list[torch.Tensor]] = {}
        for entry in scheduled:
            start = entry.request.num_computed_tokens
            tokens = entry.request.token_ids[start : start + entry.num_scheduled_tokens]
            xs[entry.request.request_id] = [self.model.embed_token(t) for t in tokens]
        heads, head_size = self.spec.num_kv_heads, self.spec.head_size
        for layer, name in enumerate(self.spec.layer_names):
            if self.worker_connector is not None:
                self.worker_connector.wait_for_layer_load(name)
            keys, values = kv_planes(self.spec, self.kv_caches[name])
            for entry in scheduled:
                start = entry.request.num_computed_tokens
                layer_xs = xs[entry.request.request_id]
                # what the cache holds for this request (loaded or computed earlier), as float rows
                blocks = torch.tensor(entry.block_ids, dtype=torch.long)
                past_k = keys.index_select(0, blocks).reshape(-1, self.model.hidden).float()
                past_v = values.index_select(0, blocks).reshape(-1, self.model.hidden).float()
                for offset, x in enumerate(layer_xs):
                    pos = start + offset
                    k, v, layer_xs[offset] = self.model.layer_step(layer, x, past_k[:pos], past_v[:pos])
                    block, slot = entry.block_ids[pos // bs], pos % bs
                    keys[block, slot] = k.reshape(heads, head_size)
                    values[block, slot] = v.reshape(heads, head_size)
                    past_k[pos] = keys[block, slot].reshape(-1)  # as stored: rounded to the cache dtype
                    past_v[pos] = values[block, slot].reshape(-1)
            if self.worker_connector is not None:
                self.worker_connector.save_kv_layer(name, self.kv_caches[name])
        return {rid: layer_xs[-1] for rid, layer_xs in xs.items() if layer_xs}

    def _update_after_forward(
        self, scheduled: list[ScheduledRequest], final_x: dict[str, torch.Tensor], failed: set[int]
    ) -> None:
        bs = self.spec.block_size
        for entry in scheduled:
            request = self._requests[entry.request.request_id]
            if self._roll_back_failed_loads(request, failed):
                continue
            kv = request.kv
            kv.num_computed_tokens += entry.num_scheduled_tokens
            if kv.num_computed_tokens == kv.num_tokens:
                request.output.append(self.model.sample(final_x[kv.request_id]))
                kv.token_ids.append(request.output[-1])
                kv.block_hashes = block_hashes(self.namespace, kv.token_ids, bs, parent_hashes=kv.block_hashes)
            if self.enable_prefix_caching:
                for index in range(kv.num_computed_tokens // bs):
                    self.allocator.register(request.block_ids[index], kv.block_hashes[index])
            if len(request.output) >= request.max_new_tokens:
                self._finish(request)
        for request in self._by_arrival(RequestStatus.WAITING_FOR_REMOTE_KVS):
            self._roll_back_failed_loads(request, failed)

    def _roll_back_failed_loads(self, request: _Request, failed: set[int]) -> bool:
        """If a block of ``request`` failed to load, recompute from that block on. True if so."""
        if not failed:
            return False
        bad = [i for i, block in enumerate(request.block_ids) if block in failed]
        if not bad:
            return False
        request.num_load_errors += 1
        first_bad_token = bad[0] * self.spec.block_size
        logger.warning(
            "request %s: %d block(s) failed to load; recomputing from token %d",
            request.kv.request_id,
            len(bad),
            first_bad_token,
        )
        request.num_external_tokens = max(0, first_bad_token - request.num_local_hit_tokens)
        request.kv.num_computed_tokens = min(request.kv.num_computed_tokens, first_bad_token)
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            request.status = RequestStatus.RUNNING
        return True

    def _finish(self, request: _Request) -> None:
        kv = request.kv
        captured = self._gather_kv(request) if self.capture_kv else None
        delay_free, params = False, None
        if self.scheduler_connector is not None:
            delay_free, params = self.scheduler_connector.request_finished(kv, list(request.block_ids))
        self._outputs[kv.request_id] = RequestOutput(
            request_id=kv.request_id,
            prompt_token_ids=kv.token_ids[: request.prompt_len],
            output_token_ids=list(request.output),
            num_local_hit_tokens=request.num_local_hit_tokens,
            num_external_tokens=request.num_external_tokens,
            kv_transfer_params=params,
            kv=captured,
            num_load_errors=request.num_load_errors,
        )
        self._finished_since_last_step.append(kv.request_id)
        if delay_free:
            request.status = RequestStatus.FINISHED_PENDING_FREE
        else:
            self._release(request)

    def _release(self, request: _Request) -> None:
        self.allocator.free(request.block_ids)
        request.block_ids = []
        request.status = RequestStatus.DONE

    def _handle_finished_transfers(self, sending: set[str], receiving: set[str]) -> None:
        for request_id in sending:
            request = self._requests.get(request_id)
            if request is not None and request.status is RequestStatus.FINISHED_PENDING_FREE:
                self._release(request)
        for request_id in receiving:
            request = self._requests.get(request_id)
            if request is not None and request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                request.kv.num_computed_tokens = request.num_local_hit_tokens + request.num_external_tokens
                request.status = RequestStatus.RUNNING

    # ------------------------------------------------------------------ helpers
    def _gather_kv(self, request: _Request) -> dict[str, torch.Tensor]:
        n = request.kv.num_computed_tokens
        blocks = torch.tensor(request.block_ids, dtype=torch.long)
        out: dict[str, torch.Tensor] = {}
        heads, head_size = self.spec.num_kv_heads, self.spec.head_size
        for name, cache in self.kv_caches.items():
            planes = kv_planes(self.spec, cache)  # each [num_blocks, bs, H, D]
            out[name] = torch.stack([p.index_select(0, blocks).reshape(-1, heads, head_size)[:n] for p in planes])
        return out

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.spec.block_size)

    def _by_arrival(self, status: RequestStatus) -> list[_Request]:
        return sorted((r for r in self._requests.values() if r.status is status), key=lambda r: r.arrival)

    def _stuck_message(self, timeout_s: float | None) -> str:
        pending = {
            r.kv.request_id: r.status.value for r in self._requests.values() if r.status is not RequestStatus.DONE
        }
        waited = f"after {timeout_s:.0f}s " if timeout_s is not None else ""
        return (
            f"engine stuck {waited}with requests {pending}: a connector never reported them in "
            "get_finished() (sending/receiving), or the cache is too small for the waiting requests"
        )


def kv_planes(spec: KVCacheSpec, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer's cache as ``[num_blocks, block_size, heads, head_size]`` views (writable).

    For ``"vllm-cpu"`` the block is split as vLLM's CPU attention does: viewed as
    ``[heads, 2 * block_size, head_size]``, the first ``block_size`` rows are keys, the rest values."""
    if spec.layout == "vllm-cpu":
        num_blocks = cache.shape[0]
        halves = cache.view(num_blocks, spec.num_kv_heads, 2 * spec.block_size, spec.head_size).chunk(2, dim=2)
        return halves[0].permute(0, 2, 1, 3), halves[1].permute(0, 2, 1, 3)
    return cache[0], cache[1]


def reference_kv(spec: KVCacheSpec, token_ids: Sequence[int], *, vocab_size: int = 512) -> dict[str, torch.Tensor]:
    """KV of ``token_ids`` recomputed from scratch (no connector, no prefix cache): the ground truth.

    Layer -> ``[2, len(token_ids), heads, head_size]`` in the spec's dtype, comparable with ``RequestOutput.kv``."""
    blocks = -(-len(token_ids) // spec.block_size)
    engine = PagedKVEngine(spec, blocks, enable_prefix_caching=False, capture_kv=True, vocab_size=vocab_size)
    output = engine.generate({"reference": token_ids}, max_new_tokens=1)["reference"]
    assert output.kv is not None
    return output.kv

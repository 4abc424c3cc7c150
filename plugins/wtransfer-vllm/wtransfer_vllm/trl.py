"""TRL's ``AsyncGRPOTrainer(weight_transfer=...)`` over any wtransfer engine.

TRL 1.16's async GRPO trainer takes a ``weight_transfer`` object (its ``WeightTransferProtocol``)
and calls it on its main process only: ``init_weight_transfer()`` once, then each sync
``pause()``, ``send_weights(iterator)``, ``resume()``, and ``destroy()`` when training ends. The
iterator yields ``(name, tensor)`` once per parameter, in the trainer's dtype (fp32 by default)
and gathered whole under FSDP2. :class:`WTransferWeightTransfer` sends it as a wtransfer round
through TRL's own ``VLLMClient`` (``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend": "shm"}'``, or ``gloo`` across hosts): each tensor is cast
to vLLM's dtype as it is packed, and a round commits whole or not at all.

TRL does not call ``resume()`` when a sync raises, so the server would stay paused (any other
client's generation requests would wait): here a failed round reads the rest of the iterator
(TRL's other ranks gather each tensor with it and would otherwise wait in that collective),
resumes the server and raises; vLLM keeps the weights it had. TRL then stops training; a caller
that catches the error and syncs again gets a new rendezvous and a whole round.

The first round holds the iterator's tensors until it is sent: it learns their names, dtypes
and shapes from them (under FSDP2 that is a whole copy of the model on the main process, where
TRL's own NCCL client streams). Later rounds stream them, a bucket at a time, as the iterator
yields; if TRL's tensors ever change, that round fails naming the tensor.

TRL's stable ``GRPOTrainer`` has no such seam. In ``vllm_mode="server"`` its ``VLLMClient`` syncs
through NCCL and refuses any device but CUDA; in ``vllm_mode="colocate"`` (vLLM inside the trainer
process) it calls the model's ``load_weights`` once per parameter, with no check before it writes and
nothing whole about it. :func:`use_in_grpo_trainer` replaces what each mode syncs through, until TRL
has a seam there.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import wtransfer
from wtransfer.engines import StreamSource
from wtransfer_vllm.client import LLMClient

logger = logging.getLogger("wtransfer_vllm")


class WTransferWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over a wtransfer trainer.

    ``vllm_client`` is TRL's ``trl.experimental.async_grpo.vllm_client.VLLMClient`` (or anything
    with its methods); ``backend`` is the engine ``vllm serve`` was started with; ``init_info``
    adds wtransfer trainer settings (``timeout_s``, ``bucket_bytes``, ...; ``world_size`` is the
    server's workers plus one, asked from the server); ``options`` are ``create_trainer``'s
    (``checksums``, ``dtype``, ...)."""

    def __init__(self, vllm_client: Any, backend: str = "shm", *, init_info: dict[str, Any] | None = None,
                 **options: Any) -> None:
        self.vllm_client = vllm_client
        self.backend = backend
        self.init_info = dict(init_info or {})
        self.options = options
        self.trainer: Any = None
        self.last_stats: dict[str, Any] | None = None
        """The stats of the last round that landed (``trainer.send_weights()``'s)."""
        self._stream = StreamSource()
        self._failed = False
        self.highest_version = 0
        """The highest version this adapter asked for or a round of it landed under (failed rounds included)."""

    def init_weight_transfer(self) -> None:
        ready = getattr(self.vllm_client, "wait_for_server_ready", None)
        if callable(ready):  # TRL's client waits for /health; with a weight_transfer of its own TRL does not
            ready()
        workers = int(self.vllm_client.get_world_size())
        self.trainer = wtransfer.create_trainer(
            self.backend, client=self.vllm_client, source=self._stream,
            init_info={**self.init_info, "world_size": workers + 1}, **self.options)

    def pause(self) -> None:
        self.vllm_client.pause()

    def send_weights(self, iterator: Iterator[tuple[str, Any]],
                     metadata: list[tuple[str, str, list[int]]] | None = None, *, version: int | None = None) -> None:
        """One round of ``iterator``'s tensors; ``metadata`` (``(name, dtype, shape)`` per tensor, in
        order, as TRL's ``GRPOTrainer`` has it) lets the first round stream too; ``version`` numbers the
        round (``send_weights(version=...)`` of the wtransfer trainer)."""
        if self.trainer is None:
            raise wtransfer.WTransferError("send_weights() before init_weight_transfer()")
        try:
            # fed first, so a failure below still walks TRL's iterator (drain())
            self._stream.feed(iterator, None if metadata is None else
                              [wtransfer.TensorEntry(n, d, tuple(s)) for n, d, s in metadata])
            if self._failed:  # the last round failed: a clean start (the server's workers join again)
                self.trainer.reconnect()
                self._failed = False
            self.highest_version = max(self.highest_version, version or 0)
            self.last_stats = self.trainer.send_weights(version=version)
            self.highest_version = max(self.highest_version, self.last_stats["version"])
        except BaseException as exc:
            self._failed = True
            self._stream.drain()  # TRL's other ranks run a gather per tensor as it advances: let them finish
            resumable = hasattr(self.vllm_client, "resume")  # GRPOTrainer's clients never pause vLLM
            resumed = "the server was resumed" if resumable else "nothing was paused"
            try:  # TRL's async trainer leaves the server paused after a failed sync
                if resumable:
                    self.vllm_client.resume()
            except Exception as resume_error:
                resumed = f"resuming it failed too: {resume_error}"
                logger.warning("wtransfer-vllm: could not resume the server after a failed round: %s", resume_error)
            if isinstance(exc, Exception) and not isinstance(exc, wtransfer.WTransferError):
                # (a client error from the commit call, a read timeout say, may come after vLLM began to commit)
                raise wtransfer.WTransferError(
                    f"the weight sync failed ({resumed}): {type(exc).__name__}: {exc}. vLLM holds its previous "
                    f"version, or this round's where its commit had begun, or says it is torn; its weight version "
                    f"(GET /weight_info) says which") from exc
            raise
        finally:
            self._stream.drain()

    def resume(self) -> None:
        self.vllm_client.resume()

    def destroy(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None


def _grpo_server(trl_client: Any, timeout_s: float) -> Any:
    """The server as :class:`WTransferWeightTransfer` drives it, for TRL's GRPO ``VLLMClient``: vLLM's
    own HTTP weight-sync client, with the world size TRL's client asks the server for."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    server = HTTPVLLMWeightSyncClient(trl_client.base_url, timeout=timeout_s)
    server.get_world_size = trl_client.get_world_size
    return server


class _ColocatedLLM(LLMClient):
    """The trainer's own in-process ``LLM`` as :class:`WTransferWeightTransfer` drives it: one worker."""

    def get_world_size(self) -> int:
        return 1


_GRPO_TRAINERS: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()
"""Each colocated ``VLLMGeneration`` of a ``GRPOTrainer``, with that trainer (both held weakly)."""


def _check_colocate(generation: Any) -> None:
    if generation.tensor_parallel_size != 1:
        raise wtransfer.WTransferError(
            f"wtransfer_vllm.trl: colocate mode with vllm_tensor_parallel_size={generation.tensor_parallel_size} is "
            "not supported (each trainer rank would hold a shard of one vLLM); use 1, or vllm_mode='server'")


def _use_in_colocate(backend: str, init_info: dict[str, Any] | None, options: dict[str, Any]) -> None:
    """``vllm_mode="colocate"``: TRL builds ``LLM(...)`` in ``VLLMGeneration._init_vllm`` and syncs in
    ``VLLMGeneration.sync_weights``; the first gets ``weight_transfer_config`` (unless TRL's caller
    set one), the second becomes a round, numbered by the trainer's step."""
    from trl.generation import vllm_generation
    from trl.trainer.grpo_trainer import GRPOTrainer

    base = getattr(vllm_generation.LLM, "_wtransfer_trl", vllm_generation.LLM)  # a second call replaces the first

    class ColocatedLLM(base):  # type: ignore[misc, valid-type]
        _wtransfer_trl = base

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("weight_transfer_config", {"backend": backend})
            super().__init__(*args, **kwargs)

    vllm_generation.LLM = ColocatedLLM
    trl_sync = getattr(vllm_generation.VLLMGeneration.sync_weights, "_wtransfer_trl",
                       vllm_generation.VLLMGeneration.sync_weights)

    def sync_weights(self: Any) -> None:
        if self.mode != "colocate":
            return trl_sync(self)
        _check_colocate(self)
        if self.enable_sleep_mode:  # as TRL does: the weights' memory must be mapped before a load
            vllm_generation.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        transfer = getattr(self, "_wtransfer", None)
        if transfer is None:
            transfer = WTransferWeightTransfer(_ColocatedLLM(self.llm), backend, init_info=init_info, **options)
            transfer.init_weight_transfer()
            self._wtransfer = transfer
            atexit.register(transfer.destroy)
        if self._weight_metadata is None:  # TRL's own first walk, as its server mode does
            self._weight_metadata = [(name, str(param.dtype).removeprefix("torch."), list(param.shape))
                                     for name, param in self._iter_named_params()]
        trainer = _GRPO_TRAINERS.get(self)
        trainer = trainer and trainer()
        version = None if trainer is None else trainer.state.global_step + 1
        if version is not None and version <= transfer.highest_version:
            version = None  # a second sync at this step (a retry, a re-push after sleep): the next free number
        transfer.send_weights(self._iter_named_params(), self._weight_metadata, version=version)

    sync_weights._wtransfer_trl = trl_sync  # type: ignore[attr-defined]
    vllm_generation.VLLMGeneration.sync_weights = sync_weights

    trl_init = getattr(GRPOTrainer.__init__, "_wtransfer_trl", GRPOTrainer.__init__)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        trl_init(self, *args, **kwargs)
        generation = getattr(self, "vllm_generation", None)
        if generation is not None and generation.mode == "colocate":
            _check_colocate(generation)
            _GRPO_TRAINERS[generation] = weakref.ref(self)  # its rounds are numbered by this trainer's step

    __init__._wtransfer_trl = trl_init  # type: ignore[attr-defined]
    GRPOTrainer.__init__ = __init__


def use_in_grpo_trainer(backend: str = "shm", *, init_info: dict[str, Any] | None = None, **options: Any) -> None:
    """Make TRL 1.16's ``GRPOTrainer`` sync through ``backend``, in ``vllm_mode="server"`` and in
    ``"colocate"``; call it before the trainer is built.

    Server mode: the trainer's ``trl.generation.vllm_client.VLLMClient`` opens its NCCL group in
    ``init_communicator`` (while the trainer is built), sends every parameter in
    ``update_named_params(metadata, iterator)`` and closes in ``close_communicator``; those three are
    replaced on the class by a :class:`WTransferWeightTransfer` round (``init_info`` and ``options``
    are its). Everything else (generation, ``reset_prefix_cache``) stays TRL's. The class is shared
    by TRL's other server-mode trainers; only ``GRPOTrainer``'s calls are served (online DPO's
    ``update_named_param`` inside ``weight_update()`` is not). HTTP calls wait ``timeout_s`` (from
    ``init_info``, default 300 s) plus a minute.

    Colocate mode: TRL's in-process ``LLM`` is built with ``weight_transfer_config={"backend":
    backend}`` and each ``sync_weights()`` is one round into it (``shm`` is the natural backend
    there), numbered by the trainer's ``global_step`` plus one: vLLM's weight version then says how
    many optimizer steps the weights it generates with have been through (version 1: none); a second
    sync at the same step (a retry, a re-push after sleep) takes the next free number. A failed round
    leaves vLLM's weights as they were and raises; TRL then stops training.
    ``vllm_tensor_parallel_size`` must be 1. The patch is TRL's ``VLLMGeneration``'s, so TRL's other
    trainers that generate through it in colocate mode (``RLOOTrainer``, ...) sync through ``backend``
    too, numbered past every label in use; only ``GRPOTrainer`` is tested.
    """
    from trl.generation.vllm_client import VLLMClient

    _use_in_colocate(backend, init_info, options)

    def init_communicator(self: Any, device: Any = 0) -> None:
        server = _grpo_server(self, float((init_info or {}).get("timeout_s", 300.0)) + 60.0)
        self.communicator = WTransferWeightTransfer(server, backend, init_info=init_info, **options)
        self.communicator.init_weight_transfer()
        atexit.register(self.close_communicator)

    def update_named_params(self: Any, metadata: list[tuple[str, str, list[int]]],
                            named_params: Iterator[tuple[str, Any]]) -> None:
        self.communicator.send_weights(named_params, metadata)

    def close_communicator(self: Any) -> None:
        if self.communicator is not None:
            self.communicator.destroy()
            self.communicator = None

    VLLMClient.init_communicator = init_communicator
    VLLMClient.update_named_params = update_named_params
    VLLMClient.close_communicator = close_communicator

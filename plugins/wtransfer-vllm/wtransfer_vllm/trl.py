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

TRL's stable ``GRPOTrainer`` (``vllm_mode="server"``) has no such seam: its ``VLLMClient`` syncs
through NCCL and refuses any device but CUDA. :func:`use_in_grpo_trainer` replaces the three
methods it syncs through, until TRL has a seam there.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Iterator
from typing import Any

import wtransfer

logger = logging.getLogger("wtransfer_vllm")


class _TrainerStream(wtransfer.WeightSource):
    """One round's ``(name, tensor)`` iterator, described by the tensors the last round carried."""

    def __init__(self) -> None:
        self.entries: list[wtransfer.TensorEntry] | None = None
        self.tensors: Iterator[tuple[str, Any]] = iter(())

    def metadata(self) -> list[wtransfer.TensorEntry]:
        assert self.entries is not None
        return list(self.entries)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self.tensors


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
        self._stream = _TrainerStream()
        self._failed = False

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
                     metadata: list[tuple[str, str, list[int]]] | None = None) -> None:
        """One round of ``iterator``'s tensors; ``metadata`` (``(name, dtype, shape)`` per tensor, in
        order, as TRL's ``GRPOTrainer`` has it) lets the first round stream too."""
        if self.trainer is None:
            raise wtransfer.WTransferError("send_weights() before init_weight_transfer()")
        try:
            if self._failed:  # the last round failed: a clean start (the server's workers join again)
                self.trainer.reconnect()
                self._failed = False
            if metadata is not None:
                self._stream.entries = [wtransfer.TensorEntry(n, d, tuple(s)) for n, d, s in metadata]
            if self._stream.entries is None:  # the first round: learn what the trainer sends
                held = list(iterator)
                self._stream.entries = [wtransfer.TensorEntry(n, wtransfer.dtype_name(t.dtype), tuple(t.shape))
                                        for n, t in held]
                iterator = iter(held)
            self._stream.tensors = iter(iterator)
            self.last_stats = self.trainer.send_weights()
        except BaseException as exc:
            self._failed = True
            try:  # TRL's other ranks run a gather per tensor as this iterator advances: let them finish
                for _ in iterator:
                    pass
            except Exception:
                pass  # the iterator itself failed: nothing more to walk
            resumable = hasattr(self.vllm_client, "resume")  # GRPOTrainer's client never pauses the server
            resumed = "it was resumed" if resumable else "it was not paused"
            try:  # TRL's async trainer leaves the server paused after a failed sync
                if resumable:
                    self.vllm_client.resume()
            except Exception as resume_error:
                resumed = f"resuming it failed too: {resume_error}"
                logger.warning("wtransfer-vllm: could not resume the server after a failed round: %s", resume_error)
            if isinstance(exc, Exception) and not isinstance(exc, wtransfer.WTransferError):
                raise wtransfer.WTransferError(
                    f"the weight sync failed and the server kept its previous weights ({resumed}): "
                    f"{type(exc).__name__}: {exc}") from exc
            raise
        finally:
            self._stream.tensors = iter(())

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


def use_in_grpo_trainer(backend: str = "shm", *, init_info: dict[str, Any] | None = None, **options: Any) -> None:
    """Make TRL 1.16's ``GRPOTrainer`` (``vllm_mode="server"``) sync through ``backend``; call it before
    the trainer is built.

    The trainer's ``trl.generation.vllm_client.VLLMClient`` opens its NCCL group in
    ``init_communicator`` (while the trainer is built), sends every parameter in
    ``update_named_params(metadata, iterator)`` and closes in ``close_communicator``; those three are
    replaced on the class by a :class:`WTransferWeightTransfer` round (``init_info`` and ``options``
    are its). Everything else (generation, ``reset_prefix_cache``) stays TRL's. The class is shared
    by TRL's other server-mode trainers; only ``GRPOTrainer``'s calls are served (online DPO's
    ``update_named_param`` inside ``weight_update()`` is not). HTTP calls wait ``timeout_s`` (from
    ``init_info``, default 300 s) plus a minute.
    """
    from trl.generation.vllm_client import VLLMClient

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

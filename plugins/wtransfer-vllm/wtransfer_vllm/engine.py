"""vLLM's worker-side ``WeightTransferEngine``, wrapping any wtransfer engine.

vLLM creates ``engine_cls(config, vllm_config, device, model)``; which wtransfer engine
to wrap is the class's ``wtransfer_backend``. One small subclass per registered name is
made on demand by this module's ``__getattr__`` (vLLM's lazy loader calls
``getattr(module, name)``), so registration imports nothing but this module.

A round, as vLLM's worker drives it::

    start_weight_update()   -> the wtransfer engine's start (nothing touches the model)
    update_weights(dict)    -> the wtransfer engine receives the whole round into staging,
                               then the staged checkpoint is loaded through
                               model.load_weights inside vLLM's layerwise reload
    finish_weight_update()  -> the wtransfer engine counts the round (weight_version + 1)

vLLM's own checkpoint-format engines open the layerwise reload in ``start`` and close it
in ``finish``. Here it is opened and closed around the load, after the round arrived
whole: a trainer that dies mid-round leaves the model untouched and serving.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, ClassVar

import wtransfer
from vllm.distributed.weight_transfer.base import WeightTransferEngine as VLLMWeightTransferEngine

from wtransfer_vllm.adapters import adapter_classes
from wtransfer_vllm.checkpoint import checkpoint_tensors
from wtransfer_vllm.staging import StagingLoader

# Under vLLM's logger tree, so the per-round line shows in vLLM's own log output.
logger = logging.getLogger("vllm.wtransfer_vllm")


class WTransferEngineAdapter(VLLMWeightTransferEngine):
    """A vLLM weight-transfer engine backed by the wtransfer engine ``wtransfer_backend``."""

    wtransfer_backend: ClassVar[str] = ""
    init_info_cls = dict  # parse_* delegate to the wtransfer engine, which owns the wire format
    update_info_cls = dict

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        parallel = vllm_config.parallel_config
        self.inner = wtransfer.WeightTransferEngineFactory.create_engine(
            wtransfer.WeightTransferConfig(backend=self.wtransfer_backend),
            wtransfer.ParallelConfig(
                rank=parallel.rank,
                world_size=parallel.world_size,
                data_parallel_index=getattr(parallel, "data_parallel_index", 0),
            ),
        )
        self._loaders: dict[int, StagingLoader] = {}

    # -- the wire format belongs to the wtransfer engine --------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        return self.inner.parse_init_info(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        info = self.inner.parse_update_info(update_dict)
        if not getattr(info, "is_checkpoint_format", True):
            raise ValueError(
                f"{self.wtransfer_backend} in vLLM loads checkpoint-format weights only "
                f"(create the trainer with is_checkpoint_format=True, the default)"
            )
        return info

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    # -- life cycle ---------------------------------------------------------------------
    def init_transfer_engine(self, init_info: Any) -> None:
        self.inner.init_transfer_engine(init_info)
        self._loader().reserve()  # off the first round's critical path

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def receive_weights(self, update_info: Any) -> None:
        loader = self._loader()
        started = time.perf_counter()
        self.inner.receive_weights(update_info, loader)  # validated, then the whole round staged
        received = time.perf_counter()
        load_into_model(self.model, self.model_config, loader.staged())
        logger.info(
            "wtransfer-vllm round: %s received %.1f MB in %.3f s, loaded into the model in %.3f s",
            self.wtransfer_backend, loader.staged_bytes / 1e6, received - started, time.perf_counter() - received,
        )

    def finish_weight_update(self) -> None:
        self.inner.finish_weight_update()

    def shutdown(self) -> None:
        self.inner.shutdown()
        for loader in self._loaders.values():
            loader.release()

    def _loader(self) -> StagingLoader:
        # One per target model (vLLM may retarget a round at a speculative draft model).
        key = id(self.model)
        if key not in self._loaders:
            self._loaders[key] = StagingLoader(
                checkpoint_tensors(self.model_config), wtransfer.dtype_name(self.model_config.dtype), self.device
            )
        return self._loaders[key]


def load_into_model(model: Any, model_config: Any, weights: list[tuple[str, Any]]) -> None:
    """Checkpoint-format weights into a vLLM model, the way vLLM's own reload does it.

    ``initialize_layerwise_reload`` puts each layer back in checkpoint form and defers its
    processing; ``model.load_weights`` maps the names (fusing q/k/v, gate/up); each layer is
    processed (on CPU: re-packed for the GEMM kernels) once complete and copied into the
    tensors vLLM computes with; ``finalize_layerwise_reload`` closes it.
    """
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:  # pragma: no cover - older vLLM
        disable_mtp_completeness_check = contextlib.nullcontext

    initialize_layerwise_reload(model)
    try:
        with disable_mtp_completeness_check():
            model.load_weights(iter(weights))
    finally:
        finalize_layerwise_reload(model, model_config)
    refresh_tied_layers(model)


def refresh_tied_layers(model: Any) -> list[str]:
    """Re-run the weight processing of layers that share their weight with an earlier layer.

    vLLM's layerwise reload processes a layer when its own weights arrive. A tied LM head
    receives none (its weight *is* the embedding's, and the checkpoint has no copy), so what
    its processing built from the weight stays as it was: on CPUs where vLLM's GEMM uses
    oneDNN (AVX-512 hosts), a packed copy of the old embedding, and the logits would come
    from the old weights while everything else moved on. Only unquantized methods are
    re-run (their processing rebuilds from the weight and is idempotent). Returns the names.
    """
    first_holder: dict[int, str] = {}
    refreshed: list[str] = []
    for name, module in model.named_modules():
        weight = getattr(module, "_parameters", {}).get("weight")
        method = getattr(module, "quant_method", None)
        if weight is None or weight.is_meta or method is None:
            continue
        key = weight.data_ptr()
        if key not in first_holder:
            first_holder[key] = name
        elif type(method).__name__.startswith("Unquantized") and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
            refreshed.append(name)
    return refreshed


__getattr__ = adapter_classes(WTransferEngineAdapter, __name__)

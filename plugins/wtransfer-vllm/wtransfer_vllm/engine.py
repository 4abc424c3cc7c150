"""vLLM's worker-side ``WeightTransferEngine``, wrapping any wtransfer engine.

vLLM creates ``engine_cls(config, vllm_config, device, model)``; which wtransfer engine
to wrap is the class's ``wtransfer_backend``. One small subclass per registered name is
made on demand by this module's ``__getattr__`` (vLLM's lazy loader calls
``getattr(module, name)``), so registration imports nothing but this module.

A round, as vLLM's worker drives it::

    start_weight_update()   -> the wtransfer engine's start (nothing touches the model)
    update_weights(dict)    -> the wtransfer engine receives the whole round into the node's
                               host staging copy (one per node, shared by its TP workers)
    finish_weight_update()  -> called on every worker once all of them have the round whole:
                               the staged checkpoint is loaded through model.load_weights,
                               directly where vLLM's kernels read the weights it writes
                               (wtransfer_vllm.direct_load), else inside vLLM's layerwise
                               reload, and the round counts

vLLM's own checkpoint-format engines open the layerwise reload in ``start`` and close it
in ``finish``. Here it is opened and closed around the load, at commit: a trainer that dies
mid-round, or before every TP worker received it, leaves every worker's model untouched and
serving. Staging is wtransfer's (host memory, never the GPU); the loader below needs the
whole round at once, so rounds are staged even when the trainer asks for ``streaming``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, ClassVar

import wtransfer
from vllm.distributed.weight_transfer.base import WeightTransferEngine as VLLMWeightTransferEngine

from wtransfer_vllm.adapters import adapter_classes
from wtransfer_vllm.checkpoint import check_round, checkpoint_tensors
from wtransfer_vllm.direct_load import DirectLoad
from wtransfer_vllm.model_check import dry_run_round
from wtransfer_vllm.probe import TOLERANCE as PROBE_TOLERANCE
from wtransfer_vllm.probe import CommitProbe
from wtransfer_vllm.probe import enabled as probe_enabled
from wtransfer_vllm.vllm_internals import (disable_mtp_completeness_check, layer_quant_method,
                                           layers_left_as_they_were, reprocess_layer_weights)
from wtransfer_vllm.worker_rpc import report_failures_as_replies

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
        self.inner.served_dtypes = served_dtypes(vllm_config.model_config)
        self._tp_size = parallel.tensor_parallel_size
        # pipeline stages and expert ranks hold part of the names: another's is not unknown
        self._names_span_workers = parallel.pipeline_parallel_size > 1 or bool(getattr(parallel, "enable_expert_parallel", False))
        self._loaders: dict[int, VllmModelLoader] = {}
        self._receiving_round: str | None = None
        self.committed_round: str | None = None
        """Names the weights the model holds, for the KV namespace and the prefix-cache salt: the round's content
        (:func:`round_identity`) where it says, else the engine's content identity (chained through partial and
        delta rounds, so two model states never share it). None while torn."""
        report_failures_as_replies(lambda engine: isinstance(engine, WTransferEngineAdapter))

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
    def weight_version(self) -> int | None:
        return self.inner.weight_version

    @property
    def weights_torn(self) -> bool:
        return self.inner.weights_torn

    # -- life cycle ---------------------------------------------------------------------
    def init_transfer_engine(self, init_info: Any) -> None:
        self.inner.init_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def receive_weights(self, update_info: Any) -> None:
        started = time.perf_counter()
        self._receiving_round = None
        from wtransfer.engines.wire import Manifest  # here: looking the class up imports no engine module

        manifest = getattr(update_info, "parsed", None)
        delta = isinstance(manifest, Manifest) and manifest.delta is not None
        partial = isinstance(manifest, Manifest) and manifest.partial
        # a delta=True or partial=True trainer's round: keep what its next round applies to or leaves out
        self._loader().keep(delta or partial)
        self.inner.receive_weights(update_info, self._loader())  # validated, then staged whole on the node
        manifest = getattr(update_info, "parsed", None)  # again: receiving adds the verified checksums
        if isinstance(manifest, Manifest):
            # a delta round's weights depend on its base: never "whole"
            self._receiving_round = round_identity(manifest, not delta and self._loader().round_whole)
        logger.info("wtransfer-vllm round: %s received and staged in %.3f s",
                    self.wtransfer_backend, time.perf_counter() - started)

    def finish_weight_update(self) -> None:
        self.committed_round, received = None, self._receiving_round
        self.inner.finish_weight_update()  # every worker has the round: load it from staging
        state = self.inner.weights_identity
        self.committed_round = received or (f"state:{state}" if state is not None else None)
        self._receiving_round = None

    def shutdown(self) -> None:
        self.inner.shutdown()

    def _loader(self) -> VllmModelLoader:
        # One per target model (vLLM may retarget a round at a speculative draft model).
        key = id(self.model)
        if key not in self._loaders:
            self._loaders[key] = VllmModelLoader(self.model, self.model_config, self._tp_size, self._names_span_workers)
        return self._loaders[key]


def served_dtypes(model_config: Any) -> Any:
    """What the trainer casts floating tensors to: vLLM's model dtype, but a checkpoint tensor stored
    in another floating dtype (a bf16 checkpoint's fp32 router bias, which vLLM keeps in fp32) in
    that one, so nothing loses precision it had at start-up."""
    model_dtype = wtransfer.dtype_name(model_config.dtype)
    stored = checkpoint_tensors(model_config) or {}
    return wtransfer.served_dtypes(model_dtype, {name: t.dtype for name, t in stored.items() if t.dtype != model_dtype})


def round_identity(manifest: Any, whole: bool) -> str | None:
    """``"weights:<digest>"`` when the round carries every checkpoint tensor (``whole``) with per-tensor
    checksums: the weights are then its content (names, dtypes, shapes, checksums), whatever the model held
    before, and two trainers sending the same weights name them the same. None otherwise: what the model holds
    then depends on what it held before, and the engine's content identity names it."""
    import hashlib
    import json

    if not whole or manifest.checksums is None:
        return None
    named = {"entries": [[e.name, e.dtype, list(e.shape)] for e in manifest.entries],
             "checksums": list(manifest.checksums)}
    return f"weights:{hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()}"


class VllmModelLoader:
    """The ``load_weights`` a wtransfer engine commits through: the whole round, at once.

    ``validate_manifest`` refuses (before any byte moves) a round vLLM cannot load: names,
    shapes and dtypes against the checkpoint vLLM loaded, or, where vLLM started without a local
    safetensors checkpoint (a dummy load, ``.bin`` weights), against what its model's own
    ``load_weights`` accepts (:mod:`wtransfer_vllm.model_check`). ``whole_round`` tells wtransfer that
    the round must be staged and handed over in one call, because vLLM's layerwise reload
    keeps the tensors it is given until each layer is complete.
    """

    whole_round = True
    delta_ready = True
    """Delta rounds (``create_trainer(..., delta=True)``) and partial rounds (``partial=True``): handed the
    tensors a round carries, this loader keeps a committed copy of every checkpoint tensor and loads the round
    with every other tensor from that copy: through vLLM's layerwise reload, each layer's processing (fused
    q/k/v, re-packing) then sees the whole layer (a layer given only some of its tensors would be processed from
    unset memory). A round that loads directly (nothing derived from the weights) loads only its own tensors
    while every load into this model since the copy was filled succeeded: the others are then, where vLLM reads
    them, what the copy holds. After a failed load the next round loads whole. The loader tracks this itself, per
    model: a round into another model (a speculative draft model) cannot vouch for this one."""

    def __init__(self, model: Any, model_config: Any, tp_size: int = 1, names_span_workers: bool = False) -> None:
        self.model = model
        self.model_config = model_config
        self.tp_size = tp_size
        self.names_span_workers = names_span_workers
        self.expected = checkpoint_tensors(model_config)
        """The checkpoint's names, dtypes and shapes; None without a local safetensors checkpoint."""
        self.model_dtype = wtransfer.dtype_name(model_config.dtype)
        self.round_whole = False
        """Whether the last round validated carries every tensor the model loads (no kept copy used)."""
        self._keep_base = False  # keep a host copy of the committed checkpoint (see keep())
        self._kept_in_place = False
        """Whether vLLM reads, for every tensor of the committed copy, the copy's values: every load since the copy
        was filled succeeded (set by this loader alone, so no other model's round can set it)."""
        self.last_load = ""
        """How the last round was loaded, as the log says it (for whoever checks which path ran)."""
        self._committed: dict[str, Any] = {}
        self.direct = DirectLoad(model)

    def keep(self, delta: bool) -> None:
        """Keep the committed copy while a delta=True or partial=True trainer sends (from its first round on);
        any other round frees it once it has loaded (a round refused or never loaded leaves it as it was)."""
        self._keep_base = delta

    def covers(self, manifest: Any) -> bool:
        """Whether the round carries every checkpoint tensor (without a local checkpoint: whether the model's own
        ``load_weights`` took it with nothing kept, as ``validate_manifest`` found just before). A worker holding
        other weights than the round's base (torn, restarted) may then take it: it reloads nothing from before."""
        if self.expected is not None:
            return {e.name for e in manifest.entries} >= set(self.expected)
        return self.round_whole

    def destination(self, name: str) -> Any:
        """The committed copy of checkpoint tensor ``name`` (what a delta round applies to), or None."""
        return self._committed.get(name)

    def validate_manifest(self, manifest: Any) -> None:
        entries = [(e.name, e.dtype, tuple(e.shape)) for e in manifest.entries]
        # a partial round's absent tensors are reloaded from the committed copy: it must hold them
        kept = set(self._committed) if getattr(manifest, "partial", False) else None
        names = {name for name, _, _ in entries}
        if self.expected is not None:
            problems = check_round(entries, self.expected, self.model_dtype, kept)
            self.round_whole = not problems and names == set(self.expected)
        else:  # no checkpoint to read: ask the model, the kept tensors completing a partial round
            completing = [(name, wtransfer.dtype_name(t.dtype), tuple(t.shape)) for name, t in self._committed.items()
                          if kept is not None and name not in names]
            problems = dry_run_round(self.model, entries + completing, self.model_dtype, self.tp_size,
                                     self.names_span_workers)
            self.round_whole = not problems and not completing
        if problems:
            raise wtransfer.ManifestMismatchError.listing(
                f"update manifest (version {manifest.version}) cannot be loaded into this vLLM model",
                [(cause, name) for cause, name, _ in problems], [todo for _, _, todo in problems])

    def __call__(self, weights: list[tuple[str, Any]]) -> None:
        started = time.perf_counter()
        arrived = {name for name, _ in weights}
        kept = [(name, tensor) for name, tensor in self._committed.items() if name not in arrived] if self._keep_base else []
        in_place, self._kept_in_place, self.last_load = self._kept_in_place, False, ""  # until this load succeeds
        how = load_into_model(self.model, self.model_config, weights, self.direct, kept, in_place)
        if not self._keep_base:  # a round of another trainer: nothing of the copy is needed any more
            self._committed.clear()
        else:  # only once vLLM holds the round: a failed load leaves the copy as it was
            for name, tensor in weights:
                held = self._committed.get(name)
                if held is not None and held.shape == tensor.shape and held.dtype == tensor.dtype:
                    held.copy_(tensor)
                else:
                    self._committed[name] = tensor.detach().to("cpu", copy=True)
            self._kept_in_place = True
        self.last_load = how
        logger.info("wtransfer-vllm round: %.1f MB loaded into the model in %.3f s (%s)",
                    sum(t.numel() * t.element_size() for _, t in weights) / 1e6, time.perf_counter() - started, how)


def load_into_model(model: Any, model_config: Any, weights: list[tuple[str, Any]], direct: DirectLoad,
                    kept: list[tuple[str, Any]], kept_in_place: bool) -> str:
    """Checkpoint-format weights into a vLLM model; returns how (``direct load``, with how many kept tensors it
    left in place, or ``layerwise reload``).
    ``kept``: the committed copy of every tensor a partial or delta round leaves out, loaded with the round
    unless ``kept_in_place`` (they are already where vLLM reads them) and the load is direct.

    Where ``direct`` finds that vLLM's kernels read the very weights ``model.load_weights`` writes
    (:mod:`wtransfer_vllm.direct_load`), that call is the whole load. Otherwise
    ``initialize_layerwise_reload`` puts each layer back in checkpoint form and defers its
    processing; ``model.load_weights`` maps the names (fusing q/k/v, gate/up); each layer is
    processed (on CPU: re-packed for the GEMM kernels) once complete and copied into the
    tensors vLLM computes with; ``finalize_layerwise_reload`` closes it. Then the commit probe
    (:mod:`wtransfer_vllm.probe`) checks that every linear layer and LM head computes with the
    round's weights, and raises naming the layers that do not.
    """
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    refusal = direct.refusal()
    if refusal is None:
        if direct.check_seconds:
            logger.info("wtransfer-vllm: every layer's kernel reads the weight load_weights writes (tested in "
                        "%.3f s): rounds load directly, without vLLM's layerwise reload", direct.check_seconds)
        with disable_mtp_completeness_check():
            model.load_weights(iter(weights if kept_in_place else weights + kept))
        return f"direct load, {len(kept)} kept tensors left in place" if kept_in_place and kept else "direct load"
    if direct.check_seconds:
        logger.info("wtransfer-vllm: rounds go through vLLM's layerwise reload: %s", refusal)
    direct.forget()  # the reload's processing may rebind what layers compute with
    probe = CommitProbe(model) if probe_enabled() else None
    with probe or contextlib.nullcontext(), layers_left_as_they_were(model) as left:
        initialize_layerwise_reload(model)
        try:
            with disable_mtp_completeness_check():
                model.load_weights(iter(weights + kept))
        finally:
            finalize_layerwise_reload(model, model_config)
        refresh_tied_layers(model)
    if left:
        logger.debug("wtransfer-vllm round: %d layer(s) received no weight and keep theirs (classes: %s)", len(left),
                     ", ".join(sorted(set(left))))
    if probe is not None:
        report = probe.check()  # raises, naming the layers, if vLLM would compute with anything else
        logger.info("wtransfer-vllm round: %d layer(s) compute with the round's weights (probe: %.3f s to "
                    "capture, %.3f s to check; worst relative error %.1e, tolerance %.0e)%s", report["layers"],
                    report["capture_s"], report["check_s"], report["worst_passing_error"], PROBE_TOLERANCE,
                    f"; not checked (no weight to compare): {', '.join(report['unchecked'])}"
                    if report["unchecked"] else "")
    return "layerwise reload"


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
        method = layer_quant_method(module)
        if weight is None or weight.is_meta or method is None:
            continue
        key = weight.data_ptr()
        if key not in first_holder:
            first_holder[key] = name
        elif type(method).__name__.startswith("Unquantized") and reprocess_layer_weights(method, module):
            refreshed.append(name)
    return refreshed


__getattr__ = adapter_classes(WTransferEngineAdapter, __name__)

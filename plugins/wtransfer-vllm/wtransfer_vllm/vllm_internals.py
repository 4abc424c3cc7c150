"""Every place the bridge reaches into vLLM beyond its public API, in one module.

The bridge otherwise uses what vLLM offers plugins: the ``vllm.general_plugins`` entry point,
``WeightTransferEngineFactory.register_engine`` / ``WeightTransferTrainerFactory.register_engine``
/ ``KVConnectorFactory.register_connector``, the base classes it subclasses
(``WeightTransferEngine``, ``TrainerWeightTransferEngine``, ``KVConnectorBase_V1``), the config
objects and the arguments of those interfaces, ``vllm.LLM``'s methods, and the exported
``vllm.model_executor.model_loader.reload`` functions that vLLM's own weight-transfer engines use.

What that does not reach is done here, by small named functions, each saying which vLLM
internal it touches and why the public API does not suffice. :data:`INTERNALS` lists every one
of them (the vLLM object's import path, the attribute, what it is used for); the test
``tests/test_vllm_internals.py`` imports each in a real vLLM and fails by name
(``WeightTransferEngineFactory._registry``) when a vLLM release renames, removes or reshapes it,
and another test fails when any other module of the bridge reaches into vLLM privately.

Nothing here imports vLLM at module level: the functions take the vLLM objects (or import them
when called), so ``import wtransfer_vllm.vllm_internals`` works without vLLM.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

# Under vLLM's logger tree, like the rest of the bridge (wtransfer_vllm.engine).
logger = logging.getLogger("vllm.wtransfer_vllm")

WRAPPED = "_wtransfer_wrapped"
"""Marks a function this bridge put in place of a vLLM one, so a second install is a no-op."""


class Internal(NamedTuple):
    """One vLLM internal the bridge relies on."""

    path: str
    """Dotted import path of the vLLM object (a class) that has the attribute; for ``function``,
    of the vLLM module that has it."""
    attribute: str
    use: str
    """What the bridge uses it for."""
    kind: str
    """What it must be: ``dict`` (a class attribute holding a dict), ``classmethod``, ``method``
    (a function on the class), ``instance`` (an attribute vLLM's ``__init__`` sets on instances),
    or ``function`` (a function of the module ``path``)."""
    params: tuple[str, ...] = ()
    """For callables: the leading parameters (after ``self``/``cls``; for ``function``, from the
    first) the bridge passes, in order."""

    @property
    def name(self) -> str:
        """``Class.attribute``: how a failure names it."""
        return f"{self.path.rsplit('.', 1)[1]}.{self.attribute}"


_WT_FACTORY = "vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory"
_KV_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory"
_ENGINE_CORE = "vllm.v1.engine.core.EngineCore"
_WORKER = "vllm.v1.worker.gpu_worker.Worker"
_LINEAR_METHOD = "vllm.model_executor.layers.linear.UnquantizedLinearMethod"
_EMBEDDING_METHOD = "vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod"
_MTP_VALIDATION = "vllm.model_executor.model_loader.mtp_validation"
_RELOAD = "vllm.model_executor.model_loader.reload"

INTERNALS: tuple[Internal, ...] = (
    # -- registration (wtransfer_vllm.registration) ------------------------------------------
    Internal(_WT_FACTORY, "_registry", "the names already registered: bare names vLLM has are skipped, and the "
             "unknown-backend error lists them", "dict"),
    Internal(_KV_FACTORY, "_registry", "the connector names already registered: bare names vLLM has are skipped, "
             "and the unknown-connector error lists them", "dict"),
    Internal(_WT_FACTORY, "create_engine", "wrapped: an unknown backend name raises an error listing wtransfer's "
             "names with a did-you-mean", "classmethod", ("config", "vllm_config", "device", "model")),
    Internal(_KV_FACTORY, "get_connector_class", "wrapped: an unknown connector name raises an error listing "
             "wtransfer's names with a did-you-mean", "classmethod", ("kv_transfer_config",)),
    # -- the engine core's side of a round (wtransfer_vllm.engine_core) -----------------------
    Internal(_ENGINE_CORE, "collective_rpc", "wrapped: workers' failures raised once all replied; caches reset "
             "after a wtransfer round commits", "method", ("method", "timeout", "args", "kwargs")),
    Internal(_ENGINE_CORE, "vllm_config", "the weight-transfer backend in use, and whether the model is multimodal",
             "instance"),
    Internal(_ENGINE_CORE, "scheduler", "the KV connector and the running requests after a commit", "instance"),
    Internal(_ENGINE_CORE, "reset_prefix_cache", "drop KV computed with the old weights after a commit", "method",
             ("reset_running_requests", "reset_connector")),
    Internal(_ENGINE_CORE, "reset_encoder_cache", "drop a multimodal model's encoder cache after a commit", "method"),
    Internal("vllm.v1.core.sched.interface.SchedulerInterface", "get_kv_connector", "the scheduler's KV connector, "
             "told which weights a commit delivered", "method"),
    Internal("vllm.v1.core.sched.scheduler.Scheduler", "running", "how many running requests a commit preempts "
             "(logged)", "instance"),
    Internal(_ENGINE_CORE, "set_weight_version", "the trainer's version set at the commit itself, so every token "
             "vLLM labels with it was computed by those weights", "method", ("weight_version",)),
    Internal(_ENGINE_CORE, "add_request", "wrapped: while a failed commit left the model torn, a new request is "
             "refused with an error instead of being answered by a mix of two versions", "method",
             ("request", "request_wave")),
    Internal("vllm.v1.core.sched.scheduler.Scheduler", "finish_requests", "the requests running when a commit "
             "tore the model, ended with an error", "method", ("request_ids", "finished_status")),
    Internal("vllm.v1.engine.core.EngineCoreProc", "output_queue", "where the refusals go to the request's "
             "client", "instance"),
    Internal("vllm.v1.engine.EngineCoreOutput", "stop_reason", "a refusal's reason, carried to the request's "
             "output", "instance"),
    Internal("vllm.v1.engine.EngineCoreOutputs", "finished_requests", "a refused request, finished", "instance"),
    Internal("vllm.v1.engine.FinishReason", "ERROR", "what a refused request finishes with", "instance"),
    Internal("vllm.v1.request.RequestStatus", "FINISHED_ERROR", "the status of a running request ended by a torn "
             "commit", "instance"),
    Internal("vllm.v1.request.Request", "cache_salt", "salted with the weights a request is computed with, so its "
             "prefix-cache blocks never match a request at other weights", "instance"),
    Internal("vllm.v1.request.Request", "block_hashes", "recomputed once the salt changed", "instance"),
    Internal("vllm.v1.request.Request", "update_block_hashes", "recomputes them", "method"),
    Internal("vllm.v1.core.sched.scheduler.Scheduler", "waiting", "the requests a commit salts again (those "
             "with no computed token: Request.num_computed_tokens, which KV connectors read too)", "instance"),
    Internal("vllm.v1.core.sched.interface.SchedulerInterface", "set_pause_state", "in_flight='drain': new "
             "requests queue while the running ones finish, as vLLM's pause_generation(mode='wait') does",
             "method", ("pause_state",)),
    Internal("vllm.v1.core.sched.interface.PauseState", "PAUSED_NEW", "the pause state of a drain", "instance"),
    Internal("vllm.v1.core.sched.interface.SchedulerInterface", "pause_state", "no drain while generation is "
             "paused already (nothing runs; the caller's pause is left as it is)", "instance"),
    Internal(_ENGINE_CORE, "_idle_state_callbacks", "a drained commit runs when the engine core process is "
             "idle, as vLLM's pause_generation(mode='wait') completes", "instance"),
    Internal(_ENGINE_CORE, "step_fn", "wrapped during a drain, to commit at its timeout with requests still "
             "running", "instance"),
    # -- the workers' side (wtransfer_vllm.worker_rpc) ----------------------------------------
    *(Internal(_WORKER, method, "wrapped: a wtransfer engine's failure is returned as a reply, not raised, so every "
               "worker replies", "method") for method in
      ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")),
    Internal(_WORKER, "_weight_update_active", "ended (set False) after a failed commit or an abandoned round, as "
             "vLLM's update_weights does on failure", "instance"),
    Internal(_WORKER, "weight_transfer_engine", "whether the worker's engine is a wtransfer one; its update "
             "target reset with the session", "instance"),
    Internal(_WORKER, "rank", "names the worker whose round failed", "instance"),
    Internal("vllm.distributed.weight_transfer.base.WeightTransferEngine", "reset_weight_update_target",
             "called when a session is ended, as vLLM's worker does", "method"),
    # -- the trainer side (wtransfer_vllm.trainer) --------------------------------------------
    Internal("vllm.distributed.weight_transfer.base.ModuleSource", "_module", "the module of vLLM's ModuleSource, "
             "sent by wtransfer's own ModuleSource (sharded ranks write their own shards)", "instance"),
    # -- the commit probe and tied layers (wtransfer_vllm.probe, wtransfer_vllm.engine) --------
    Internal("vllm.model_executor.layers.linear.LinearBase", "quant_method", "the linear layers' weight processing "
             "and forward kernel (probed; tied heads re-processed)", "instance"),
    Internal("vllm.model_executor.layers.vocab_parallel_embedding.VocabParallelEmbedding", "quant_method",
             "the embedding / LM head's weight processing and forward kernel (probed; tied heads re-processed)",
             "instance"),
    Internal(_LINEAR_METHOD, "process_weights_after_loading", "wrapped per instance during a commit: the probe "
             "sees each layer's weight as loaded, before processing (the probe matches this class by name); "
             "re-run on tied layers after a commit", "method", ("layer",)),
    Internal(_EMBEDDING_METHOD, "process_weights_after_loading", "wrapped per instance during a commit: the probe "
             "sees each layer's weight as loaded, before processing (the probe matches this class by name); "
             "re-run on a tied LM head after a commit", "method", ("layer",)),
    # -- whether a plain load_weights is the whole commit (wtransfer_vllm.direct_load) ----------
    Internal("vllm.model_executor.layers.attention.attention.Attention", "process_weights_after_loading",
             "an attention layer's own post-load step: a layer with one that holds parameters may derive state "
             "from them, and then every round goes through the layerwise reload", "method", ("act_dtype",)),
    # -- the commit's load (wtransfer_vllm.engine) ----------------------------------------------
    Internal(_MTP_VALIDATION, "disable_mtp_completeness_check", "around model.load_weights at a commit and in a "
             "round's dry run, as vLLM's own weight-transfer engines do: a round's load must not be refused as an "
             "incomplete MTP checkpoint",
             "function", ()),
    # -- a round checked against vLLM's own model (wtransfer_vllm.model_check) -----------------
    Internal(f"{_RELOAD}.layerwise", "get_layerwise_info", "each layer's checkpoint-form metadata, recorded when vLLM "
             "built the model: the dry run that checks a round without a local checkpoint", "function", ("layer",)),
    Internal(f"{_RELOAD}.meta", "restore_layer_on_meta", "puts a layer in checkpoint form on the meta device for the "
             "dry run, as vLLM's layerwise reload does first", "function", ("layer", "info")),
    Internal("vllm.model_executor.model_loader.weight_utils", "default_weight_loader", "the loader the dry run "
             "counts for a parameter that has none of its own", "function", ("param", "loaded_weight")),
    Internal(f"{_RELOAD}.utils", "get_tensor_load_numel", "how many of a parameter's elements a checkpoint fills "
             "(padding excluded)", "function", ("tensor",)),
)
"""Every vLLM internal the bridge relies on (see :class:`Internal`)."""


# ============================================================== registries of vLLM's factories
def registered_names(factory: Any) -> set[str]:
    """The names registered in one of vLLM's factories.

    Touches ``WeightTransferEngineFactory._registry`` / ``KVConnectorFactory._registry`` (read
    only). vLLM has no public listing of registered names; the bridge reads them to skip bare
    names vLLM already has (registering one would raise, which the caller handles too).
    """
    return set(getattr(factory, "_registry", {}) or {})


def registry(factory: Any) -> Mapping[str, Any] | None:
    """The factory's registry (name -> class loader) for reading, or None where it has no dict.

    Touches ``WeightTransferEngineFactory._registry`` / ``KVConnectorFactory._registry`` (read
    only), from inside the wrapped lookups: whether a name is known, and which names to list.
    """
    known = getattr(factory, "_registry", None)
    return known if isinstance(known, dict) else None


def wrap_factory_method(factory: Any, method: str, wrapper_for: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace the classmethod ``factory.method`` by ``classmethod(wrapper_for(original))``, once.

    ``original`` is the underlying function (call it as ``original(cls, config, ...)``). Touches
    ``WeightTransferEngineFactory.create_engine`` and ``KVConnectorFactory.get_connector_class``:
    vLLM's own unknown-name error lists only its dict's keys, and has no hook to extend it, so the
    bridge puts its own error (wtransfer's names, a did-you-mean) in front of the lookup.
    Returns False when the method was wrapped already.
    """
    original = getattr(factory, method).__func__
    if getattr(original, WRAPPED, False):
        return False
    wrapped = wrapper_for(original)
    setattr(wrapped, WRAPPED, True)
    setattr(factory, method, classmethod(wrapped))
    return True


def check_before_engine_config(check: Callable[[Any], None]) -> bool:
    """Run ``check(engine_args)`` first in ``EngineArgs.create_engine_config``, once per process.

    Touches ``vllm.engine.arg_utils.EngineArgs.create_engine_config``: ``LLM(...)`` and ``vllm serve``
    build the engine's config there, in the user's process, before any engine core or worker starts,
    while vLLM checks a weight-transfer backend's name only when a worker creates its engine, where
    the error ends up inside a worker's traceback under "Engine core initialization failed". Returns
    False when the method was wrapped already.
    """
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, WRAPPED, False):
        return False

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        check(self)
        return original(self, *args, **kwargs)

    setattr(create_engine_config, WRAPPED, True)
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    return True


# ============================================================== the engine core
def hook_engine_core_rpc(wrapper_for: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``EngineCore.collective_rpc`` by ``wrapper_for(original)``, once per process.

    The wrapper is called as ``(self, method, timeout, args, kwargs)`` and calls
    ``original(self, method, timeout, args, kwargs)``. Touches ``vllm.v1.engine.core.EngineCore``:
    every client's ``finish_weight_update`` (offline ``LLM``, ``vllm serve``, Ray, vLLM's trainer
    factory) reaches the workers through this one method, and vLLM has no hook after a weight
    update where the workers' replies can be checked and the caches reset. Returns True when the
    wrap is in place (whether put there now or before).
    """
    return _hook_engine_core("collective_rpc", wrapper_for)


def hook_engine_core_add_request(wrapper_for: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``EngineCore.add_request`` by ``wrapper_for(original)``, once per process.

    The wrapper is called as ``(self, request, request_wave)``. Touches ``EngineCore.add_request``:
    every request, from any client, enters the scheduler there, on the engine core's thread (the
    one the commit runs on), and vLLM has no admission hook a plugin can use.
    """
    return _hook_engine_core("add_request", wrapper_for)


def _hook_engine_core(name: str, wrapper_for: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    from vllm.v1.engine.core import EngineCore

    original = getattr(EngineCore, name)
    if getattr(original, WRAPPED, False):
        return True
    wrapped = wrapper_for(original)
    setattr(wrapped, WRAPPED, True)
    setattr(EngineCore, name, wrapped)
    return True


def set_engine_weight_version(engine_core: Any, version: str | None) -> None:
    """``EngineCore.set_weight_version``: the label vLLM attaches to every step's outputs.

    Touches an internal method: ``LLM.finish_weight_update(version)`` sets the same label, but as
    a second call after the commit returned, so a step may run between them and label tokens the
    new weights computed with the old version. Set here, on the engine core's thread, in the
    commit itself. ``None`` while the model is torn (vLLM then reports no version).
    """
    engine_core.set_weight_version(version)


def end_requests_with_error(engine_core: Any, request_ids: list[Any] | None, reason: str) -> int:
    """End the engine core's requests (``None``: every one it holds) with an error output saying
    ``reason``; returns how many.

    Touches ``Scheduler.finish_requests`` (``RequestStatus.FINISHED_ERROR``), and
    :func:`send_errors`. vLLM ends requests this way itself on a retryable internal error; no
    public API ends a request with a reason.
    """
    from vllm.v1.request import RequestStatus

    ended = engine_core.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
    send_errors(engine_core, [(r.request_id, r.client_index) for r in ended], reason)
    return len(ended)


def send_errors(engine_core: Any, requests: list[tuple[str, int]], reason: str) -> bool:
    """Tell each request's client (``(request_id, client_index)``) it finished with an error, the
    reason in ``stop_reason``. False where the engine core runs in the client's process (no output
    queue): the caller raises instead.

    Touches ``EngineCoreProc.output_queue``, ``EngineCoreOutputs`` / ``EngineCoreOutput`` and
    ``FinishReason.ERROR``: how vLLM's engine core answers a request it will not run (its
    multimodal cache-miss path does the same).
    """
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    queue = getattr(engine_core, "output_queue", None)
    if queue is None:
        return False
    by_client: dict[int, list[str]] = {}
    for request_id, client_index in requests:
        by_client.setdefault(client_index, []).append(request_id)
    for client_index, ids in by_client.items():
        outputs = [EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, stop_reason=reason)
                   for request_id in ids]
        queue.put_nowait((client_index, EngineCoreOutputs(finished_requests=set(ids), outputs=outputs)))
    return True


def engine_core_config(engine_core: Any) -> Any:
    """The engine core's ``VllmConfig``.

    Touches ``EngineCore.vllm_config``, an attribute of an internal class: the wrapped
    ``collective_rpc`` runs on the engine core, where no public API hands out the config.
    """
    return engine_core.vllm_config


def engine_core_kv_connector(engine_core: Any) -> Any | None:
    """The scheduler-side KV connector of the engine core, or None.

    Touches ``EngineCore.scheduler`` and ``SchedulerInterface.get_kv_connector``: the connector
    instance that will key blocks after the reset lives there, and vLLM hands it out nowhere else.
    """
    scheduler = engine_core.scheduler
    return scheduler.get_kv_connector() if hasattr(scheduler, "get_kv_connector") else None


def engine_core_running_requests(engine_core: Any) -> int:
    """How many requests the engine core's scheduler is running (for the log line).

    Touches ``EngineCore.scheduler`` and ``Scheduler.running``; vLLM exposes no count of running
    requests to code on the engine core.
    """
    return len(getattr(engine_core.scheduler, "running", ()))


def reset_prefix_cache(engine_core: Any) -> bool:
    """``EngineCore.reset_prefix_cache(reset_running_requests=True, reset_connector=True)``.

    Touches ``EngineCore.reset_prefix_cache``: the public ``LLM.reset_prefix_cache`` is a client
    call into this same engine core, which cannot be made from inside it (the bridge runs here,
    between two steps, right after the commit). ``reset_running_requests`` preempts running
    requests (their KV recomputed with the new weights); without it vLLM skips the reset while
    any request runs. Returns vLLM's answer (False: not reset).
    """
    return bool(engine_core.reset_prefix_cache(reset_running_requests=True, reset_connector=True))


def reset_encoder_cache(engine_core: Any) -> None:
    """``EngineCore.reset_encoder_cache()``: same reason as :func:`reset_prefix_cache`."""
    engine_core.reset_encoder_cache()


# ============================================================== the workers
def hook_worker_methods(names: Iterable[str], wrapper_for: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace each ``Worker.<name>`` by ``wrapper_for(name, original)``, once per process.

    Touches ``vllm.v1.worker.gpu_worker.Worker`` (vLLM-CPU's ``CPUWorker`` inherits it): with
    several workers vLLM's executor raises on the first failed reply and leaves the others'
    replies queued, so every later RPC reads the wrong reply; the worker method must *return* a
    wtransfer engine's failure instead, and vLLM offers no hook around these methods.
    """
    from vllm.v1.worker.gpu_worker import Worker

    for name in names:
        original = getattr(Worker, name)
        if not getattr(original, WRAPPED, False):
            wrapped = wrapper_for(name, original)
            setattr(wrapped, WRAPPED, True)
            setattr(Worker, name, wrapped)


def worker_weight_transfer_engine(worker: Any) -> Any | None:
    """The worker's weight-transfer engine, or None before it has one.

    Touches ``Worker.weight_transfer_engine``, an attribute of an internal class, read inside
    the wrapped worker methods (which engine the round is for).
    """
    return getattr(worker, "weight_transfer_engine", None)


def worker_rank(worker: Any) -> int | None:
    """The worker's global rank, named in its failure reply. Touches ``WorkerBase.rank``."""
    return getattr(worker, "rank", None)


def end_weight_update_session(worker: Any) -> None:
    """End the worker's update session, if one is open, the way vLLM ends a failed one.

    Touches ``Worker._weight_update_active`` (vLLM's private session flag) and calls
    ``WeightTransferEngine.reset_weight_update_target``, as vLLM's own ``update_weights`` does
    when it fails. vLLM has no public way to abandon a session: a failed
    ``finish_weight_update`` (or a round another TP worker failed) would leave it open, and every
    later ``start_weight_update`` would fail with "a weight update is already active".
    """
    if getattr(worker, "_weight_update_active", False):
        worker._weight_update_active = False
        worker.weight_transfer_engine.reset_weight_update_target()


# ============================================================== the trainer side
def module_source_module(source: Any) -> Any | None:
    """The module of a vLLM ``ModuleSource``; None for any other source (or another vLLM's).

    Touches ``vllm.distributed.weight_transfer.base.ModuleSource._module``: vLLM's
    ``ModuleSource`` has no public accessor for its module, and sending the module itself
    (wtransfer's ``ModuleSource``) lets the ranks of a sharded trainer write their own shards
    instead of gathering on rank 0. Where the attribute is gone, the source is wrapped as is.
    """
    cls = type(source)
    if (cls.__name__, cls.__module__) != ("ModuleSource", "vllm.distributed.weight_transfer.base"):
        return None
    module = getattr(source, "_module", None)
    return module if callable(getattr(module, "named_parameters", None)) else None


# ============================================================== layers' quantization methods
def layer_quant_method(layer: Any) -> Any | None:
    """The layer's vLLM quantization method (``quant_method``), or None.

    Touches ``LinearBase.quant_method`` / ``VocabParallelEmbedding.quant_method``: where vLLM's
    layers keep what processes their weights after loading and computes their forward; no
    public API names it. The probe checks what it computes; tied heads are re-processed through it.
    """
    return getattr(layer, "quant_method", None)


def reprocess_layer_weights(method: Any, layer: Any) -> bool:
    """Run ``method.process_weights_after_loading(layer)`` again, where the method has one;
    returns whether it ran.

    Touches ``UnquantizedLinearMethod.process_weights_after_loading`` /
    ``UnquantizedEmbeddingMethod.process_weights_after_loading``: vLLM's layerwise reload runs a
    layer's processing when that layer's own weights arrive, and a tied LM head receives none,
    so what it built from the (shared) weight would stay stale; vLLM has no public call to
    re-process one layer (see ``wtransfer_vllm.engine.refresh_tied_layers``).
    """
    process = getattr(method, "process_weights_after_loading", None)
    if process is None:
        return False
    process(layer)
    return True


def processing_beyond_plain_kernels(model: Any, plain_methods: Iterable[str]) -> list[str]:
    """What vLLM's post-load processing would derive for ``model`` beyond the kernels of its layers whose
    quantization method is one of ``plain_methods`` (class names): each layer with another method, each layer
    with a post-load step of its own that holds parameters (an MLA attention layer's absorbed matrices),
    and the model's own post-load hook. An empty list: nothing but those layers' kernels can hold state
    derived from a weight (an attention layer without parameters, as vLLM's ``Attention`` over an
    unquantized KV cache, derives none).

    Touches ``quant_method`` and ``process_weights_after_loading`` on the model and its layers: what vLLM's
    ``model_loader.utils.process_weights_after_loading`` runs after every load; vLLM has no public way to
    ask what that processing derives.
    """
    plain = set(plain_methods)
    found = []
    if callable(getattr(model, "process_weights_after_loading", None)):
        found.append(f"the model's own process_weights_after_loading ({type(model).__name__})")
    for name, module in model.named_modules():
        method = layer_quant_method(module)
        if method is not None and type(method).__name__ not in plain:
            found.append(f"{name} ({type(method).__name__})")
        elif (method is None and callable(getattr(module, "process_weights_after_loading", None))
              and any(True for _ in module.parameters())):
            found.append(f"{name} ({type(module).__name__}'s own post-load step)")
    return found


def patch_process_weights_after_loading(method: Any, replacement_for: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Put ``replacement_for(current)`` as ``method.process_weights_after_loading`` on this one
    instance; returns the function that puts back what was there.

    ``current`` is the bound method (or a function an earlier patch left on the instance), called
    as ``current(layer, ...)``. Touches ``UnquantizedLinearMethod.process_weights_after_loading`` /
    ``UnquantizedEmbeddingMethod.process_weights_after_loading``: vLLM's layerwise reload calls it
    once a layer's weights are all loaded, and it is the only point where the weight is seen in
    checkpoint form (fused, sharded) before processing repacks it; vLLM has no hook there.
    """
    attribute = "process_weights_after_loading"
    had_own = attribute in vars(method)
    previous = getattr(method, attribute)
    setattr(method, attribute, replacement_for(previous))

    def restore() -> None:
        if had_own:
            setattr(method, attribute, previous)
        else:
            delattr(method, attribute)

    return restore



# ============================================================== the commit's load
_mtp_fallback_warned = False


def disable_mtp_completeness_check() -> contextlib.AbstractContextManager[None]:
    """vLLM's ``disable_mtp_completeness_check()`` context, or a no-op where this vLLM has none.

    Touches ``vllm.model_executor.model_loader.mtp_validation.disable_mtp_completeness_check``,
    a function of vLLM's model loader that no public API exports. vLLM's MTP (multi-token
    prediction) models' ``load_weights`` raise when the weights they are given lack the MTP
    layers, a check meant for a checkpoint loaded at start-up; vLLM's own weight-transfer
    engines (nccl, ipc) turn it off around their ``model.load_weights``, and so does the bridge
    around a commit's. Where the import fails (an older vLLM, or one that moved or renamed it),
    the load runs without it, and a warning says so once per process; the test
    ``test_vllm_still_has[mtp_validation.disable_mtp_completeness_check]`` fails by name.
    """
    global _mtp_fallback_warned
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check as disable
    except ImportError as exc:
        if not _mtp_fallback_warned:
            _mtp_fallback_warned = True
            logger.warning("wtransfer-vllm: this vLLM has no %s.disable_mtp_completeness_check (%s); weights are "
                           "loaded with vLLM's MTP completeness check on", _MTP_VALIDATION, exc)
        return contextlib.nullcontext()
    return disable()


# ============================================================== the dry run of a round
@contextlib.contextmanager
def layers_in_checkpoint_form(model: Any) -> Iterator[list[tuple[str, Any]]]:
    """Every layer of ``model`` in checkpoint form with every tensor on the meta device, for the
    duration; each layer's own tensors are put back afterwards, whatever happened.

    Touches ``reload.layerwise.get_layerwise_info`` and ``reload.meta.restore_layer_on_meta``: the
    checkpoint-form metadata vLLM recorded when it built the model, put back as vLLM's layerwise
    reload does first. The tensors it leaves live (biases, layers it skips) are replaced by meta
    copies too, and the restored ones by copies of their own, so nothing the dry run calls can
    write the model's memory, and nothing it sets on a tensor reaches vLLM's stored metadata.
    Yields ``(name, layer)`` for every module. The caller must not run the model meanwhile.
    """
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

    def meta_copy(tensor: Any) -> Any:
        copy = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="meta")
        copy.__class__ = tensor.__class__
        copy.__dict__ = dict(tensor.__dict__)
        return copy

    saved: list[tuple[Any, dict[str, Any], dict[str, Any], set[str], dict[str, Any]]] = []
    layers = list(model.named_modules())
    try:
        for _, layer in layers:
            plain = {key: value for key, value in vars(layer).items() if isinstance(value, torch.Tensor)}
            saved.append((layer, dict(layer._parameters), dict(layer._buffers),
                          set(layer._non_persistent_buffers_set), plain))
            restore_layer_on_meta(layer, get_layerwise_info(layer))
            for store in (layer._parameters, layer._buffers):
                for key, tensor in list(store.items()):
                    if tensor is not None:
                        store[key] = meta_copy(tensor)
        yield layers
    finally:
        for layer, parameters, buffers, non_persistent, plain in saved:
            for store, own in ((layer._parameters, parameters), (layer._buffers, buffers)):
                store.clear()
                store.update(own)
            layer._non_persistent_buffers_set = non_persistent
            for key in [k for k, v in vars(layer).items() if isinstance(v, torch.Tensor) and k not in plain]:
                delattr(layer, key)
            for key, value in plain.items():
                object.__setattr__(layer, key, value)


def original_weight_loader(tensor: Any) -> Callable[..., Any]:
    """The weight loader vLLM calls for ``tensor``: its own, or vLLM's ``default_weight_loader``,
    unwrapped from any layerwise-reload wrapper (``online_process_loader``) vLLM left on it, as
    vLLM's reload does itself. Touches ``weight_utils.default_weight_loader`` and that wrapper's
    ``__wrapped__`` chain (what ``reload.layerwise._get_original_loader`` follows)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    loader = getattr(tensor, "weight_loader", None) or default_weight_loader
    while getattr(loader, "__name__", "") == "online_process_loader" and hasattr(loader, "__wrapped__"):
        loader = loader.__wrapped__
    return loader


class _LayersLeftAsTheyWere(logging.Filter):
    """Takes vLLM's per-layer ``"%s: Failed to load weights"`` warnings for the layer classes ``expected`` (counting
    them); a warning naming any other class passes: a layer a round should have filled got nothing."""

    def __init__(self, expected: set[str]) -> None:
        super().__init__()
        self.expected = expected
        self.layers: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights" and record.args and str(record.args[0]) in self.expected:
            self.layers.append(str(record.args[0]))
            return False
        return True


def layers_no_round_fills(model: Any) -> set[str]:
    """Class names of the layers no checkpoint tensor fills: those holding buffers but no parameter of their own (a
    rotary embedding's cache), and those whose every parameter is an earlier layer's (a tied LM head)."""
    seen: set[int] = set()
    classes: set[str] = set()
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if (not own and any(True for _ in module.buffers(recurse=False))) or (own and all(id(p) in seen for p in own)):
            classes.add(type(module).__name__)
        seen.update(id(p) for p in own)
    return classes


@contextlib.contextmanager
def layers_left_as_they_were(model: Any) -> Iterator[list[str]]:
    """Within: vLLM's layerwise reload does not warn of each layer of ``model`` that no round fills (it keeps that
    layer's tensors, :func:`layers_no_round_fills`); the list yielded holds those layers' class names instead.

    vLLM warns for every layer a load gives no tensor, and every round leaves two out by design: a
    rotary embedding's cache is no checkpoint tensor, and a tied LM head gets the embedding's weight
    (refreshed after the load). A warning for a layer of any other class still shows: every load carries
    the whole model (a partial round adds the kept tensors), so such a layer got nothing it should have.
    Touches the logger of ``reload.layerwise`` and its message text; if either changes, vLLM's warnings
    simply show again."""
    quiet = _LayersLeftAsTheyWere(layers_no_round_fills(model))
    layerwise = logging.getLogger(f"{_RELOAD}.layerwise")
    layerwise.addFilter(quiet)
    try:
        yield quiet.layers
    finally:
        layerwise.removeFilter(quiet)


@contextlib.contextmanager
def torchao_reload_off(model: Any) -> Iterator[None]:
    """``model._do_torchao_reload`` off for the duration, as vLLM's ``initialize_layerwise_reload``
    turns it off: a torchao model's ``load_weights`` would otherwise run a real layerwise reload.
    Touches that model attribute (set by vLLM's torchao support only; absent elsewhere)."""
    flag = getattr(model, "_do_torchao_reload", None)
    if flag:
        model._do_torchao_reload = False
    try:
        yield
    finally:
        if flag:
            model._do_torchao_reload = flag


def load_numel(tensor: Any) -> int:
    """How many of a parameter's elements a checkpoint fills (vLLM's ``get_tensor_load_numel``)."""
    from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

    return int(get_tensor_load_numel(tensor))


# ============================================================== requests at a commit
def salt_request(request: Any, salt: str | None) -> None:
    """Key ``request``'s prefix-cache blocks to ``salt`` (the weights it is computed with) on top
    of the salt its client gave it, and recompute its block hashes.

    Touches ``Request.cache_salt``, ``Request.block_hashes`` and ``Request.update_block_hashes``:
    vLLM's prefix cache serves a block to any request whose prefix hashes the same, and the
    salt is the one input of that hash a request carries; a client's ``cache_salt`` cannot name
    weights the client does not know are coming.
    """
    user = request.__dict__.setdefault("_wtransfer_client_salt", request.cache_salt)
    salted = user if salt is None else (f"{user}|{salt}" if user else salt)
    if salted == request.cache_salt:
        return
    request.cache_salt = salted
    request.block_hashes = []
    request.update_block_hashes()


def requests_not_started(engine_core: Any) -> list[Any]:
    """The waiting requests nothing was computed for yet (a preempted one starts again from 0).

    Touches ``Scheduler.waiting`` and ``Request.num_computed_tokens``.
    """
    return [r for r in engine_core.scheduler.waiting if r.num_computed_tokens == 0]


def drain_then(engine_core: Any, commit: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``commit()`` once the requests running now finished, or after ``timeout_s`` with those
    still running; new requests queue meanwhile. Returns a ``concurrent.futures.Future`` of
    ``commit()``'s result (vLLM's engine core answers a utility call when it completes), or None
    where the engine core runs in the caller's process (nothing else steps it) or generation is
    paused already: commit now.

    Touches ``SchedulerInterface.set_pause_state`` (``PauseState.PAUSED_NEW``), the engine core
    process's ``_idle_state_callbacks`` and ``step_fn``: how vLLM's own
    ``pause_generation(mode="wait")`` drains, which a utility call cannot invoke on itself.
    """
    import time
    from concurrent.futures import Future

    from vllm.v1.core.sched.interface import PauseState

    if getattr(engine_core, "output_queue", None) is None or engine_core.scheduler.pause_state != PauseState.UNPAUSED:
        return None  # in the caller's process (only its process runs idle callbacks), or paused: nothing runs
    callbacks = engine_core._idle_state_callbacks
    future: Future[Any] = Future()
    step = engine_core.step_fn
    deadline = time.monotonic() + timeout_s

    def run(_engine: Any = None) -> None:
        if future.done() or future.running():
            return
        future.set_running_or_notify_cancel()
        engine_core.step_fn = step
        if engine_core.scheduler.pause_state == PauseState.PAUSED_NEW:  # a pause asked meanwhile stays
            engine_core.scheduler.set_pause_state(PauseState.UNPAUSED)
        try:
            future.set_result(commit())
        except BaseException as exc:
            future.set_exception(exc)

    def step_until_deadline() -> Any:
        if time.monotonic() >= deadline:
            logger.warning("wtransfer-vllm: %d request(s) still running after the %g s drain: committing; "
                           "their KV is recomputed with the new weights", len(engine_core.scheduler.running),
                           timeout_s)
            run()
        return step()

    engine_core.scheduler.set_pause_state(PauseState.PAUSED_NEW)
    engine_core.step_fn = step_until_deadline
    callbacks.append(run)
    return future

"""The weight-transfer toolkit, upper layer: what an engine author derives from and implements.

Two layers, each a promise of its own (the surface test holds both to their ``__all__``; the
table in docs/plugins.md lists and explains every name):

``wtransfer.engines`` (this module)
    For someone deriving from a built-in or writing a worker/trainer pair: the worker-side base
    and its info classes, the trainer-side base with its extension points, weight sources, and
    the two families to derive from, torch.distributed (:mod:`wtransfer.engines.gloo`, the NCCL
    plugin) and same-host (:mod:`wtransfer.engines.shm`). See ``__all__``.

``wtransfer.engines.wire`` (the lower layer)
    For someone writing a brand-new transport: the wire protocol, the manifest, the packing
    plan and the control channel. See its docstring.

Errors are :mod:`wtransfer`'s (``TransferError``, ``TransferTimeoutError`` ...). The public modules
are these two, :mod:`wtransfer.engines.shm` and :mod:`wtransfer.engines.gloo`. The folders beside them
(``channel``, ``rounds``, ``trainer``, ``worker``, ``torch_distributed``, and ``shm``'s own modules)
show how the toolkit is built; they are private and may change in any release (docs/architecture.md).
"""

from wtransfer._lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {  # module -> the public names it defines
    # worker side
    "wtransfer.engines.worker.base": ("WeightTransferEngine", "WeightTransferInitInfo", "WeightTransferUpdateInfo",
                                      "LoadWeights"),
    "wtransfer.engines.worker.helpers": ("ManifestUpdateInfo", "global_rank", "check_buffer_budget",
                                         "BufferBudgetOptions"),
    "wtransfer.engines.worker.loader": ("module_loader",),
    # trainer side
    "wtransfer.engines.trainer.engine": ("TrainerWeightTransferEngine",),
    "wtransfer.engines.trainer.options": ("TrainerInitOptions",),
    "wtransfer.engines.trainer.client": ("ClientCall", "accepts_weight_version"),
    "wtransfer.engines.trainer.create": ("create_trainer",),
    "wtransfer.engines.rounds.source": ("WeightSource", "ModuleSource", "TensorSource", "StreamSource"),
    # bases to derive from
    "wtransfer.engines.torch_distributed.backend": ("TorchDistributedBackend",),
    "wtransfer.engines.torch_distributed.worker": ("TorchDistributedWeightTransferEngine",),
    "wtransfer.engines.torch_distributed.options": ("TorchDistributedInitInfo", "TorchDistributedOptions",
                                                    "TorchDistributedInitOptions"),
    "wtransfer.engines.torch_distributed.trainer": ("TorchDistributedTrainer",),
    "wtransfer.engines.torch_distributed.sender": ("TorchDistributedSender",),
    "wtransfer.engines.shm": ("SharedMemoryWeightTransferEngine", "SharedMemoryTrainer", "SharedMemoryInitOptions"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

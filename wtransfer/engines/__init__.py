"""The weight-transfer toolkit, upper layer: what an engine author derives from and implements.

Two layers, each a promise of its own (the surface test holds both to these lists):

``wtransfer.engines`` (this module)
    For someone deriving from a built-in or writing a worker/trainer pair.

    Worker side: ``WeightTransferEngine`` (the seed's base class), ``WeightTransferInitInfo``,
    ``WeightTransferUpdateInfo``, ``ManifestUpdateInfo`` (per-round info carrying the manifest),
    ``LoadWeights`` (the loader's type), ``global_rank`` (the seed's rank rule),
    ``BufferBudgetOptions`` / ``check_buffer_budget`` (``max_buffer_bytes``), ``module_loader``,
    ``validate_with_loader``. An engine declares its ``WeightTransferConfig.options`` as ``options_cls``.

    Trainer side: ``TrainerWeightTransferEngine`` with its extension points ``prepare_workers``,
    ``wait_for_workers``, ``send_round``, ``release`` (optionally ``plan``); ``TrainerInitOptions``
    (subclassed as a backend's ``init_options_cls``); ``ClientCall``; ``WeightSource``,
    ``ModuleSource``, ``TensorSource``; ``create_trainer``.

    Bases to derive from: the torch.distributed family (``TorchDistributedBackend``, whose ``device``,
    ``make_process_group``, ``allocate`` ... a new collective backend overrides;
    ``TorchDistributedWeightTransferEngine``, ``TorchDistributedInitInfo``, ``TorchDistributedTrainer``,
    ``TorchDistributedOptions``, ``TorchDistributedInitOptions``, and ``TorchDistributedSender``, which a
    backend's trainer names as ``sender_cls`` via ``class MySender(MyBackend, TorchDistributedSender)``)
    and the same-host family (``SharedMemoryWeightTransferEngine``, ``SharedMemoryTrainer``,
    ``SharedMemoryInitOptions``). The leaves: :mod:`wtransfer.engines.gloo`, :mod:`wtransfer.engines.shm`.

``wtransfer.engines.wire`` (the lower layer)
    For someone writing a brand-new transport: the wire protocol, the manifest, the packing
    plan and the control channel. See its docstring.

Errors are :mod:`wtransfer`'s (``TransferError``, ``TransferTimeoutError`` ...). Names in
``_``-modules are private and may change in any release.
"""

from wtransfer._lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {  # module -> the public names it defines
    # worker side
    "wtransfer.engines._base": ("WeightTransferEngine", "WeightTransferInitInfo", "WeightTransferUpdateInfo",
                                "LoadWeights"),
    "wtransfer.engines._worker": ("ManifestUpdateInfo", "global_rank", "check_buffer_budget", "BufferBudgetOptions"),
    "wtransfer.engines._loader": ("validate_with_loader", "module_loader"),
    # trainer side
    "wtransfer.engines._trainer": ("TrainerWeightTransferEngine", "TrainerInitOptions", "ClientCall", "create_trainer"),
    "wtransfer.engines._source": ("WeightSource", "ModuleSource", "TensorSource"),
    # bases to derive from
    "wtransfer.engines._td_backend": ("TorchDistributedBackend",),
    "wtransfer.engines._td_worker": ("TorchDistributedWeightTransferEngine",),
    "wtransfer.engines._td_options": ("TorchDistributedInitInfo", "TorchDistributedOptions",
                                      "TorchDistributedInitOptions"),
    "wtransfer.engines._td_trainer": ("TorchDistributedTrainer",),
    "wtransfer.engines._td_sender": ("TorchDistributedSender",),
    "wtransfer.engines.shm": ("SharedMemoryWeightTransferEngine", "SharedMemoryTrainer", "SharedMemoryInitOptions"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

"""The weight-transfer toolkit, upper layer: what an engine author derives from and implements.

Two layers, each a promise of its own (the surface test holds both to these lists):

``wtransfer.engines`` (this module)
    For someone deriving from a built-in or writing a worker/trainer pair.

    Worker side: ``WeightTransferEngine`` (the seed's base class), ``WeightTransferInitInfo``,
    ``WeightTransferUpdateInfo``, ``ManifestUpdateInfo`` (per-round info carrying the
    manifest), ``LoadWeights`` (the loader callable's type), ``RoundGuard`` (a mixin:
    ``finish_weight_update`` only after a whole round), ``global_rank`` (the seed's rank
    rule), ``BufferBudgetOptions`` / ``check_buffer_budget`` (``max_buffer_bytes``),
    ``module_loader``, ``validate_with_loader``. An engine declares its
    ``WeightTransferConfig.options`` as ``options_cls`` (see :mod:`wtransfer.options`).

    Trainer side: ``TrainerWeightTransferEngine`` with its extension points
    ``prepare_workers``, ``wait_for_workers``, ``send_round``, ``release`` (and optionally
    ``plan``); ``TrainerInitOptions`` (the ``init_info`` every trainer takes, and its
    defaults: a backend subclasses it as its ``init_options_cls``); ``ClientCall`` (a running
    client call the engine watches); ``WeightSource``, ``ModuleSource``, ``TensorSource``
    (a source's ``metadata()`` returns ``wtransfer.TensorEntry``), ``create_trainer``.

    Bases to derive from: the torch.distributed family (``TorchDistributedBackend``, the
    mixin whose ``device``, ``make_process_group``, ``allocate`` ... a new collective
    backend overrides; ``TorchDistributedWeightTransferEngine`` and its
    ``TorchDistributedInitInfo``, ``TorchDistributedTrainer``,
    ``TorchDistributedOptions``, ``TorchDistributedInitOptions``, and
    ``TorchDistributedSender``: what the other ranks of a sharded trainer run, a backend's
    trainer naming ``class MySender(MyBackend, TorchDistributedSender)`` as its ``sender_cls``
    so that every rank sends its own shards) and the same-host family
    (``SharedMemoryWeightTransferEngine``, ``SharedMemoryTrainer``, ``SharedMemoryInitOptions``).
    A trainer's ``init_options_cls`` extends its base's. The leaves live in their
    own public modules: :mod:`wtransfer.engines.gloo`, :mod:`wtransfer.engines.shm`.

``wtransfer.engines.wire`` (the lower layer)
    For someone writing a brand-new transport: the wire protocol, the manifest, the packing
    plan and the control channel. See its docstring.

Errors are :mod:`wtransfer`'s (``TransferError``, ``TransferTimeoutError`` ...). Names in
``_``-modules are private and may change in any release.
"""

from wtransfer._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    # worker side
    "WeightTransferEngine": "wtransfer.engines._base",
    "WeightTransferInitInfo": "wtransfer.engines._base",
    "WeightTransferUpdateInfo": "wtransfer.engines._base",
    "LoadWeights": "wtransfer.engines._base",
    "ManifestUpdateInfo": "wtransfer.engines._worker",
    "RoundGuard": "wtransfer.engines._worker",
    "global_rank": "wtransfer.engines._worker",
    "check_buffer_budget": "wtransfer.engines._worker",
    "BufferBudgetOptions": "wtransfer.engines._worker",
    "validate_with_loader": "wtransfer.engines._loader",
    "module_loader": "wtransfer.engines._loader",
    # trainer side
    "TrainerWeightTransferEngine": "wtransfer.engines._trainer",
    "TrainerInitOptions": "wtransfer.engines._trainer",
    "ClientCall": "wtransfer.engines._trainer",
    "create_trainer": "wtransfer.engines._trainer",
    "WeightSource": "wtransfer.engines._source",
    "ModuleSource": "wtransfer.engines._source",
    "TensorSource": "wtransfer.engines._source",
    # bases to derive from
    "TorchDistributedBackend": "wtransfer.engines._td_backend",
    "TorchDistributedWeightTransferEngine": "wtransfer.engines._td_worker",
    "TorchDistributedInitInfo": "wtransfer.engines._td_options",
    "TorchDistributedTrainer": "wtransfer.engines._td_trainer",
    "TorchDistributedSender": "wtransfer.engines._td_sender",
    "TorchDistributedOptions": "wtransfer.engines._td_options",
    "TorchDistributedInitOptions": "wtransfer.engines._td_options",
    "SharedMemoryWeightTransferEngine": "wtransfer.engines.shm",
    "SharedMemoryTrainer": "wtransfer.engines.shm",
    "SharedMemoryInitOptions": "wtransfer.engines.shm",
}

# Names this module exported before the toolkit was cut in two: importing one says where it went.
_WIRE = "wtransfer.engines.wire"
_MOVED: dict[str, str] = {
    **dict.fromkeys([
        "PROTOCOL_VERSION", "MIB", "ALIGN", "check_int", "check_timeout", "check_protocol",
        "check_bucket_bytes", "ManifestRejected", "gc_paused", "Manifest", "TensorEntry",
        "build_manifest", "tensor_checksum", "Bucket", "plan_buckets", "Packer", "Unpacker",
        "ControlChannel", "Listener", "connect", "PeerClosedError",
    ], _WIRE),
    "GlooWeightTransferEngine": "wtransfer.engines.gloo",
    "GlooTrainer": "wtransfer.engines.gloo",
    "GlooOptions": "wtransfer.engines.gloo",
    "GlooInitOptions": "wtransfer.engines.gloo",
    "SharedMemoryInitInfo": "wtransfer.engines.shm",
    "WeightTransferEngineFactory": "wtransfer",
    "WeightSyncClient": "wtransfer",
    "NoTrainerSideError": "wtransfer",
    "WeightTransferInitRequest": "wtransfer",
    "WeightTransferUpdateRequest": "wtransfer",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _MOVED)

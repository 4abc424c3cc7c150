"""The weight-transfer toolkit: everything a backend author may import, and nothing else.

Built-in engines are made only of these parts, and so is the NCCL plugin. Names not
listed here live in ``_``-modules and may change in any release.

Worker side
    ``WeightTransferEngine`` (the seed's base class), ``WeightTransferInitInfo``,
    ``WeightTransferUpdateInfo``, ``ManifestUpdateInfo`` (per-round info carrying the
    manifest), ``RoundGuard`` (a mixin: ``finish_weight_update`` only after a whole
    round), ``global_rank`` (the seed's rank rule), ``check_buffer_budget``
    (``max_buffer_bytes``, declared by ``BufferBudgetOptions``), ``validate_with_loader``,
    ``module_loader``. An engine declares its ``WeightTransferConfig.options`` as
    ``options_cls`` (see :mod:`wtransfer.options`).
Trainer side
    ``TrainerWeightTransferEngine`` with its public extension points ``prepare_workers``,
    ``wait_for_workers``, ``send_round``, ``release`` (and optionally ``plan``);
    ``ClientCall`` (a running client call the engine watches); ``WeightSource``,
    ``ModuleSource``, ``TensorSource``, ``create_trainer``; ``TrainerInitOptions`` (the
    ``init_info`` every trainer takes: a backend extends it as its ``init_options_cls``).
Wire protocol (both sides)
    ``PROTOCOL_VERSION``, ``MIB``, ``ALIGN``, ``check_int``, ``check_timeout``,
    ``check_protocol``, ``check_bucket_bytes``, ``ManifestRejected``, ``gc_paused``;
    the manifest (``Manifest``, ``TensorEntry``, ``build_manifest``, ``tensor_checksum``)
    and the packing plan (``Bucket``, ``plan_buckets``, ``Packer``, ``Unpacker``);
    a framed Unix/TCP control channel (``ControlChannel``, ``Listener``, ``connect``).
Backends to derive from
    ``TorchDistributedBackend`` / ``TorchDistributedWeightTransferEngine`` /
    ``TorchDistributedTrainer`` / ``TorchDistributedInitInfo`` / ``TorchDistributedOptions`` /
    ``TorchDistributedInitOptions`` (what gloo and NCCL share: override ``device``,
    ``make_process_group``, ``allocate`` ... on the backend mixin), ``GlooOptions`` /
    ``GlooInitOptions``,
    ``GlooWeightTransferEngine`` / ``GlooTrainer``, ``SharedMemoryWeightTransferEngine`` /
    ``SharedMemoryTrainer`` / ``SharedMemoryInitInfo``.
"""

from wtransfer._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    # worker side
    "WeightTransferEngine": "wtransfer.engines._base",
    "WeightTransferInitInfo": "wtransfer.engines._base",
    "WeightTransferUpdateInfo": "wtransfer.engines._base",
    "WeightTransferInitRequest": "wtransfer.engines._base",
    "WeightTransferUpdateRequest": "wtransfer.engines._base",
    "LoadWeights": "wtransfer.engines._base",
    "ManifestUpdateInfo": "wtransfer.engines._worker",
    "RoundGuard": "wtransfer.engines._worker",
    "global_rank": "wtransfer.engines._worker",
    "check_buffer_budget": "wtransfer.engines._worker",
    "BufferBudgetOptions": "wtransfer.engines._worker",
    "validate_with_loader": "wtransfer.engines._loader",
    "module_loader": "wtransfer.engines._loader",
    "WeightTransferEngineFactory": "wtransfer.engines._factory",
    # trainer side
    "TrainerWeightTransferEngine": "wtransfer.engines._trainer",
    "ClientCall": "wtransfer.engines._trainer",
    "NoTrainerSideError": "wtransfer.engines._trainer",
    "create_trainer": "wtransfer.engines._trainer",
    "TrainerInitOptions": "wtransfer.engines._trainer",
    "WeightSyncClient": "wtransfer.engines._client",
    "WeightSource": "wtransfer.engines._source",
    "ModuleSource": "wtransfer.engines._source",
    "TensorSource": "wtransfer.engines._source",
    # wire protocol
    "PROTOCOL_VERSION": "wtransfer.engines._protocol",
    "MIB": "wtransfer.engines._protocol",
    "ALIGN": "wtransfer.engines._protocol",
    "check_int": "wtransfer.engines._protocol",
    "check_timeout": "wtransfer.engines._protocol",
    "check_protocol": "wtransfer.engines._protocol",
    "check_bucket_bytes": "wtransfer.engines._protocol",
    "ManifestRejected": "wtransfer.engines._protocol",
    "gc_paused": "wtransfer.engines._protocol",
    "Manifest": "wtransfer.engines._manifest",
    "TensorEntry": "wtransfer.engines._manifest",
    "build_manifest": "wtransfer.engines._manifest",
    "tensor_checksum": "wtransfer.engines._manifest",
    "Bucket": "wtransfer.engines._packing",
    "plan_buckets": "wtransfer.engines._packing",
    "Packer": "wtransfer.engines._packing",
    "Unpacker": "wtransfer.engines._packing",
    "ControlChannel": "wtransfer.engines._control",
    "Listener": "wtransfer.engines._control",
    "connect": "wtransfer.engines._control",
    "PeerClosedError": "wtransfer.engines._control",
    # backends to derive from
    "TorchDistributedBackend": "wtransfer.engines._torch_distributed",
    "TorchDistributedInitInfo": "wtransfer.engines._torch_distributed",
    "TorchDistributedWeightTransferEngine": "wtransfer.engines._torch_distributed",
    "TorchDistributedTrainer": "wtransfer.engines._torch_distributed",
    "TorchDistributedOptions": "wtransfer.engines._torch_distributed",
    "TorchDistributedInitOptions": "wtransfer.engines._torch_distributed",
    "GlooOptions": "wtransfer.engines._torch_distributed",
    "GlooInitOptions": "wtransfer.engines._torch_distributed",
    "GlooWeightTransferEngine": "wtransfer.engines.gloo",
    "GlooTrainer": "wtransfer.engines.gloo",
    "SharedMemoryWeightTransferEngine": "wtransfer.engines.shm",
    "SharedMemoryTrainer": "wtransfer.engines.shm",
    "SharedMemoryInitInfo": "wtransfer.engines.shm",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

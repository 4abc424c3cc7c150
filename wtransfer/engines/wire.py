"""The weight-transfer toolkit, lower layer: the parts a brand-new transport is built from.

Use it to write a transport the built-ins do not cover (a new fabric, a new store); to
derive from a built-in or write a worker/trainer pair, :mod:`wtransfer.engines` (the upper
layer) is all you need. The built-in engines and the NCCL plugin are made of these parts:
the wire protocol, the manifest, the packing plan and the control channel (length-framed
JSON and raw bytes over a Unix or TCP socket: nothing is pickled). The names are in
``__all__`` and explained in docs/plugins.md.

This layer changes more often than the upper one; a plugin that uses it should pin
``wtransfer`` to a minor version.
"""

from wtransfer._lazy import lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {  # module -> the public names it defines
    # wire protocol
    "wtransfer.engines.channel.protocol": ("PROTOCOL_VERSION", "MIB", "ALIGN", "check_int", "check_timeout",
                                           "check_protocol", "check_bucket_bytes", "ManifestRejected", "gc_paused"),
    # manifest
    "wtransfer.engines.rounds.manifest": ("Manifest", "TensorEntry", "build_manifest", "tensor_checksum"),
    # packing plan
    "wtransfer.engines.rounds.packing": ("Bucket", "plan_buckets", "Packer", "Unpacker"),
    # control channel
    "wtransfer.engines.channel.control": ("ControlChannel", "Listener", "connect", "PeerClosedError"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

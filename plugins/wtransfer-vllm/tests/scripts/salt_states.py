"""The bridge's name for the weights vLLM holds (the prefix-cache salt, the KV fingerprint) after rounds with
checksums on: whole A, an empty partial round, whole B, an empty partial round again. Prints the names as JSON.

vLLM's adapter runs for real (``WTransferEngineAdapter.receive_weights`` / ``finish_weight_update``) around a
wtransfer engine that delivers tensors by hand and verifies checksums as a transport does; only vLLM's model
loader is replaced by one that keeps the tensors (no model is started).
"""

import dataclasses
import json
import os

import torch
import wtransfer
from wtransfer.engines.wire import Manifest, TensorEntry, build_manifest, tensor_checksum
from wtransfer_vllm.engine import WTransferEngineAdapter


class ByHand(wtransfer.WeightTransferEngine):
    init_info_cls = dict
    update_info_cls = wtransfer.engines.ManifestUpdateInfo
    tensors = {}

    def init_transfer_engine(self, init_info):
        pass

    def receive_weights(self, update_info, load_weights):
        manifest = update_info.parsed
        for entry in manifest.entries:
            load_weights([(entry.name, self.tensors[entry.name])])
        verified = tuple(tensor_checksum(self.tensors[e.name]) for e in manifest.entries)
        update_info.parsed = dataclasses.replace(manifest, checksums=verified)  # as shm and gloo do

    def shutdown(self):
        pass


class KeepingLoader:
    """Stands in for vLLM's model loader: keeps what it is given."""

    round_whole = False
    held = {}

    def keep(self, delta):
        pass

    def validate_manifest(self, manifest):
        self.round_whole = {e.name for e in manifest.entries} == {"a", "b"}

    def covers(self, manifest):
        return self.round_whole

    def __call__(self, weights):
        self.held.update({name: tensor.clone() for name, tensor in weights})


adapter = WTransferEngineAdapter.__new__(WTransferEngineAdapter)
adapter.inner = ByHand(wtransfer.WeightTransferConfig(backend="by-hand"))
adapter.wtransfer_backend = "by-hand"
adapter._receiving_round = adapter.committed_round = None
loader = KeepingLoader()
adapter._loader = lambda: loader
key = os.urandom(6).hex()
names = []
for version, tensors, partial in ((1, {"a": 1.0, "b": 1.0}, False), (2, {}, True),
                                  (3, {"a": 2.0, "b": 2.0}, False), (4, {}, True)):
    ByHand.tensors = {name: torch.full((4,), value) for name, value in tensors.items()}
    entries = [TensorEntry(name, "float32", (4,)) for name in ByHand.tensors]
    plain = build_manifest(entries, version, "xxh3_64", None, None, partial, adapter.inner.weights_identity)
    commit = {"mode": "streaming", "key": key, "timeout_s": 10.0}  # what a trainer's manifest carries
    manifest = Manifest.from_dict({**plain.to_dict(), "commit": commit})
    adapter.start_weight_update()
    adapter.receive_weights(adapter.parse_update_info({"manifest": manifest.to_dict()}))
    adapter.finish_weight_update()
    names.append({"version": adapter.inner.weight_version, "weights": adapter.committed_round,
                  "held": {n: float(t[0]) for n, t in sorted(loader.held.items())}})
print(json.dumps(names))

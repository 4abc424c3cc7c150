"""What a round must look like to load into a vLLM model: the checkpoint's tensors.

vLLM's ``model.load_weights`` takes checkpoint (Hugging Face) names and fuses them itself
(q/k/v into qkv, gate/up into gate_up), so the model's own parameters cannot tell whether a
name will load. The checkpoint vLLM loaded at start-up can: its safetensors headers list
every name, dtype and shape, and reading them costs a few milliseconds (no tensor data).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("wtransfer_vllm")

# safetensors header dtype -> wtransfer manifest dtype name
_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool",
}


@dataclass(frozen=True)
class CheckpointTensor:
    dtype: str
    shape: tuple[int, ...]


def _checkpoint_dir(model: str, revision: str | None) -> Path | None:
    if os.path.isdir(model):
        return Path(model)
    try:  # a hub name vLLM downloaded: its local snapshot, never a new download
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:
        return None


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files that make up the checkpoint, as vLLM picks them.

    With an index (``model.safetensors.index.json``) exactly the files its ``weight_map``
    names. Without one, every ``*.safetensors`` file but Mistral's ``consolidated*`` one when
    others exist: it holds the same weights under other names, and reading both would make
    every round look incomplete.
    """
    import json

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return [folder / name for name in names if (folder / name).is_file()]
    files = sorted(folder.glob("*.safetensors"))
    others = [f for f in files if not f.name.startswith("consolidated")]
    return others or files


def checkpoint_tensors(model_config: Any) -> dict[str, CheckpointTensor] | None:
    """Name -> dtype/shape of every tensor in the checkpoint vLLM loaded; None if unknown
    (no safetensors files found, e.g. a dummy load or a ``.bin`` checkpoint)."""
    import json
    import struct

    folder = _checkpoint_dir(str(model_config.model), getattr(model_config, "revision", None))
    if folder is None:
        return None
    files = checkpoint_files(folder)
    if not files:
        return None
    tensors: dict[str, CheckpointTensor] = {}
    for file in files:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(info["dtype"], info["dtype"].lower())
            tensors[name] = CheckpointTensor(dtype, tuple(info["shape"]))
    return tensors


FINGERPRINT_SAMPLES = 64
"""Evenly spaced 4 KiB windows of each checkpoint file's data that go into its fingerprint."""


def checkpoint_fingerprint(model_config: Any) -> str:
    """A hex digest naming the weights vLLM loaded: KV stored under another never matches.

    It covers the model's name, revision, dtype and quantization, its ``config.json``, and
    for every safetensors file its size, its whole header (names, dtypes, shapes, offsets)
    and 64 windows of 4 KiB spread over its data: fine-tuned weights with the same shapes
    differ there, and a 100 GB checkpoint costs 64 small reads a file, not a full read.
    Without safetensors files (a dummy load, a ``.bin`` checkpoint) only the names and
    config are covered, and a warning says to set ``model_fingerprint`` explicitly.
    """
    import hashlib
    import struct

    digest = hashlib.sha256()
    folder = _update_with_identity(digest, model_config)
    files = checkpoint_files(folder) if folder is not None else []
    for file in files:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            (length,) = struct.unpack("<Q", handle.read(8))
            header = handle.read(length)
            digest.update(file.name.encode() + struct.pack("<QQ", size, length) + header)
            start, span = 8 + length, max(0, size - 8 - length)
            for index in range(FINGERPRINT_SAMPLES):
                handle.seek(start + span * index // FINGERPRINT_SAMPLES)
                digest.update(handle.read(4096))
    if not files:
        logger.warning(
            "wtransfer-vllm: no safetensors checkpoint found for %s; the KV model fingerprint covers its "
            "name and config only. Set kv_connector_extra_config['model_fingerprint'] to name the weights",
            model_config.model,
        )
    return digest.hexdigest()


def model_identity(model_config: Any) -> str:
    """A hex digest of what vLLM serves besides the weights: the model's name, revision, dtype,
    quantization and ``config.json``. Weights delivered whole by a round (every checkpoint
    tensor, with checksums) are named on top of it, whatever was loaded before."""
    import hashlib

    digest = hashlib.sha256()
    _update_with_identity(digest, model_config)
    return digest.hexdigest()


def _update_with_identity(digest: Any, model_config: Any) -> Any:
    """Feed the model's identity and config to ``digest``; returns the checkpoint folder (or None)."""
    import json

    identity = {
        "model": str(model_config.model),
        "revision": getattr(model_config, "revision", None),
        "dtype": str(getattr(model_config, "dtype", "")),
        "quantization": getattr(model_config, "quantization", None),
    }
    digest.update(json.dumps(identity, sort_keys=True).encode())
    folder = _checkpoint_dir(str(model_config.model), getattr(model_config, "revision", None))
    if folder is not None and (folder / "config.json").is_file():
        digest.update((folder / "config.json").read_bytes())
    return folder


Problem = tuple[str, "str | None", str]
"""Why a round cannot load: the cause, the tensor it concerns (None: the round as a whole), what to do."""
CAST_TODO = ("leave create_trainer's dtype= unset: the trainer then casts each tensor to the dtype vLLM's workers "
             "load")
NAMES_TODO = ("send the tensors under the names of the checkpoint vLLM loaded (the Hugging Face model's "
              "named_parameters()), not vLLM's fused ones such as qkv_proj")
SHAPE_TODO = "train the model vLLM serves: load the trainer's model from the same checkpoint or config"


def check_round(
    entries: list[tuple[str, str, tuple[int, ...]]],
    expected: dict[str, CheckpointTensor],
    model_dtype: str,
    kept: set[str] | None = None,
) -> list[Problem]:
    """Every reason the round ``entries`` (name, dtype, shape) cannot load, as (cause, tensor,
    what to do); empty if it can.

    A name must be a checkpoint tensor with the same shape; its dtype must be the
    checkpoint's or the model's (vLLM converts while loading). Every checkpoint tensor
    must be present, in the round or in ``kept`` (the committed copy a partial round is
    completed from): vLLM's layerwise reload processes a layer once all of its weights
    arrived, and a layer missing some would be rebuilt from uninitialised memory.
    """
    problems: list[Problem] = []
    seen: set[str] = set()
    for name, dtype, shape in entries:
        if name in seen:
            problems.append(("sent twice in one round", name, "send each tensor once a round"))
        seen.add(name)
        want = expected.get(name)
        if want is None:
            problems.append(("unknown tensor, not in the checkpoint vLLM loaded", name, NAMES_TODO))
            continue
        if tuple(shape) != want.shape:
            problems.append((f"shape {list(shape)} != checkpoint {list(want.shape)}", name, SHAPE_TODO))
        if dtype not in (want.dtype, model_dtype):
            problems.append((f"dtype {dtype}, neither the checkpoint's {want.dtype} nor the model's {model_dtype}",
                             name, CAST_TODO))
    for name in sorted(set(expected) - seen - (kept or set())):
        if kept is None:
            problems.append(("missing: in the checkpoint, not in the round", name,
                             "send every tensor, or create_trainer(..., partial=True) to keep the ones a round "
                             "leaves out"))
        else:
            problems.append(("missing from a partial=True trainer's first round", name,
                             "make the first round whole: the tensors later rounds leave out are reloaded from "
                             "the copy it leaves"))
    return problems

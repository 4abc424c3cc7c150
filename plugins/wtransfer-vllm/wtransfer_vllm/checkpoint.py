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


def checkpoint_tensors(model_config: Any) -> dict[str, CheckpointTensor] | None:
    """Name -> dtype/shape of every tensor in the checkpoint vLLM loaded; None if unknown
    (no safetensors files found, e.g. a dummy load or a ``.bin`` checkpoint)."""
    import json
    import struct

    folder = _checkpoint_dir(str(model_config.model), getattr(model_config, "revision", None))
    if folder is None:
        return None
    files = sorted(folder.glob("*.safetensors"))
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


def check_round(
    entries: list[tuple[str, str, tuple[int, ...]]],
    expected: dict[str, CheckpointTensor] | None,
    model_dtype: str,
) -> list[str]:
    """Every reason the round ``entries`` (name, dtype, shape) cannot load; empty if it can.

    A name must be a checkpoint tensor with the same shape; its dtype must be the
    checkpoint's or the model's (vLLM converts while loading). Every checkpoint tensor
    must be present: vLLM's layerwise reload processes a layer once all of its weights
    arrived, and a layer missing some would be rebuilt from uninitialised memory.
    """
    problems: list[str] = []
    seen: set[str] = set()
    for name, dtype, shape in entries:
        if name in seen:
            problems.append(f"{name!r} appears twice")
        seen.add(name)
        if expected is None:
            continue
        want = expected.get(name)
        if want is None:
            problems.append(f"unknown tensor {name!r} (not in the checkpoint vLLM loaded)")
            continue
        if tuple(shape) != want.shape:
            problems.append(f"{name!r}: shape {list(shape)} != checkpoint {list(want.shape)}")
        if dtype not in (want.dtype, model_dtype):
            problems.append(f"{name!r}: dtype {dtype} is neither the checkpoint's {want.dtype} nor the model's {model_dtype}")
    if expected is not None:
        missing = sorted(set(expected) - seen)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            problems.append(f"missing {len(missing)} checkpoint tensor(s): {shown}")
    return problems

"""Which checkpoint a round is checked against, as pure functions (no vLLM needed)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wtransfer_vllm.checkpoint import CheckpointTensor, check_round, checkpoint_files


def write_header(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file with only a header (what the checks read)."""
    header = {name: {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]} for name, (dtype, shape) in tensors.items()}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_mistrals_consolidated_file_beside_the_shards_is_not_part_of_the_checkpoint(tmp_path: Path) -> None:
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors"):
        write_header(tmp_path / name, {"w": ("BF16", [2])})
    assert [f.name for f in checkpoint_files(tmp_path)] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_an_index_names_exactly_the_files_of_the_checkpoint(tmp_path: Path) -> None:
    for name in ("a.safetensors", "b.safetensors", "stale.safetensors"):
        write_header(tmp_path / name, {"w": ("BF16", [2])})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "b.safetensors", "y": "a.safetensors"}}))
    assert [f.name for f in checkpoint_files(tmp_path)] == ["a.safetensors", "b.safetensors"]


def test_a_lone_consolidated_checkpoint_is_used(tmp_path: Path) -> None:
    write_header(tmp_path / "consolidated.safetensors", {"w": ("BF16", [2])})
    assert [f.name for f in checkpoint_files(tmp_path)] == ["consolidated.safetensors"]


def test_a_round_is_checked_against_names_shapes_dtypes_and_completeness() -> None:
    expected = {"a": CheckpointTensor("bfloat16", (2, 3)), "b": CheckpointTensor("float32", (4,))}
    assert check_round([("a", "bfloat16", (2, 3)), ("b", "bfloat16", (4,))], expected, "bfloat16") == []
    problems = check_round([("a", "float16", (3, 2)), ("c", "bfloat16", (1,))], expected, "bfloat16")
    starts = ("shape [3, 2] != checkpoint [2, 3]", "dtype float16, ", "unknown tensor, ", "missing: in the checkpoint")
    assert sorted((next(s for s in starts if cause.startswith(s)), name) for cause, name, _ in problems) == sorted(
        zip(starts, "aacb")), problems

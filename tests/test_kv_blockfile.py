"""Block files: real safetensors both ways, atomic writes, and every kind of damage caught before loading."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from wtransfer.connectors._blockfile import (
    BlockFileError,
    BlockLayout,
    block_checksum,
    check_header,
    read_block_file,
    write_block_file,
)

LAYOUT = BlockLayout("ab" * 32, "fp", ("l0", "l1"), 4, 2, 8, "bfloat16")
HASH = "cd" * 32


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _data(seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _read(path: Path, block_hash: str = HASH) -> torch.Tensor:
    out = torch.empty(LAYOUT.shape, dtype=torch.bfloat16)
    read_block_file(str(path), LAYOUT, block_hash, tensor_bytes(out))
    return out


def test_round_trip_and_interop_with_the_safetensors_library(tmp_path: Path) -> None:
    data = _data()
    ours = tmp_path / "ours.safetensors"
    write_block_file(str(ours), LAYOUT, HASH, tensor_bytes(data))
    assert torch.equal(_read(ours), data)
    assert [p.name for p in tmp_path.iterdir()] == ["ours.safetensors"]  # no temporary left behind
    # a file written by safetensors itself, with the same metadata, reads back through our checks
    theirs = tmp_path / "theirs.safetensors"
    save_file({"kv": data}, str(theirs), metadata=LAYOUT.metadata(HASH, block_checksum(tensor_bytes(data))))
    assert torch.equal(_read(theirs), data)


def test_checksum_catches_every_single_bit_flip_and_swapped_words() -> None:
    raw = bytearray(tensor_bytes(_data()))
    reference = block_checksum(memoryview(raw))
    rng = random.Random(1)
    for _ in range(300):
        position, bit = rng.randrange(len(raw)), rng.randrange(8)
        raw[position] ^= 1 << bit
        assert block_checksum(memoryview(raw)) != reference
        raw[position] ^= 1 << bit
    words = np.frombuffer(raw, dtype="<u8").copy()
    words[[3, 40]] = words[[40, 3]]
    assert block_checksum(memoryview(words.tobytes())) != reference
    # zero-padded tail bytes count too
    assert block_checksum(memoryview(b"abc")) != block_checksum(memoryview(b"abd"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[:-1], "truncated or padded"),
        (lambda b: b + b"\0", "truncated or padded"),
        (lambda b: b[:5], "no header"),
        (lambda b: b"\xff" * 8 + b[8:], "header length"),
        (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "checksum mismatch"),
    ],
)
def test_damaged_files_raise_and_leave_the_target_untouched(tmp_path: Path, damage, message: str) -> None:
    path = tmp_path / "block.safetensors"
    write_block_file(str(path), LAYOUT, HASH, tensor_bytes(_data()))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(BlockFileError, match=message):
        _read(path)


def test_a_file_of_another_block_or_layout_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "block.safetensors"
    write_block_file(str(path), LAYOUT, HASH, tensor_bytes(_data()))
    with pytest.raises(BlockFileError, match="block_hash"):
        check_header(str(path), LAYOUT, "ef" * 32)
    other = BlockLayout("ab" * 32, "other-model", ("l0", "l1"), 4, 2, 8, "bfloat16")
    with pytest.raises(BlockFileError, match="model_fingerprint"):
        check_header(str(path), other, HASH)


def test_failed_writes_leave_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="layout needs"):
        write_block_file(str(tmp_path / "x.safetensors"), LAYOUT, HASH, memoryview(b"short"))
    with pytest.raises(FileNotFoundError):
        write_block_file(str(tmp_path / "missing" / "x.safetensors"), LAYOUT, HASH, tensor_bytes(_data()))
    assert list(tmp_path.iterdir()) == []

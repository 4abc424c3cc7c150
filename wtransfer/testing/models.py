"""Small models for weight-transfer tests, importable by spawned workers as ``module:function``.

:func:`matrix_model` holds one parameter per awkward case a transport must get right:
bf16/fp16/fp8/bool/int/complex dtypes, a 0-dim scalar, an empty tensor, a transposed
(non-contiguous) view, a view with a storage offset, and a tensor larger than a bucket.
Values depend on ``seed`` only, so a trainer and its workers build the same layout with
different contents.
"""

from __future__ import annotations

import torch

OVERSIZE_ELEMENTS = 600_000
"""2.4 MB of float32: larger than a 1 MiB bucket, so it must be split across buckets."""


def _values(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-1000, 1000, shape, generator=generator).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=torch.complex64).to(dtype)
    return torch.randn(shape, generator=generator).to(dtype)


def matrix_model(seed: int = 0, variant: str = "default") -> torch.nn.Module:
    """The dtype/shape matrix as a module. ``variant="mismatch"`` changes one shape (for
    manifest-mismatch tests); ``variant="extra"`` adds a parameter the trainer does not have."""
    generator = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()

    def add(name: str, tensor: torch.Tensor) -> None:
        trainable = tensor.dtype.is_floating_point and tensor.dtype.itemsize >= 2
        module.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=trainable))

    add("bf16", _values((64, 48), torch.bfloat16, generator))
    add("fp16", _values((33,), torch.float16, generator))
    add("fp8_e4m3", _values((16, 16), torch.float8_e4m3fn, generator))
    add("fp8_e5m2", _values((7, 5), torch.float8_e5m2, generator))
    add("mask", _values((13,), torch.bool, generator))
    add("ids", _values((9,), torch.int64, generator))
    add("int8", _values((31,), torch.int8, generator))
    add("complex", _values((4, 3), torch.complex64, generator))
    add("scalar", _values((), torch.float32, generator))
    add("empty", _values((0, 8), torch.float32, generator))
    add("transposed", _values((24, 40), torch.float32, generator).t())  # non-contiguous
    add("offset_view", _values((10, 12), torch.float32, generator)[2:, 3:])  # storage offset
    add("oversize", _values((OVERSIZE_ELEMENTS,), torch.float32, generator))
    add("norm", _values((48,), torch.bfloat16, generator))
    if variant == "mismatch":
        module.bf16 = torch.nn.Parameter(_values((64, 47), torch.bfloat16, generator))
    elif variant == "extra":
        add("extra", _values((5,), torch.float32, generator))
    elif variant != "default":
        raise ValueError(f"unknown matrix_model variant {variant!r}")
    return module


class TiedLM(torch.nn.Module):
    """A tiny language model with tied input and output embeddings, as many LLMs have.

    For sharded-trainer tests (FSDP2 shards each block and the root): the output head's
    weight *is* the embedding, so a transport must send it once and a loader must tie it.
    """

    def __init__(self, vocab: int = 512, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(token_ids)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(self.norm(hidden))


def tied_lm(seed: int = 0, vocab: int = 512, hidden: int = 64, layers: int = 2) -> TiedLM:
    """:class:`TiedLM` with weights that depend on ``seed`` only (same on every rank that asks)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TiedLM(vocab, hidden, layers)

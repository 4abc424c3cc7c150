"""Small models for weight-transfer tests, importable by worker processes as ``module:function``.

:func:`matrix_model` holds one parameter per awkward case a transport must get right: bf16/fp16/fp8/bool/int/complex
dtypes, a 0-dim scalar, an empty tensor, a transposed view, a view with a storage offset, and a tensor larger than a
bucket. Values depend on ``seed`` only, so trainer and workers build the same layout with different contents.
"""

from __future__ import annotations

import math
import re
from typing import Any

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


def matrix_model(seed: int = 0, variant: str = "default", device: str = "cpu") -> torch.nn.Module:
    """The dtype/shape matrix as a module. ``variant="mismatch"`` changes one shape; ``variant="extra"`` adds a
    parameter the trainer does not have. ``device="cuda"``: a worker whose model lives on the GPU."""
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
    return module.to(device)


class TiedLM(torch.nn.Module):
    """A tiny language model with tied input and output embeddings, as many LLMs have.

    For sharded-trainer tests: the output head's weight *is* the embedding, so a transport must send it once and a
    loader must tie it."""

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


def tied_lm(seed: int = 0, vocab: int = 512, hidden: int = 64, layers: int = 2, dtype: str = "float32") -> TiedLM:
    """:class:`TiedLM` with weights that depend on ``seed`` only (same on every rank that asks)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TiedLM(vocab, hidden, layers).to(getattr(torch, dtype))


def tiny_llama(seed: int = 0, hidden: int = 128, layers: int = 2, vocab: int = 1024, dtype: str = "bfloat16",
               frozen_embedding: bool = False) -> torch.nn.Module:
    """A real ``transformers`` Llama (built from a config, nothing downloaded), bf16 by default, weights depending on
    ``seed`` only. ``frozen_embedding``: the embedding does not train (as a vision tower or a base under LoRA)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    if frozen_embedding:
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


# -- synthetic decoders, for benchmarks and tests (any size, any dtype) ------------------------------------------------------------------------------------
def decoder_shapes(
    hidden: int, intermediate: int, layers: int, vocab: int, kv_dim: int
) -> list[tuple[str, list[int]]]:
    """Tensor shapes of a Qwen2-style decoder (tied embeddings: the LM head is not sent)."""
    shapes: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", [hidden, hidden]), (p + "self_attn.q_proj.bias", [hidden]),
            (p + "self_attn.k_proj.weight", [kv_dim, hidden]), (p + "self_attn.k_proj.bias", [kv_dim]),
            (p + "self_attn.v_proj.weight", [kv_dim, hidden]), (p + "self_attn.v_proj.bias", [kv_dim]),
            (p + "self_attn.o_proj.weight", [hidden, hidden]),
            (p + "mlp.gate_proj.weight", [intermediate, hidden]), (p + "mlp.up_proj.weight", [intermediate, hidden]),
            (p + "mlp.down_proj.weight", [hidden, intermediate]),
            (p + "input_layernorm.weight", [hidden]), (p + "post_attention_layernorm.weight", [hidden]),
        ]  # fmt: skip
    shapes.append(("model.norm.weight", [hidden]))
    return shapes


def shapes_for_params(params: int) -> list[tuple[str, list[int]]]:
    """A decoder of about ``params`` parameters: Qwen2-0.5B's geometry, scaled by depth."""
    hidden, intermediate, kv_dim = (896, 4864, 128) if params >= 60_000_000 else (256, 1024, 64)
    per_layer = sum(math.prod(s) for _, s in decoder_shapes(hidden, intermediate, 1, 0, kv_dim)) - hidden
    vocab = max(256, min(151_936, int(params * 0.275) // hidden))
    layers = max(1, round((params - vocab * hidden) / per_layer))
    return decoder_shapes(hidden, intermediate, layers, vocab, kv_dim)


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kKmMbB]?)$")


def parse_model(spec: str) -> list[tuple[str, list[int]]]:
    """``0.5B`` / ``100M`` (parameters) or explicit shapes ``4096x4096,896,16x16*100``."""
    match = _SIZE.match(spec.strip())
    if match:
        scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}[match.group(2).lower()]
        return shapes_for_params(int(float(match.group(1)) * scale))
    shapes: list[tuple[str, list[int]]] = []
    for item in spec.split(","):
        item = item.strip()
        shape_text, _, repeat = item.partition("*")
        try:
            shape = [int(d) for d in shape_text.split("x")] if shape_text not in ("", "()") else []
            count = int(repeat) if repeat else 1
        except ValueError:
            raise ValueError(f"--model: cannot parse {item!r}; use e.g. 0.5B, 100M or 4096x4096,896*24") from None
        shapes += [(f"t{len(shapes) + i}.weight", shape) for i in range(count)]
    return shapes


def build_model(shapes: list[list[Any]], dtype: str, random: bool = False, seed: int = 0) -> torch.nn.Module:
    """A module holding ``[name, shape]`` or ``[name, shape, dtype_name]`` parameters under their dotted names."""
    from wtransfer._dtypes import dtype_from_name

    root = torch.nn.Module()
    pools: dict[Any, torch.Tensor] = {}
    for index, (name, shape, *override) in enumerate(shapes):
        torch_dtype = dtype_from_name(override[0] if override else dtype)
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        tensor = torch.zeros(shape, dtype=torch_dtype)
        if random and tensor.numel():
            if torch_dtype not in pools:
                pools[torch_dtype] = _random_pool(torch_dtype, seed)
            _fill_from_pool(tensor, pools[torch_dtype], index * 7919)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def worker_model(shapes: list[list[Any]], dtype: str) -> torch.nn.Module:
    """The worker's copy (zeros, resident): what the engine overwrites every round."""
    return build_model(shapes, dtype)


def _random_pool(dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.randn(1 << 22, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (1 << 22,), generator=generator).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, ((1 << 22) * size,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


def _fill_from_pool(tensor: torch.Tensor, pool: torch.Tensor, offset: int) -> None:
    """Cheap distinct random content: the pool, rotated by ``offset``, tiled over the tensor."""
    flat = tensor.view(-1)
    done, size = 0, pool.numel()
    start = offset % size
    while done < flat.numel():
        take = min(size - start, flat.numel() - done)
        flat[done : done + take].copy_(pool[start : start + take])
        done, start = done + take, 0


def mutate(model: torch.nn.Module, round_index: int) -> None:
    """Change every tensor a little (1 byte in 4093), so each round carries new weights."""
    for parameter in model.parameters():
        if parameter.numel() == 0:
            continue
        if parameter.dtype == torch.bool:
            parameter.data.view(-1)[round_index % parameter.numel()].logical_not_()
            continue
        raw = parameter.data.view(-1).view(torch.uint8)
        raw[(round_index * 131) % min(4093, raw.numel()) :: 4093].add_(1)


def digests(model: torch.nn.Module) -> dict[str, int]:
    from wtransfer.engines.wire import tensor_checksum

    return {name: tensor_checksum(p.data) for name, p in model.named_parameters()}

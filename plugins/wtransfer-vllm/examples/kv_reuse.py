"""Reuse a prompt's KV across ``vllm.LLM`` instances with wtransfer's ``storage`` connector.

usage: python kv_reuse.py MODEL_DIR STORE_DIR

Two vLLM instances, one after the other, each with its own engine process and an empty prefix
cache, share nothing but STORE_DIR. The first computes a 129-token prompt and stores its 4 full
KV blocks (32 tokens each) there; the second loads them instead of computing them and must
produce the same tokens. Minutes on a small machine; the last line says PASS or FAIL,
and the exit status with it.
"""

import argparse

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
from wtransfer_vllm.testing import llm_kwargs

PROMPT = [(7 * i + 3) % 500 for i in range(129)]


def generate_once(model_dir: str, store_dir: str) -> tuple[int, list[int]]:
    """A new vLLM instance with the store as its KV connector: prompt tokens it reused, tokens it made."""
    kv = KVTransferConfig(
        kv_connector="storage",                              # or "wtransfer:storage", "multi", "offloading"
        kv_role="kv_both",
        kv_connector_extra_config={"path": store_dir},       # storage's options (unknown keys are an error)
        kv_load_failure_policy="recompute",                  # a damaged block is recomputed, not an error
    )
    llm = LLM(**llm_kwargs(model_dir, kv_transfer_config=kv))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()  # vLLM 0.32's LLM has no close(): stop its engine now, not at exit
    return output.num_cached_tokens, list(output.outputs[0].token_ids)


if __name__ == "__main__":  # vLLM starts processes: keep the guard
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("store_dir")
    args = parser.parse_args()

    first_reused, first = generate_once(args.model_dir, args.store_dir)
    print(f"first instance: reused {first_reused} of {len(PROMPT)} prompt tokens (0 on an empty store); "
          f"tokens: {first}")
    second_reused, second = generate_once(args.model_dir, args.store_dir)
    print(f"second instance: reused {second_reused} of {len(PROMPT)} prompt tokens; tokens: {second}")
    full_blocks = len(PROMPT) // 32 * 32  # vLLM stores full blocks only
    if second_reused == full_blocks and second == first:
        print(f"PASS: the second instance loaded {second_reused} prompt tokens' KV from {args.store_dir} "
              f"and generated the same tokens as the first")
    else:
        print(f"FAIL: the second instance reused {second_reused} of the {full_blocks} stored prompt tokens "
              f"and its tokens {'equal' if second == first else 'differ from'} the first's")
        raise SystemExit(1)

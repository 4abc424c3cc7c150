"""Reuse a prompt's KV across ``vllm.LLM`` restarts with wtransfer's ``storage`` connector.

usage: python kv_reuse.py MODEL_DIR STORE_DIR

Run it twice. The first process computes a 129-token prompt and stores its 4 full KV
blocks (32 tokens each) under STORE_DIR; the second, a new process with an empty prefix
cache, loads them instead of computing them, and must produce the same tokens. Each run
takes about 30 s on a 2-core machine; its last line is the result.
"""

import argparse

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
from wtransfer_vllm.testing import llm_kwargs

if __name__ == "__main__":  # vLLM starts processes: keep the guard
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("store_dir")
    args = parser.parse_args()

    kv = KVTransferConfig(
        kv_connector="storage",                              # or "wtransfer:storage", "multi", "offloading"
        kv_role="kv_both",
        kv_connector_extra_config={"path": args.store_dir},  # storage's options (unknown keys are an error)
        kv_load_failure_policy="recompute",                  # a damaged block is recomputed, not an error
    )
    llm = LLM(**llm_kwargs(args.model_dir, kv_transfer_config=kv))
    prompt = [(7 * i + 3) % 500 for i in range(129)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    print(f"reused {output.num_cached_tokens} of {len(prompt)} prompt tokens; "
          f"tokens: {list(output.outputs[0].token_ids)}")

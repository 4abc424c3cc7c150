"""One vLLM instance (offline LLM) with a KV connector, generating prompts one by one.

usage: kv_run.py MODEL_DIR OUT_JSON CONNECTOR EXTRA_CONFIG_JSON PROMPTS_JSON [LLM_KWARGS_JSON]

CONNECTOR ``none`` runs without a connector. ``LLM_KWARGS_JSON`` may hold
``kv_load_failure_policy`` (a ``KVTransferConfig`` field) besides ``LLM`` arguments, and
``reset_after`` (indices of prompts after which ``llm.reset_prefix_cache(reset_connector=True)``
runs, as vLLM's RL flow does after a weight update), and ``max_tokens`` (default 4). Writes, per
prompt: greedy tokens, logprobs and vLLM's ``num_cached_tokens``.
"""

import json
import sys

from wtransfer_vllm.testing import generate_one_by_one, llm_kwargs, write_json

if __name__ == "__main__":
    model_dir, out, connector, extra, prompts = sys.argv[1:6]
    overrides = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    from vllm import LLM
    from vllm.config import KVTransferConfig

    policy = overrides.pop("kv_load_failure_policy", "fail")
    reset_after = set(overrides.pop("reset_after", []))
    max_tokens = overrides.pop("max_tokens", 4)
    if connector != "none":
        overrides["kv_transfer_config"] = KVTransferConfig(
            kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=json.loads(extra),
            kv_load_failure_policy=policy,
        )
    llm = LLM(**llm_kwargs(model_dir, **overrides))
    results = []
    for index, prompt in enumerate(json.loads(prompts)):
        results += generate_one_by_one(llm, [prompt], max_tokens)
        if index in reset_after:
            assert llm.reset_prefix_cache(reset_connector=True), "vLLM could not reset its caches"
    write_json(out, {"results": results})

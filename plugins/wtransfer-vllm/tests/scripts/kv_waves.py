"""A vLLM instance under memory pressure: waves of concurrent prompts that make vLLM preempt.

usage: kv_waves.py MODEL_DIR OUT_JSON CONNECTOR EXTRA_CONFIG_JSON PROMPTS_JSON WAVES LLM_KWARGS_JSON

Each wave submits every prompt of ``PROMPTS_JSON`` at once (64 generated tokens each) to an
instance whose KV cache is cut small (``num_gpu_blocks_override`` in ``LLM_KWARGS_JSON``), so
vLLM preempts running requests and hands their blocks to others in the same step: the
condition under which a connector that copies blocks after ``wait_for_save`` returned stores
another request's KV. Then, if ``"replay": true``, the same instance generates every prompt
again one by one (so a connector's own tier, e.g. ``offloading``, is read back). Writes the
per-prompt results of the replay (tokens, logprobs, ``num_cached_tokens``), the number of
preemptions vLLM counted and the connector's counters.
"""

import json
import sys

from wtransfer_vllm.testing import generate_one_by_one, llm_kwargs, write_json


def preemptions(llm) -> int:
    total = 0
    for metric in llm.get_metrics():
        if metric.name == "vllm:num_preemptions":
            total += int(getattr(metric, "value", 0))
    return total


if __name__ == "__main__":
    model_dir, out, connector, extra, prompts_json, waves = sys.argv[1:7]
    overrides = json.loads(sys.argv[7])
    replay = overrides.pop("replay", False)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    if connector != "none":
        overrides["kv_transfer_config"] = KVTransferConfig(
            kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=json.loads(extra),
        )
    llm = LLM(**llm_kwargs(model_dir, disable_log_stats=False, **overrides))
    prompts = json.loads(prompts_json)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for _ in range(int(waves)):
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    counted = preemptions(llm)
    results = generate_one_by_one(llm, prompts) if replay else []
    write_json(out, {"results": results, "preemptions": counted})

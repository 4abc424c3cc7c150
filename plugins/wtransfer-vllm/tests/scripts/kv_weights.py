"""One vLLM instance with a ``storage`` KV connector, synced by a wtransfer trainer in this process.

usage: kv_weights.py MODEL_DIR STORE OUT_JSON ROUNDS PROMPTS_JSON [reset]

Generates every prompt one by one at the loaded weights ("before"), then takes ROUNDS rounds
(perturbed weights, per-tensor checksums) and generates them again twice ("after", "again").
vLLM's own prefix cache is off, so every reused token came through the connector
(``num_cached_tokens``). With ``reset``, the connector's cache is reset by hand before the
rounds (as ``pause_generation`` does by default): its fingerprint becomes unique to that reset.
"""

import json
import sys

import wtransfer
from wtransfer_vllm import LLMClient
from wtransfer_vllm.testing import generate_one_by_one, llm_kwargs, load_trainer_model, perturb, write_json

if __name__ == "__main__":
    model_dir, store, out, rounds, prompts_json = sys.argv[1:6]
    from vllm import LLM
    from vllm.config import KVTransferConfig

    prompts = json.loads(prompts_json)
    llm = LLM(**llm_kwargs(
        model_dir, weight_transfer_config={"backend": "shm"}, enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(kv_connector="storage", kv_role="kv_both",
                                            kv_connector_extra_config={"path": store}),
    ))
    result = {"before": generate_one_by_one(llm, prompts)}
    if len(sys.argv) > 6 and sys.argv[6] == "reset":
        assert llm.reset_prefix_cache(reset_connector=True)
    if int(rounds):
        model = load_trainer_model(model_dir)
        trainer = wtransfer.create_trainer("shm", client=LLMClient(llm), source=wtransfer.ModuleSource(model),
                                           init_info={"world_size": 2}, checksums=True)
        for step in range(int(rounds)):
            perturb(model, step)
            trainer.send_weights()
        trainer.shutdown()
        result["after"] = generate_one_by_one(llm, prompts)
        result["again"] = generate_one_by_one(llm, prompts)
    write_json(out, result)

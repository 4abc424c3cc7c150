"""vLLM's ``LLM`` in a Ray actor, synced by a wtransfer trainer through vLLM's ``RayVLLMWeightSyncClient``.

usage: ray_sync.py BACKEND MODEL_DIR OUT_JSON [ROUNDS]
"""

import sys

import ray
import wtransfer
from vllm import LLM, SamplingParams
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
from vllm.inputs import TokensPrompt
from wtransfer_vllm.testing import PROMPTS, llm_kwargs, load_trainer_model, perturb, write_json

if __name__ == "__main__":
    backend, model_dir, out = sys.argv[1:4]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=1)(LLM).remote(**llm_kwargs(model_dir, weight_transfer_config={"backend": backend}))
        model = load_trainer_model(model_dir)
        trainer = wtransfer.create_trainer(backend, client=RayVLLMWeightSyncClient(actor),
                                           source=wtransfer.ModuleSource(model), init_info={"world_size": 2})
        for step in range(rounds):
            perturb(model, step)
            trainer.send_weights()
        trainer.shutdown()
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
        # one prompt per call, as testing.greedy (the reference) generates: a batch's make-up moves last bits
        outputs = [output for p in PROMPTS
                   for output in ray.get(actor.generate.remote([TokensPrompt(prompt_token_ids=p)], params,
                                                               use_tqdm=False))]
        after = [{"tokens": list(o.outputs[0].token_ids),
                  "logprobs": [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                 for o in outputs]
        write_json(out, {"after": after, "weight_version": ray.get(actor.get_weight_version.remote())})
    finally:
        ray.shutdown()

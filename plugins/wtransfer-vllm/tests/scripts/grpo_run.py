"""TRL 1.16's own ``GRPOTrainer`` (fp32 masters) syncing vLLM through ``use_in_grpo_trainer``.

usage: grpo_run.py colocate|server MODEL_DIR FINAL_DIR OUT_JSON [BASE_URL]
  colocate  vLLM inside this process: TRL builds its ``LLM`` (external launcher) from MODEL_DIR
  server    ``vllm serve`` at BASE_URL (started with ``--weight-transfer-config '{"backend": "shm"}'``)

STEPS GRPO steps on CPU, a sync before each (TRL's own schedule), then one more sync: what a user
evaluating the final policy runs. FINAL_DIR gets the trainer's final fp32 weights (and the
tokenizer), for a fresh load to compare with. Writes vLLM's greedy outputs before training, after
the first step (the weights synced at step 0) and after the last sync; each round's stats; each
sync's seconds; in colocate mode the settings TRL built its ``LLM`` with.
"""

import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from wtransfer_vllm.testing import greedy, served_greedy, write_json
from wtransfer_vllm.trl import use_in_grpo_trainer

STEPS = 3


def rewards(completions, **_):
    """Any reward that differs between completions: GRPO then has advantages to learn from."""
    return [float(sum(map(ord, c)) % 5) for c in completions]


if __name__ == "__main__":
    mode, model_dir, final_dir, out = sys.argv[1:5]
    base_url = sys.argv[5] if len(sys.argv) > 5 else None
    use_in_grpo_trainer("shm", init_info={"timeout_s": 60, "bucket_bytes": 64 << 10})  # many buckets a round
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # fp32 masters; vLLM runs bf16
    prompts = Dataset.from_dict({"prompt": [" ".join(f"t{(7 * i + j) % 500 + 3}" for j in range(6)) for i in range(16)]})
    where = {"vllm_server_base_url": base_url} if mode == "server" else {"vllm_max_model_length": 128}
    args = GRPOConfig(output_dir=os.path.join(os.path.dirname(out), "grpo"), use_vllm=True, vllm_mode=mode, **where,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=STEPS,
                      learning_rate=1e-3, use_cpu=True, bf16=False, report_to=[], save_strategy="no", seed=0)
    result = {"stats": [], "seconds": []}

    def outputs():
        if mode == "server":
            return served_greedy(base_url, model_dir)
        return greedy(trainer.vllm_generation.llm)

    class AfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:  # vLLM still has what the sync at step 0 sent
                result["after_first"] = outputs()

    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=prompts,
                          processing_class=tokenizer, callbacks=[AfterFirstStep()])
    generation = trainer.vllm_generation
    sync = generation.sync_weights

    def timed_sync():
        start = time.perf_counter()
        sync()
        result["seconds"].append(time.perf_counter() - start)
        transfer = generation._wtransfer if mode == "colocate" else generation.vllm_client.communicator
        result["stats"].append(transfer.last_stats)

    generation.sync_weights = timed_sync
    result["before"] = outputs()
    trainer.train()
    generation.sync_weights()  # the final weights, as a user evaluating the trained policy syncs them
    result["after"] = outputs()
    if mode == "colocate":
        result["threads"] = torch.get_num_threads()  # vLLM computed in this process: a reference must match
        result["weight_version"] = generation.llm.get_weight_version()
        config = generation.llm.llm_engine.vllm_config  # a fresh load to compare with must compute the same way
        result["llm_kwargs"] = {"max_model_len": config.model_config.max_model_len,
                                "block_size": config.cache_config.block_size,
                                "enforce_eager": config.model_config.enforce_eager,
                                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                                "logprobs_mode": config.model_config.logprobs_mode,
                                "max_num_seqs": config.scheduler_config.max_num_seqs, "seed": config.model_config.seed}
    model.save_pretrained(final_dir)
    tokenizer.save_pretrained(final_dir)
    write_json(out, result)

"""One vLLM instance (offline LLM) synced by a wtransfer trainer in this process.

usage: offline_sync.py BACKEND MODEL_DIR FINAL_DIR OUT_JSON [ROUNDS] [wtransfer|vllm-factory] [DELTA_FINAL_DIR]
                       [DUMMY_DIR]

With DUMMY_DIR (a config-only copy of MODEL_DIR), vLLM starts from it with ``load_format="dummy"``,
as an RL rollout engine does, and the trainer's first round fills it.

``vllm-factory`` builds the trainer the way code written against vLLM does:
``WeightTransferTrainerFactory.trainer_init`` with vLLM's own ``ModuleSource``.
Writes: outputs before and after, vLLM's digests and weight version, per-round stats;
saves the trainer's final weights to FINAL_DIR (the reference loads them fresh). With
DELTA_FINAL_DIR, the same LLM then runs ``delta_sync.delta_scenario`` (its result under "delta")
and ``partial_sync.partial_scenario`` (under "partial"): one vLLM start for all three.
"""

import os
import sys
import traceback

os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the delta and partial scenarios ask vLLM's worker how it loaded

import wtransfer
from wtransfer_vllm import LLMClient
from wtransfer_vllm.testing import (BLOCK_FILLING_PROMPTS, checksums, generate_one_by_one, greedy, llm_kwargs,
                                    load_trainer_model, perturb, write_json)

if __name__ == "__main__":
    backend, model_dir, final_dir, out = sys.argv[1:5]
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    via = sys.argv[6] if len(sys.argv) > 6 else "wtransfer"
    delta_final = sys.argv[7] if len(sys.argv) > 7 and sys.argv[7] else None
    dummy_dir = sys.argv[8] if len(sys.argv) > 8 else None
    from vllm import LLM

    start = {"load_format": "dummy"} if dummy_dir else {}
    llm = LLM(**llm_kwargs(dummy_dir or model_dir, weight_transfer_config={"backend": backend}, **start))
    before = greedy(llm)  # the RL order: generate, then sync, then generate
    # The block-filling prompts are in vLLM's prefix cache now: a repeat hits it (on every host).
    cached_before = [r["num_cached_tokens"] for r in generate_one_by_one(llm, BLOCK_FILLING_PROMPTS)]
    model = load_trainer_model(model_dir)
    if via == "vllm-factory":
        from vllm.distributed.weight_transfer.base import ModuleSource as VLLMModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from wtransfer_vllm import trainer_init_info

        trainer = WeightTransferTrainerFactory.trainer_init(
            trainer_init_info(backend, world_size=2), client=LLMClient(llm), source=VLLMModuleSource(model)
        )
    else:
        # shm: the trainer's tensors live in the staged copy after the first round (share_source)
        shared = {"share_source": True} if backend == "shm" else {}
        trainer = wtransfer.create_trainer(
            backend, client=LLMClient(llm), source=wtransfer.ModuleSource(model), init_info={"world_size": 2, **shared}
        )
    stats = []
    for step in range(rounds):
        perturb(model, step)
        stats.append(trainer.send_weights())
    # The trainer trains on after its last round (here: halves every weight in place, undone below): vLLM
    # serves what the round carried, never the trainer's live tensors.
    import torch

    held = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.5)
    after = greedy(llm)
    again = greedy(llm)  # from the prefix cache refilled after the sync
    with torch.no_grad():
        for parameter, value in zip(model.parameters(), held):
            parameter.copy_(value)
    result = {"before": before, "after": after, "again": again, "cached_before": cached_before,
              "checksums": checksums(llm),
              "weight_version": llm.get_weight_version(), "stats": stats}
    result["shared_tensors"] = getattr(trainer, "shared_tensors", None)
    trainer.shutdown()
    model.save_pretrained(final_dir)
    write_json(out, result)
    if delta_final:
        from delta_sync import delta_scenario

        llm.shutdown_weight_transfer_engine()
        try:  # its own failure fails its own test, not this scenario's
            result["delta"] = delta_scenario(llm, backend, model_dir, delta_final, tp=1)
        except Exception:
            result["delta"] = {"error": traceback.format_exc()}
        write_json(out, result)
        from partial_sync import partial_scenario

        try:
            result["partial"] = partial_scenario(llm, backend, model_dir, rounds, tp=1)
        except Exception:
            result["partial"] = {"error": traceback.format_exc()}
        write_json(out, result)

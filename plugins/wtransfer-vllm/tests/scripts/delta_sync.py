"""An offline vLLM synced by a ``delta=True`` trainer, in the RL order, after real AdamW steps.

usage: delta_sync.py BACKEND MODEL_DIR FINAL_DIR OUT_JSON [TP]

Generate, then: round 1 (whole), two AdamW steps each followed by a delta round (the embedding and
parts of two fused modules are frozen, so they travel in neither), generate again, and a round with nothing trained. Writes the
outputs, the rounds' stats and the host's CPU flags; saves the trainer's final weights (with a
tokenizer) to FINAL_DIR, which the test loads into a fresh vLLM for the reference. With TP > 1
each of vLLM's worker processes rebuilds its deltas on its own committed copy.
"""

import sys

import wtransfer
from wtransfer_vllm import LLMClient
from wtransfer_vllm.testing import (checksums, greedy, llm_kwargs, load_trainer_model, perturb, write_json,
                                    write_tokenizer)

if __name__ == "__main__":
    backend, model_dir, final_dir, out = sys.argv[1:5]
    tp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    import torch
    from vllm import LLM

    parallel = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    llm = LLM(**llm_kwargs(model_dir, weight_transfer_config={"backend": backend}, **parallel))
    before = greedy(llm)  # the RL order: generate, then sync, then generate
    model = load_trainer_model(model_dir)
    model.get_input_embeddings().weight.requires_grad_(False)  # a frozen part: it never travels again
    # Frozen halves of fused modules: vLLM loads q/k/v into one qkv_proj and gate/up into one
    # gate_up_proj, so these layers change only in part, and must still be reloaded whole.
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[-1].mlp
    for frozen in (attention.k_proj, attention.v_proj, mlp.gate_proj):
        frozen.weight.requires_grad_(False)
    perturb(model, 0)  # the trainer starts elsewhere than the checkpoint vLLM loaded
    trainer = wtransfer.create_trainer(backend, client=LLMClient(llm), source=wtransfer.ModuleSource(model),
                                       init_info={"world_size": tp + 1}, delta=True)
    stats = [trainer.send_weights()]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    for step in range(2):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stats.append(trainer.send_weights())
    after = greedy(llm)
    stats.append(trainer.send_weights())  # nothing trained: nothing moves
    again = greedy(llm)
    trainer.shutdown()
    model.save_pretrained(final_dir)
    write_tokenizer(final_dir, model.config.vocab_size)
    write_json(out, {"before": before, "after": after, "again": again, "stats": stats, "checksums": checksums(llm),
                     "weight_version": llm.get_weight_version()})

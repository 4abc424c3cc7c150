"""A scenario for an offline vLLM already running: a ``delta=True`` trainer's rounds after real AdamW steps.

Imported by the scripts that hold an ``LLM`` (``offline_sync.py`` at TP=1, ``tp_sync.py`` at TP=2),
which run it after their own scenario, on the same engine: one vLLM start serves both.

Generate, then: round 1 (whole: this trainer is new to the workers), two AdamW steps each followed
by a delta round (the embedding and parts of two fused modules are frozen, so they travel in
neither), generate again, and a round with nothing trained. Returns the outputs, the rounds' stats,
vLLM's digests and label; saves the trainer's final weights (with a tokenizer) to ``final_dir``,
which the test loads into a fresh vLLM for the reference. With TP > 1 each of vLLM's worker
processes rebuilds its deltas on its own committed copy. How each worker loaded each round is read from it
("loads", through ``collective_rpc``: the caller sets VLLM_ALLOW_INSECURE_SERIALIZATION).
"""

import wtransfer
from wtransfer_vllm import LLMClient
from wtransfer_vllm.testing import checksums, greedy, how_loaded, load_trainer_model, perturb, write_tokenizer


def delta_scenario(llm, backend: str, model_dir: str, final_dir: str, tp: int) -> dict:
    import torch

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
    try:  # the engine is left free for the next scenario, whatever happens here
        stats = [trainer.send_weights()]
        loads = [llm.collective_rpc(how_loaded)]  # per round, how each of vLLM's workers loaded it
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        for step in range(2):
            ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            stats.append(trainer.send_weights())
            loads.append(llm.collective_rpc(how_loaded))
        after = greedy(llm)
        stats.append(trainer.send_weights())  # nothing trained: nothing moves
        loads.append(llm.collective_rpc(how_loaded))
        again = greedy(llm)
    finally:
        trainer.shutdown()
        llm.shutdown_weight_transfer_engine()
    model.save_pretrained(final_dir)
    write_tokenizer(final_dir, model.config.vocab_size)
    return {"before": before, "after": after, "again": again, "stats": stats, "loads": loads, "checksums": checksums(llm),
            "weight_version": llm.get_weight_version()}

"""A scenario for an offline vLLM already running: a ``partial=True`` trainer's rounds.

Imported by the scripts that hold an ``LLM`` (``offline_sync.py`` at TP=1, ``tp_sync.py`` at TP=2)
and run after their other scenarios on the same engine. Every round's outputs are compared with
the reference checkpoint (``final_checkpoint``: ROUNDS ``perturb`` steps), which needs no new vLLM:

1. a whole round of the reference's weights but for the MLP weights, which are elsewhere;
2. only the MLP weights, the reference's: merged, vLLM holds the reference;
3. everything but the embedding, elsewhere; 4. everything but the embedding, the reference's:
   merged with the embedding kept since round 1, vLLM holds the reference again; then the same with
   only the q_proj weights, one part of each fused qkv_proj (k and v kept);
5. rounds vLLM's model cannot load, each refused before a byte moves, nothing written: one naming
   a tensor the model lacks, one with a transposed shape, (from a trainer that sends whole
   rounds) one without layer 0's v_proj, which would leave the fused qkv_proj filled in part,
   and one cast to float16 (``dtype="float16"``) where vLLM serves bfloat16.

Two ways of loading a partial round: where the direct load is allowed and vLLM's kernels read the
weights it writes (the host decides), only the round's tensors are loaded; otherwise vLLM's layerwise
reload loads them with every kept tensor. ``direct_load=False`` turns the direct load off on vLLM's
workers for the scenario, so a host that allows it runs both ways, one per vLLM instance. How each
worker loaded each round is read from it ("loads"). Both go through ``collective_rpc``: the caller sets
VLLM_ALLOW_INSECURE_SERIALIZATION.
"""

import wtransfer
from wtransfer_vllm import LLMClient
from wtransfer_vllm.testing import checksums, greedy, how_loaded, load_trainer_model, perturb, set_direct_load


def refusal(trainer) -> str | None:
    """The error a round raised (None: it was taken)."""
    try:
        trainer.send_weights()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def partial_scenario(llm, backend: str, model_dir: str, rounds: int, tp: int, direct_load: bool = True) -> dict:
    final, other = load_trainer_model(model_dir), load_trainer_model(model_dir)
    for step in range(rounds):
        perturb(final, step)
    perturb(other, 77)
    theirs, elsewhere = dict(final.named_parameters()), dict(other.named_parameters())

    def mlp(name: str) -> bool:
        return ".mlp." in name

    def embedding(name: str) -> bool:
        return "embed_tokens" in name

    def q_proj(name: str) -> bool:
        return ".q_proj." in name

    tensors = {name: (elsewhere if mlp(name) else theirs)[name].detach() for name in theirs}
    trainer = wtransfer.create_trainer(backend, client=LLMClient(llm), source=wtransfer.TensorSource(tensors),
                                       init_info={"world_size": tp + 1}, partial=True)
    outputs, stats, loads = {}, [], {}

    def send(label: str, pick, source: dict) -> None:
        tensors.clear()
        tensors.update({name: source[name].detach() for name in theirs if pick(name)})
        stats.append(trainer.send_weights())
        loads[label] = llm.collective_rpc(how_loaded)
        outputs[label] = greedy(llm)

    previous, switched = None, False
    try:  # the engine is left free for the next scenario, whatever happens here
        if not direct_load:
            previous, switched = llm.collective_rpc(set_direct_load, args=("0",))[0], True
        stats.append(trainer.send_weights())
        loads["whole"] = llm.collective_rpc(how_loaded)
        outputs["whole"] = greedy(llm)
        send("mlp", mlp, theirs)
        send("rest elsewhere", lambda name: not embedding(name), elsewhere)
        send("rest", lambda name: not embedding(name), theirs)
        send("q elsewhere", q_proj, elsewhere)  # one part of each fused qkv_proj
        send("q", q_proj, theirs)
        refused = {}
        down = "model.layers.0.mlp.down_proj.weight"
        for label, bad in (("unknown", {down.replace("weight", "wieght"): theirs[down]}),
                           ("shape", {down: theirs[down].t().contiguous()})):
            tensors.clear()
            tensors.update({name: t.detach() for name, t in bad.items()})
            refused[label] = refusal(trainer)
        trainer.shutdown()
        llm.shutdown_weight_transfer_engine()
        no_v = {name: t.detach() for name, t in theirs.items() if name != "model.layers.0.self_attn.v_proj.weight"}
        trainer = wtransfer.create_trainer(backend, client=LLMClient(llm), source=wtransfer.TensorSource(no_v),
                                           init_info={"world_size": tp + 1})
        refused["incomplete"] = refusal(trainer)
        trainer.shutdown()
        llm.shutdown_weight_transfer_engine()
        whole = {name: t.detach() for name, t in theirs.items()}
        trainer = wtransfer.create_trainer(backend, client=LLMClient(llm), source=wtransfer.TensorSource(whole),
                                           init_info={"world_size": tp + 1}, dtype="float16")
        refused["dtype"] = refusal(trainer)  # every tensor cast to a dtype the model does not hold
        outputs["after refused"] = greedy(llm)
    finally:
        try:
            trainer.shutdown()
            llm.shutdown_weight_transfer_engine()
        finally:
            if switched:
                llm.collective_rpc(set_direct_load, args=(previous,))
    return {"outputs": outputs, "stats": stats, "refused": refused, "checksums": checksums(llm), "tensors": len(theirs),
            "direct_load": direct_load, "loads": loads,
            "mlp_bytes": sum(t.numel() * t.element_size() for n, t in theirs.items() if mlp(n))}

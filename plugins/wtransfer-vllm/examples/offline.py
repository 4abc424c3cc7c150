"""Keep an offline ``vllm.LLM`` in sync with a trainer, set up as RL teams run it, and check the result.

usage: python offline.py MODEL_DIR [--backend shm] [--rounds 3]

vLLM starts as a rollout engine does: ``load_format="dummy"`` from a copy of MODEL_DIR's config
and tokenizer, with no weights in it (random weights; each round is checked against what vLLM's
own model loads). The trainer holds fp32 master weights of MODEL_DIR; each round reaches vLLM as
its bf16 (cast while packed). Round 1 fills vLLM whole; then the embedding and final norm stay
frozen and each later round carries only the decoder layers, which train (``partial=True``: vLLM
keeps what a round leaves out). In the RL order: vLLM generates first, then the rounds, then it
generates again; a fresh ``LLM`` loaded from the trainer's weights must compute the same greedy
tokens and logprobs. Two vLLM starts: minutes on a small machine; the last line says
PASS or FAIL, and the exit status with it.
"""

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
import wtransfer
from vllm import LLM
from wtransfer_vllm import LLMClient
from wtransfer_vllm.testing import greedy, llm_kwargs, perturb

if __name__ == "__main__":  # vLLM starts processes: keep the guard
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())

    config_only = work / "config-only"  # what a rollout engine starts from: no weights
    shutil.copytree(args.model_dir, config_only, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    llm = LLM(**llm_kwargs(config_only, load_format="dummy", weight_transfer_config={"backend": args.backend}))
    greedy(llm)  # rollouts with the weights vLLM has (their KV stays in its prefix cache)

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)  # fp32 masters
    sending = dict(model.named_parameters())  # read at every round: what it names is what travels
    trainer = wtransfer.create_trainer(args.backend, client=LLMClient(llm), source=wtransfer.TensorSource(sending),
                                       init_info={"world_size": 2}, partial=True)
    rounds = [trainer.send_weights()]  # round 1: every tensor, over vLLM's random weights
    training = {name: p for name, p in model.named_parameters() if ".layers." in name}
    sending.clear()
    sending.update(training)  # from now on only the decoder layers travel
    for step in range(args.rounds):
        perturb(model.model.layers, step)  # a stand-in for an optimizer step of the layers that train
        rounds.append(trainer.send_weights())
    for stats in rounds:
        print(f"round {stats['version']}: {stats['tensors']} tensors, {stats['bytes'] / 1e6:.1f} MB as bf16 "
              f"({stats['cast_tensors']} cast from fp32) in {stats['seconds']:.3f} s")
    synced = greedy(llm)
    trainer.shutdown()
    print(f"vLLM weight version: {llm.get_weight_version()}")
    llm.llm_engine.engine_core.shutdown()  # vLLM 0.32's LLM has no close(): stop its engine now, not at exit

    # the check: a fresh load of the trainer's weights, saved in vLLM's dtype (rounded as vLLM's own load would)
    model.to(torch.bfloat16).save_pretrained(work / "final")
    shutil.copy(config_only / "tokenizer.json", work / "final")
    fresh_llm = LLM(**llm_kwargs(work / "final"))
    fresh = greedy(fresh_llm)
    fresh_llm.llm_engine.engine_core.shutdown()
    shutil.rmtree(work)
    differ = [i for i, (a, b) in enumerate(zip(synced, fresh)) if a != b]
    if differ:
        print(f"FAIL: after {len(rounds)} rounds over {args.backend}, vLLM's greedy tokens or logprobs differ from "
              f"a fresh load of the trainer's weights for prompts {differ}")
        raise SystemExit(1)
    print(f"PASS: after {len(rounds)} rounds over {args.backend}, vLLM's greedy tokens and logprobs are identical "
          f"to a fresh load of the trainer's weights ({len(synced)} prompts)")

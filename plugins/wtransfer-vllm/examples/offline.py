"""Sync an offline ``vllm.LLM`` from a trainer in the same process, and check the result.

usage: python offline.py MODEL_DIR [--backend shm] [--rounds 3]

The "trainer" is the same checkpoint in transformers; each round stands in for an
optimizer step (every parameter changes), then ``send_weights()`` pushes it into vLLM. In
the RL order: vLLM generates first (its prefix cache then holds the prompts' KV), then the
rounds, then it generates again; a fresh ``LLM`` loaded from the trainer's weights must
compute the same greedy tokens and logprobs. Takes about a minute on a 2-core machine (two
vLLM starts); the last line is the result.
"""

import argparse
import tempfile

import wtransfer
from vllm import LLM
from wtransfer_vllm import LLMClient
from wtransfer_vllm.testing import greedy, llm_kwargs, load_trainer_model, perturb, write_tokenizer

if __name__ == "__main__":  # vLLM starts processes: keep the guard
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(**llm_kwargs(args.model_dir, weight_transfer_config={"backend": args.backend}))
    greedy(llm)  # rollouts with the current weights (their KV stays in vLLM's prefix cache)
    model = load_trainer_model(args.model_dir)
    trainer = wtransfer.create_trainer(
        args.backend, client=LLMClient(llm), source=wtransfer.ModuleSource(model), init_info={"world_size": 2}
    )
    for step in range(args.rounds):
        perturb(model, step)
        stats = trainer.send_weights()
        print(f"round {stats['version']}: {stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.3f} s")
    synced = greedy(llm)
    trainer.shutdown()
    print(f"vLLM weight version: {llm.get_weight_version()}")
    del llm

    with tempfile.TemporaryDirectory() as folder:  # the check: a fresh load of the trainer's weights
        model.save_pretrained(folder)
        write_tokenizer(folder, model.config.vocab_size)
        fresh = greedy(LLM(**llm_kwargs(folder)))
    print(f"result: after {args.rounds} rounds over {args.backend}, vLLM's tokens and logprobs are "
          f"identical to a fresh load: {synced == fresh}")
    raise SystemExit(0 if synced == fresh else 1)

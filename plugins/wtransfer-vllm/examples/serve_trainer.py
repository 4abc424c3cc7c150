"""A trainer process syncing ``vllm serve`` through vLLM's own HTTP client.

usage: python serve_trainer.py BASE_URL MODEL_DIR [--backend shm] [--rounds 3]

The server must run with VLLM_SERVER_DEV_MODE=1 (on loopback: --host 127.0.0.1, its dev
endpoints must not face a network) and --weight-transfer-config naming the same backend.
Waits for the server (it prints progress; a first start can take minutes on a small machine),
prints each round and what the server reports at /weight_info. The last line says
PASS (the server reports the last round's version and its greedy outputs moved off the
checkpoint's) or FAIL, and the exit status with it. That vLLM then computes exactly what a fresh
load of the trainer's weights computes is what ``offline.py`` checks.
"""

import argparse
import time

import requests
import torch
import transformers
import wtransfer
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from wtransfer_vllm.testing import perturb, served_greedy

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("base_url")
    parser.add_argument("model_dir")
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    started = time.monotonic()  # the server may still be starting
    said = 0.0
    while True:
        try:
            if requests.get(f"{args.base_url}/health", timeout=2).ok:
                break
        except requests.ConnectionError:
            pass
        waited = time.monotonic() - started
        if waited > 300:
            raise SystemExit(f"no vLLM server answered at {args.base_url} within 300 s: is it running, on that port?")
        if waited - said >= 10:
            said = waited
            print(f"waiting for the vLLM server at {args.base_url} ({waited:.0f} s; it loads the model first)",
                  flush=True)
        time.sleep(1)
    before = served_greedy(args.base_url, args.model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)  # fp32 masters
    trainer = wtransfer.create_trainer(
        args.backend, client=HTTPVLLMWeightSyncClient(args.base_url), source=wtransfer.ModuleSource(model),
        init_info={"world_size": 2},
    )
    for step in range(args.rounds):
        perturb(model, step)  # a stand-in for an optimizer step
        stats = trainer.send_weights()  # the server then reports str(stats["version"])
        label = str(stats["version"])
        print(f"round {stats['version']}: {stats['bytes'] / 1e6:.1f} MB as bf16 in {stats['seconds']:.3f} s")
    trainer.shutdown()
    info = requests.get(f"{args.base_url}/weight_info", timeout=10).json()
    print("weight_info:", info)
    changed = served_greedy(args.base_url, args.model_dir) != before
    if info.get("weight_version") == label and changed:
        print(f"PASS: {args.rounds} rounds synced into vllm serve over {args.backend}; it serves version "
              f"{label} and its greedy outputs changed")
    else:
        print(f"FAIL: after {args.rounds} rounds over {args.backend} the server reports version "
              f"{info.get('weight_version')!r} (expected {label!r}); outputs changed: {changed}")
        raise SystemExit(1)

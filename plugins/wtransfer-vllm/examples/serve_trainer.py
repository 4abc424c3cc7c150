"""A trainer process syncing ``vllm serve`` through vLLM's own HTTP client.

usage: python serve_trainer.py BASE_URL MODEL_DIR [--backend shm] [--rounds 3]

The server must run with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config naming the
same backend. Prints each round, then what the server reports at /weight_info.
"""

import argparse
import time

import requests
import wtransfer
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from wtransfer_vllm.testing import load_trainer_model, perturb, served_greedy

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("base_url")
    parser.add_argument("model_dir")
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    deadline = time.monotonic() + 300  # the server may still be starting
    while True:
        try:
            if requests.get(f"{args.base_url}/health", timeout=2).ok:
                break
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"no vLLM server answered at {args.base_url} within 300 s")
        time.sleep(1)
    before = served_greedy(args.base_url, args.model_dir)
    model = load_trainer_model(args.model_dir)
    trainer = wtransfer.create_trainer(
        args.backend, client=HTTPVLLMWeightSyncClient(args.base_url), source=wtransfer.ModuleSource(model),
        init_info={"world_size": 2},
    )
    for step in range(args.rounds):
        perturb(model, step)
        stats = trainer.send_weights(f"step-{step}")
        print(f"round {stats['version']}: {stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.3f} s")
    trainer.shutdown()
    print("weight_info:", requests.get(f"{args.base_url}/weight_info", timeout=10).json())
    print("outputs changed:", served_greedy(args.base_url, args.model_dir) != before)

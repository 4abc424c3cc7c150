"""A trainer process syncing ``vllm serve`` through vLLM's own HTTP client.

usage: python serve_trainer.py BASE_URL MODEL_DIR [--backend shm] [--rounds 3]

The server must run with VLLM_SERVER_DEV_MODE=1 (on loopback: --host 127.0.0.1, its dev
endpoints must not face a network) and --weight-transfer-config naming the same backend.
Waits for the server (it prints progress; a first start takes about a minute on a 2-core
machine), prints each round and what the server reports at /weight_info; the last line is
the result.
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
    changed = served_greedy(args.base_url, args.model_dir) != before
    print(f"result: {args.rounds} rounds synced into vllm serve over {args.backend}; outputs changed: {changed}")

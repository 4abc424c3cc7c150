"""A trainer process driving ``vllm serve`` through vLLM's own ``HTTPVLLMWeightSyncClient``.

usage: http_trainer.py MODE BASE_URL BACKEND MODEL_DIR OUT_JSON
  sync      perturb and send ROUNDS rounds (the reference checkpoint's steps)
  kill      send changed weights, but SIGKILL this process half-way through the round
  mismatch  send weights with one tensor renamed: vLLM must refuse the round
  resend    send MODEL_DIR's weights unchanged, labelled "resent"
  BACKEND may differ from the server's: the trainer's error must then carry the server's reason
"""

import os
import signal
import sys

import wtransfer
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from wtransfer_vllm.testing import load_trainer_model, perturb, write_json


class DiesMidRound(wtransfer.ModuleSource):
    """Yields half of the model's tensors, then the trainer process is killed."""

    def __iter__(self):
        entries = self.metadata()
        for index, item in enumerate(super().__iter__()):
            if index == len(entries) // 2:
                os.kill(os.getpid(), signal.SIGKILL)
            yield item


if __name__ == "__main__":
    mode, base_url, backend, model_dir, out = sys.argv[1:6]
    rounds = int(os.environ.get("ROUNDS", "3"))
    client = HTTPVLLMWeightSyncClient(base_url, timeout=120)
    model = load_trainer_model(model_dir)
    # Small buckets, so that a round is many buckets and a kill lands between them.
    init_info = {"world_size": 2, "timeout_s": 60, "bucket_bytes": 64 << 10}
    if mode == "kill":
        perturb(model, 99)
        source = DiesMidRound(model)
    elif mode == "mismatch":
        state = dict(model.named_parameters())
        first = next(iter(state))
        state[first.replace("weight", "wieght")] = state.pop(first)
        source = wtransfer.TensorSource(state)
    else:
        source = wtransfer.ModuleSource(model)
    result = {"stats": [], "error": None}
    try:
        trainer = wtransfer.create_trainer(backend, client=client, source=source, init_info=init_info)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        write_json(out, result)
        raise SystemExit(0)
    try:
        if mode == "sync":
            for step in range(rounds):
                perturb(model, step)
                result["stats"].append(trainer.send_weights())
        else:
            result["stats"].append(trainer.send_weights("resent" if mode == "resend" else None))
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    trainer.shutdown()
    write_json(out, result)

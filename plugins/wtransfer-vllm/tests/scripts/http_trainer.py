"""A trainer process driving ``vllm serve`` through vLLM's own ``HTTPVLLMWeightSyncClient``.

usage: http_trainer.py MODE BASE_URL BACKEND MODEL_DIR OUT_JSON
  sync      perturb and send ROUNDS rounds (the reference checkpoint's steps)
  kill      send changed weights, but SIGKILL this process half-way through the round
  mismatch  send weights with one tensor renamed: vLLM must refuse the round
  resend    send MODEL_DIR's weights unchanged, labelled "resent"
  trl       TRL's protocol calls, in TRL's order, through TRL's own VLLMClient and
            wtransfer_vllm.trl: a round whose iterator dies half-way, then ROUNDS rounds of
            fp32 masters (each the reference step's bf16 value less a quarter of its last bf16
            place: only a cast that rounds makes them the reference's weights)
  BACKEND may differ from the server's: the trainer's error must then carry the server's reason
"""

import os
import signal
import sys

import torch
import wtransfer
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from wtransfer_vllm.testing import load_trainer_model, perturb, served_greedy, write_json


class DiesMidRound(wtransfer.ModuleSource):
    """Yields half of the model's tensors, then the trainer process is killed."""

    def __iter__(self):
        entries = self.metadata()
        for index, item in enumerate(super().__iter__()):
            if index == len(entries) // 2:
                os.kill(os.getpid(), signal.SIGKILL)
            yield item


def fp32_masters(model):
    """TRL's ``_streaming_iter``: ``(name, tensor)`` per parameter, fp32, once."""
    for name, parameter in model.named_parameters():
        exact = parameter.detach().float()
        below = (exact.view(torch.int32) - 0x4000).view(torch.float32)  # rounds up to exact, truncates below it
        yield name, torch.where(exact == 0, exact, below)


def dies_half_way(tensors):
    items = list(tensors)
    yield from items[: len(items) // 2]
    raise RuntimeError("a trainer rank died while its tensors were gathered")


def trl_steps(base_url, backend, model_dir, rounds):
    """What TRL 1.16's AsyncGRPOTrainer calls on its weight_transfer, in its order (main process)."""
    import requests
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    from wtransfer_vllm.trl import WTransferWeightTransfer

    PartialState()  # TRL's trainer has accelerate's state by then; its client logs through it
    model = load_trainer_model(model_dir)
    transfer = WTransferWeightTransfer(VLLMClient(base_url), backend, init_info={"timeout_s": 60,
                                                                              "bucket_bytes": 64 << 10})
    result = {"stats": [], "error": None}
    transfer.init_weight_transfer()
    for step in range(rounds):
        perturb(model, step)
        transfer.pause()
        transfer.send_weights(fp32_masters(model))
        transfer.resume()
        result["stats"].append(transfer.last_stats)
        if step == 0:  # a round that dies with bytes already moving (streamed, after the first)
            before = served_greedy(base_url, model_dir)
            stray = load_trainer_model(model_dir)
            perturb(stray, 99)
            transfer.pause()
            try:
                transfer.send_weights(dies_half_way(fp32_masters(stray)))  # TRL would not resume() after this
            except Exception as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"
            paused = result["paused_after_failure"] = requests.get(f"{base_url}/is_paused", timeout=10).json()["is_paused"]
            if paused:  # a completion would wait for a resume that never comes
                break
            result["kept_weights"] = served_greedy(base_url, model_dir) == before
    transfer.destroy()
    return result


if __name__ == "__main__":
    mode, base_url, backend, model_dir, out = sys.argv[1:6]
    rounds = int(os.environ.get("ROUNDS", "3"))
    if mode == "trl":
        write_json(out, trl_steps(base_url, backend, model_dir, rounds))
        raise SystemExit(0)
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

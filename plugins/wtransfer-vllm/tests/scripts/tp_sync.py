"""An offline vLLM with tensor_parallel_size=2 synced by wtransfer, then a trainer killed before commit.

usage: tp_sync.py MODEL_DIR OUT_JSON ROUNDS [DELTA_FINAL_DIR] [DUMMY_DIR]

With DUMMY_DIR (a config-only copy of MODEL_DIR), vLLM starts from it with ``load_format="dummy"``
and the first round fills it.

1. The RL order: generate, ROUNDS rounds through ``LLMClient`` (trainer world_size 3: this process
   and vLLM's two TP workers, one host staging copy shared by both), generate twice.
2. Trainers in another process, driving this LLM over a pipe (JSON requests: a control plane
   as a user would write one), send changed weights and are SIGKILLed: one when the engine asks
   for the round's last tensor, one the moment vLLM says every TP worker received the round
   whole, before it can call finish_weight_update. No worker may commit, so vLLM must compute
   exactly what it computed before.
With DELTA_FINAL_DIR, ``delta_sync.delta_scenario`` and ``partial_sync.partial_scenario`` (the direct
load turned off: through vLLM's layerwise reload) run on the same engine between 1. and 2. (their results
under "delta" and "partial"): one TP=2 start.
Then ``torn_scenario`` (under "torn"): worker 1's commit fails while worker 0's lands, and the
trainer's next round heals it. The killed trainers must leave vLLM as it was just before them
("before_kills").
Writes outputs, vLLM's per-worker digests and versions at each point.
"""

import json
import multiprocessing
import os
import signal
import sys
import traceback

os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the torn scenario's hook travels to worker 1 as a callable

import cloudpickle
import stale_layer
import wtransfer
from stale_layer import STALE_LAYER, stale
from wtransfer_vllm import LLMClient
from wtransfer_vllm.testing import answers, checksums, greedy, llm_kwargs, load_trainer_model, perturb, write_json

cloudpickle.register_pickle_by_value(stale_layer)  # the hook travels whole to vLLM's workers

TP = 2
INIT_INFO = {"world_size": TP + 1, "timeout_s": 60, "bucket_bytes": 64 << 10}


class PipeClient:
    """The trainer's side of a pipe to the process that holds the ``LLM`` (JSON messages)."""

    def __init__(self, conn, die_after=None):
        self.conn, self.die_after = conn, die_after

    def _call(self, method, *args):
        self.conn.send_bytes(json.dumps({"method": method, "args": list(args)}).encode())
        reply = json.loads(self.conn.recv_bytes())
        if reply.get("error"):
            raise RuntimeError(reply["error"])
        if method == self.die_after:
            os.kill(os.getpid(), signal.SIGKILL)  # every TP worker has the round; finish never comes

    def init_weight_transfer_engine(self, info):
        self._call("init_weight_transfer_engine", info)

    def start_weight_update(self):
        self._call("start_weight_update")

    def update_weights(self, info):
        self._call("update_weights", info)

    def finish_weight_update(self):
        self._call("finish_weight_update")


class DiesAtLastTensor(wtransfer.ModuleSource):
    """Every bucket but the last is sent; the trainer dies when the engine asks for the last tensor
    (one TP worker may have released more of the round than the other by then)."""

    def __iter__(self):
        last = len(self.metadata()) - 1
        for index, item in enumerate(super().__iter__()):
            if index == last:
                os.kill(os.getpid(), signal.SIGKILL)
            yield item


def killed_trainer(conn, model_dir, when):
    model = load_trainer_model(model_dir)
    perturb(model, 99)
    if when == "before-finish":
        client, source = PipeClient(conn, die_after="update_weights"), wtransfer.ModuleSource(model)
    else:
        client, source = PipeClient(conn), DiesAtLastTensor(model)
    trainer = wtransfer.create_trainer("shm", client=client, source=source, init_info=INIT_INFO)
    trainer.send_weights()


def torn_scenario(llm, model_dir, rounds):
    """One TP worker's commit fails while the other's lands: vLLM must serve nothing until the
    trainer's next round, which must then compute exactly what a fresh TP=2 load of it does."""
    import torch

    final = load_trainer_model(model_dir)
    for step in range(rounds):
        perturb(final, step)  # the weights the TP=2 reference loaded
    model = load_trainer_model(model_dir)
    model.load_state_dict(final.state_dict())
    perturb(model, 77)  # the torn round's weights: neither the old nor the final ones
    held = llm.get_weight_version()  # what vLLM holds from the earlier scenarios' trainers
    trainer = wtransfer.create_trainer("shm", client=LLMClient(llm), source=wtransfer.ModuleSource(model),
                                       init_info=INIT_INFO)
    # worker 1's commit probe finds STALE_LAYER computing with other weights: its commit fails after
    # it loaded the round, while worker 0's lands
    result = {"stale_method": llm.collective_rpc(stale, args=(STALE_LAYER, True, 1)), "held_before": held}
    try:
        trainer.send_weights()
        result["error"] = None
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["torn_version"] = llm.get_weight_version()
    result["torn_answers"] = answers(llm)
    llm.collective_rpc(stale, args=(STALE_LAYER, False, 1))
    with torch.no_grad():
        model.load_state_dict(final.state_dict())
    result["healed_stats"] = trainer.send_weights()  # the same trainer's next round heals it
    result["healed_version"] = llm.get_weight_version()
    result["healed"] = greedy(llm)
    result["healed_answers"] = answers(llm)
    result["healed_checksums"] = checksums(llm)
    trainer.shutdown()
    return result


def serve_pipe(conn, client):
    """Run the trainer's calls on the LLM until the trainer is gone; returns the calls' outcomes."""
    calls = []
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return calls
        try:
            getattr(client, request["method"])(*request["args"])
            calls.append(request["method"])
            reply = {}
        except Exception as exc:
            calls.append(f"{request['method']}: {type(exc).__name__}")
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            conn.send_bytes(json.dumps(reply).encode())
        except OSError:  # the trainer died while the call ran
            return calls


if __name__ == "__main__":
    model_dir, out = sys.argv[1:3]
    rounds = int(sys.argv[3])
    delta_final = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
    dummy_dir = sys.argv[5] if len(sys.argv) > 5 else None
    from vllm import LLM

    start = {"load_format": "dummy"} if dummy_dir else {}
    llm = LLM(**llm_kwargs(dummy_dir or model_dir, tensor_parallel_size=TP, distributed_executor_backend="mp",
                           weight_transfer_config={"backend": "shm"}, **start))
    result = {"before": greedy(llm)}
    model = load_trainer_model(model_dir)
    trainer = wtransfer.create_trainer("shm", client=LLMClient(llm), source=wtransfer.ModuleSource(model),
                                       init_info=INIT_INFO)
    result["stats"] = []
    for step in range(rounds):
        perturb(model, step)
        result["stats"].append(trainer.send_weights())
    trainer.shutdown()
    llm.shutdown_weight_transfer_engine()
    result.update(after=greedy(llm), again=greedy(llm), checksums=checksums(llm),
                  weight_version=llm.get_weight_version())
    write_json(out, result)  # each scenario's part as soon as it is done
    if delta_final:
        from delta_sync import delta_scenario

        try:  # its own failure fails its own test, not this scenario's
            result["delta"] = delta_scenario(llm, "shm", model_dir, delta_final, tp=TP)
        except Exception:
            result["delta"] = {"error": traceback.format_exc()}
        write_json(out, result)
        from partial_sync import partial_scenario

        try:  # through the layerwise reload: the offline (TP=1) test loads directly where the host allows it
            result["partial"] = partial_scenario(llm, "shm", model_dir, rounds, tp=TP, direct_load=False)
        except Exception:
            result["partial"] = {"error": traceback.format_exc()}
        write_json(out, result)
    try:
        result["torn"] = torn_scenario(llm, model_dir, rounds)
    except Exception:
        result["torn"] = {"error": traceback.format_exc()}
    write_json(out, result)
    # what the killed trainers must leave as it is
    result["before_kills"] = {"outputs": greedy(llm), "checksums": checksums(llm),
                              "weight_version": llm.get_weight_version()}

    context = multiprocessing.get_context("spawn")
    result["kills"] = {}
    for when in ("last-tensor", "before-finish"):
        ours, theirs = context.Pipe()
        child = context.Process(target=killed_trainer, args=(theirs, model_dir, when))
        child.start()
        theirs.close()
        calls = serve_pipe(ours, LLMClient(llm))
        child.join(60)
        result["kills"][when] = {"calls": calls, "exitcode": child.exitcode, "outputs": greedy(llm),
                                 "checksums": checksums(llm), "weight_version": llm.get_weight_version()}
        if when == "last-tensor":  # the workers raised; their session ended with it (vLLM resets it)
            llm.shutdown_weight_transfer_engine()
    write_json(out, result)

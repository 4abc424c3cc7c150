"""Two offline vLLM instances behind one trainer (``FleetClient``), one instance's commit failing.

usage: fleet_sync.py MODEL_DIR OUT_JSON ROUNDS

Round 1 lands on both. For round 2 a test hook (through vLLM's collective_rpc) makes one layer of
instance 1 stale, so its commit probe fails the commit after the load: instance 0 holds round 2,
instance 1 is torn. The trainer's ``send_weights()`` must raise ``FleetCommitError`` saying so;
each instance's answers are recorded. The hook is removed and the same trainer sends the rest of
ROUNDS rounds (the final checkpoint's weights): both instances must then hold one version.
"""

import os
import sys

os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the hook travels to instance 1's worker as a callable

import cloudpickle
import stale_layer
import wtransfer
from stale_layer import STALE_LAYER, stale
from wtransfer_vllm import FleetClient, FleetCommitError, LLMClient
from wtransfer_vllm.testing import PROMPTS, answers, greedy, llm_kwargs, load_trainer_model, perturb, write_json

cloudpickle.register_pickle_by_value(stale_layer)  # the hook travels whole to vLLM's workers

if __name__ == "__main__":
    model_dir, out = sys.argv[1:3]
    rounds = int(sys.argv[3])
    from vllm import LLM

    llms = [LLM(**llm_kwargs(model_dir, weight_transfer_config={"backend": "shm"})) for _ in range(2)]
    model = load_trainer_model(model_dir)
    trainer = wtransfer.create_trainer("shm", client=FleetClient([LLMClient(llm) for llm in llms], workers=1),
                                       source=wtransfer.ModuleSource(model),
                                       init_info={"world_size": 3, "timeout_s": 60})
    perturb(model, 0)
    result = {"first": trainer.send_weights()["version"],
              "first_versions": [llm.get_weight_version() for llm in llms]}
    result["stale_method"] = llms[1].collective_rpc(stale, args=(STALE_LAYER,))
    perturb(model, 1)
    try:
        trainer.send_weights()
        result["error"] = None
    except FleetCommitError as exc:
        result.update(error=str(exc), error_versions=exc.versions)
    result["torn_versions"] = [llm.get_weight_version() for llm in llms]
    result["torn_answers"] = [answers(llm, PROMPTS[:3], max_tokens=4) for llm in llms]
    llms[1].collective_rpc(stale, args=(STALE_LAYER, False))
    result["stats"] = []
    for step in range(2, rounds):
        perturb(model, step)
        result["stats"].append(trainer.send_weights())
    trainer.shutdown()
    result["versions"] = [llm.get_weight_version() for llm in llms]
    result["outputs"] = [greedy(llm) for llm in llms]
    write_json(out, result)

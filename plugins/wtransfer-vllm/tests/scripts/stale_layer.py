"""A layer made stale on purpose: the commit probe must fail the round and name it; and a layer whose
kernel reads a copy of its weight: the direct load must refuse it, and the round still land.

usage: stale_layer.py MODEL_DIR OUT_JSON LAYER [LAYER ...]

First, a round whose load fails part-way: the model's ``load_weights`` writes the first half of the
round's tensors, then raises (as a load that runs out of memory would). vLLM must then hold no version
and refuse requests, naming the torn weights, while the layers whose tensors were written compute with
the failed round's weights and the others with the round before; the next round must land, bring every
layer checked to its weights (those whose vLLM weight is a trainer tensor as is: not fused), and serve.

Then, with the direct load allowed, the first LAYER is made to compute from a copy of its weight made
whenever it is processed (as vLLM's packed GEMM kernels do on hosts with AVX-512 or AMX), and a round is
sent: a plain ``load_weights`` would leave that layer computing with the old copy, so the direct load must
refuse and the layerwise reload (which processes the layer again) must bring the round's weights in.

Then a test-only hook is put on one layer of vLLM's model (through vLLM's collective_rpc): when the
layer's weights are processed after loading, the weight it is processed from is scaled first, so
vLLM computes with something other than the round's weights, on every host (the way a packed
GEMM weight or a tied head that was not rebuilt would), and a round is sent: once per LAYER with
the probe on, once more for the first LAYER with it off (to show what goes unnoticed without it),
then a round with no stale layer, which must land.
"""

import os
import sys

os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the test's hook travels to the worker as a callable

import wtransfer
from wtransfer_vllm import LLMClient
from wtransfer_vllm.testing import PROMPTS, answers, greedy, llm_kwargs, load_trainer_model, perturb, write_json


STALE_LAYER = "model.layers.0.mlp.down_proj"
"""The layer the torn-commit scenarios make stale on one worker (a row-parallel linear layer)."""


def stale(worker, layer_name, on=True, rank=None):
    """The hook, run on vLLM's workers (``rank``'s only, if given): once on, ``layer_name``'s weight
    is scaled before vLLM processes it, so the kernel computes with something other than what was
    loaded; ``on=False`` removes it. Returns the layer's method class name where it acted.

    Only vLLM's layerwise reload processes weights, so while the hook is on that worker's direct load
    is off (``WTRANSFER_VLLM_DIRECT_LOAD=0``): a direct load would never meet the fault."""
    if rank is not None and worker.rank != rank:
        return None
    method = dict(worker.model_runner.model.named_modules())[layer_name].quant_method
    if not on:
        del method.process_weights_after_loading
        os.environ.pop("WTRANSFER_VLLM_DIRECT_LOAD", None)
        return None
    os.environ["WTRANSFER_VLLM_DIRECT_LOAD"] = "0"
    process = type(method).process_weights_after_loading

    def stale_process(layer, *args, **kwargs):
        layer.weight.data.mul_(0.5)  # what the kernel gets is not what was loaded
        return process(method, layer, *args, **kwargs)

    method.process_weights_after_loading = stale_process
    return type(method).__name__


def packs(worker, layer_name, on=True):
    """The hook, run on vLLM's workers: once on, ``layer_name`` computes from a copy of its weight, made
    now and again each time vLLM processes the layer's weights (from the weight as loaded); ``on=False``
    removes it. Returns the layer's method class name, or None where vLLM already packs that layer's
    weight itself (its ``layer.weight`` is empty: nothing to copy, and the direct load is refused for it)."""
    import torch

    layer = dict(worker.model_runner.model.named_modules())[layer_name]
    method = layer.quant_method
    if not on:
        if "apply" in vars(method):
            del method.apply, method.process_weights_after_loading
        return None
    if layer.weight.numel() == 0:
        return None
    process = type(method).process_weights_after_loading

    def pack(weight):
        copy = weight.detach().clone()
        method.apply = lambda layer, x, bias=None: torch.nn.functional.linear(x, copy, bias)

    def packing_process(layer, *args, **kwargs):
        loaded = layer.weight.detach().clone()  # as loaded: vLLM's own processing may empty layer.weight
        result = process(method, layer, *args, **kwargs)
        pack(loaded)
        return result

    pack(layer.weight)
    method.process_weights_after_loading = packing_process
    return type(method).__name__


def fails_part_way(worker, on=True):
    """The hook, run on vLLM's workers: once on, the model's ``load_weights`` loads the first half of the
    tensors it is given, then raises; ``on=False`` removes it and returns the names it loaded."""
    model = worker.model_runner.model
    if not on:
        del model.load_weights
        return model.__dict__.pop("loaded_part_way", None)
    load = type(model).load_weights

    def failing(weights):
        weights = list(weights)
        model.loaded_part_way = [name for name, _ in weights[: len(weights) // 2]]
        load(model, weights[: len(weights) // 2])
        raise RuntimeError("test hook: load_weights failed part-way")

    model.load_weights = failing


def computes_with(worker, layer_name, rows):
    """The relative error between what ``layer_name`` computes (its kernel, as vLLM serves with it) on a
    random row and that row times the trainer's weight (``rows``: its values, as lists)."""
    import torch

    from wtransfer_vllm.probe import kernel_output, relative_error

    layer = dict(worker.model_runner.model.named_modules())[layer_name]
    weight = torch.tensor(rows, dtype=layer.weight.dtype)
    row = torch.randn((1, weight.shape[1]), generator=torch.Generator().manual_seed(7)).to(weight.dtype)
    with torch.no_grad():
        return relative_error(kernel_output(layer, row, slice(None)), row.float() @ weight.float().T)


def set_probe(worker, on):
    os.environ["WTRANSFER_VLLM_PROBE"] = "1" if on else "0"


def one_round(llm, model, step):
    trainer = wtransfer.create_trainer("shm", client=LLMClient(llm), source=wtransfer.ModuleSource(model),
                                       init_info={"world_size": 2, "timeout_s": 60})
    perturb(model, step)
    try:
        trainer.send_weights()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    model_dir, out = sys.argv[1:3]
    layers = sys.argv[3:]
    from vllm import LLM

    llm = LLM(**llm_kwargs(model_dir, weight_transfer_config={"backend": "shm"}))
    model = load_trainer_model(model_dir)
    result = {"before": greedy(llm), "rounds": []}
    parameters = dict(model.named_parameters())

    def errors(names):  # what each layer computes with, against the trainer's weights as they are now
        return {name: llm.collective_rpc(computes_with, args=(name, parameters[f"{name}.weight"].detach().float()
                                                               .tolist()))[0] for name in names}

    unfused = ["model.embed_tokens", *(f"model.layers.{index}.{part}" for index in (0, 1)
                                       for part in ("self_attn.o_proj", "mlp.down_proj"))]
    llm.collective_rpc(fails_part_way)
    torn = {"error": one_round(llm, model, 30), "version": llm.get_weight_version(),
            "answers": answers(llm, PROMPTS[:2], max_tokens=4), "errors": errors(unfused)}
    torn["loaded"] = llm.collective_rpc(fails_part_way, args=(False,))[0]
    torn.update(healed_error=one_round(llm, model, 31), healed_version=llm.get_weight_version(),
                healed_errors=errors(unfused), healed_answers=answers(llm, PROMPTS[:2], max_tokens=4))
    result["part_way"] = torn
    method = llm.collective_rpc(packs, args=(layers[0],))[0]
    error = one_round(llm, model, 20)
    result["packed"] = {"layer": layers[0], "method": method, "error": error,
                        "relative_error": errors([layers[0]])[layers[0]]}
    llm.collective_rpc(packs, args=(layers[0], False))
    for step, (layer, probe) in enumerate([(name, True) for name in layers] + [(layers[0], False)]):
        llm.collective_rpc(set_probe, args=(probe,))
        method = llm.collective_rpc(stale, args=(layer,))[0]
        result["rounds"].append({"layer": layer, "method": method, "probe": probe,
                                 "error": one_round(llm, model, step)})
        llm.collective_rpc(stale, args=(layer, False))
    llm.collective_rpc(set_probe, args=(True,))
    result["healed_error"] = one_round(llm, model, 10)
    result["after_heal"] = greedy(llm)
    write_json(out, result)

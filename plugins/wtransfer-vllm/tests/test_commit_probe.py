"""The commit probe: a layer that computes with anything but the round's weights fails the round, by name.
And the direct load: a layer whose kernel reads a copy of its weight sends rounds through the layerwise reload.

A test hook (``scripts/stale_layer.py``) makes one layer stale on purpose, on every host: the
weight it is processed from after loading is scaled, as a packed GEMM weight or a tied head that a
reload did not rebuild would be. With the probe on, the round fails and names the layer; with it
off, the same round "succeeds" while vLLM computes with the wrong weight. Before those, the same script
makes one layer compute from a copy of its weight made whenever it is processed (as packed GEMM weights
are): a direct ``load_weights`` would leave it computing with the old copy. First of all, a round whose
``load_weights`` raises part-way (a direct load where vLLM's kernels allow it) must leave vLLM torn, serving
nothing, and the next round must heal it (the layers checked: those not fused by vLLM).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_harness import cpu_flags, run_script
from wtransfer_vllm.probe import TOLERANCE

LINEAR = "model.layers.0.mlp.down_proj"
TIED_HEAD = "model.embed_tokens"  # the tiny Llama ties its LM head to the embedding: the logits path


def test_a_stale_layer_fails_the_round_naming_it_and_goes_unnoticed_without_the_probe(
    vllm_python: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    print(f"host CPU flags: {cpu_flags()}")
    out = tmp_path / "stale.json"
    run = run_script(vllm_python, "stale_layer.py", str(tiny_llama), str(out), LINEAR, TIED_HEAD, timeout=900)
    result = json.loads(out.read_text())
    log = run.stdout + run.stderr

    part_way = result["part_way"]  # a load that raised after writing half the round
    print(f"the round that failed part-way: {part_way['error']}; layers against its weights: {part_way['errors']}; "
          f"after the next round, against that round's: {part_way['healed_errors']}")
    assert part_way["error"] and "torn" in part_way["error"], part_way["error"]
    assert part_way["version"] is None
    assert all(answer["finish_reason"] == "error" and "weights are torn" in str(answer["stop_reason"])
               for answer in part_way["answers"]), part_way["answers"]
    new = {layer for layer in part_way["errors"] if f"{layer}.weight" in part_way["loaded"]}
    assert new and new != set(part_way["errors"]), part_way["loaded"]  # the checked layers span both halves
    for layer, error in part_way["errors"].items():  # torn indeed: the written layers new, the others old
        assert (error <= TOLERANCE) == (layer in new), (layer, error, part_way["loaded"])
    assert part_way["healed_error"] is None and part_way["healed_version"] is not None, part_way
    assert all(error <= TOLERANCE for error in part_way["healed_errors"].values()), part_way["healed_errors"]
    assert all(answer["finish_reason"] == "length" and answer["versions"] == [[part_way["healed_version"], 0, 4]]
               for answer in part_way["healed_answers"]), part_way["healed_answers"]

    packed = result["packed"]  # the direct load allowed, LINEAR computing from a copy of its weight
    print(f"the packed round: {packed}")
    assert packed["error"] is None, packed
    assert packed["relative_error"] <= TOLERANCE, f"{LINEAR} still computes with its old copy: {packed}"
    refusal = log.partition("rounds go through vLLM's layerwise reload: ")[2].partition("\n")[0]
    print(f"the direct load's verdict: {refusal or 'accepted'}")
    assert refusal, "the direct load was not refused"
    if packed["method"] is None:  # vLLM packs LINEAR itself on this host (its weight emptied): no hook was put
        assert " keeps no 2-D weight of its own" in refusal, refusal
    else:  # the hook's copy, or (where vLLM packs some other layers) an emptied weight
        assert packed["method"] == "UnquantizedLinearMethod", packed
        assert (refusal.startswith(f"{LINEAR}: its kernel does not read the live weight")
                or " keeps no 2-D weight of its own" in refusal), refusal
    if refusal.startswith(f"{LINEAR}: its kernel does not read the live weight"):  # accepted until the hook
        assert "rounds load directly" in log.partition(refusal)[0], "the part-way rounds were not direct loads"
    linear, head, unprobed = result["rounds"]

    assert linear["method"] == "UnquantizedLinearMethod" and head["method"] == "UnquantizedEmbeddingMethod"
    for stale in (linear, head):
        assert stale["error"] is not None, f"a stale {stale['layer']} went unnoticed"
        assert "do not compute with the round's weights" in stale["error"], stale["error"]
        assert stale["layer"] in stale["error"], stale["error"]
    assert head["layer"] + " (" in head["error"] and LINEAR + " (" not in head["error"]  # only the stale one
    assert unprobed["probe"] is False and unprobed["error"] is None  # what the probe is for

    assert result["healed_error"] is None
    assert result["after_heal"] != result["before"]

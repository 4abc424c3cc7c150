"""Offline ``vllm.LLM(weight_transfer_config={"backend": ...})`` synced by ``wtransfer.create_trainer``.

The trainer (transformers, bf16, same process) perturbs every parameter and syncs ROUNDS rounds through
``wtransfer_vllm.LLMClient``: with ``wtransfer.create_trainer`` (shm, ``share_source=True``: its tensors live in the
staged copy), and with vLLM's own ``WeightTransferTrainerFactory.trainer_init`` and vLLM's ``ModuleSource`` (gloo).
Then the trainer halves its weights in place (training on) while vLLM generates: vLLM must compute exactly what a
fresh vLLM loaded from the trainer's last round computes: the same greedy tokens, the same logprobs to the last
bit, and vLLM's own weight digests.

The shm engine then serves a ``delta=True`` trainer too (one vLLM start for both scenarios; the
TP=2 delta scenario runs on test_tensor_parallel's engine).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from vllm_harness import ROUNDS, EngineRun, cpu_flags, engine_run, run_script, vllm_env


def offline_run(python: Path, model: Path, out_dir: Path, backend: str, via: str, delta: bool = False,
                dummy: Path | None = None) -> EngineRun:
    out = out_dir / "result.json"
    return engine_run(python, "offline_sync.py", out, backend, str(model), str(out_dir / "final"), str(out), str(ROUNDS),
                      via, str(out_dir / "delta-final") if delta else "", *([str(dummy)] if dummy else []))


@pytest.fixture(scope="module")
def shm_engine(vllm_python: Path, tiny_llama: Path, config_only_llama: Path,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, EngineRun]:
    """One offline shm LLM, three scenarios in turn: ``create_trainer``'s rounds, a delta trainer's,
    a partial trainer's. It starts as an RL rollout engine does, ``load_format="dummy"`` from a
    directory with no weights in it: the first round fills it, checked against vLLM's own model."""
    out_dir = tmp_path_factory.mktemp("shm-engine")
    assert not [f for f in config_only_llama.iterdir() if f.suffix in (".safetensors", ".bin", ".pt")]
    return out_dir, offline_run(vllm_python, tiny_llama, out_dir, "shm", "wtransfer", delta=True,
                                dummy=config_only_llama)


@pytest.mark.parametrize(("backend", "via"), [("shm", "wtransfer"), ("gloo", "vllm-factory")])
def test_offline_llm_computes_exactly_the_trainers_weights(
    backend: str, via: str, vllm_python: Path, tiny_llama: Path, final_checkpoint: Path, reference: dict, tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    if backend == "shm":  # its engine then serves the delta scenario, whose test checks how the script ended
        out_dir, run = request.getfixturevalue("shm_engine")
    else:
        out_dir, run = tmp_path, offline_run(vllm_python, tiny_llama, tmp_path, backend, via)
        run.assert_clean_exit()
    run.part("stats")
    result = run.result

    # The trainer ended where the reference checkpoint is (same deterministic steps).
    ours, theirs = load_file(out_dir / "final" / "model.safetensors"), load_file(final_checkpoint / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)

    assert result["before"] != result["after"], "the sync changed nothing vLLM computes"
    # Before the sync, repeating a block-filling prompt hit vLLM's prefix cache: the condition is
    # forced, not left to the host. After it, no request may read KV computed with the old weights.
    assert all(cached >= 32 for cached in result["cached_before"]), result["cached_before"]
    assert result["after"] == reference["outputs"]  # tokens and logprobs, exactly
    assert result["again"] == reference["outputs"]  # and again, from the cache refilled with new-weight KV
    assert result["checksums"] == reference["checksums"]  # vLLM's digests, for what they cover
    assert result["weight_version"] == str(ROUNDS)
    stats = result["stats"]
    if backend == "shm":  # the trainer's bf16 tensors travel uncast: each lived in the staged copy (share_source)
        assert result["shared_tensors"] == stats[0]["tensors"], (result["shared_tensors"], stats[0]["tensors"])
    assert [s["version"] for s in stats] == list(range(1, ROUNDS + 1))
    assert all(s["bytes"] == sum(t.numel() * t.element_size() for t in theirs.values()) for s in stats)


def test_delta_rounds_after_adamw_steps_make_vllm_compute_exactly_a_fresh_load(
    vllm_python: Path, shm_engine: tuple[Path, EngineRun]
) -> None:
    """``delta=True`` inside vLLM: the rounds after the first carry only what AdamW changed (the
    frozen embedding nothing), the bridge loads them (directly, leaving the rest in place, where the host
    allows it; else with the rest from its committed copy), and vLLM then computes exactly what a fresh vLLM
    loaded from the trainer's weights computes."""
    print(f"host CPU flags: {cpu_flags()}")
    out_dir, run = shm_engine
    check_delta_scenario(vllm_python, run.part("delta"), out_dir / "delta-final", tp=1)
    run.assert_clean_exit()


def test_partial_rounds_keep_what_they_leave_out_and_equal_a_fresh_load(
    shm_engine: tuple[Path, EngineRun], reference: dict
) -> None:
    """``partial=True`` inside vLLM: rounds of only the MLP weights, then of everything but the
    embedding, then of only the q_proj weights (one part of each fused qkv_proj), merged with what vLLM
    committed before, equal a fresh load of the merged weights. Where the host allows the direct load,
    each round loads only its tensors (the TP=2 test runs the same rounds through the layerwise reload)."""
    _, run = shm_engine
    check_partial_scenario(run.part("partial"), reference)
    run.assert_clean_exit()


def check_loads(first: list[str], later: list[list[str]], direct_load: bool) -> None:
    """How each of vLLM's workers loaded a partial or delta trainer's rounds (its first, whole, then ``later``):
    directly where the direct load is allowed and this host's kernels read the live weights, each later round
    then loading only its own tensors (the kept copy filled by the first); else through the layerwise reload."""
    print(f"how the workers loaded each round: {[first, *later]}")
    if direct_load and all(how.startswith("direct load") for how in first):
        assert first == ["direct load"] * len(first), first  # nothing kept yet: the round was whole
        for hows in later:
            assert all(re.fullmatch(r"direct load, \d+ kept tensors left in place", how) for how in hows), later
    else:  # turned off, or refused by this host (where vLLM packs its GEMM weights)
        assert all(how == "layerwise reload" for hows in [first, *later] for how in hows), [first, *later]


def check_partial_scenario(result: dict, reference: dict) -> None:
    """What ``scripts/partial_sync.py``'s scenario must show, at any TP (``reference``: a fresh load
    of the reference checkpoint at that TP)."""
    assert "error" not in result, f"the partial scenario raised:\n{result['error']}"
    loads = result["loads"]
    print(f"host CPU flags: {cpu_flags()}; direct load {'allowed' if result['direct_load'] else 'off'}")
    check_loads(loads["whole"], [loads[label] for label in ("mlp", "rest elsewhere", "rest", "q elsewhere", "q")],
                result["direct_load"])
    outputs, stats = result["outputs"], result["stats"]
    assert outputs["whole"] != reference["outputs"]  # its MLP weights were elsewhere
    assert outputs["mlp"] == reference["outputs"]  # only the MLP travelled: the rest was kept
    assert outputs["rest elsewhere"] != reference["outputs"]
    assert outputs["rest"] == reference["outputs"]  # the embedding kept since the first round
    assert outputs["q elsewhere"] != reference["outputs"]
    assert outputs["q"] == reference["outputs"]  # k and v of each fused qkv_proj kept
    assert result["checksums"] == reference["checksums"]
    assert stats[1]["bytes"] == result["mlp_bytes"] < stats[0]["bytes"]  # the wire carried the subset only
    assert stats[3]["tensors"] < stats[0]["tensors"]
    # vLLM started without a checkpoint: each refusal is its own model's verdict, before a byte moved
    # each as the workers' own ManifestMismatchError, one line per cause, what to do last
    refused = result["refused"]
    assert all(r.startswith("ManifestMismatchError: client.") for r in refused.values()), refused
    assert re.search(r"unknown tensor, .*\(1 tensor\): 'model\.layers\.0\.mlp\.down_proj\.wieght'", refused["unknown"])
    assert re.search(r"shape \[\d+, \d+\] .*\(1 tensor\): 'model\.layers\.0\.mlp\.down_proj\.weight'", refused["shape"])
    # every tensor cast to float16 where vLLM serves bfloat16: one line for all, every worker named once
    dtype = refused["dtype"].splitlines()
    assert re.match(r"ManifestMismatchError: client\.\w+\(\) failed on the workers: workers? 0(, 1)?: ", dtype[0]), dtype
    (cast,) = [line for line in dtype if "float16" in line]
    assert cast.startswith("- dtype float16, neither the ") and f"({result['tensors']} tensors): '" in cast, dtype
    assert dtype[-1].startswith("What to do: leave create_trainer's dtype= unset"), dtype
    assert len(dtype) == 3 and len(refused["dtype"]) < 1000, refused["dtype"]
    filled = re.search(r"model\.layers\.0\.self_attn\.qkv_proj\.weight \((\d+)/(\d+) elements\)", refused["incomplete"])
    assert filled and 0 < int(filled[1]) < int(filled[2]), refused  # q and k loaded, v's part not
    assert outputs["after refused"] == reference["outputs"]


def check_delta_scenario(python: Path, result: dict, final: Path, tp: int) -> None:
    """What ``scripts/delta_sync.py``'s scenario must show, at any TP (a fresh load at that TP is the reference)."""
    assert "error" not in result, f"the delta scenario raised:\n{result['error']}"
    fresh = final.parent / "delta-fresh.json"
    run_script(python, "reference.py", str(final), str(fresh), json.dumps({"tensor_parallel_size": tp}),
               env=vllm_env(tp))
    reference = json.loads(fresh.read_text())

    stats = result["stats"]
    assert [s["delta"] for s in stats] == ["full", "delta", "delta", "delta"], [s.get("delta_refused") for s in stats]
    check_loads(result["loads"][0], result["loads"][1:], direct_load=True)
    for s in stats[1:3]:
        assert s["sparse_tensors"] > 0 and s["unchanged_tensors"] >= 4 and s["wire_bytes"] < 0.5 * s["bytes"], s
    assert stats[3]["wire_bytes"] == 0
    assert result["before"] != result["after"], "the sync changed nothing vLLM computes"
    assert result["after"] == reference["outputs"]  # tokens and logprobs, exactly
    assert result["again"] == reference["outputs"]  # after a round that carried nothing
    assert result["checksums"] == reference["checksums"]  # vLLM's digests (every worker's), for what they cover
    if tp > 1:
        assert any(key.startswith("worker 1/") for key in result["checksums"])
    # a new trainer on an LLM that earlier rounds synced: it numbers past them (labels only go up)
    versions = [s["version"] for s in stats]
    assert versions == list(range(versions[0], versions[0] + 4)) and versions[0] > ROUNDS, versions
    assert result["weight_version"] == str(versions[-1])


def test_a_fleet_whose_commit_fails_on_one_instance_says_where_each_stands_and_the_next_round_rejoins_them(
    vllm_python: Path, tiny_llama: Path, reference: dict, tmp_path: Path
) -> None:
    """Two offline ``LLM``s behind one trainer (``FleetClient``). Instance 1's commit fails (its probe
    finds a layer computing with other weights) while instance 0's lands: ``send_weights()`` raises
    ``FleetCommitError`` naming what each holds, instance 0 answers at the new version, instance 1
    refuses (torn); the trainer's next rounds bring both to one version, computing exactly what a
    fresh load of the trainer's final weights computes."""
    print(f"host CPU flags: {cpu_flags()}")
    out = tmp_path / "fleet.json"
    run_script(vllm_python, "fleet_sync.py", str(tiny_llama), str(out), str(ROUNDS), timeout=600)
    result = json.loads(out.read_text())
    assert result["first"] == 1 and result["first_versions"] == ["1", "1"]
    assert result["stale_method"] == ["UnquantizedLinearMethod"]
    assert result["error"] is not None and result["error_versions"] == ["2", None], result
    assert "instance 0: version 2 (committed)" in result["error"], result["error"]
    assert "instance 1: no version (torn" in result["error"], result["error"]
    assert result["torn_versions"] == ["2", None]
    assert all(a["finish_reason"] == "length" and a["versions"] == [["2", 0, 4]] for a in result["torn_answers"][0])
    assert all(a["finish_reason"] == "error" and "weights are torn" in a["stop_reason"]
               for a in result["torn_answers"][1]), result["torn_answers"][1]
    assert [s["version"] for s in result["stats"]] == list(range(3, ROUNDS + 1))
    assert result["versions"] == [str(ROUNDS)] * 2
    assert result["outputs"] == [reference["outputs"]] * 2

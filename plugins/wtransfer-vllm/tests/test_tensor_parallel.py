"""vLLM with ``tensor_parallel_size=2`` (two worker processes, one host staging copy) synced by wtransfer.

In the RL order (generate, sync, generate) vLLM must compute exactly what a fresh TP=2 load of the
trainer's final checkpoint computes, tokens, logprobs and vLLM's own per-worker digests; and a
trainer killed at the round's last tensor, or after every TP worker received the round whole but
before it could commit, must leave vLLM computing exactly what it computed before (no worker
commits alone). The same TP=2 engine then serves a ``delta=True`` trainer (one TP=2 start for both).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_offline_sync import check_delta_scenario, check_partial_scenario
from vllm_harness import ROUNDS, EngineRun, cpu_flags, engine_run, run_script, tp_env


@pytest.fixture(scope="module")
def reference_tp2(vllm_python: Path, final_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("reference-tp2") / "reference.json"
    run_script(vllm_python, "reference.py", str(final_checkpoint), str(out), json.dumps({"tensor_parallel_size": 2}),
               env=tp_env())
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tp2_engine(vllm_python: Path, tiny_llama: Path, config_only_llama: Path,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, EngineRun]:
    """One TP=2 LLM, its scenarios in turn: the RL-order sync, a delta trainer's rounds, a partial
    trainer's, the killed trainers. It starts ``load_format="dummy"`` from a directory with no
    weights: the first round fills it, each worker checking it against its shard of vLLM's model."""
    out_dir = tmp_path_factory.mktemp("tp2-engine")
    return out_dir, engine_run(vllm_python, "tp_sync.py", out_dir / "tp.json", str(tiny_llama), str(out_dir / "tp.json"),
                               str(ROUNDS), str(out_dir / "delta-final"), str(config_only_llama), env=tp_env())


def test_tp2_sync_equals_a_fresh_tp2_load_and_a_trainer_killed_before_commit_changes_nothing(
    tp2_engine: tuple[Path, EngineRun], reference_tp2: dict
) -> None:
    print(f"host CPU flags: {cpu_flags()}")
    _, run = tp2_engine
    run.part("kills")  # the last scenario: it ran, and the script ended cleanly
    run.assert_clean_exit()
    result = run.result

    assert result["before"] != result["after"], "the sync changed nothing vLLM computes"
    assert result["after"] == reference_tp2["outputs"]  # tokens and logprobs, exactly
    assert result["again"] == reference_tp2["outputs"]  # from the prefix cache refilled after the sync
    assert any(key.startswith("worker 1/") for key in result["checksums"])  # both shards, neither overwritten
    assert result["checksums"] == reference_tp2["checksums"]
    assert [s["workers"] for s in result["stats"]] == [2] * ROUNDS
    assert result["weight_version"] == str(ROUNDS)

    # Killed at the last tensor: the round failed on the workers, nothing committed.
    last = result["kills"]["last-tensor"]
    assert last["exitcode"] == -9
    assert last["calls"][:2] == ["init_weight_transfer_engine", "start_weight_update"]
    assert last["calls"][2].startswith("update_weights: "), last["calls"]  # the workers raised
    # Killed after both TP workers had the round whole, before finish: still nothing committed.
    whole = result["kills"]["before-finish"]
    assert whole["calls"] == ["init_weight_transfer_engine", "start_weight_update", "update_weights"]
    assert whole["exitcode"] == -9
    for kill in (last, whole):  # what vLLM computed, held and said just before the killed trainers
        for key in ("outputs", "checksums", "weight_version"):
            assert kill[key] == result["before_kills"][key], key


def test_tp2_delta_rounds_after_adamw_steps_make_vllm_compute_exactly_a_fresh_tp2_load(
    vllm_python: Path, tp2_engine: tuple[Path, EngineRun]
) -> None:
    """``delta=True`` at TP=2: both of vLLM's workers rebuild the same deltas on their own copies and
    each loads its shard of every tensor (a fresh TP=2 load of the trainer's weights is the reference)."""
    print(f"host CPU flags: {cpu_flags()}")
    out_dir, run = tp2_engine
    check_delta_scenario(vllm_python, run.part("delta"), out_dir / "delta-final", tp=2)


def test_tp2_partial_rounds_keep_what_they_leave_out_and_equal_a_fresh_tp2_load(
    tp2_engine: tuple[Path, EngineRun], reference_tp2: dict
) -> None:
    """``partial=True`` at TP=2, through vLLM's layerwise reload (the direct load turned off on its workers): each
    worker completes the touched layers from its own committed copy. (The offline test at TP=1 loads directly
    where the host allows it: then only the round's tensors are loaded.)"""
    print(f"host CPU flags: {cpu_flags()}")
    _, run = tp2_engine
    check_partial_scenario(run.part("partial"), reference_tp2)


def test_tp2_commit_failing_on_one_worker_serves_nothing_until_the_next_round_heals_it(
    tp2_engine: tuple[Path, EngineRun], reference_tp2: dict
) -> None:
    """Worker 1's commit fails (its probe finds a layer computing with other weights) after worker 0's
    landed: a mix of two versions. vLLM must report no version and answer no request from it (each
    ends with an error saying the weights are torn); the same trainer's next round restores service,
    under the trainer's version, computing exactly what a fresh TP=2 load computes."""
    print(f"host CPU flags: {cpu_flags()}")
    _, run = tp2_engine
    torn = run.part("torn")
    assert torn["stale_method"][1] == "UnquantizedLinearMethod", torn["stale_method"]  # worker 1 only
    assert torn["stale_method"][0] is None
    assert torn["error"] and "The model is torn" in torn["error"] and "worker 1" in torn["error"], torn["error"]
    assert torn["torn_version"] is None
    for answer in torn["torn_answers"]:  # refused, saying why; not one token from the mixed model
        assert answer["finish_reason"] == "error" and answer["tokens"] == [], answer
        assert "weights are torn" in str(answer["stop_reason"]), answer
    stats = torn["healed_stats"]
    held = int(torn["held_before"])  # what the earlier scenarios' trainers left: this new trainer numbers past it
    assert f"version {held + 1}, torn" in torn["error"], torn["error"]  # the new trainer's first round
    assert stats["version"] == held + 2  # worker 0 holds held + 1: the next round is not numbered that again
    assert torn["healed_version"] == str(stats["version"])
    assert torn["healed"] == reference_tp2["outputs"]
    assert torn["healed_checksums"] == reference_tp2["checksums"]
    for answer in torn["healed_answers"]:  # every token labelled with the version that computed it
        assert answer["finish_reason"] == "length" and answer["versions"] == [[str(stats["version"]), 0, 8]], answer

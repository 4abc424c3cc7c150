"""TRL 1.16's own ``GRPOTrainer`` with vLLM inside its process (``vllm_mode="colocate"``), its syncs
made wtransfer rounds by ``wtransfer_vllm.trl.use_in_grpo_trainer``; the server mode runs against
test_serve's ``vllm serve``."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_harness import cpu_flags, run_script, vllm_env


def test_a_colocated_grpo_trainer_leaves_vllm_computing_exactly_a_fresh_load_of_its_final_weights(
    vllm_python: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """fp32 masters, three GRPO steps, a sync before each and one after: every sync is a numbered
    wtransfer round, cast to vLLM's bf16 as it is packed, and vLLM then computes what a fresh load
    of the trainer's final weights computes (in the configuration TRL built it with), token for
    token and logprob for logprob."""
    out, final, fresh = tmp_path / "grpo.json", tmp_path / "final", tmp_path / "fresh.json"
    run_script(vllm_python, "grpo_run.py", "colocate", str(tiny_llama), str(final), str(out), timeout=900,
               env=vllm_env())
    result = json.loads(out.read_text())
    run_script(vllm_python, "reference.py", str(final), str(fresh), json.dumps(result["llm_kwargs"]),
               str(result["threads"]), env=vllm_env())
    reference = json.loads(fresh.read_text())["outputs"]
    print(f"CPU flags: {cpu_flags()}; seconds per sync: {result['seconds']}")
    # wtransfer's rounds ran (TRL's own sync labels nothing): one per sync, numbered global_step + 1
    assert [s["version"] for s in result["stats"]] == [1, 2, 3, 4]
    assert result["weight_version"] == "4"
    assert result["after_first"] == result["before"]  # the sync at step 0 sends the checkpoint's own weights
    assert result["after"] != result["before"]  # training moved them
    assert result["after"] == reference
    assert all(s["cast_tensors"] == s["tensors"] for s in result["stats"]), result["stats"]

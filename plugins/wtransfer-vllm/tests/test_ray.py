"""vLLM in a Ray actor, driven by vLLM's unchanged ``RayVLLMWeightSyncClient`` (Ray is installed in
the tests' vLLM environment), synced over shm: the same exactness as the other clients."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_harness import ROUNDS, run_script


def test_ray_actor_synced_through_vllms_ray_client(
    vllm_python: Path, tiny_llama: Path, reference: dict, tmp_path: Path
) -> None:
    out = tmp_path / "ray.json"
    run_script(vllm_python, "ray_sync.py", "shm", str(tiny_llama), str(out), str(ROUNDS))
    result = json.loads(out.read_text())
    assert result["after"] == reference["outputs"]  # tokens and logprobs, exactly
    assert result["weight_version"] == str(ROUNDS)

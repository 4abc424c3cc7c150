"""The name vLLM's prefix cache and KV connectors key to (the salt) names the whole model state."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_harness import run_script


def test_two_model_states_never_share_a_salt(vllm_python: Path) -> None:
    """With checksums on, an empty partial round after weights A and one after weights B were named alike (a digest
    of the round's own, empty, entries), so ``in_flight="keep"`` or a failed cache reset could serve KV computed
    at A to a model holding B. The name now derives from the engine's content identity."""
    out = run_script(vllm_python, "salt_states.py", timeout=300)
    rounds = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["version"] for r in rounds] == [1, 2, 3, 4]
    assert rounds[1]["held"] == {"a": 1.0, "b": 1.0} and rounds[3]["held"] == {"a": 2.0, "b": 2.0}
    weights = [r["weights"] for r in rounds]
    assert None not in weights and len(set(weights)) == 4, weights
    assert weights[0].startswith("weights:") and weights[2].startswith("weights:")  # whole, checksummed: content

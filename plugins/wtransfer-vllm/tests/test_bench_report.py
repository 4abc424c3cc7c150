"""The vLLM sync benchmark's verdicts and phase breakdown, from measured rows (no vLLM needed)."""

from __future__ import annotations

import argparse
import copy
from typing import Any

from wtransfer_vllm.bench import FLOOR, report

OUTPUTS = [{"tokens": [1, 2], "logprobs": [-0.5, -0.25]}]
ARGS = argparse.Namespace(model="qwen2-0.5b", rounds=3, target=3.0, floor_target=1.2, json=False)


def _rounds(seconds: list[float], phases: dict[str, float] | None = None) -> list[dict[str, Any]]:
    return [{"seconds": s, "bytes": 10**9, "extra_rss": 0, **({"phases": phases} if phases else {})} for s in seconds]


RESULTS = {
    "wtransfer shm": {
        "rounds": _rounds([1.1, 1.0, 1.2], {"plan": 0.01, "start": 0.02, "send": 0.3, "commit": 0.6}),
        "outputs": OUTPUTS,
        "worker_log": [f"{mb} MB loaded into the model in {s} s" for mb, s in ((988.0, 0.5), (988.0, 0.45), (988.0, 0.55))]
        + ["24 layer(s) compute with the round's weights (probe: 0.010 s to capture, 0.020 s to check; ...)"] * 3,
    },
    FLOOR: {"rounds": _rounds([0.95, 0.95, 1.0]), "outputs": OUTPUTS},
    "save + reload_weights": {"rounds": _rounds([4.0, 4.0, 4.0]), "outputs": OUTPUTS},
    "restart LLM": {"rounds": [{"seconds": 20.0, "bytes": 10**9, "extra_rss": None}], "outputs": OUTPUTS},
}


def test_a_sync_within_its_floor_target_passes_and_shows_where_its_time_goes(capsys) -> None:
    assert report(copy.deepcopy(RESULTS), ["shm"], ARGS) == 0
    out = capsys.readouterr().out
    assert "takes 1.16x vLLM's reload from memory (target <= 1.2x)" in out  # medians: 1.1 s against 0.95 s
    assert "where the time goes (median s): round 1.100, plan 0.010, start 0.020, send 0.300, commit 0.600, " \
           "vLLM worker load (probe included) 0.500, vLLM worker probe 0.030" in out


def test_a_sync_over_its_floor_target_fails_by_name(capsys) -> None:
    slow = copy.deepcopy(RESULTS)
    slow["wtransfer shm"]["rounds"] = _rounds([1.5, 1.5, 1.5], {"plan": 0.01, "start": 0.02, "send": 0.3, "commit": 1.1})
    assert report(slow, ["shm"], ARGS) == 1
    assert "wtransfer shm takes 1.58x vLLM's in-memory reload, target <= 1.2x" in capsys.readouterr().out

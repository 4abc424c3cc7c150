"""The KV benchmark's verdicts, from measured rows (no vLLM needed): what passes, what exits 1."""

from __future__ import annotations

import argparse
import copy

from wtransfer_vllm.bench_kv import report

FIRST = {"token": 7, "logprob": -1.25}
ROWS = {
    "recompute": {"method": "recompute", "ttft_s": 10.0, "all_ttft_s": [10.0], "cached_tokens": 0, "first": FIRST,
                  "prefix_hit": {"token": 7, "logprob": -1.5, "cached": 2016}, "store_bytes": 0, "bytes_per_token": None},
    "storage": {"method": "storage", "ttft_s": 0.1, "all_ttft_s": [0.1], "cached_tokens": 2016, "first": FIRST,
                "prefix_hit": FIRST, "store_bytes": 10, "bytes_per_token": 12500.0},
    "ExampleConnector": {"method": "ExampleConnector", "ttft_s": 0.2, "all_ttft_s": [0.2], "cached_tokens": 2016,
                         "first": FIRST, "prefix_hit": FIRST, "store_bytes": 10, "bytes_per_token": 12300.0},
}
ARGS = argparse.Namespace(model="qwen2-0.5b", tokens=2048, repeats=1, json=False)


def test_targets_met_exit_0_and_say_so(capsys) -> None:
    assert report(copy.deepcopy(ROWS), ARGS) == 0
    out = capsys.readouterr().out
    assert "storage is 100.00x faster than recompute" in out and "targets met" in out


def test_a_missed_target_or_a_different_first_token_exits_1(capsys) -> None:
    slow = copy.deepcopy(ROWS)
    slow["storage"]["ttft_s"] = 0.18
    assert report(slow, ARGS) == 1
    assert "storage is 1.11x faster than ExampleConnector, target >= 1.5x" in capsys.readouterr().out
    wrong = copy.deepcopy(ROWS)
    wrong["storage"]["first"] = {"token": 7, "logprob": -1.2500001}
    assert report(wrong, ARGS) == 1
    assert "differ from ExampleConnector's" in capsys.readouterr().out


def test_saving_is_judged_against_the_same_prompts_without_a_connector(capsys) -> None:
    rows = copy.deepcopy(ROWS)
    plain = {"ttft_s": 10.0, "all_ttft_s": [10.0], "cached_tokens": 0}
    rows["saving"] = {"method": "saving", "ttft_s": 10.3, "all_ttft_s": [10.3], "cached_tokens": 0,
                      "without_connector": plain}
    assert report(copy.deepcopy(rows), ARGS) == 0
    assert "without a connector 10.000 s (10.000): 1.030x (target <= 1.05x)" in capsys.readouterr().out
    rows["saving"]["ttft_s"] = 10.8
    assert report(rows, ARGS) == 1
    assert "takes 1.080x the time to first token it takes without a connector, target <= 1.05x" in (
        capsys.readouterr().out)

"""``vllm serve`` (its own process, loopback, VLLM_SERVER_DEV_MODE=1) synced by trainer processes
through vLLM's unchanged ``HTTPVLLMWeightSyncClient``.

One server lives through the whole story: a sync equal to a fresh load, ``/weight_info``,
a trainer killed mid-round, a mismatched manifest, and a new trainer afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from wtransfer.testing.processes import loopback_port

from vllm_harness import IN_PROCESS_ENV, ROUNDS, run_script, tied_popen

BACKEND = "shm"
LOGS: dict[str, Path] = {}
"""Each server's log, by its base URL."""


@pytest.fixture(scope="module")
def server(vllm_python: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = loopback_port()
    command = run_script(vllm_python, "-c", "import sys, json; from wtransfer_vllm.testing import serve_command; "
                         "print(json.dumps(serve_command(*sys.argv[1:3], int(sys.argv[3]), sys.argv[4])))",
                         str(vllm_python), str(tiny_llama), str(port), BACKEND).stdout.strip().splitlines()[-1]
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w")
    LOGS[f"http://127.0.0.1:{port}"] = Path(log.name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    process = tied_popen(json.loads(command), stdout=log, stderr=subprocess.STDOUT,
                         env={**env, "VLLM_SERVER_DEV_MODE": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise AssertionError(f"vllm serve exited {process.returncode}:\n{Path(log.name).read_text()[-6000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    pass
                if query(vllm_python, base_url, "weight_info") is not None:
                    break
            except (OSError, AssertionError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve not up after 300 s:\n{Path(log.name).read_text()[-6000:]}")
            time.sleep(2)
        yield base_url
    finally:
        try:  # the group is gone if the server exited: its own error above is the one to see
            os.killpg(process.pid, 15)
            process.wait(60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
        log.close()


def query(python: Path, base_url: str, what: str, *args: str) -> object:
    """Ask the server (from the vLLM environment, which has requests): outputs, version or digests."""
    code = """
import json, sys, requests
from wtransfer_vllm.testing import served_greedy
base, what, model = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None
if what == "weight_info":
    print(json.dumps(requests.get(base + "/weight_info", timeout=10).json()["weight_version"]))
elif what == "outputs":
    print(json.dumps(served_greedy(base, model)))
else:
    baseline = json.load(open(model))
    print(json.dumps(requests.post(base + "/weight_checker", json={"action": "compare", "baseline": baseline}, timeout=60).json()))
"""
    out = run_script(python, "-c", code, base_url, what, *args, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def trainer(python: Path, mode: str, base_url: str, model: Path, tmp_path: Path,
            backend: str = BACKEND) -> tuple[int, dict]:
    out = tmp_path / f"{mode}-{backend}.json"
    done = run_script(python, "http_trainer.py", mode, base_url, backend, str(model), str(out), timeout=600,
                      check=False, env={"ROUNDS": str(ROUNDS)})
    if done.returncode not in (0, -9):
        raise AssertionError(f"trainer {mode} exited {done.returncode}:\n{done.stderr[-6000:]}")
    return done.returncode, (json.loads(out.read_text()) if out.exists() else {})


def test_serve_sync_kill_mismatch_and_resync(
    server: str, vllm_python: Path, tiny_llama: Path, final_checkpoint: Path, reference: dict, tmp_path: Path
) -> None:
    model = str(tiny_llama)
    before = query(vllm_python, server, "outputs", model)

    # 1. A trainer syncs ROUNDS rounds: vLLM computes exactly what a fresh load of its final weights does.
    code, result = trainer(vllm_python, "sync", server, tiny_llama, tmp_path)
    assert code == 0 and result["error"] is None, result
    after = query(vllm_python, server, "outputs", model)
    assert after != before
    assert after == reference["outputs"]
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(reference["checksums"]))
    assert query(vllm_python, server, "compare", str(baseline)) == {"match": True, "mismatches": []}
    assert query(vllm_python, server, "weight_info") == str(ROUNDS)

    # 2. A trainer killed half-way through a round (bytes already moving): vLLM keeps serving the old weights.
    code, _ = trainer(vllm_python, "kill", server, final_checkpoint, tmp_path)
    assert code == -9
    assert query(vllm_python, server, "outputs", model) == after
    assert query(vllm_python, server, "weight_info") == str(ROUNDS)

    # 3. A manifest vLLM cannot load (a renamed tensor) is refused, nothing written.
    code, result = trainer(vllm_python, "mismatch", server, final_checkpoint, tmp_path)
    assert code == 0 and result["error"] is not None and result["stats"] == []
    assert query(vllm_python, server, "outputs", model) == after
    assert query(vllm_python, server, "weight_info") == str(ROUNDS)

    # 4. A trainer of another backend: refused at init, and the trainer's error says why (not a bare 500).
    code, result = trainer(vllm_python, "sync", server, final_checkpoint, tmp_path, backend="gloo")
    assert code == 0 and result["stats"] == [], result
    # the workers' own error, the worker named: vLLM's parser raised a ValueError, not one of wtransfer's
    assert result["error"].startswith("TransferError: client.init_weight_transfer_engine() failed on the workers: "
                                      "worker 0: ValueError: Invalid init_info"), result["error"]
    assert "master_address" in result["error"], result["error"]  # gloo's init_info, which shm's parser refuses
    assert query(vllm_python, server, "outputs", model) == after
    # 5. A new trainer syncs afterwards: the original weights again, so vLLM computes what it did at first.
    code, result = trainer(vllm_python, "resend", server, tiny_llama, tmp_path)
    assert code == 0 and result["error"] is None, result
    assert query(vllm_python, server, "outputs", model) == before
    assert query(vllm_python, server, "weight_info") == "resent"
    # a new trainer numbers past what vLLM's workers hold (ROUNDS): labels only go up across trainers
    assert [s["version"] for s in result["stats"]] == [ROUNDS + 1], result["stats"]

    # 6. TRL's AsyncGRPOTrainer protocol through TRL's own VLLMClient (wtransfer_vllm.trl): fp32 master
    # weights, cast to vLLM's bf16 while packed, reach exactly the reference's weights; a round whose
    # iterator dies half-way (after the first) leaves the weights and the server running (TRL would
    # leave it paused), and the rounds after it land.
    code, result = trainer(vllm_python, "trl", server, tiny_llama, tmp_path)
    assert code == 0, result
    versions = [s["version"] for s in result["stats"]]
    assert versions == sorted(set(versions)) and versions[0] > ROUNDS + 1, versions  # past the resent round
    assert "died while its tensors were gathered" in result["error"], result["error"]
    assert result["paused_after_failure"] is False and result["kept_weights"] is True
    assert [s["cast_tensors"] == s["tensors"] for s in result["stats"]] == [True] * ROUNDS, result["stats"]
    assert query(vllm_python, server, "outputs", model) == reference["outputs"]
    assert query(vllm_python, server, "compare", str(baseline)) == {"match": True, "mismatches": []}

    # 7. TRL's own GRPOTrainer in server mode (scripts/grpo_run.py), its VLLMClient's sync made wtransfer
    # rounds by use_in_grpo_trainer: fp32 masters, three steps, a sync before each and one after; vLLM
    # then computes what a fresh load of the trainer's final weights computes. The trainer is shut down
    # by TRL's atexit hook, and the script must still exit cleanly.
    out, final, fresh = tmp_path / "grpo.json", tmp_path / "grpo-final", tmp_path / "grpo-fresh.json"
    run_script(vllm_python, "grpo_run.py", "server", model, str(final), str(out), server, timeout=600)
    result = json.loads(out.read_text())
    run_script(vllm_python, "reference.py", str(final), str(fresh), env=IN_PROCESS_ENV)
    assert result["after_first"] == before  # the sync at step 0 sends the checkpoint's own weights
    assert result["after"] != before
    fresh_load = json.loads(fresh.read_text())
    grpo_baseline = tmp_path / "grpo-baseline.json"
    grpo_baseline.write_text(json.dumps(fresh_load["checksums"]))  # the weights first: they are wtransfer's part
    assert query(vllm_python, server, "compare", str(grpo_baseline)) == {"match": True, "mismatches": []}
    assert result["after"] == fresh_load["outputs"]
    assert query(vllm_python, server, "outputs", model) == result["after"]
    grpo_versions = [s["version"] for s in result["stats"]]
    assert len(grpo_versions) == 4 and grpo_versions == sorted(set(grpo_versions)), grpo_versions
    assert grpo_versions[0] > versions[-1], (versions, grpo_versions)  # past every label step 6 left
    assert all(s["cast_tensors"] == s["tensors"] for s in result["stats"]), result["stats"]


def test_rounds_committed_while_requests_run_label_every_token_for_each_in_flight_choice(
    server: str, vllm_python: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """Requests in flight while a round commits, for each ``in_flight`` choice (``scripts/inflight.py``).

    Each response's tokens before the switch its spans report equal the old version's, and those
    after it what a fresh load of the new version computes after that prefix: for ``recompute`` the
    round changes every weight (a request left on KV of the old weights would differ); for
    ``keep``, whose requests go on with that KV by design, only the final norm, so the KV is the
    same at both versions and the check is exact. ``recompute`` preempts the running requests,
    ``keep`` and ``drain`` do not; ``drain`` answers them wholly at the old version and a request
    sent during the drain wholly at the new. A request after the commit reuses no KV computed at
    the old version (its prompt was computed then; under ``keep`` nothing was reset, so only the
    salt keeps it off); the same request once more reuses the first's."""
    out = tmp_path / "inflight.json"
    run_script(vllm_python, "inflight.py", server, str(tiny_llama), str(out), timeout=600)
    results = json.loads(out.read_text())
    for choice, result in results.items():
        a, b = result["a"], result["b"]
        if choice != "drain":  # a drain's commit runs once they are done: its log says how many it waited for
            assert result["running_at_round"] >= 1, (choice, result["running_at_round"], result["tokens_at_round"])
        switched = 0
        for index, (response, baseline, continued) in enumerate(
                zip(result["inflight"], result["baseline"], result["continued"])):
            spans, tokens = response["spans"], response["tokens"]
            assert response["finish_reason"] == "length" and spans[0][1] == 0 and spans[-1][2] == len(tokens)
            assert [s[0] for s in spans] in ([a], [a, b], [b]), (choice, index, spans)
            cut = next((s[1] for s in spans if s[0] == b), len(tokens))
            assert len(baseline["tokens"]) == len(tokens)  # the baseline runs as long: every token before a switch
            assert tokens[:cut] == baseline["tokens"][:cut], (choice, index, spans)  # computed at A
            if cut < len(tokens):  # computed at B, after the prefix (as many as the model's length leaves)
                n = min(len(continued["tokens"]), len(tokens) - cut)
                assert n and tokens[cut:cut + n] == continued["tokens"][:n], (choice, index, spans)
            switched += 0 < cut < len(tokens)
        if choice == "drain":
            waited = re.findall(r"the commit waits for (\d+) running request", LOGS[server].read_text())
            if not waited:  # on a host busy enough that they ended before the commit reached vLLM's engine
                print("drain: the in-flight requests ended before the commit came; its wait was not exercised")
            assert all(int(n) >= 1 for n in waited), waited
            assert switched == 0 and all(r["spans"] == [[a, 0, len(r["tokens"])]] for r in result["inflight"])
            assert result["preempted"] == 0
            late = result["late"][0]
            assert late["spans"] == [[b, 0, len(late["tokens"])]], late
            assert late["tokens"] == result["late_reference"][0]["tokens"]
        else:
            assert switched >= 1, (choice, [r["spans"] for r in result["inflight"]])  # a request spans the commit
            if choice == "recompute":
                assert result["preempted"] >= switched, (choice, result["preempted"])
            else:
                assert result["preempted"] == 0, (choice, result["preempted"])
        assert [r["cached"] for r in result["fresh"]] == [0] * len(result["fresh"]), (choice, result["fresh"])
        assert all(r["cached"] > 0 for r in result["again"]), (choice, result["again"])
        assert [r["tokens"] for r in result["again"]] == [r["tokens"] for r in result["fresh"]]
        assert all(r["spans"] == [[b, 0, len(r["tokens"])]] for r in result["fresh"])

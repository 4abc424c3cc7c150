"""A sharded trainer with a real transformers model: FSDP2 ranks (gloo, CPU), a Llama with tied
embeddings, real optimizer steps, workers bit-exact with the unsharded state after every round.

Runs in the throwaway vLLM environment (it has transformers); no vLLM instance is started.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_harness import ROUNDS, EngineRun, engine_run, run_script


@pytest.mark.parametrize(("world", "backend"), [(2, "shm"), (4, "gloo")])
def test_fsdp2_llama_ranks_sync_the_unsharded_state(
    world: int, backend: str, vllm_python: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    run_script(vllm_python, "fsdp_sync.py", str(world), backend, str(tiny_llama), str(out))
    rounds = json.loads(out.read_text())["rounds"]
    assert [r["version"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert r["worker_versions"] == [r["version"]] * 2
        for worker in r["workers"]:
            wrong = sorted(name for name in r["trainer"] if worker.get(name) != r["trainer"][name])
            assert not wrong, f"round {r['version']}: a worker differs in {wrong}"
    assert "model.embed_tokens.weight" in rounds[0]["trainer"]  # the tied embedding, sent once
    assert rounds[0]["trainer"] != rounds[-1]["trainer"]  # the optimizer really changed the weights


@pytest.fixture(scope="module")
def fsdp_vllm_run(vllm_python: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """``run(backend)``: per backend, one LLM held by rank 0 runs every mode of that backend in turn
    (one vLLM start each); rank 0's JSON gets each mode's part (rank 1's in ``.rank1``) as it ends."""
    runs: dict[str, tuple[EngineRun, Path]] = {}

    def run(backend: str) -> tuple[EngineRun, Path]:
        if backend not in runs:
            out = tmp_path_factory.mktemp(f"fsdp-vllm-{backend}") / "result.json"
            runs[backend] = engine_run(vllm_python, "fsdp_vllm_sync.py", out, backend, str(tiny_llama), str(out),
                                       str(ROUNDS), ",".join(MODES[backend])), Path(f"{out}.rank1")
        return runs[backend]

    return run


MODES = {"shm": ["writes", "gathers"], "gloo": ["writes"]}


def checkpoint_bytes(model_dir: Path) -> int:
    """The tensor bytes of a safetensors checkpoint (a bf16 one here), from its header."""
    import struct

    with open(model_dir / "model.safetensors", "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return sum(end - start for name, info in header.items() if name != "__metadata__"
               for start, end in [info["data_offsets"]])


@pytest.mark.parametrize(("backend", "mode"), [("shm", "writes"), ("gloo", "writes"), ("shm", "gathers")])
def test_a_vllm_llm_synced_by_fsdp2_ranks_through_vllms_trainer_factory(
    backend: str, mode: str, fsdp_vllm_run, reference: dict, tiny_llama: Path
) -> None:
    # vLLM 0.32 calls trainer_init and send_weights on every trainer rank; rank 0 holds the LLM.
    # The ranks take the same deterministic steps as the reference checkpoint, so vLLM must
    # compute exactly what a fresh vLLM loaded from it computes. "writes": vLLM's ModuleSource,
    # and every rank sends its own shards (into shm's buffers, or on gloo groups of its own with
    # vLLM's worker); "gathers": vLLM's source behind a wrapper of the user's, so rank 0 gathers.
    # On shm both modes run on one LLM, "gathers" second: its trainer starts from the checkpoint again.
    # The ranks keep fp32 masters (bf16 compute) that equal the reference only if cast by rounding.
    run, rank1 = fsdp_vllm_run(backend)
    result = run.part(mode)
    other = json.loads(rank1.read_text()) if rank1.exists() else {}
    assert mode in other, f"rank 1 wrote no {mode!r} result: the script exited {run.returncode}\n{run.output}"
    other = other[mode]
    if mode == MODES[backend][-1]:  # the last mode on that engine: the script ended cleanly too
        run.assert_clean_exit()
    # after round 1 (one step), vLLM computed something else than after the last: this mode's
    # rounds moved the weights, whatever the LLM held before it
    assert result["after_first"] != result["after"]
    assert result["after"] == reference["outputs"]  # tokens and logprobs, exactly
    assert result["checksums"] == reference["checksums"]
    # its own rounds' number; a trainer after another on the same LLM numbers past it: labels only go up
    versions = [s["version"] for s in result["stats"]]
    assert len(versions) == ROUNDS and versions == list(range(versions[0], versions[0] + ROUNDS)), versions
    assert versions[0] == 1 if mode == MODES[backend][0] else versions[0] > ROUNDS, versions
    assert result["weight_version"] == str(versions[-1])
    assert len(other["stats"]) == ROUNDS
    for rank, stats in ((0, result["stats"]), (1, other["stats"])):
        assert [s["wrote_shards"] for s in stats] == [mode == "writes"] * ROUNDS, f"rank {rank}: {stats}"
    assert all(s["cast_tensors"] == s["tensors"] for s in result["stats"])  # every tensor left fp32 as bf16
    assert all(s["bytes"] == checkpoint_bytes(tiny_llama) for s in result["stats"]), result["stats"]  # bf16 on the wire

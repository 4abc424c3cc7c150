"""Time to first token in a real vLLM: a stored prefix (wtransfer ``storage``) against recomputing
it and against vLLM's own ``ExampleConnector``.

    python -m wtransfer_vllm.bench_kv [--model qwen2-0.5b|tiny] [--tokens 2048] [--repeats 3]

A random checkpoint of the chosen shapes is written once, and one prompt of ``--tokens``
tokens. Each method then runs in its own processes, on a directory in /dev/shm:

* ``storage`` and ``ExampleConnector``: a first ``vllm.LLM`` computes the prompt and stores
  its KV; a *restarted* ``LLM`` (a new process: empty prefix cache) is timed;
* ``recompute``: a restarted ``LLM`` with no connector is timed;
* saving: an ``LLM`` with ``storage`` computes prompts it has never seen (each repeat shifts
  every token) and saves their KV, and so does an ``LLM`` with no connector on the same
  prompts; the ratio of their times to first token is what saving costs a request (the block
  copies out of the cache happen before the step ends, the file writes in the background).

In the timed process the prompt is generated once to warm vLLM up on the timed path; then
each repeat resets vLLM's own prefix cache and times ``llm.generate(prompt, max_tokens=1)``
as the caller waits for it (scheduling, loading through the connector, the forward pass of
what is not reused, sampling). The median is reported, with the tokens vLLM says it reused
and the bytes each store holds per reused token. The first token and its logprob after a
``storage`` load must equal, to the last bit, those after an ``ExampleConnector`` load of the
same KV (vLLM's own reference connector); recomputing the whole prompt, and vLLM's own prefix
cache supplying the same tokens, round differently in the last bits (shown, not failed). Both connectors get the same settings: same directory kind,
same block size, their own default threads. Exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from wtransfer.testing.bench_blocks import machine_description

from wtransfer_vllm.bench import vllm_version

METHODS = ("recompute", "storage", "ExampleConnector")
TARGETS = {"recompute": 5.0, "ExampleConnector": 1.5}
"""Required TTFT speed-up of ``storage`` over each peer."""
SAVING_TARGET = 1.05
"""A request whose KV is saved may take at most this times the same request's time to first
token without a connector."""


def _kv_config(method: str, store: str) -> Any:
    from vllm.config import KVTransferConfig

    if method == "storage":
        return KVTransferConfig(kv_connector="storage", kv_role="kv_both", kv_connector_extra_config={"path": store})
    if method == "ExampleConnector":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config={"shared_storage_path": store})
    return None


def _llm(args: argparse.Namespace) -> Any:
    from vllm import LLM

    from wtransfer_vllm.testing import llm_kwargs

    config = _kv_config(args.method, args.store)
    extra = {"kv_transfer_config": config} if config is not None else {}
    return LLM(**llm_kwargs(args.model_dir, max_model_len=args.tokens + 64, kv_cache_memory_bytes=1 << 30,
                            max_num_batched_tokens=args.tokens + 64, **extra))


def _generate(llm: Any, prompt: list[int]) -> tuple[float, dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    started = time.perf_counter()
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    completion = output.outputs[0]
    token = completion.token_ids[0]
    return seconds, {"token": token, "logprob": completion.logprobs[0][token].logprob,
                     "cached": int(output.num_cached_tokens or 0)}


def _child(args: argparse.Namespace) -> dict[str, Any]:
    prompt = json.loads(Path(args.prompt).read_text())
    llm = _llm(args)
    if args.role == "prime":
        _, first = _generate(llm, prompt)
        return {"first": first}
    if args.role == "saving":
        _generate(llm, prompt)  # warm-up, as the timed runs do
        modulus = max(prompt) + 1
        runs = []
        for repeat in range(args.repeats):  # a prompt never seen: all of it is computed and saved
            seconds, first = _generate(llm, [(token + repeat + 1) % modulus for token in prompt])
            runs.append({"seconds": seconds, **first})
        return {"runs": runs}
    _generate(llm, prompt)  # warm-up on the very path that is timed (first-call costs are vLLM's, not ours)
    runs = []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()  # what vLLM reuses must come through the connector each time
        seconds, first = _generate(llm, prompt)
        runs.append({"seconds": seconds, **first})
    # vLLM's own prefix cache reusing the same tokens: what a reused prefix must compute
    _, prefix_hit = _generate(llm, prompt)
    return {"runs": runs, "prefix_hit": prefix_hit}


def _run_child(role: str, method: str, args: argparse.Namespace, model_dir: Path, prompt: Path,
               store: Path) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    command = [sys.executable, "-m", "wtransfer_vllm.bench_kv", "--child", "--role", role, "--method", method,
               "--model-dir", str(model_dir), "--prompt", str(prompt), "--store", str(store),
               "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--out", out]
    print(f"[bench] {method}: {role} ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    try:
        if done.returncode != 0:
            raise RuntimeError(f"bench child {method} {role} exited {done.returncode}:\n{done.stderr[-6000:]}")
        return json.loads(Path(out).read_text())
    finally:
        os.unlink(out)


def _store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


def run(args: argparse.Namespace) -> int:
    if args.child:
        Path(args.out).write_text(json.dumps(_child(args)))
        return 0
    if args.report_rows:
        return report(json.loads(Path(args.report_rows).read_text()), args)
    from wtransfer_vllm.testing import write_model

    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        root = Path(folder)
        model_dir = root / "model"
        print(f"[bench] writing a random {args.model} checkpoint ...", file=sys.stderr, flush=True)
        write_model(model_dir, "llama" if args.model == "tiny" else "qwen2",
                    max_position_embeddings=max(4096, args.tokens + 64))
        vocab = 500 if args.model == "tiny" else 150000
        prompt = [(7919 * i + 13) % vocab for i in range(args.tokens)]
        prompt_file = root / "prompt.json"
        prompt_file.write_text(json.dumps(prompt))
        for method in METHODS:
            store = root / f"store-{method}"
            store.mkdir()
            primed = _run_child("prime", method, args, model_dir, prompt_file, store) if method != "recompute" else {}
            timed = _run_child("timed", method, args, model_dir, prompt_file, store)
            seconds = [r["seconds"] for r in timed["runs"]]
            stored = _store_bytes(store)
            reused = timed["runs"][0]["cached"]
            rows[method] = {
                "method": method, "ttft_s": statistics.median(seconds), "all_ttft_s": seconds,
                "prefix_hit": timed["prefix_hit"],
                "cached_tokens": reused, "first": {k: timed["runs"][0][k] for k in ("token", "logprob")},
                "primed_first": primed.get("first"), "store_bytes": stored,
                "bytes_per_token": stored / reused if stored and reused else None,
            }
        saving = {}
        for method in ("recompute", "storage"):
            store = root / f"store-saving-{method}"
            store.mkdir()
            runs = _run_child("saving", method, args, model_dir, prompt_file, store)["runs"]
            seconds = [r["seconds"] for r in runs]
            saving[method] = {"ttft_s": statistics.median(seconds), "all_ttft_s": seconds,
                              "cached_tokens": max(r["cached"] for r in runs)}
        rows["saving"] = {"method": "saving", **saving["storage"], "without_connector": saving["recompute"]}
    if args.save_rows:
        Path(args.save_rows).write_text(json.dumps(rows))
    return report(rows, args)


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> int:
    rows = dict(rows)
    saving = rows.pop("saving", None)
    ours = rows["storage"]
    reference = rows["ExampleConnector"]["first"]
    failures = []
    for row in rows.values():
        row["same_first_token"] = row["first"] == reference
    if not ours["same_first_token"]:
        failures.append(f"storage: first token/logprob {ours['first']} differ from ExampleConnector's ({reference})")
    for method, target in TARGETS.items():
        row = rows[method]
        row["storage_speedup"] = row["ttft_s"] / ours["ttft_s"]
        if row["storage_speedup"] < target:
            failures.append(f"storage is {row['storage_speedup']:.2f}x faster than {method}, target >= {target}x")
    if ours["cached_tokens"] < args.tokens - 64:
        failures.append(f"storage reused only {ours['cached_tokens']} of {args.tokens} tokens")
    if saving is not None:
        plain = saving["without_connector"]
        saving["vs_no_connector"] = saving["ttft_s"] / plain["ttft_s"]
        if saving["cached_tokens"] or plain["cached_tokens"]:
            failures.append("saving: tokens were reused; the prompts were meant to be new")
        if saving["vs_no_connector"] > SAVING_TARGET:
            failures.append(f"a request whose KV is saved takes {saving['vs_no_connector']:.3f}x the time to first "
                            f"token it takes without a connector, target <= {SAVING_TARGET}x")
    document = {"machine": f"{machine_description()}, vLLM {vllm_version()}", "model": args.model, "tokens": args.tokens, "repeats": args.repeats,
                "rows": list(rows.values()), "saving": saving, "failures": failures}
    if args.json:
        print(json.dumps(document, indent=1))
        return 1 if failures else 0
    print(f"time to first token in vLLM, restarted LLM: {args.model} shapes, a {args.tokens}-token prompt, "
          f"median of {args.repeats}, {document['machine']}")
    print(f"{'method':<18} {'TTFT s':>8} {'(each run)':<22} {'reused tokens':>14} {'bytes/reused token':>18}  "
          "first token+logprob vs ExampleConnector's")
    for row in rows.values():
        per_token = "-" if row["bytes_per_token"] is None else f"{row['bytes_per_token']:.0f}"
        each = "(" + ", ".join(f"{t:.3f}" for t in row["all_ttft_s"]) + ")"
        same = ("(the reference)" if row["method"] == "ExampleConnector" else "same" if row["same_first_token"]
                else f"token {row['first']['token']}, logprob {row['first']['logprob']:.7f}")
        print(f"{row['method']:<18} {row['ttft_s']:>8.3f} {each:<22} {row['cached_tokens']:>14} {per_token:>18}  {same}")
    hit = rows["recompute"]["prefix_hit"]
    print(f"ExampleConnector's first token {reference['token']}, logprob {reference['logprob']:.7f}; vLLM's own "
          f"prefix cache ({hit['cached']} tokens reused): token {hit['token']}, logprob {hit['logprob']:.7f}")
    for method, target in TARGETS.items():
        print(f"storage is {rows[method]['storage_speedup']:.2f}x faster than {method} (target >= {target}x)")
    if saving is not None:
        plain = saving["without_connector"]
        each = ", ".join(f"{t:.3f}" for t in saving["all_ttft_s"])
        each_plain = ", ".join(f"{t:.3f}" for t in plain["all_ttft_s"])
        print(f"prompts never seen: TTFT saving with storage {saving['ttft_s']:.3f} s ({each}), without a "
              f"connector {plain['ttft_s']:.3f} s ({each_plain}): {saving['vs_no_connector']:.3f}x "
              f"(target <= {SAVING_TARGET}x)")
    print("targets met" if not failures else "targets MISSED:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2-0.5b", choices=["qwen2-0.5b", "tiny"],
                        help="checkpoint shapes: Qwen2-0.5B (~1 GB bf16) or the tests' tiny Llama (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length in tokens (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per method; the median is "
                        "reported (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table "
                        "(default: the table)")
    parser.add_argument("--save-rows", metavar="FILE", help="also write the raw measurements to FILE (default: not "
                        "written); --report-rows FILE prints a saved run again")
    parser.add_argument("--report-rows", metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["prime", "timed", "saving"], help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    for hidden in ("--model-dir", "--prompt", "--store", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wtransfer_vllm.bench_kv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""``vllm serve --kv-transfer-config '{"kv_connector": "storage", ...}'``, started twice.

usage: kv_serve.py MODEL_DIR STORE_DIR PORT OUT_JSON PROMPT_JSON

Each server answers one completion of the prompt (token ids) and is stopped; the second,
a new server process, should get the prompt's blocks from the store. Writes, per server:
the completion text and the cached tokens vLLM reports in ``usage.prompt_tokens_details``.
"""

import json
import os
import signal
import subprocess
import sys
import time

import requests

from wtransfer_vllm.testing import write_json

def die_with(parent):
    """The server gets SIGTERM when this script exits, however it ends (Linux's parent-death signal)."""
    def arm():
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)
    return arm


if __name__ == "__main__":
    model, store, port, out, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
    kv = {"kv_connector": "storage", "kv_role": "kv_both", "kv_connector_extra_config": {"path": store}}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "256", "--block-size", "32",
               "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager", "--enable-prompt-tokens-details",
               "--kv-transfer-config", json.dumps(kv)]
    base = f"http://127.0.0.1:{port}"
    results = []
    for _ in range(2):
        server = subprocess.Popen(command, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True,
                                  preexec_fn=die_with(os.getpid()))
        try:
            deadline = time.monotonic() + 300
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"vllm serve exited {server.returncode}")
                try:
                    if requests.get(base + "/v1/models", timeout=2).ok:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("vllm serve not up after 300 s")
                time.sleep(1)
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
            answer = requests.post(base + "/v1/completions", json=body, timeout=120).json()
            details = answer["usage"].get("prompt_tokens_details") or {}
            results.append({"text": answer["choices"][0]["text"], "cached": details.get("cached_tokens")})
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    write_json(out, results)

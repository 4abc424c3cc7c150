"""Rounds committed while ``vllm serve`` generates, once per ``in_flight`` choice.

usage: inflight.py BASE_URL MODEL_DIR OUT_JSON

The server must run with ``--enable-scale-out`` (its ``/inference/v1/generate`` responses carry
vLLM's ``weight_versions`` spans) and ``--enable-prompt-tokens-details`` (cached prompt tokens).
For each of ``recompute``, ``keep`` and ``drain``, a trainer created with that ``in_flight``:

1. sends the checkpoint whole (version A), and the long prompts are generated at A, all at once
   ("baseline");
2. starts the long prompts again (streamed) and sends a round (version B) whose commit (finish)
   lands while they run (for ``recompute`` and ``keep``, held by vLLM's pause once each streamed
   4 tokens). For ``recompute`` and
   ``drain`` the round changes every weight (a request that kept KV of A would compute other
   tokens than a fresh load of B after the same prefix); for ``keep``, only the final norm's
   weight, so A and B compute the same KV and what a kept request computes at B after its prefix
   is known exactly. For ``drain``, a "late" request is sent once the drain began;
3. generates, after the round, each in-flight response's continuation at B (its prompt and the
   tokens it had at the switch), and twice the "probes", other long prompts computed at A only
   (in step 1): the first ("fresh") must reuse no KV (any would be A's), the second ("again")
   reuses the first's.

Writes, per choice, the responses' tokens, spans and cached tokens, and the server's preemption
count before and after the round.
"""

import json
import re
import sys
import threading
import time

import requests
import torch

import wtransfer
from wtransfer_vllm.testing import BLOCK_FILLING_PROMPTS, load_trainer_model, perturb, write_json
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

IN_FLIGHT_TOKENS = 400  # long enough to be running when the commit lands
MAX_MODEL_LEN = 512  # the server's
COMPARED = 48
"""Tokens compared after a switch: what B computes after the prefix (fewer near the model's length).
Before it, every token is compared with the baseline, which runs as long as the in-flight requests."""
INIT_INFO = {"world_size": 2, "timeout_s": 60}


def concurrently(one, count):
    """``one(i)`` for every i at once, one thread each (each a request of its own); their results."""
    results = [None] * count

    def run(index):
        results[index] = one(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def spans_of(choice):
    return [[s["version"], s["start"], s["end"]] for s in choice.get("weight_versions") or []]


def generate(base_url, prompts, max_tokens=COMPARED):
    """All prompts at once: tokens, spans, cached prompt tokens."""

    def one(index):
        body = {"token_ids": prompts[index],
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
        reply = requests.post(f"{base_url}/inference/v1/generate", json=body, timeout=120)
        reply.raise_for_status()
        data = reply.json()
        choice = data["choices"][0]
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        return {"tokens": choice["token_ids"], "finish_reason": choice["finish_reason"], "spans": spans_of(choice),
                "cached": details.get("cached_tokens")}

    return concurrently(one, len(prompts))


def streamed(base_url, prompts, progress):
    """Like :func:`generate`, streamed: ``progress[i]`` counts prompt i's tokens as they come."""

    def one(index):
        body = {"token_ids": prompts[index], "stream": True,
                "sampling_params": {"max_tokens": IN_FLIGHT_TOKENS, "temperature": 0.0, "ignore_eos": True}}
        tokens, spans, finish = [], [], None
        with requests.post(f"{base_url}/inference/v1/generate", json=body, timeout=120, stream=True) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices") or []:
                    tokens += choice.get("token_ids") or []
                    progress[index] = len(tokens)
                    finish = choice.get("finish_reason") or finish
                    spans = spans_of(choice) or spans
        return {"tokens": tokens, "finish_reason": finish, "spans": spans}

    return concurrently(one, len(prompts))


def metric(base_url, name):
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M))


class Client(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP client whose ``finish_weight_update`` (the commit) lands, once armed, while the
    requests in flight run. They were submitted under vLLM's pause (mode "keep") so that they start
    together. With ``freeze`` (``recompute``, ``keep``) they are stepped (:func:`step_until_started`)
    until each streamed 4 tokens and stay paused through the round until its commit returned, as RL
    loops pause around a sync: however fast the server decodes, they are mid-generation when it
    lands. Without (``drain``, which waits for running requests and so must not meet a pause), they
    are resumed just before the commit is sent, 400 tokens from their end."""

    def __init__(self, base_url):
        super().__init__(base_url, timeout=120)
        self.base_url = base_url
        self.finishing = threading.Event()
        self.armed = None  # each in-flight request's tokens so far
        self.freeze = False
        self.at_finish = None

    def finish_weight_update(self, weight_version=None):
        armed = self.armed
        if armed is not None:
            self.at_finish = {"running": metric(self.base_url, "num_requests_running"),
                              "preemptions": metric(self.base_url, "num_preemptions_total"),
                              "tokens": list(armed)}
            if not self.freeze:
                resume(self.base_url)  # and the commit right after it
            self.finishing.set()  # the armed round's commit, not an earlier round's
        try:
            return super().finish_weight_update(weight_version)
        finally:
            if armed is not None and self.freeze:
                resume(self.base_url)


def step_until_started(base_url, progress):
    """Resume the paused server and pause it again at once until every request streamed 4 tokens;
    it is left paused. Watching the stream while the server runs freely races its decoding: on a busy
    host the client saw each request's 400 tokens arrive at once, already finished."""
    deadline = time.monotonic() + 60
    while min(progress) < 4 and time.monotonic() < deadline:
        resume(base_url)
        pause(base_url)  # at once: the round trips alone let a few steps run (over 200 tokens once, under load)
        time.sleep(0.05)  # the stream's reader catches up with what the pause let out


def held_running(base_url):
    """Whether the paused server holds a request mid-generation, by its own count. A reader thread
    still alive did not say so: in one CI run the round then found none running, every request
    ended. The count is current: vLLM records each step's count before its pause replies, and a
    paused server runs no step."""
    return metric(base_url, "num_requests_running") >= 1


def resume(base_url):
    requests.post(f"{base_url}/resume", timeout=30).raise_for_status()


def pause(base_url):
    """vLLM's pause, mode "keep" (requests stay where they are), caches kept."""
    requests.post(f"{base_url}/pause", params={"mode": "keep", "clear_cache": "false"}, timeout=30).raise_for_status()


def one_choice(base_url, model_dir, in_flight):
    model = load_trainer_model(model_dir)
    client = Client(base_url)
    trainer = wtransfer.create_trainer("shm", client=client, source=wtransfer.ModuleSource(model),
                                       init_info=INIT_INFO, in_flight=in_flight)
    prompts = BLOCK_FILLING_PROMPTS
    probes = [list(reversed(p)) for p in prompts]  # computed at A only: after the round, any hit is A's KV
    try:
        a = trainer.send_weights()["version"]
        result = {"a": str(a), "baseline": generate(base_url, prompts, IN_FLIGHT_TOKENS)}
        generate(base_url, probes, 8)
        streamed(base_url, prompts[:1], [0])  # the server's first streamed answer is slow to start
        if in_flight == "keep":
            with torch.no_grad():  # version B: the final norm only, so every KV is the same at A and B
                generator = torch.Generator().manual_seed(5)
                norm = model.model.norm.weight
                norm.mul_(1 + 0.5 * torch.randn(norm.shape, generator=generator))
        else:
            perturb(model, 7, scale=0.2)  # every weight: KV of A is not KV of B
        inflight, late = {}, {}
        for attempt in range(5):
            progress = [0] * len(prompts)
            client.armed, client.freeze = progress, in_flight != "drain"
            # Held (vLLM's pause) until all of them are queued, so that they start together: on two
            # cores a busy engine admits requests slowly, and one could end before another began.
            pause(base_url)
            started = threading.Thread(target=lambda: inflight.update(r=streamed(base_url, prompts, progress)))
            started.start()
            time.sleep(1.0)
            if in_flight == "drain":
                break
            step_until_started(base_url, progress)
            if held_running(base_url):  # some are mid-generation, held by the pause
                break
            # on a loaded host one resume/pause round trip let every request run to its end: the
            # round would find none running, so the requests are sent again (at A: no round yet)
            print(f"in-flight attempt {attempt + 1}: no request held mid-generation; sending them again", flush=True)
            resume(base_url)
            started.join()  # before the next pause, which would otherwise hold (and count) these
        else:
            raise SystemExit(f"{in_flight}: none of 5 attempts held a request mid-generation")
        late_thread = None
        if in_flight == "drain":
            def send_late():
                client.finishing.wait(60)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:  # the drain holds new requests: it has begun
                    if requests.get(f"{base_url}/is_paused", timeout=30).json().get("is_paused"):
                        break
                    time.sleep(0.005)
                late.update(r=generate(base_url, prompts[:1]))

            late_thread = threading.Thread(target=send_late)
            late_thread.start()
        round_started = time.monotonic()
        b = trainer.send_weights()["version"]
        result["round_s"] = time.monotonic() - round_started
        started.join()
        if late_thread is not None:
            late_thread.join()
            result["late"] = late["r"]
        client.armed = None
        result.update(b=str(b), inflight=inflight["r"], running_at_round=client.at_finish["running"],
                      tokens_at_round=client.at_finish["tokens"],
                      preempted=metric(base_url, "num_preemptions_total") - client.at_finish["preemptions"])
        # what B computes after each response's prefix at the switch (its whole output when it had none)
        cut = [next((s[1] for s in r["spans"] if s[0] == str(b)), len(r["tokens"])) for r in result["inflight"]]
        result["continued"] = [  # one by one: each may continue for as many tokens as its length leaves
            generate(base_url, [p + r["tokens"][:k]], max(1, min(COMPARED, MAX_MODEL_LEN - len(p) - k)))[0]
            for p, r, k in zip(prompts, result["inflight"], cut)]
        result["fresh"] = generate(base_url, probes, 8)
        result["again"] = generate(base_url, probes, 8)
        if in_flight == "drain":
            result["late_reference"] = generate(base_url, prompts[:1])
        return result
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    base_url, model_dir, out = sys.argv[1:4]
    results = {}
    for choice in ("recompute", "keep", "drain"):
        results[choice] = one_choice(base_url, model_dir, choice)
        write_json(out, results)

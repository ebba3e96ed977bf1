"""Real vLLM: a chat stream whose engine is SIGKILLed mid-way goes on from the other replica, without gap or repeat.

Two replicas of the bundled SmolLM2 on vLLM's CPU backend behind `llmgwctl
serve`, the model with `continuation: true`. A long greedy stream
(temperature 0) is opened with the official `openai` client; once it has
passed some tokens, the process group of the engine serving it is SIGKILLed
(a machine gone: API server and engine core at once). The client's stream
must finish as one stream (one id, one role delta), and its text must be,
exactly, what the client had at the cut followed by what the surviving
replica continues from that text: the test asks that replica itself, with
the same `continue_final_message` request, for the part after the cut
(where the cut was, in tokens, is in serve's access log). Whether the whole
text also equals the surviving replica's whole answer to the first request
is printed, not asserted: re-tokenising the text at the cut may choose other
tokens than the generation did, so greedy decoding may go another way there.

Both engines get `--max-num-seqs 1`, a small KV cache and no prefix cache
(so the check's request is computed as the router's was), and their threads
are pinned to one core (VLLM_CPU_OMP_THREADS_BIND, inherited from serve's
environment): the test machine has two cores and other work.

Skipped when vLLM, the model file or the conversion's modules are missing,
unless LLMGW_REQUIRE_VLLM=1 (.ci/run sets it): then their absence fails.
"""
from __future__ import annotations

import os
import re
import signal
import time

import openai
import pytest
import requests
import yaml

from .fleet import wait_until
from .vllm import MODEL, bundled_model, served_vllm

# Two engines loading on one shared core take minutes on a busy CI machine;
# 900 s is past the agent's own start timeout with room for the second.
READY_TIMEOUT = 900.0
REQUEST_TIMEOUT = 300.0
pytestmark = pytest.mark.timeout(1800)
SERVE_ARGS = ("--settle", "2", "--poll-interval", "0.5")
# Long enough to be cut well inside; ignore_eos so it runs to the end. A
# short stream lost the race on a loaded CI machine: the engine had sent all
# of it before the client (starved of CPU) had read KILL_AFTER chunks, so the
# kill cut nothing and there was no hand-over to find.
TOKENS = 600
# Content chunks passed before the kill: well after the start, well before the end.
KILL_AFTER = 30
ASKED = [{"role": "user", "content": "Tell me a long story about a dragon who learns to bake bread."}]
GREEDY = {"temperature": 0, "ignore_eos": True}


def two_replicas() -> str:
    """The bundled vLLM catalog, twice over and with continuation on, sized for two engines on one core."""
    doc, model, profile = bundled_model()
    model["replicas"] = 2
    model["continuation"] = True
    # 256 MiB of KV cache: 11,000 tokens of SmolLM2's, five full 2048-token contexts.
    profile["args"] = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
                       "--max-num-seqs", "1", "--no-enable-prefix-caching"]
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory, request):
    with served_vllm(tmp_path_factory.mktemp("vllm-continuation"), {"vllm.yaml": two_replicas()}, request,
                     *SERVE_ARGS, replicas=2, ready_timeout=READY_TIMEOUT, what="vllm continuation e2e",
                     close=lambda fleet: fleet.close_waiting(timeout=60)) as fleet:
        yield fleet


def test_a_stream_whose_vllm_is_killed_mid_way_completes_from_the_other_replica_without_gap_or_repeat(served):
    started = time.monotonic()
    client = openai.OpenAI(base_url=served.router + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)
    replicas = {r["id"]: r for r in served.ready(MODEL)}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASKED, max_tokens=TOKENS, stream=True, stream_options={"include_usage": True},
        extra_body=GREEDY)
    victim = raw.headers["x-llmgw-replica"]
    (survivor,) = [r for rid, r in replicas.items() if rid != victim]
    chunks, deltas = [], []
    for chunk in raw.parse():
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            deltas.append(chunk.choices[0].delta.content)
            if len(deltas) == KILL_AFTER:
                # The engine's whole process group: its API server and its engine core.
                os.killpg(replicas[victim]["pid"], signal.SIGKILL)
    # One stream, finished.
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # Where it was cut: serve's access log names the hand-over and the tokens sent by then.
    line = wait_until(lambda: next((ln for ln in served.log("serve").splitlines()
                                    if f"continued={victim}>{survivor['id']}@" in ln), None),
                      "the hand-over in serve's access log", timeout=30)
    cut = int(re.search(r"continued=\S+@(\d+)", line).group(1))
    assert KILL_AFTER <= cut < TOKENS
    before, after = "".join(deltas[:cut]), "".join(deltas[cut:])
    # What the surviving replica continues from the text the client had: exactly the rest of the stream.
    direct = requests.post(survivor["url"] + "/v1/chat/completions", timeout=REQUEST_TIMEOUT, json={
        "model": MODEL, "messages": ASKED + [{"role": "assistant", "content": before}], "max_tokens": TOKENS - cut,
        "continue_final_message": True, "add_generation_prompt": False, **GREEDY})
    assert direct.status_code == 200, direct.text
    continued = direct.json()["choices"][0]["message"]["content"]
    assert after == continued, f"cut after {cut} tokens at {before[-60:]!r}"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == cut + direct.json()["usage"]["completion_tokens"]
    # For the record: the same request answered whole by the surviving replica.
    whole = requests.post(survivor["url"] + "/v1/chat/completions", timeout=REQUEST_TIMEOUT, json={
        "model": MODEL, "messages": ASKED, "max_tokens": TOKENS, **GREEDY}).json()
    same = whole["choices"][0]["message"]["content"] == before + after
    served.say(f"vllm continuation e2e: cut after {cut} tokens; continued text equals the survivor's whole "
               f"answer: {same}; prompt tokens {usage.prompt_tokens} (whole: {whole['usage']['prompt_tokens']}); "
               f"test body {time.monotonic() - started:.1f}s")

"""Real vLLM: a Responses conversation chained by previous_response_id across two replicas, with no failed turn.

Two replicas of the bundled SmolLM2 on vLLM's CPU backend behind `llmgwctl
serve`, each storing its responses in its own memory
(VLLM_ENABLE_RESPONSES_API_STORE=1 in the profile's env). The official
`openai` client drives six turns, plain and streamed, each continuing the
one before by `previous_response_id`: vLLM answers 404 for an id it does
not hold, so without the router's affinity about half would fail. Every
turn must succeed and be answered by the replica that stored the one
before; the stored response is retrieved through the router; and the other
replica, asked directly, does not hold it (what the router saved the
client from).

One module-scoped serve; short answers (max_output_tokens 8) so the cost
is the engines' start. Skipped when vLLM, the model file or the
conversion's modules are missing, unless LLMGW_REQUIRE_VLLM=1 (.ci/run
sets it): then their absence fails.
"""
from __future__ import annotations

import time

import openai
import pytest
import requests
import yaml

from .vllm import MODEL, bundled_model, served_vllm

# Two engines loading on one shared core take minutes on a busy CI machine;
# 900 s is past the agent's own start timeout with room for the second.
READY_TIMEOUT = 900.0
REQUEST_TIMEOUT = 300.0
pytestmark = pytest.mark.timeout(1800)
SERVE_ARGS = ("--settle", "2", "--poll-interval", "0.5")
TURNS = 6


def two_storing_replicas() -> str:
    """The bundled vLLM catalog, twice over, each engine storing its responses, sized for two engines on one core."""
    doc, model, profile = bundled_model()
    model["replicas"] = 2
    # 256 MiB of KV cache: 11,000 tokens of SmolLM2's, five full 2048-token contexts.
    profile["args"] = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "2"]
    profile["env"] = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory, request):
    with served_vllm(tmp_path_factory.mktemp("vllm-responses"), {"vllm.yaml": two_storing_replicas()}, request,
                     *SERVE_ARGS, replicas=2, ready_timeout=READY_TIMEOUT, what="vllm responses e2e") as fleet:
        yield fleet


def test_a_six_turn_responses_conversation_across_two_vllm_replicas_has_no_failed_turn(served):
    started = time.monotonic()
    client = openai.OpenAI(base_url=served.router + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)
    replicas = {r["id"]: r for r in served.ready(MODEL)}
    assert len(replicas) == 2
    previous, answered = None, []
    for turn in range(TURNS):
        asked = dict(model=MODEL, input=f"Say a word about the number {turn}.", previous_response_id=previous,
                     max_output_tokens=8, temperature=0)
        if turn % 2:
            raw = client.responses.with_raw_response.create(**asked, stream=True)
            events = list(raw.parse())
            kinds = [e.type for e in events]
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
            response = events[-1].response
        else:
            raw = client.responses.with_raw_response.create(**asked)
            response = raw.parse()
        assert response.status in ("completed", "incomplete"), response
        assert response.previous_response_id == previous
        answered.append(raw.headers["x-llmgw-replica"])
        previous = response.id
    assert len(set(answered)) == 1, answered
    # Retrieved through the router from the replica that stored it.
    got = client.responses.with_raw_response.retrieve(previous)
    assert got.headers["x-llmgw-replica"] == answered[0] and got.parse().id == previous
    # The other replica does not hold it: vLLM's own 404.
    (elsewhere,) = [r for rid, r in replicas.items() if rid != answered[0]]
    r = requests.get(f"{elsewhere['url']}/v1/responses/{previous}", timeout=REQUEST_TIMEOUT)
    assert r.status_code == 404, r.text
    served.say(f"vllm responses e2e: {TURNS} chained turns on replica {answered[0]}, 0 failed; "
               f"test body {time.monotonic() - started:.1f}s")

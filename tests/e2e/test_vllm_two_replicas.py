"""Real vLLM, two replicas: a Responses conversation and a LoRA adapter each stay on the replica that holds them.

Two replicas of the bundled SmolLM2 on vLLM's CPU backend behind `llmgwctl
serve`, in one module because starting the engines is what costs (minutes
on CI's shared core); each test is seconds once they run.

Responses: each engine stores its responses in its own memory
(VLLM_ENABLE_RESPONSES_API_STORE=1 in the profile's env). The official
`openai` client drives six turns, plain and streamed, each continuing the
one before by `previous_response_id`: vLLM answers 404 for an id it does
not hold, so without the router's affinity about half would fail. Every
turn must succeed and be answered by the replica that stored the one
before; the stored response is retrieved through the router; and the other
replica, asked directly, does not hold it (what the router saved the
client from).

Adapters: the model has one LoRA adapter (made with peft, as in
test_vllm_lora.py) placed on one replica (`replicas: 1`). 20 requests for it
are all answered by the replica status says holds it (the router's
X-LLMGW-Replica), the other replica's own vLLM does not serve it, and
requests for the base still go to both.

One module-scoped serve; short answers (8 tokens, 4 for the adapter's) so
the cost is the engines' start. Skipped when vLLM, the model file, the
conversion's modules or peft are missing, unless LLMGW_REQUIRE_VLLM=1
(.ci/run sets it): then their absence fails.
"""
from __future__ import annotations

import time

import openai
import pytest
import requests
import yaml

from llmgwctl.engines.gguf import converted_dir

from .fleet import Fleet, wait_until
from .vllm import MODEL, bundled_model, check_prerequisites, lora_adapter, served_vllm

# Two engines loading on one shared core take minutes on a busy CI machine;
# 900 s is past the agent's own start timeout with room for the second.
READY_TIMEOUT = 900.0
REQUEST_TIMEOUT = 300.0
pytestmark = pytest.mark.timeout(1800)
SERVE_ARGS = ("--settle", "2", "--poll-interval", "0.5")
TURNS = 6
ADAPTER = "smollm2-first"
ASKS = 20


def two_replicas(adapter: str) -> str:
    """The bundled vLLM catalog, twice over, each engine storing its responses, sized for two engines on one core.

    With one LoRA adapter (directory `adapter`) on one of the two replicas.
    """
    doc, model, profile = bundled_model()
    model["replicas"] = 2
    # One slot, rank 8: the one adapter, and the least LoRA memory on each engine.
    model["lora"] = {"max_loras": 1, "max_rank": 8}
    model["adapters"] = [{"name": ADAPTER, "source": adapter, "replicas": 1}]
    # 256 MiB of KV cache: 11,000 tokens of SmolLM2's, five full 2048-token contexts.
    profile["args"] = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "2"]
    profile["env"] = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory, request):
    # test_vllm_lora.py's first adapter: one made (and cached) for both modules.
    adapter = lora_adapter(converted_dir(check_prerequisites()), "first", seed=1)
    with served_vllm(tmp_path_factory.mktemp("vllm-two"), {"vllm.yaml": two_replicas(str(adapter))}, request,
                     *SERVE_ARGS, replicas=2, ready_timeout=READY_TIMEOUT, what="vllm two replicas e2e") as fleet:
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
    served.say(f"vllm two replicas e2e: {TURNS} chained turns on replica {answered[0]}, 0 failed; "
               f"test body {time.monotonic() - started:.1f}s")


def ask(fleet: Fleet, model: str, content: str) -> requests.Response:
    return requests.post(fleet.router + "/v1/chat/completions", timeout=REQUEST_TIMEOUT, json={
        "model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 4})


def holders(fleet: Fleet) -> list[str]:
    """The replicas status shows with the adapter loaded."""
    return [r["id"] for r in fleet.ready(MODEL) for a in r["adapters"] if a["name"] == ADAPTER and a["state"] == "loaded"]


def test_an_adapter_on_one_of_two_vllm_replicas_gets_all_its_requests(served):
    started = time.monotonic()
    wait_until(lambda: len(holders(served)) == 1, f"{ADAPTER} loaded on one replica", timeout=REQUEST_TIMEOUT)
    (holder,) = holders(served)
    wait_until(lambda: ask(served, ADAPTER, "hi").status_code == 200, "the router routing the adapter")
    loaded_in = time.monotonic() - started
    answered = []
    for i in range(ASKS):
        reply = ask(served, ADAPTER, f"Name a colour, number {i}.")
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == ADAPTER
        answered.append(reply.headers["x-llmgw-replica"])
    assert answered == [holder] * ASKS, answered
    asked_in = time.monotonic() - started - loaded_in
    # The other engine does not serve it: without the router's placement, half would be vLLM's 404.
    (other,) = [r for r in served.ready(MODEL) if r["id"] != holder]
    served_there = [m["id"] for m in requests.get(other["url"] + "/v1/models", timeout=10).json()["data"]]
    assert ADAPTER not in served_there and MODEL in served_there
    # The base is still spread over both (two random choices among idle replicas).
    base = [ask(served, MODEL, f"Name a colour, number {i}.") for i in range(ASKS)]
    assert all(r.status_code == 200 for r in base), [r.text for r in base if r.status_code != 200]
    assert {r.headers["x-llmgw-replica"] for r in base} == {holder, other["id"]}
    served.say(f"vllm two replicas e2e: {ASKS} of {ASKS} adapter requests on {holder}, the base on both; "
               f"loaded and routed {loaded_in:.1f}s, {ASKS} adapter requests {asked_in:.1f}s, "
               f"test body {time.monotonic() - started:.1f}s")

"""Real vLLM behind `llmgwctl serve`: vLLM's CPU backend serving the bundled SmolLM2 through the router.

One engine for the whole module (it takes half a minute or more to start on
one core): `llmgwctl serve` runs as a process on 127.0.0.1 with the catalog
users get from catalogs/vllm-cpu/ (plus the fake model, so the catalog stays
non-empty when the last test removes smollm2), its local agent launching
vLLM through the vllm driver -- which converts the GGUF on its first start
on a machine. The module checks what the issue promised: chat, completions
and streaming with usage from the official `openai` client; the router's
poller reading vLLM's live /metrics, running, waiting and KV cache moving in
what the balancer holds while generations run; /v1/models giving vLLM's
max_model_len and /tokenize reaching vLLM by the body's model; a SIGKILLed `serve` started
again adopting the running engine without restarting it; and a stream that
is running when its model leaves the catalog finishing before the engine is
stopped. Tests run in file order: the last one stops the engine.

The profile gets `--max-num-seqs 1`, so a second request waits in vLLM's
queue while a first generates, and the engine's threads are pinned to one
core (VLLM_CPU_OMP_THREADS_BIND, inherited from serve's environment): the
test machine has two cores and other work.

Skipped when vLLM, the model file or the conversion's modules are missing,
unless LLMGW_REQUIRE_VLLM=1 (.ci/run sets it): then their absence fails.
"""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import openai
import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .fleet import Fleet, alive, endpoint_metrics, wait_until
from .vllm import MODEL, bundled_model, served_vllm

# The first start on a machine converts the GGUF (25-80 s) and vLLM then
# loads on one core (30-45 s idle, minutes on a CI machine running the rest
# of the suite); 600 s is the agent's own start timeout.
READY_TIMEOUT = 600.0
# A request here is at most a few hundred tokens at ~30 tokens/s on one core.
REQUEST_TIMEOUT = 120.0
# Setup (conversion, engine start) counts against the first test's timeout.
pytestmark = pytest.mark.timeout(1200)

# A short poll interval so readings follow the engine closely; a long drain
# grace so the last test's stream is never cut by the deadline.
SERVE_ARGS = ("--settle", "2", "--poll-interval", "0.2", "--drain-grace", "300")

FAKE = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: fake-chat
    profiles: [{name: cpu, engine: fake, gpus: 0}]
"""


def test_catalog() -> str:
    """The bundled vLLM catalog, with one request at a time in the engine."""
    doc, _, profile = bundled_model()
    profile["args"] = [*profile["args"], "--max-num-seqs", "1"]
    return yaml.safe_dump(doc, sort_keys=False)


test_catalog.__test__ = False   # a helper, not a test


def router_gauges(fleet: Fleet, endpoint: str) -> dict[str, float]:
    """What the router holds for one endpoint, from its own /metrics."""
    names = {"llmgw_router_inflight_requests": "inflight", "llmgw_router_endpoint_metrics_age_seconds": "age",
             "llmgw_router_endpoint_running_requests": "running",
             "llmgw_router_endpoint_waiting_requests": "waiting",
             "llmgw_router_endpoint_kv_cache_usage_ratio": "kv"}
    found: dict[str, float] = {"age": math.inf}
    found.update((names[name], value) for name, value in endpoint_metrics(fleet.router, endpoint).items()
                 if name in names)
    return found


def router_tokens_out(fleet: Fleet) -> float:
    for family in text_string_to_metric_families(requests.get(fleet.router + "/metrics", timeout=5).text):
        for sample in family.samples:
            if (sample.name == "llmgw_router_tokens_total" and sample.labels.get("model") == MODEL
                    and sample.labels.get("direction") == "out"):
                return sample.value
    return 0.0


def open_stream(fleet: Fleet, max_tokens: int) -> tuple[requests.Response, object]:
    """A streamed completion that generates exactly max_tokens; returns it once its first token came."""
    resp = requests.post(fleet.router + "/v1/completions", stream=True, timeout=REQUEST_TIMEOUT,
                         json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
                               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status_code == 200, resp.text
    # Kept in a name: a line iterator dropped mid-stream is closed, and
    # urllib3 then hangs up, which would end the request being measured.
    lines = resp.iter_lines()
    assert next(line for line in lines if line.startswith(b"data: "))
    return resp, lines


@pytest.fixture(scope="module")
def served(tmp_path_factory, request):
    with served_vllm(tmp_path_factory.mktemp("vllm"), {"vllm.yaml": test_catalog(), "fake.yaml": FAKE}, request,
                     *SERVE_ARGS, ready_timeout=READY_TIMEOUT) as fleet:
        yield fleet


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.router + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)


def test_status_shows_smollm2_ready_on_vllm(served):
    (replica,) = served.ready(MODEL)
    assert replica["engine"] == "vllm" and replica["gpus"] == []
    node = served.status()["nodes"][0]
    assert "vllm" in node["engines"] and "vllm" not in node["engines_missing"]
    out = subprocess.run([sys.executable, "-m", "llmgwctl", "status", "--controller", served.control],
                         capture_output=True, text=True, timeout=60)
    row = next(line.split() for line in out.stdout.splitlines() if line.startswith(MODEL + " "))
    assert row[:4] == [MODEL, "1", "1", "1"], out.stdout


def test_chat_and_completion_come_from_vllm(served, client):
    reply = client.chat.completions.create(model=MODEL, max_tokens=8,
                                           messages=[{"role": "user", "content": "Say hello."}])
    assert reply.choices[0].message.content.strip()
    assert reply.model == MODEL                       # vLLM serves it under the catalog name
    assert reply.system_fingerprint.startswith("vllm-")
    assert 1 <= reply.usage.completion_tokens <= 8    # counted by vLLM's tokenizer
    assert reply.usage.prompt_tokens > 5              # SmolLM2's chat template wrapped the message
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                     extra_body={"ignore_eos": True})
    assert text.choices[0].text.strip() and text.usage.completion_tokens == 6
    assert text.usage.prompt_tokens > 0


def test_streamed_chat_carries_usage_and_the_router_counts_it(served, client):
    before = router_tokens_out(served)
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=12, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count to five."}]))
    deltas = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(deltas).strip()
    assert sum(1 for d in deltas if d) >= 2           # token by token, not one buffered blob
    usage = chunks[-1].usage                          # the last chunk: usage only, no choices
    assert chunks[-1].choices == [] and usage is not None
    assert 2 <= usage.completion_tokens <= 12 and usage.prompt_tokens > 5
    # The router read the usage line out of the stream it passed through.
    wait_until(lambda: router_tokens_out(served) - before == usage.completion_tokens,
               "the router's token counter to move by the stream's usage", timeout=10)


def test_models_has_vllms_max_model_len_and_tokenize_reaches_vllm(served):
    (replica,) = served.ready(MODEL)
    card = next(c for c in requests.get(replica["url"] + "/v1/models", timeout=5).json()["data"] if c["id"] == MODEL)
    # The router asked the engine as it joined; the catalog runs it with --max-model-len 2048.
    entry = wait_until(lambda: (m := requests.get(served.router + f"/v1/models/{MODEL}", timeout=5).json())
                       ["context_length"] is not None and m, "the router to learn vLLM's context length")
    assert entry["context_length"] == card["max_model_len"] == 2048
    assert entry["status"] == "loaded" and entry["parent"] is None
    # vLLM's tokenizer, by the model in the body: the same length, and the tokens turn back into the text.
    r = requests.post(served.router + "/tokenize", timeout=REQUEST_TIMEOUT,
                      json={"model": MODEL, "prompt": "Hello there", "add_special_tokens": False})
    assert r.status_code == 200 and r.headers["x-llmgw-replica"] == replica["id"], r.text
    tokens = r.json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 2048
    back = requests.post(served.router + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]},
                         timeout=REQUEST_TIMEOUT)
    assert back.status_code == 200 and back.json()["prompt"].strip() == "Hello there", back.text


def test_the_balancer_holds_vllms_live_readings_while_generations_run(served):
    (replica,) = served.ready(MODEL)
    rid = replica["id"]
    # Idle: the poller has read vLLM's page, and it says nothing runs.
    wait_until(lambda: (g := router_gauges(served, rid)).get("running") == 0 and g.get("waiting") == 0
               and g.get("kv") == 0, "an idle reading of vLLM", timeout=REQUEST_TIMEOUT)
    first, first_lines = open_stream(served, 1500)
    second = None
    try:
        running = wait_until(lambda: (g := router_gauges(served, rid)).get("running") == 1 and g.get("kv", 0) > 0
                             and g, "vLLM's reading of the running generation")
        assert running["age"] < 5 and running["waiting"] == 0
        # The KV cache fills as the generation goes on, a block at a time: 128
        # tokens on vLLM's CPU backend (platforms/cpu.py), a few seconds idle but
        # over a minute on a CI machine busy with other work (a CI run timed out
        # at 60 s), so the wait is bounded by a request's time, not a minute.
        wait_until(lambda: router_gauges(served, rid)["kv"] > running["kv"], "the KV reading to grow",
                   timeout=2 * REQUEST_TIMEOUT)
        # With --max-num-seqs 1 a second request waits in vLLM's queue.
        second = requests.post(served.router + "/v1/completions", stream=True, timeout=REQUEST_TIMEOUT,
                               json={"model": MODEL, "prompt": "Twice upon a time", "max_tokens": 4, "stream": True})
        queued = wait_until(lambda: (g := router_gauges(served, rid)).get("waiting") == 1 and g,
                            "vLLM's reading of the queued request")
        assert queued["running"] == 1 and queued["inflight"] == 2
    finally:
        first.close()     # the router hangs up on vLLM, which aborts the generation
    assert second.status_code == 200
    assert b"[DONE]" in b"".join(second.iter_lines())   # it ran once the first was aborted
    second.close()
    wait_until(lambda: (g := router_gauges(served, rid)).get("running") == 0 and g.get("waiting") == 0
               and g.get("kv") == 0 and g.get("inflight") == 0, "an idle reading again", timeout=REQUEST_TIMEOUT)


def test_a_killed_serve_started_again_adopts_the_running_vllm(served, client):
    (before,) = served.ready(MODEL)
    served.kill_controller(signal.SIGKILL)
    # The engine runs on in its own process group, still answering.
    assert alive(before["pid"])
    assert requests.get(before["url"] + "/health", timeout=5).status_code == 200
    served.start_serve(*SERVE_ARGS)
    (after,) = wait_until(lambda: served.ready(MODEL), "smollm2 ready again", timeout=REQUEST_TIMEOUT)
    assert (after["id"], after["pid"], after["url"]) == (before["id"], before["pid"], before["url"])
    assert after["restarts"] == 0 and after["adopted"]
    reply = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].message.content and reply.model == MODEL


def test_a_stream_running_when_its_model_leaves_the_catalog_finishes_before_vllm_stops(served):
    (replica,) = served.ready(MODEL)
    pid = replica["pid"]
    # ~600 tokens at ~30 a second: the stream is still generating long after the edit is in force.
    resp, lines = open_stream(served, 600)
    try:
        (served.catalogs / "vllm.yaml").unlink()
        wait_until(lambda: [r["state"] for r in served.replicas(MODEL)] == ["draining"],
                   "the replica draining, out of the router")
        assert alive(pid)
        rest = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    finally:
        resp.close()
    # Every token came: the engine was not stopped under the stream.
    text = "".join(c["choices"][0]["text"] for c in rest if c["choices"])
    assert text and [c["choices"][0]["finish_reason"] for c in rest if c["choices"]][-1] == "length"
    assert rest[-1]["usage"]["completion_tokens"] == 600
    # Then, with nothing in flight, the replica goes and its engine stops.
    wait_until(lambda: served.replicas(MODEL) == [], "smollm2's replica gone", timeout=REQUEST_TIMEOUT)
    wait_until(lambda: not alive(pid), "vLLM stopped", timeout=REQUEST_TIMEOUT)
    assert client_models(served) == ["fake-chat"]


def client_models(fleet: Fleet) -> list[str]:
    return [m["id"] for m in requests.get(fleet.router + "/v1/models", timeout=5).json()["data"]]

"""The fake engine, run as a real process and spoken to as clients speak to vLLM."""
from __future__ import annotations

import json
import math

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from llmgwctl.engines import parse_load

from ..support import wait_until
from .conftest import wait_healthy

MODEL = "fake-llama"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def gauges(url: str) -> dict[str, float]:
    page = requests.get(f"{url}/metrics", timeout=5).text
    out = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if family.type == "gauge":
                assert sample.labels == {"engine": "0", "model_name": MODEL}
                out[sample.name] = sample.value
    return out


def test_health_is_503_until_startup_delay_has_passed(fake_engine):
    engine = fake_engine(MODEL, "--startup-delay", "3")
    first = requests.get(f"{engine.url}/health", timeout=5)
    assert first.status_code == 503
    early = requests.post(f"{engine.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=5)
    assert early.status_code == 503
    assert early.json()["error"]["code"] == 503
    wait_healthy(engine.url, timeout=30)
    assert requests.post(f"{engine.url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                         timeout=5).status_code == 200


def test_models_lists_the_served_name(fake_engine):
    engine = fake_engine(MODEL)
    models = client(engine.url).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_reply_is_deterministic_and_names_the_replica(fake_engine):
    engine = fake_engine(MODEL, "--replica-id", "r7")
    c = client(engine.url)
    messages = [{"role": "user", "content": "what is two plus two"}]
    a = c.chat.completions.create(model=MODEL, messages=messages)
    b = c.chat.completions.create(model=MODEL, messages=messages)
    other = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "something else"}])
    text = a.choices[0].message.content
    assert text == b.choices[0].message.content
    assert text != other.choices[0].message.content
    assert text.startswith(f"replica=r7 model={MODEL} prompt=")
    assert a.choices[0].finish_reason == "stop"
    assert a.usage.completion_tokens == 16          # --default-max-tokens
    assert a.usage.prompt_tokens == 5               # whitespace words of the prompt
    assert a.model == MODEL


def test_max_tokens_is_honoured(fake_engine):
    engine = fake_engine(MODEL)
    c = client(engine.url)
    reply = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5)
    assert reply.usage.completion_tokens == 5
    assert len(reply.choices[0].message.content.split()) == 5
    assert reply.choices[0].finish_reason == "length"
    long = c.completions.create(model=MODEL, prompt="x", max_tokens=40, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 40
    assert long.choices[0].finish_reason == "length"


def test_replica_id_defaults_to_the_port(fake_engine):
    engine = fake_engine(MODEL)
    reply = client(engine.url).completions.create(model=MODEL, prompt="hello")
    assert reply.choices[0].text.startswith(f"replica={engine.port} ")


def test_streaming_chat_matches_the_whole_reply_and_ends_with_usage(fake_engine):
    engine = fake_engine(MODEL)
    c = client(engine.url)
    messages = [{"role": "user", "content": "stream me"}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in content_chunks) == whole.choices[0].message.content
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in content_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.completion_tokens, usage_chunk.usage.prompt_tokens) == (8, 2)
    assert len({ch.id for ch in chunks}) == 1


def test_streaming_wire_format_is_sse_ending_with_done(fake_engine):
    engine = fake_engine(MODEL)
    r = requests.post(f"{engine.url}/v1/completions", timeout=10,
                      json={"model": MODEL, "prompt": "p", "max_tokens": 3, "stream": True})
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    bodies = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert [b["object"] for b in bodies] == ["text_completion"] * 3
    assert "usage" not in bodies[-1]                # not asked for: no usage chunk


def test_embeddings_are_deterministic_unit_vectors(fake_engine):
    engine = fake_engine(MODEL, "--embedding-dim", "32")
    c = client(engine.url)
    # The openai client asks for base64 by default; check float too.
    one = c.embeddings.create(model=MODEL, input="alpha").data[0].embedding
    again = c.embeddings.create(model=MODEL, input=["alpha", "beta"])
    as_float = c.embeddings.create(model=MODEL, input="alpha", encoding_format="float").data[0].embedding
    assert len(one) == 32
    assert [d.index for d in again.data] == [0, 1]
    assert again.data[0].embedding == pytest.approx(one, abs=1e-6)
    assert as_float == pytest.approx(one, abs=1e-6)
    assert again.data[1].embedding != pytest.approx(one, abs=1e-3)
    assert math.sqrt(sum(x * x for x in one)) == pytest.approx(1.0, abs=1e-5)


def test_wrong_model_is_vllm_404(fake_engine):
    engine = fake_engine(MODEL)
    with pytest.raises(openai.NotFoundError) as caught:
        client(engine.url).chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert caught.value.body == {"message": "The model `other` does not exist.", "type": "NotFoundError",
                                 "param": "model", "code": 404}


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"model": "fake-llama", "messages": "hi"}',
                                  b'{"model": "fake-llama", "messages": [{"role": "user"}], "max_tokens": -1}'])
def test_bad_body_is_400_in_openai_shape(fake_engine, body):
    engine = fake_engine(MODEL)
    r = requests.post(f"{engine.url}/v1/chat/completions", data=body, timeout=5,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["message"]


def test_fail_rate_fails_the_same_requests_every_run(fake_engine):
    outcomes = []
    for _ in range(2):
        engine = fake_engine(MODEL, "--fail-rate", "0.25")
        codes = [requests.post(f"{engine.url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                               timeout=5).status_code for _ in range(8)]
        outcomes.append(codes)
        engine.stop()
    assert outcomes[0] == outcomes[1] == [200, 200, 200, 500, 200, 200, 200, 500]


def test_metrics_follow_open_streams_and_queue_beyond_max_num_seqs(fake_engine):
    # 2 tokens/s and 200 tokens: each stream stays open far longer than the test needs.
    engine = fake_engine(MODEL, "--tokens-per-second", "2", "--max-num-seqs", "3")
    assert gauges(engine.url)["vllm:num_requests_running"] == 0
    streams = []
    try:
        for _ in range(5):
            r = requests.post(f"{engine.url}/v1/chat/completions", stream=True, timeout=30,
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hold"}],
                                    "max_tokens": 200, "ignore_eos": True, "stream": True})
            assert r.status_code == 200
            streams.append(r)
        wait_until(lambda: gauges(engine.url)["vllm:num_requests_running"] == 3, what="3 running")
        now = gauges(engine.url)
        assert now["vllm:num_requests_waiting"] == 2
        assert now["vllm:kv_cache_usage_perc"] == 1.0
        # The adapter the router uses reads the same page the same way.
        reading = parse_load("fake", requests.get(f"{engine.url}/metrics", timeout=5).text)
        assert (reading.running, reading.waiting, reading.kv_cache) == (3, 2, 1.0)
    finally:
        for r in streams:
            r.close()
    # Disconnected clients free their slots.
    wait_until(lambda: gauges(engine.url)["vllm:num_requests_running"] == 0, what="slots freed on disconnect")
    assert gauges(engine.url)["vllm:num_requests_waiting"] == 0


def test_open_stream_count_matches_running(fake_engine):
    engine = fake_engine(MODEL, "--tokens-per-second", "1")
    streams = []
    try:
        for expected in (1, 2, 3, 4):
            streams.append(requests.post(f"{engine.url}/v1/completions", stream=True, timeout=30,
                                         json={"model": MODEL, "prompt": "p", "max_tokens": 100,
                                               "ignore_eos": True, "stream": True}))
            wait_until(lambda expected=expected: gauges(engine.url)["vllm:num_requests_running"] == expected, what=f"{expected} running")
        streams.pop().close()
        wait_until(lambda: gauges(engine.url)["vllm:num_requests_running"] == 3, what="3 running after one closed")
    finally:
        for r in streams:
            r.close()


def test_counters_parse_and_count_finished_requests(fake_engine):
    engine = fake_engine(MODEL)
    c = client(engine.url)
    c.completions.create(model=MODEL, prompt="one two three", max_tokens=4)
    c.completions.create(model=MODEL, prompt="four", max_tokens=2)
    page = requests.get(f"{engine.url}/metrics", timeout=5).text
    values = {(s.name, s.labels.get("finished_reason")): s.value
              for f in text_string_to_metric_families(page) for s in f.samples}
    assert values[("vllm:generation_tokens_total", None)] == 6
    assert values[("vllm:prompt_tokens_total", None)] == 4
    assert values[("vllm:request_success_total", "length")] == 2


def test_unknown_route_is_openai_404(fake_engine):
    engine = fake_engine(MODEL)
    r = requests.get(f"{engine.url}/v1/nope", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_responses_are_stored_per_process_and_an_unknown_one_is_vllms_404(fake_engine):
    engine = fake_engine(MODEL, "--replica-id", "r9")
    c = client(engine.url)
    first = c.responses.create(model=MODEL, input="hello", max_output_tokens=6)
    assert first.output_text.startswith("replica=r9") and len(first.output_text.split()) == 6
    assert first.usage.output_tokens == 6 and first.status == "completed"
    second = c.responses.create(model=MODEL, input="hello", previous_response_id=first.id)
    # The whole conversation is the prompt: the same input after a turn is another prompt.
    assert second.output_text.split()[2] != first.output_text.split()[2]
    assert c.responses.retrieve(first.id).output_text == first.output_text
    # An id this process never made, as vLLM answers it: 404 with its words and param.
    r = requests.post(f"{engine.url}/v1/responses", timeout=5,
                      json={"model": MODEL, "input": "x", "previous_response_id": "resp_elsewhere"})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "Response with id 'resp_elsewhere' not found.",
                                 "type": "invalid_request_error", "param": "response_id", "code": 404}
    # store: false keeps nothing.
    fleeting = c.responses.create(model=MODEL, input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(fleeting.id)
    assert c.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)


def test_a_responses_stream_has_the_events_the_sdk_parses_in_vllms_order(fake_engine):
    engine = fake_engine(MODEL)
    r = requests.post(f"{engine.url}/v1/responses", timeout=5, stream=True,
                      json={"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 3})
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = [block for block in r.text.split("\n\n") if block]
    kinds = [block.split("\n")[0].removeprefix("event: ") for block in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 3 + [
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    data = [json.loads(block.split("\n")[1].removeprefix("data: ")) for block in events]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["type"] for d in data] == kinds
    # As vLLM lays them out: the response first in the created event, its id first in the response
    # (what the router reads without parsing the event), then sequence_number and type.
    assert events[0].split("\n")[1].startswith('data: {"response":{"id":"resp_')
    assert list(data[0]) == ["response", "sequence_number", "type"]
    assert data[0]["response"]["id"] == data[-1]["response"]["id"]
    assert data[-1]["response"]["usage"]["output_tokens"] == 3

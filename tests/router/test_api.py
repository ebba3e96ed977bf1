"""The OpenAI-compatible API end to end: the official `openai` client, the router, real fake engines."""
from __future__ import annotations

import json

import openai
import pytest
import requests

from .harness import catalog, make_router, wait_until

MODEL = "qwen2.5-7b-instruct"


@pytest.fixture
def setup(engines, routers):
    engine = engines(MODEL, "r1")
    rt = routers(make_router(catalog((MODEL, ("qwen", "default")), ("other-model", ()))))
    rt.set_endpoints([engine.endpoint()])
    client = openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    return engine, rt, client


def test_chat_and_completion_without_streaming(setup):
    engine, rt, client = setup
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5)
    chat = raw.parse()
    assert chat.model == MODEL and chat.choices[0].message.content
    assert "replica=r1" in chat.choices[0].message.content
    assert raw.headers["x-llmgw-replica"] == "r1"
    assert raw.headers["x-llmgw-catalog-version"] == rt.router.catalog.version
    done = client.completions.create(model=MODEL, prompt="once upon", max_tokens=4)
    assert done.choices[0].text and done.usage.completion_tokens == 4


def test_chat_and_completion_streaming(setup):
    engine, rt, client = setup
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "replica=r1" in text
    stream = client.completions.create(model=MODEL, prompt="x", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith("replica=r1")


def test_streamed_bytes_pass_through_unchanged(setup):
    engine, rt, _ = setup
    body = {"model": MODEL, "prompt": "same bytes", "max_tokens": 8, "stream": True, "seed": 1}
    via_router = requests.post(rt.url + "/v1/completions", json=body, timeout=30)
    direct = requests.post(engine.url + "/v1/completions", json=body, timeout=30)
    assert via_router.headers["Content-Type"].startswith("text/event-stream")

    def events(text):   # ids and timestamps differ per request; everything else must match
        out = []
        for line in text.split("\n\n"):
            if line.startswith("data: {"):
                doc = json.loads(line[6:])
                doc.pop("id"), doc.pop("created")
                out.append(doc)
            elif line:
                out.append(line)
        return out
    assert events(via_router.text) == events(direct.text) and len(events(direct.text)) == 9   # 8 tokens + [DONE]


def test_alias_resolves_to_the_served_name_and_is_echoed_back(setup):
    engine, rt, client = setup
    for alias in ("qwen", "default"):
        chat = client.chat.completions.create(model=alias, messages=[{"role": "user", "content": "a"}], max_tokens=2)
        # The fake engine answers 404 for any name but its own, and says the name it was sent:
        # this reply proves the rewrite; its `model` is the name the client asked for (echo.py).
        assert f"model={MODEL}" in chat.choices[0].message.content
        assert chat.model == alias


def test_embeddings_and_other_post_routes(setup):
    engine, rt, client = setup
    emb = client.embeddings.create(model="qwen", input=["a", "b"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 16
    # A route outside the route table: the router's own 404, and no engine is asked.
    r = requests.post(rt.url + "/v1/audio/speech", json={"model": MODEL, "input": "x"}, timeout=10)
    assert r.status_code == 404 and "x-llmgw-replica" not in r.headers and r.json()["error"]["code"] == "not_found"


def test_models_lists_names_aliases_and_ready_counts(setup):
    engine, rt, client = setup
    listed = {m.id: m for m in client.models.list()}
    assert set(listed) == {MODEL, "qwen", "default", "other-model"}
    raw = requests.get(rt.url + "/v1/models", timeout=10).json()
    by_id = {m["id"]: m for m in raw["data"]}
    assert raw["object"] == "list"
    assert by_id[MODEL]["llmgw"]["ready_replicas"] == 1
    assert by_id["qwen"]["llmgw"] == {"ready_replicas": 1, "alias_of": MODEL}
    assert by_id["other-model"]["llmgw"]["ready_replicas"] == 0
    rt.set_endpoints([])
    assert requests.get(rt.url + "/v1/models", timeout=10).json()["data"][0]["llmgw"]["ready_replicas"] == 0
    # Retrieve one, by name or alias, as the openai client does.
    one = client.models.retrieve("qwen")
    assert one.id == "qwen" and one.object == "model"
    # What changed with the endpoints gone: its status, and the ready count (its context length is
    # what its engine said, whenever it was asked: tests/router/test_models_list.py).
    learned = ("context_length", "max_model_len")
    retrieved = {k: v for k, v in requests.get(rt.url + f"/v1/models/{MODEL}", timeout=10).json().items()
                 if k not in learned}
    assert retrieved == {**{k: v for k, v in by_id[MODEL].items() if k not in learned}, "status": "unloaded",
                         "llmgw": {**by_id[MODEL]["llmgw"], "ready_replicas": 0}}
    missing = requests.get(rt.url + "/v1/models/qwen2.5-7b-instrukt", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found" and MODEL in missing.json()["error"]["message"]
    health = requests.get(rt.url + "/healthz", timeout=10).json()
    assert health["status"] == "ok" and health["catalog_version"] == rt.router.catalog.version


def _error(r: requests.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"} and err["code"] == code and err["message"]
    return err


def test_error_cases_have_their_status_and_openai_shape(setup):
    engine, rt, client = setup
    url = rt.url + "/v1/chat/completions"
    _error(requests.post(url, data=b"{not json", timeout=10), 400, "invalid_json")
    _error(requests.post(url, json=["a list"], timeout=10), 400, "invalid_body")
    _error(requests.post(url, json={"messages": []}, timeout=10), 400, "missing_model")
    err = _error(requests.post(url, json={"model": "qwen2.5-7b-instrct"}, timeout=10), 404, "model_not_found")
    assert "'qwen2.5-7b-instrct'" in err["message"] and "did you mean 'qwen2.5-7b-instruct'" in err["message"]
    r = requests.post(url, json={"model": "other-model"}, timeout=10)
    _error(r, 503, "no_ready_replica")
    assert int(r.headers["Retry-After"]) > 0
    _error(requests.get(rt.url + "/v2/nothing", timeout=10), 404, "not_found")
    # And the openai client raises the matching exception with our message.
    with pytest.raises(openai.NotFoundError, match="did you mean"):
        client.chat.completions.create(model="qwen2", messages=[{"role": "user", "content": "a"}])
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="other-model", messages=[{"role": "user", "content": "a"}])
    assert info.value.status_code == 503


def test_body_over_the_limit_is_413(engines, routers):
    engine = engines(MODEL, "r1")
    rt = routers(make_router(catalog((MODEL, ())), max_body_bytes=1024))
    rt.set_endpoints([engine.endpoint()])
    big = {"model": MODEL, "prompt": "x" * 2000}
    _error(requests.post(rt.url + "/v1/completions", json=big, timeout=10), 413, "request_too_large")

    def chunked():   # no Content-Length: the limit holds while reading too
        yield json.dumps(big).encode()
    _error(requests.post(rt.url + "/v1/completions", data=chunked(), timeout=10), 413, "request_too_large")
    ok = requests.post(rt.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=10)
    assert ok.status_code == 200


def test_engine_errors_pass_through_untouched(setup):
    engine, rt, _ = setup
    bad = {"model": MODEL, "prompt": "x", "max_tokens": -1}
    via_router = requests.post(rt.url + "/v1/completions", json=bad, timeout=10)
    direct = requests.post(engine.url + "/v1/completions", json=bad, timeout=10)
    assert via_router.status_code == direct.status_code == 400
    assert via_router.json() == direct.json()


def test_usage_snapshot_counts_last_use(setup):
    engine, rt, client = setup
    before = rt.call(rt.router.usage_snapshot)
    assert before == {"r1": (None, 0)}
    client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    last_used, inflight = rt.call(rt.router.usage_snapshot)["r1"]
    assert last_used is not None and inflight == 0
    wait_until(lambda: rt.router.balancer.states()[0].load is not None, what="a metrics reading")

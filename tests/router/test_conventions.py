"""What clients and tools expect of the router's HTTP face, against a real router and real fake engines.

Request ids end to end (client, access log, engine), the header policy,
/health and /readyz, 405 with Allow, CORS, and a stream held for a cold start
kept company by SSE comments -- parsed by the official `openai` SDK.
"""
from __future__ import annotations

import logging
import re
import threading

import openai
import pytest
import requests

from llmgwctl.catalog import Catalog

from .harness import catalog, make_router, wait_until
from .test_coldstart_e2e import SilentWaker, StartingWaker

MODEL = "conv-model"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def engine_lines(path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("fake engine")]


def test_one_request_id_at_client_access_log_and_engine(tmp_path, engines, routers, caplog):
    log = tmp_path / "engine.log"
    engine = engines(MODEL, "conv-r1", "--log-requests", stderr=log)
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([engine.endpoint()])
    sent = {"X-Request-Id": "client-id-42", "traceparent": TRACEPARENT, "tracestate": "vendor=abc",
            "Authorization": "Bearer sk-the-gateways-not-the-engines", "Cookie": "session=1",
            "X-Secret-Header": "never-forwarded"}
    with caplog.at_level(logging.INFO, logger="llmgw.access"):
        r = requests.post(rt.url + "/v1/chat/completions", json=CHAT, headers=sent, timeout=30)
        s = requests.post(rt.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                          headers={"X-Request-Id": "stream-id-7"}, timeout=30)
        # A stream is logged once its end is written, which may be just after the client read it.
        wait_until(lambda: len([rec for rec in caplog.records if rec.name == "llmgw.access"]) == 2, timeout=10,
                   what="both access lines")
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "client-id-42"
    assert s.status_code == 200 and s.headers["X-Request-Id"] == "stream-id-7" and "[DONE]" in s.text
    wait_until(lambda: len(engine_lines(log)) == 2, timeout=10, what="the engine's two request lines")
    plain, streamed = engine_lines(log)
    # The engine saw the id and the trace context, and none of the client's credentials or other headers.
    assert "x-request-id=client-id-42" in plain and f"traceparent={TRACEPARENT}" in plain
    assert "tracestate=vendor=abc" in plain
    assert "authorization=absent" in plain and "cookie=absent" in plain
    assert "x-request-id=stream-id-7" in streamed and "traceparent=-" in streamed
    lines = {rec.request_id: rec for rec in caplog.records if rec.name == "llmgw.access"}
    ok = lines["client-id-42"]
    usage = r.json()["usage"]
    assert ok.status == 200 and ok.endpoint == "conv-r1" and ok.model == MODEL
    assert (ok.tokens_in, ok.tokens_out) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert "id=client-id-42" in ok.getMessage() and f"tokens={usage['prompt_tokens']}/" in ok.getMessage()
    assert lines["stream-id-7"].status == 200


def test_an_id_the_router_cannot_trust_is_replaced_and_every_answer_carries_one(tmp_path, engines, routers):
    log = tmp_path / "engine.log"
    engine = engines(MODEL, "conv-r2", "--log-requests", stderr=log)
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([engine.endpoint()])
    for bad in ("x" * 129, "has space", "semi;colon", "quote\"d"):
        r = requests.post(rt.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": bad}, timeout=30)
        assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{16}", r.headers["X-Request-Id"]), bad
    r = requests.post(rt.url + "/v1/chat/completions", json=CHAT,
                      headers={"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "tracestate": "a=b"}, timeout=30)
    made = r.headers["X-Request-Id"]
    wait_until(lambda: len(engine_lines(log)) == 5, timeout=10, what="the engine's request lines")
    last = engine_lines(log)[-1]
    # The id the client got is the one the engine got; an invalid traceparent takes its tracestate with it.
    assert f"x-request-id={made}" in last and "traceparent=-" in last and "tracestate=-" in last
    # Errors of every kind, and the other routes, carry an id too.
    answers = [
        requests.post(rt.url + "/v1/chat/completions", json={**CHAT, "model": "nope"}, timeout=10),   # 404
        requests.post(rt.url + "/v1/chat/completions", data=b"{bad", timeout=10),                    # 400
        requests.get(rt.url + "/nowhere", timeout=10),                                               # 404
        requests.get(rt.url + "/v1/chat/completions", timeout=10),                                   # 405
        requests.get(rt.url + "/v1/models", timeout=10),
        requests.get(rt.url + "/health", timeout=10),
    ]
    assert [a.status_code for a in answers] == [404, 400, 404, 405, 200, 200]
    assert all(re.fullmatch(r"[0-9a-f]{16}", a.headers["X-Request-Id"]) for a in answers)
    assert requests.get(rt.url + "/health", headers={"X-Request-Id": "probe-1"},
                        timeout=10).headers["X-Request-Id"] == "probe-1"


def test_health_is_liveness_and_readyz_waits_for_a_catalog_and_an_endpoint_list(engines, routers):
    empty = routers(make_router(Catalog()))
    assert requests.get(empty.url + "/health", timeout=10).json() == {"status": "ok"}
    r = requests.get(empty.url + "/readyz", timeout=10)
    assert r.status_code == 503 and len(r.json()["problems"]) == 2
    rt = routers(make_router(catalog((MODEL, ()))))
    r = requests.get(rt.url + "/readyz", timeout=10)
    assert r.status_code == 503 and r.json()["problems"] == ["no endpoint list received yet"]
    # An empty list is an answer: a scaled-to-zero fleet's router must stay in the load balancer.
    rt.set_endpoints([])
    r = requests.get(rt.url + "/readyz", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ready" and r.json()["endpoints"] == 0


def test_a_method_a_route_does_not_take_is_405_with_allow(routers):
    rt = routers(make_router(catalog((MODEL, ()))))
    for method, path, allow in (("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/embeddings", "POST"),
                                ("DELETE", "/v1/models", "GET, HEAD"), ("POST", "/health", "GET, HEAD"),
                                ("OPTIONS", "/v1/completions", "POST"), ("GET", "/v1/responses", "POST"),
                                ("PUT", "/v1/responses/resp_x", "GET, DELETE"),
                                ("GET", "/v1/responses/resp_x/cancel", "POST"),
                                ("DELETE", "/v1/responses/resp_x/input_items", "GET")):
        r = requests.request(method, rt.url + path, timeout=10)
        assert r.status_code == 405 and r.headers["Allow"] == allow, (method, path)
        assert r.json()["error"]["code"] == "method_not_allowed" and r.json()["error"]["type"]
    # Without CORS on, no CORS headers however the client asks.
    r = requests.options(rt.url + "/v1/chat/completions", timeout=10,
                         headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert "Access-Control-Allow-Origin" not in r.headers
    # Not a route under any method (routes.TABLE): 404, not 405.
    assert requests.get(rt.url + "/v1/no-such-thing", timeout=10).status_code == 404
    assert requests.get(rt.url + "/v2/models", timeout=10).status_code == 404
    assert requests.get(rt.url + "/v1/responses/resp_x/other", timeout=10).status_code == 404


def test_cors_preflight_and_answers_for_the_named_origins_only(engines, routers):
    engine = engines(MODEL, "conv-cors")
    rt = routers(make_router(catalog((MODEL, ())), cors_origins=("https://app.example",)))
    rt.set_endpoints([engine.endpoint()])
    ask = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
    r = requests.options(rt.url + "/v1/chat/completions", headers=ask, timeout=10)
    assert r.status_code == 204
    assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert r.headers["Access-Control-Allow-Headers"] == ask["Access-Control-Request-Headers"]
    assert r.headers["Vary"] == "Origin" and int(r.headers["Access-Control-Max-Age"]) > 0
    r = requests.options(rt.url + "/v1/chat/completions", headers={**ask, "Origin": "https://evil.example"},
                         timeout=10)
    assert r.status_code == 403 and "Access-Control-Allow-Origin" not in r.headers
    assert r.json()["error"]["code"] == "cors_origin_not_allowed"
    for body in (CHAT, {**CHAT, "stream": True}, {**CHAT, "model": "nope"}):
        r = requests.post(rt.url + "/v1/chat/completions", json=body, headers={"Origin": "https://app.example"},
                          timeout=30)
        assert r.headers["Access-Control-Allow-Origin"] == "https://app.example", body
        assert "X-Request-Id" in r.headers["Access-Control-Expose-Headers"]
    # Another site's page is refused outright (httporigin), not only left unable to read the answer.
    r = requests.post(rt.url + "/v1/chat/completions", json=CHAT, headers={"Origin": "https://evil.example"},
                      timeout=30)
    assert r.status_code == 403 and "Access-Control-Allow-Origin" not in r.headers
    anyone = routers(make_router(catalog((MODEL, ())), cors_origins=("*",)))
    r = requests.options(anyone.url + "/v1/models", headers={**ask, "Origin": "https://x.example"}, timeout=10)
    assert r.status_code == 204 and r.headers["Access-Control-Allow-Origin"] == "*"


def test_an_allowed_page_may_delete_a_stored_response_through_cors(engines, routers):
    """DELETE /v1/responses/{id} is a route the router takes: a preflight allows it, and the call reaches it."""
    engine = engines(MODEL, "conv-cors-delete")
    rt = routers(make_router(catalog((MODEL, ())), cors_origins=("https://app.example",)))
    rt.set_endpoints([engine.endpoint()])
    page = {"Origin": "https://app.example"}
    r = requests.options(rt.url + "/v1/responses/resp_x", timeout=10,
                         headers={**page, "Access-Control-Request-Method": "DELETE"})
    assert r.status_code == 204 and "DELETE" in r.headers["Access-Control-Allow-Methods"].split(", ")
    # Not the browser guard's 403: the router's own answer for a response it never stored.
    r = requests.delete(rt.url + "/v1/responses/resp_x", headers=page, timeout=10)
    assert r.status_code == 404 and r.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert r.json()["error"]["code"] != "cors_origin_not_allowed"


def test_a_stream_held_for_a_cold_start_gets_comments_and_the_openai_sdk_parses_it(engines, routers):
    waker = StartingWaker(engines)
    rt = routers(make_router(catalog((MODEL, ())), waker=waker, cold_timeout=30, cold_keepalive=0.2))
    waker.rt = rt
    # Bring the engine up slowly enough for several comments: the waker's
    # engine starts in a thread, and its process takes well over 0.2 s.
    client = openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
    stream = raw.parse()
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text and raw.headers["content-type"].startswith("text/event-stream")
    assert re.fullmatch(r"[0-9a-f]{16}", raw.headers["x-request-id"])
    assert waker.calls == [MODEL]


def test_the_comments_are_on_the_wire_and_a_warm_stream_gets_none(engines, routers):
    waker = StartingWaker(engines)
    rt = routers(make_router(catalog((MODEL, ())), waker=waker, cold_timeout=30, cold_keepalive=0.2))
    waker.rt = rt
    r = requests.post(rt.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60)
    assert r.status_code == 200
    comments = [line for line in r.text.splitlines() if line.startswith(":")]
    assert comments and all(c.startswith(f": waiting for model {MODEL} to start") for c in comments)
    assert r.text.rstrip().endswith("data: [DONE]")
    warm = requests.post(rt.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60)
    assert warm.headers["x-llmgw-replica"] == "woken"
    assert not [line for line in warm.text.splitlines() if line.startswith(":")]


def test_a_cold_timeout_after_the_comments_is_an_error_event_the_sdk_raises(routers, caplog):
    rt = routers(make_router(catalog((MODEL, ())), waker=SilentWaker(), cold_timeout=1.0, cold_keepalive=0.2))
    client = openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with caplog.at_level(logging.INFO, logger="llmgw.access"):
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                stream=True)
        with pytest.raises(openai.APIError, match="no replica was ready within"):
            for _ in stream:
                pass
        # The router's thread writes the access line once its handler returns, which can be
        # after the client has read the error event (CI saw it not there yet).
        logged = wait_until(lambda: [rec for rec in caplog.records if rec.name == "llmgw.access"],
                            "the stream's access line")
    assert [rec.status for rec in logged] == [503]
    # Not a stream: the wait ends in the plain 503 it always was.
    r = requests.post(rt.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0


def test_a_client_that_leaves_during_the_comments_is_counted_as_499(routers):
    rt = routers(make_router(catalog((MODEL, ())), waker=SilentWaker(), cold_timeout=30, cold_keepalive=0.1))
    got_comment = threading.Event()

    def client():
        with requests.post(rt.url + "/v1/chat/completions", json={**CHAT, "stream": True}, stream=True,
                           timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith(b":"):
                    got_comment.set()
                    return      # closes the connection
    t = threading.Thread(target=client, daemon=True)
    t.start()
    assert got_comment.wait(20)
    t.join(20)
    wait_until(lambda: rt.router.cold.waiting(MODEL) == 0, timeout=10, what="the wait to end with the client")
    page = requests.get(rt.url + "/metrics", timeout=10).text
    assert re.search(r'llmgw_router_requests_total\{code="499",endpoint="",model="%s"\} 1' % MODEL, page), page

"""What the router hands its RequestSink per request (contracts.requestlog): one record each, as the client saw it."""
from __future__ import annotations

import requests

from llmgwctl.router.watch import RequestOutbox

from .harness import catalog, make_router, wait_until

MODEL = "qwen2.5-7b-instruct"


def test_each_request_is_one_record_with_what_was_asked_what_served_and_why_it_failed(engines, routers):
    engine = engines(MODEL, "r1")
    rt = routers(make_router(catalog((MODEL, ("qwen",)), ("cold-model", ()))))
    rt.set_endpoints([engine.endpoint()])
    box = RequestOutbox()
    rt.call(lambda: rt.router.set_request_sink(box))
    chat = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    ok = requests.post(rt.url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "rec-1"}, timeout=30)
    streamed = requests.post(rt.url + "/v1/chat/completions", timeout=30, headers={"X-Request-Id": "rec-2"},
                             json=chat | {"stream": True, "stream_options": {"include_usage": True}})
    unknown = requests.post(rt.url + "/v1/chat/completions", json=chat | {"model": "nope"},
                            headers={"X-Request-Id": "rec-3"}, timeout=30)
    assert (ok.status_code, streamed.status_code, unknown.status_code) == (200, 200, 404)
    # A stream's record is made once its handler has finished it, which may be just after the client read its end.
    taken: list = []
    wait_until(lambda: taken.extend(rt.call(box.take)) or len(taken) == 3, what="three records")
    records = {r.id: r for r in taken}
    assert sorted(records) == ["rec-1", "rec-2", "rec-3"]
    whole, stream, refused = records["rec-1"], records["rec-2"], records["rec-3"]
    assert (whole.asked, whole.model, whole.status, whole.replica, whole.stream) == ("qwen", MODEL, 200, "r1", False)
    assert whole.tokens_out == 3 and whole.ttft is not None and whole.error is None and whole.key is None
    assert stream.stream and stream.tokens_out == 3 and 0 < (stream.ttft or 0) <= stream.duration
    assert (refused.asked, refused.model, refused.status, refused.replica) == ("nope", "", 404, "")
    assert refused.error and "nope" in refused.error
    assert rt.call(box.take) == [], "taken once"

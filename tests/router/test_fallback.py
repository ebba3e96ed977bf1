"""Fallback models against a real router and real fake engines: when a model's requests go to its fallbacks.

A fallback answers only when the model asked for has no replica that can
(down, unplaceable, saturated); the engine that answers is the fallback's, and
it gets the request under the fallback's own name (a fake engine answers 404 to
any other). The answer says who served it; a key is never widened.
"""
from __future__ import annotations

import logging
import threading

import pytest
import requests

from llmgwctl.catalog import Catalog, Model, Profile
from llmgwctl.contracts import ModelCondition, ModelState
from llmgwctl.router.auth import hash_key, parse_keys

from ..support import wait_until
from .harness import make_router

KEY_A, KEY_AB = "sk-only-a-" + "a" * 32, "sk-a-and-b-" + "b" * 32


def model(name, *fallbacks, aliases=()):
    return Model(name=name, aliases=tuple(aliases), source=f"org/{name}", fallbacks=tuple(fallbacks),
                 profiles=(Profile(name="default", engine="fake", gpus=0),))


def chain_catalog():
    return Catalog([model("a", "b-alias", aliases=["a-alias"]), model("b", "c", aliases=["b-alias"]), model("c")])


class Waker:
    def __init__(self) -> None:
        self.woken: list[str] = []

    def wake(self, model_name: str) -> None:
        self.woken.append(model_name)


def chat(url, model, key=None, timeout=30, **extra):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(url + "/v1/chat/completions", headers=headers, timeout=timeout,
                         json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                               **extra})


def fallbacks_metric(rt, key=None) -> dict[tuple[str, str, str], float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = requests.get(rt.url + "/metrics", headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    out = {}
    for line in resp.text.splitlines():
        if line.startswith("llmgw_router_fallbacks_total{"):
            labels, value = line[len("llmgw_router_fallbacks_total{"):].rsplit("} ", 1)
            got = dict(part.split("=", 1) for part in labels.split(","))
            out[(got["model"].strip('"'), got["fallback"].strip('"'), got["reason"].strip('"'))] = float(value)
    return out


@pytest.fixture
def fleet(engines, routers):
    waker = Waker()
    rt = routers(make_router(chain_catalog(), waker=waker, cold_timeout=60))
    rt.waker = waker
    return rt, engines


def test_a_model_with_no_ready_replica_is_served_by_its_fallback_under_the_fallbacks_name(fleet, caplog):
    rt, engines = fleet
    b = engines("b", "b-r1")
    rt.set_endpoints([b.endpoint()])
    with caplog.at_level(logging.INFO, logger="llmgw.access"):
        resp = chat(rt.url, "a-alias")
    assert resp.status_code == 200, resp.text
    # The fake engine serves only its own name: it got the request as "b".
    assert resp.json()["model"] == "b"
    assert resp.headers["x-llmgw-model"] == "b" and resp.headers["x-llmgw-fallback-from"] == "a"
    assert resp.headers["x-llmgw-replica"] == "b-r1"
    # The model is woken all the same, so its own replica comes for the next requests.
    assert "a" in rt.waker.woken
    assert fallbacks_metric(rt) == {("a", "b", "down"): 1.0}
    (line,) = [r for r in caplog.records if r.name == "llmgw.access"]
    assert line.model == "b" and line.fallback_from == "a" and "fallback_from=a" in line.getMessage()
    # A request for b itself says b, and no fallback.
    resp = chat(rt.url, "b")
    assert resp.headers["x-llmgw-model"] == "b" and "x-llmgw-fallback-from" not in resp.headers


def test_a_stream_falls_back_too_and_its_headers_say_so(fleet):
    rt, engines = fleet
    b = engines("b", "b-r1")
    rt.set_endpoints([b.endpoint()])
    with chat(rt.url, "a", stream=True) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-llmgw-model"] == "b" and resp.headers["x-llmgw-fallback-from"] == "a"
        body = resp.content.decode()
    assert '"model":"b"' in body.replace(" ", "") and body.rstrip().endswith("data: [DONE]")


def test_the_chain_goes_on_through_a_fallbacks_own_fallbacks(fleet):
    rt, engines = fleet
    c = engines("c", "c-r1")
    rt.set_endpoints([c.endpoint()])
    resp = chat(rt.url, "a")
    assert resp.status_code == 200 and resp.json()["model"] == "c"
    assert resp.headers["x-llmgw-model"] == "c" and resp.headers["x-llmgw-fallback-from"] == "a"
    # b, asked for itself, falls back to c as well.
    assert chat(rt.url, "b").headers["x-llmgw-fallback-from"] == "b"


def test_once_the_model_is_up_again_it_answers_itself(fleet):
    rt, engines = fleet
    a, b = engines("a", "a-r1"), engines("b", "b-r1")
    rt.set_endpoints([b.endpoint()])
    assert chat(rt.url, "a").headers["x-llmgw-model"] == "b"
    rt.set_endpoints([a.endpoint(), b.endpoint()])
    resp = chat(rt.url, "a")
    assert resp.status_code == 200 and resp.json()["model"] == "a"
    assert resp.headers["x-llmgw-model"] == "a" and "x-llmgw-fallback-from" not in resp.headers


def test_with_no_fallback_able_to_answer_the_models_own_answer_stands(engines, routers):
    rt = routers(make_router(chain_catalog()))      # no waker: no cold wait, the 503 at once
    resp = chat(rt.url, "a")
    assert resp.status_code == 503 and "'a'" in resp.json()["error"]["message"]
    assert "x-llmgw-model" not in resp.headers
    assert fallbacks_metric(rt) == {}


def test_an_unplaceable_model_falls_back_but_never_past_what_the_key_may_use(engines, routers, tmp_path):
    rt = routers(make_router(chain_catalog(), waker=Waker(), cold_timeout=60))
    b = engines("b", "b-r1")
    rt.set_endpoints([b.endpoint()])
    rt.call(rt.router.set_model_states, [ModelState("a", ModelCondition.UNPLACEABLE, "needs 8 GPUs", retry=False)])
    keys = parse_keys({"keys": [
        {"name": "only-a", "sha256": hash_key(KEY_A), "models": ["a"], "rpm": 100},
        {"name": "a-and-b", "sha256": hash_key(KEY_AB), "models": ["a", "b-alias"], "rpm": 100}]})
    rt.call(rt.router.set_api_keys, keys)
    # A key that may not use b does not get b through a's fallback: a's own answer stands.
    resp = chat(rt.url, "a", key=KEY_A)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "model_unplaceable" and "needs 8 GPUs" in resp.json()["error"]["message"]
    assert "x-llmgw-model" not in resp.headers
    assert chat(rt.url, "b", key=KEY_A).status_code == 403
    # A key allowed b (by an alias of it) is served by b.
    resp = chat(rt.url, "a", key=KEY_AB)
    assert resp.status_code == 200 and resp.json()["model"] == "b"
    assert resp.headers["x-llmgw-fallback-from"] == "a"
    assert fallbacks_metric(rt, KEY_AB) == {("a", "b", "unplaceable"): 1.0}
    # The engine of b served that one request and no other.
    assert b.load() is not None
    text = requests.get(b.url + "/metrics", timeout=5).text
    assert any(line.startswith("vllm:request_success_total") and line.endswith(" 1.0") for line in text.splitlines())


def test_a_saturated_model_spills_to_a_fallback_with_room(engines, routers):
    rt = routers(make_router(chain_catalog(), waker=Waker(), cold_timeout=60, poll_interval=0.2))
    # One slot, slow tokens: a second request waits at the engine, and its /metrics says so.
    a = engines("a", "a-r1", "--max-num-seqs", "1", "--tokens-per-second", "20")
    b = engines("b", "b-r1")
    rt.set_endpoints([a.endpoint(), b.endpoint()])
    done = []
    threads = [threading.Thread(target=lambda: done.append(chat(rt.url, "a", max_tokens=60))) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        # The router's pick learns a is full from the engine's own reading (a request waiting).
        wait_until(lambda: rt.call(rt.router.balancer.room, "a") is False, timeout=30, what="a seen full")
        resp = chat(rt.url, "a")
        assert resp.status_code == 200 and resp.json()["model"] == "b"
        assert resp.headers["x-llmgw-fallback-from"] == "a"
        assert fallbacks_metric(rt) == {("a", "b", "saturated"): 1.0}
    finally:
        for t in threads:
            t.join(60)
    assert [r.json()["model"] for r in done] == ["a", "a"]


def test_a_model_whose_every_endpoint_refuses_falls_back_instead_of_waiting(fleet):
    rt, engines = fleet
    # a's engine is gone but the router was not told: its endpoint is listed, and refuses.
    a, b = engines("a", "a-r1"), engines("b", "b-r1")
    a.kill()
    rt.set_endpoints([a.endpoint(), b.endpoint()])
    resp = chat(rt.url, "a-alias", timeout=20)       # well inside the 60 s cold timeout it would wait otherwise
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "b" and resp.headers["x-llmgw-fallback-from"] == "a"
    assert fallbacks_metric(rt) == {("a", "b", "down"): 1.0}
    # The next one goes to b at once: a's endpoint is ejected, so a is down as the request arrives.
    assert chat(rt.url, "a").headers["x-llmgw-fallback-from"] == "a"
    assert fallbacks_metric(rt) == {("a", "b", "down"): 2.0}


def test_a_fallback_after_refusals_is_picked_by_the_fallbacks_own_policy(engines, routers):
    # b routes by prefix. The prompt's first request goes to b directly, and the prefix index keeps
    # the replica that got it. Each round, a's only endpoint is a fresh one whose engine is gone: the
    # request is sent there, refused, and falls back late; picked by least-load (two random choices
    # between idle replicas) it would land on either, by b's policy on the one that holds the prompt.
    from llmgwctl.contracts import Endpoint

    cat = Catalog([model("a", "b"), Model(name="b", source="org/b", routing="prefix",
                                          profiles=(Profile(name="default", engine="fake", gpus=0),))])
    rt = routers(make_router(cat, cold_timeout=60))
    gone = engines("a", "a-gone")
    gone.kill()
    b1, b2 = engines("b", "b-r1"), engines("b", "b-r2")
    system = "You are a careful assistant for the ACME support desk. " * 40    # many prefix blocks
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    rt.set_endpoints([b1.endpoint(), b2.endpoint()])
    first = requests.post(rt.url + "/v1/chat/completions", timeout=30,
                          json={"model": "b", "messages": messages, "max_tokens": 4})
    assert first.status_code == 200, first.text
    holder = first.headers["x-llmgw-replica"]
    served = []
    for n in range(8):
        rt.set_endpoints([Endpoint(f"a-r{n}", "a", "default", "fake", gone.url), b1.endpoint(), b2.endpoint()])
        resp = requests.post(rt.url + "/v1/chat/completions", timeout=30,
                             json={"model": "a", "messages": messages, "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-llmgw-fallback-from"] == "a" and resp.headers["x-llmgw-attempts"] == "2"
        served.append(resp.headers["x-llmgw-replica"])
    assert served == [holder] * 8, (holder, served)

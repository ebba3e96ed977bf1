"""Retries before the first byte, end to end: a real router, fake engines failing each way (`--fault`, SIGUSR1).

A replica that fails before any byte of its answer could reach the client
-- it answers 503, resets the connection, cuts its headers short, or sends
none in time -- has the request sent to another replica, and the client
gets that replica's 200 with `x-llmgw-attempts: 2`. The budget bounds the
tries; a stream that had a byte out is never sent again (a continuation,
where the model has it on, is its own path).
"""
from __future__ import annotations

import logging
import os
import signal

import openai
import pytest
import requests

from llmgwctl.catalog import Model, Profile
from llmgwctl.router.retry import Attempts, Failure

from ..support import wait_until
from .harness import catalog, make_router

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# A header timeout a test can wait out: the `no-headers` replica never answers.
HEADERS_TIMEOUT = 1.0


def _post(rt, stream: bool) -> requests.Response:
    return requests.post(rt.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)


def _access_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "llmgw.access"]


@pytest.mark.parametrize(("fault", "reason"), [("unavailable", "refused"), ("reset", "unreached"),
                                               ("cut-headers", "headers_cut"), ("no-headers", "timed_out")])
def test_a_replica_failing_before_its_first_byte_is_retried_on_another(engines, routers, caplog, fault, reason):
    bad = engines(MODEL, "bad", "--fault", fault)
    good = engines(MODEL, "good")
    # The failing replica in a higher tier: every first pick is it.
    endpoints = [bad.endpoint(priority=10), good.endpoint()]
    for stream in (False, True):
        # A router each: the first failure ejects the replica for a while, and each must meet it.
        rt = routers(make_router(catalog((MODEL, ())), upstream_headers_timeout=HEADERS_TIMEOUT))
        rt.set_endpoints(endpoints)
        with caplog.at_level(logging.INFO, logger="llmgw.access"):
            r = _post(rt, stream)
            (line,) = wait_until(lambda: _access_lines(caplog), what="the access line")
        caplog.clear()
        assert r.status_code == 200, r.text
        assert r.headers["x-llmgw-replica"] == "good" and r.headers["x-llmgw-attempts"] == "2"
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
        else:
            assert r.json()["choices"][0]["message"]["content"]
        assert line.attempts == 2 and line.endpoint == "good" and " attempts=2 " in line.getMessage()
        (state,) = [s for s in rt.router.balancer.states() if s.replica_id == "bad"]
        assert state.failures == 1 and state.inflight == 0
        page = requests.get(rt.url + "/metrics", timeout=5).text
        assert f'llmgw_router_retries_total{{model="{MODEL}",reason="{reason}"}} 1.0' in page


def test_every_replica_failing_is_a_clear_error_after_each_was_tried_once(engines, routers):
    # Ordered by tier: the 503 first, the reset last, so the router's own error ends it.
    failing = [engines(MODEL, name, "--fault", fault).endpoint(priority=p)
               for name, fault, p in (("u", "unavailable", 30), ("c", "cut-headers", 20), ("r", "reset", 10))]
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints(failing)
    r = _post(rt, False)
    assert r.status_code == 502 and r.headers["x-llmgw-attempts"] == "3"
    err = r.json()["error"]
    assert err["code"] == "upstream_unavailable"
    message = err["message"]
    assert message.startswith(f"every replica tried for model {MODEL!r} failed: 3 attempts: u: answered 503")
    assert "; c: " in message and "headers were complete" in message and "; r: " in message
    assert "X-Request-Id" in r.headers


def test_the_budget_bounds_the_tries_and_a_last_503_passes_through(engines, routers):
    failing = [engines(MODEL, name, "--fault", "unavailable").endpoint() for name in ("a", "b", "c")]
    rt = routers(make_router(catalog((MODEL, ())), max_attempts=2))
    rt.set_endpoints(failing)
    r = _post(rt, False)
    # The last attempt's answer is the engine's own, passed on untouched, with the count.
    assert r.status_code == 503 and r.headers["x-llmgw-attempts"] == "2"
    assert "injected: --fault unavailable" in r.json()["error"]["message"]
    assert sorted(s.last_used is None for s in rt.router.balancer.states()) == [False, False, True]


def test_one_replica_answering_503_is_answered_as_before_in_one_attempt(engines, routers):
    alone = engines(MODEL, "alone", "--fault", "unavailable")
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([alone.endpoint()])
    r = _post(rt, False)
    assert r.status_code == 503 and r.headers["x-llmgw-attempts"] == "1"
    assert r.headers["x-llmgw-replica"] == "alone"


def test_a_replica_toggled_to_503_by_sigusr1_is_retried_until_toggled_back(engines, routers):
    flaky = engines(MODEL, "flaky")
    steady = engines(MODEL, "steady")
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([flaky.endpoint(priority=10), steady.endpoint()])
    assert _post(rt, False).headers["x-llmgw-replica"] == "flaky"

    def answers_503() -> bool:
        return requests.post(flaky.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 503
    os.kill(flaky.proc.pid, signal.SIGUSR1)
    wait_until(answers_503, what="the fake to answer 503 after SIGUSR1")
    r = _post(rt, False)
    assert r.status_code == 200 and r.headers["x-llmgw-replica"] == "steady"
    assert r.headers["x-llmgw-attempts"] == "2"
    os.kill(flaky.proc.pid, signal.SIGUSR1)
    wait_until(lambda: not answers_503(), what="the fake to answer again after the second SIGUSR1")
    # Back once its ejection (1 s after one failure) runs out.
    wait_until(lambda: _post(rt, False).headers["x-llmgw-replica"] == "flaky", what="the replica back in routing")


PACE = ("--tokens-per-second", "20")


@pytest.mark.parametrize("continuation", [0, 2])
def test_a_stream_cut_after_its_first_byte_is_not_retried(engines, routers, caplog, continuation):
    running = {n: engines(MODEL, n, *PACE) for n in "ab"}
    cat = catalog(Model(name=MODEL, source="org/m", profiles=(Profile(name="default", engine="fake", gpus=0),),
                        continuation=continuation))
    rt = routers(make_router(cat))
    rt.set_endpoints([e.endpoint() for e in running.values()])
    client = openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with caplog.at_level(logging.INFO, logger="llmgw.access"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=CHAT["messages"], max_tokens=40, stream=True, extra_body={"ignore_eos": True})
        assert raw.headers["x-llmgw-attempts"] == "1"
        victim = raw.headers["x-llmgw-replica"]
        got, error = [], None
        try:
            for chunk in raw.parse():
                got.append(chunk)
                if len(got) == 4:
                    running[victim].kill()
        except openai.APIError as exc:
            error = exc
        (line,) = wait_until(lambda: _access_lines(caplog), what="the access line of the cut stream")
    assert line.attempts == 1
    other = "b" if victim == "a" else "a"
    (survivor,) = [s for s in rt.router.balancer.states() if s.replica_id == other]
    if continuation:
        # Continued as the catalog asks: a hand-over, not a retry.
        assert error is None and f"continued={victim}>{other}@" in line.getMessage()
        assert survivor.last_used is not None
    else:
        assert isinstance(error, openai.APIError) and "stopped mid-stream" in str(error)
        assert survivor.last_used is None       # nothing was sent to the other replica


def test_attempts_spend_their_budget_once_per_replica_and_say_what_failed():
    attempts = Attempts(3)
    assert attempts.start() == 1 and attempts.left == 2
    attempts.failed(Failure("a", "ConnectionRefusedError", Failure.UNREACHED))
    assert attempts.unreached_only()
    attempts.start()
    attempts.failed(Failure("b", "answered 503", Failure.REFUSED))
    assert not attempts.unreached_only() and attempts.left == 1
    assert attempts.summary() == "2 attempts: a: ConnectionRefusedError; b: answered 503"
    attempts.start()
    assert attempts.left == 0
    attempts.grant()
    assert attempts.left == 1
    assert Attempts(0).budget == 1      # a request is always tried once

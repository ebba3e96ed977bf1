"""Requests in flight to a replica that wedges move as soon as it leaves the routing (router/inflight.py).

Real fake engines and a real router. One replica is SIGSTOPped while a
request waits on it; the router's polls of it go unanswered, outlier
ejection takes it out, and the request waiting for its headers is sent to
the other replica at once -- with a headers timeout of 120 s, so an answer
from the other replica can only come from that move, never from the
timeout. A stream that already sent bytes is continued elsewhere where the
model has continuation on; one that may not be continued, a request with no
attempt left, and requests on a replica that merely leaves the endpoint
list while it answers (a drain) stay where they are; one withdrawn while
its polls go unanswered (its agent saw it wedged first) moves.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal

import openai
import pytest
import requests

from llmgwctl.catalog import Model, Profile
from llmgwctl.contracts import Endpoint
from llmgwctl.router.balancer import Balancer
from llmgwctl.router.inflight import Abandoned, InFlight
from llmgwctl.router.upstream import UpstreamBroken

from ..support import wait_until
from .harness import catalog, make_router
from .test_continuation import whole_reply

MODEL = "m"
ASKED = [{"role": "user", "content": "tell me more"}]
# Long past the test's own bounds: an answer from the other replica proves the early move.
HEADERS_TIMEOUT = 120.0
# 40 tokens at 10 a second: a whole answer's headers come after 4 s, a stream runs 4 s.
PACE = ("--tokens-per-second", "10")
TOKENS = 40
# Ejection takes about three polls of a second each; the wait for it, and for what follows, is bounded by this.
BOUND = 30.0


def _model(continuation: int = 0) -> Model:
    return Model(name=MODEL, source="org/m", profiles=(Profile(name="default", engine="fake", gpus=0),),
                 continuation=continuation)


def _setup(engines, routers, continuation: int = 0, **config):
    running = {n: engines(MODEL, n, *PACE) for n in "ab"}
    rt = routers(make_router(catalog(_model(continuation)), upstream_headers_timeout=HEADERS_TIMEOUT, **config))
    # `a` in the higher tier: every first pick is it.
    rt.set_endpoints([running["a"].endpoint(priority=10), running["b"].endpoint()])
    return running, rt


def _post(rt) -> requests.Response:
    return requests.post(rt.url + "/v1/chat/completions", timeout=BOUND * 2, json={
        "model": MODEL, "messages": ASKED, "max_tokens": TOKENS, "ignore_eos": True})


def _access_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "llmgw.access"]


def _waiting_on(rt, rid: str) -> int:
    state = rt.router.balancer.state_of(rid)
    return rt.call(rt.router.inflight.waiting, state)


def _ejected(rt, rid: str) -> bool:
    return rid in rt.call(rt.router.ejector.current)


def test_a_request_waiting_on_a_replica_that_wedges_is_answered_by_the_other(engines, routers, caplog):
    running, rt = _setup(engines, routers)
    wedged = running["a"]
    with caplog.at_level(logging.INFO, logger="llmgw.access"), concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, rt)
        wait_until(lambda: _waiting_on(rt, "a") == 1, what="the request waiting on a")
        os.kill(wedged.proc.pid, signal.SIGSTOP)
        try:
            r = pending.result(timeout=BOUND * 2)
            (line,) = wait_until(lambda: _access_lines(caplog), what="the access line")
            ejected = _ejected(rt, "a")
        finally:
            os.kill(wedged.proc.pid, signal.SIGCONT)
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-replica"] == "b" and r.headers["x-llmgw-attempts"] == "2"
    assert r.json()["choices"][0]["message"]["content"]
    assert ejected      # the move came with the ejection, not with a timeout
    assert line.attempts == 2 and line.endpoint == "b" and " attempts=2 " in line.getMessage()
    assert _waiting_on(rt, "a") == 0 and rt.router.balancer.state_of("a").inflight == 0
    page = requests.get(rt.url + "/metrics", timeout=5).text
    assert f'llmgw_router_retries_total{{model="{MODEL}",reason="abandoned"}} 1.0' in page


def test_with_no_attempt_left_the_request_waits_for_its_replica_as_before(engines, routers):
    running, rt = _setup(engines, routers, max_attempts=1)
    wedged = running["a"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, rt)
        wait_until(lambda: _waiting_on(rt, "a") == 0 and rt.router.balancer.state_of("a").inflight == 1,
                   what="the request on a (not movable: no attempt left)")
        os.kill(wedged.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: _ejected(rt, "a"), what="a ejected", timeout=BOUND)
            assert not pending.done()
        finally:
            os.kill(wedged.proc.pid, signal.SIGCONT)
        r = pending.result(timeout=BOUND * 2)
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-replica"] == "a" and r.headers["x-llmgw-attempts"] == "1"


def test_a_request_on_a_replica_that_leaves_the_list_gracefully_is_not_cut(engines, routers):
    running, rt = _setup(engines, routers)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, rt)
        wait_until(lambda: _waiting_on(rt, "a") == 1, what="the request waiting on a")
        rt.set_endpoints([running["b"].endpoint()])        # a drained: out of the list, its engine answering
        r = pending.result(timeout=BOUND * 2)
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-replica"] == "a" and r.headers["x-llmgw-attempts"] == "1"


@pytest.mark.parametrize("eject_after", [1000, 0])
def test_a_request_on_a_replica_withdrawn_while_it_does_not_answer_moves(engines, routers, eject_after):
    # The router's own ejection too slow to come first (1000), or off (0: --eject-after 0): the
    # controller withdraws the replica, as when its agent reported it unhealthy, while the router's
    # polls of it go unanswered.
    running, rt = _setup(engines, routers, eject_after=eject_after)
    wedged = running["a"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, rt)
        wait_until(lambda: _waiting_on(rt, "a") == 1, what="the request waiting on a")
        os.kill(wedged.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: "a" in rt.call(rt.router.outliers.silent), what="a poll of a unanswered",
                       timeout=BOUND)
            rt.set_endpoints([running["b"].endpoint()])
            r = pending.result(timeout=BOUND * 2)
        finally:
            os.kill(wedged.proc.pid, signal.SIGCONT)
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-replica"] == "b" and r.headers["x-llmgw-attempts"] == "2"


def _stream(rt):
    client = openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0, timeout=BOUND * 2)
    return client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASKED, max_tokens=TOKENS, stream=True, extra_body={"ignore_eos": True})


def _read_wedging(raw, wedged, after: int = 4):
    """The stream's text, and the error it raised (or None); its replica SIGSTOPped after `after` chunks."""
    text, error, seen = [], None, 0
    try:
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
                seen += 1
                if seen == after:
                    os.kill(wedged.proc.pid, signal.SIGSTOP)
    except openai.APIError as exc:
        error = exc
    return "".join(text), error


def test_a_stream_on_a_replica_that_wedges_is_continued_on_the_other(engines, routers, caplog):
    running, rt = _setup(engines, routers, continuation=2)
    wedged = running["a"]
    with caplog.at_level(logging.INFO, logger="llmgw.access"):
        raw = _stream(rt)
        assert raw.headers["x-llmgw-replica"] == "a"
        try:
            text, error = _read_wedging(raw, wedged)
            ejected = _ejected(rt, "a")
        finally:
            os.kill(wedged.proc.pid, signal.SIGCONT)
        (line,) = wait_until(lambda: _access_lines(caplog), what="the access line of the continued stream")
    assert error is None
    assert ejected
    assert text == whole_reply("a", TOKENS)     # the fake continues deterministically from the text it is given
    assert "continued=a>b@" in line.getMessage() and line.attempts == 1


def test_a_stream_that_may_not_be_continued_is_left_to_its_replica(engines, routers):
    running, rt = _setup(engines, routers, continuation=0)
    wedged = running["a"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        raw = _stream(rt)
        reading = pool.submit(_read_wedging, raw, wedged)
        try:
            wait_until(lambda: _ejected(rt, "a"), what="a ejected", timeout=BOUND)
            assert not reading.done()
        finally:
            os.kill(wedged.proc.pid, signal.SIGCONT)
        text, error = reading.result(timeout=BOUND * 2)
    assert error is None and text == whole_reply("a", TOKENS)


def test_a_stream_on_a_lone_replica_that_is_ejected_reads_on_when_it_wakes(engines, routers):
    # The model's only replica: ejected for its missed polls, its stream has nowhere to be continued,
    # so it is not cut -- cut, it could only end with an error -- and completes once its engine answers.
    lone = engines(MODEL, "a", *PACE)
    rt = routers(make_router(catalog(_model(continuation=2)), upstream_headers_timeout=HEADERS_TIMEOUT))
    rt.set_endpoints([lone.endpoint()])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        raw = _stream(rt)
        reading = pool.submit(_read_wedging, raw, lone)
        try:
            wait_until(lambda: _ejected(rt, "a"), what="a ejected", timeout=BOUND)
            streaming = rt.call(rt.router.inflight.streaming, rt.router.balancer.state_of("a"))
            assert not reading.done()
        finally:
            os.kill(lone.proc.pid, signal.SIGCONT)
        text, error = reading.result(timeout=BOUND * 2)
    assert streaming == 1       # still registered: moved, should another replica join
    assert error is None and text == whole_reply("a", TOKENS)


def test_a_continuation_waiting_on_a_replica_that_wedges_moves_to_the_next(engines, routers, caplog):
    # a serves the stream and is killed mid-way; its continuation goes to b, which was SIGSTOPped just
    # before and is not yet ejected: it waits for b's headers until b's ejection moves it on to c.
    # With a headers timeout of 120 s, an answer from c can only come from that move.
    running = {n: engines(MODEL, n, *PACE) for n in "abc"}
    rt = routers(make_router(catalog(_model(continuation=2)), upstream_headers_timeout=HEADERS_TIMEOUT))
    rt.set_endpoints([running["a"].endpoint(priority=10), running["b"].endpoint(priority=5),
                      running["c"].endpoint()])
    wedged = running["b"]
    text, error, seen = [], None, 0
    with caplog.at_level(logging.INFO, logger="llmgw.access"):
        raw = _stream(rt)
        assert raw.headers["x-llmgw-replica"] == "a"
        try:
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    seen += 1
                    if seen == 4:
                        os.kill(wedged.proc.pid, signal.SIGSTOP)
                        running["a"].kill()
        except openai.APIError as exc:
            error = exc
        finally:
            ejected = _ejected(rt, "b")
            os.kill(wedged.proc.pid, signal.SIGCONT)
        (line,) = wait_until(lambda: _access_lines(caplog), what="the access line of the continued stream")
    assert error is None
    assert ejected
    assert "".join(text) == whole_reply("a", TOKENS)
    assert "continued=a>c@" in line.getMessage(), line.getMessage()


# -- InFlight alone --------------------------------------------------------------------------------------

def _two():
    balancer = Balancer()
    balancer.set_endpoints([Endpoint("r-1", MODEL, "p", "fake", "http://127.0.0.1:1"),
                            Endpoint("r-2", MODEL, "p", "fake", "http://127.0.0.1:2")])
    return balancer, balancer.state_of("r-1"), balancer.state_of("r-2")


async def test_abandoned_while_waiting_raises_abandoned_and_another_cancel_still_cancels():
    balancer, one, two = _two()
    inflight = InFlight(balancer)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(inflight.headers(one, MODEL, (one,), never))
    await asyncio.sleep(0)
    assert inflight.waiting(one) == 1
    assert inflight.abandon(one, "r-1 was ejected: no answer") == (1, 0)
    with pytest.raises(Abandoned, match="r-1 was ejected: no answer"):
        await waiter
    assert inflight.waiting(one) == 0

    stopped = asyncio.ensure_future(inflight.headers(one, MODEL, (one,), asyncio.get_running_loop().create_future()))
    await asyncio.sleep(0)
    stopped.cancel()            # the app stopping, not an abandon: a cancel as ever
    with pytest.raises(asyncio.CancelledError):
        await stopped
    assert inflight.waiting(one) == 0


async def test_a_request_with_nowhere_else_to_go_is_not_abandoned():
    balancer, one, two = _two()
    inflight = InFlight(balancer)
    sent: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    # It tried r-2 already; r-1 is all that is left.
    waiter = asyncio.ensure_future(inflight.headers(one, MODEL, (two, one), sent))
    await asyncio.sleep(0)
    assert inflight.abandon(one, "r-1 was ejected: no answer") == (0, 0)
    sent.set_result("headers")
    assert await waiter == "headers"
    # And one whose only other replica is out of routing too.
    balancer.keep_out(two, float("inf"))
    sent = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(inflight.headers(one, MODEL, (one,), sent))
    await asyncio.sleep(0)
    assert inflight.abandon(one, "r-1 was ejected: no answer") == (0, 0)
    sent.set_result("headers")
    assert await waiter == "headers"


class _Stream:
    """What InFlight does to a stream's answer: fails it and releases it."""

    def __init__(self):
        self.failed: Exception | None = None
        self.released = False

    def fail(self, exc: Exception) -> None:
        self.failed = exc

    def release(self) -> None:
        self.released = True


def test_a_stream_with_nowhere_to_be_continued_is_not_cut():
    # A model's lone replica ejected (its polls late on a loaded machine, say): cut, its stream could
    # only end with an error, so it reads on, as a request waiting for headers waits.
    balancer = Balancer()
    balancer.set_endpoints([Endpoint("r-1", MODEL, "p", "fake", "http://127.0.0.1:1")])
    one = balancer.state_of("r-1")
    inflight = InFlight(balancer)
    lone = _Stream()
    inflight.stream(one, lone, MODEL, (one,))
    assert inflight.abandon(one, "r-1 was ejected: no answer") == (0, 0)
    assert lone.failed is None and not lone.released
    assert inflight.streaming(one) == 1
    inflight.stream_done(one, lone)
    assert inflight.streaming(one) == 0


def test_a_stream_is_cut_only_where_its_model_has_a_replica_it_was_not_on():
    balancer, one, two = _two()
    inflight = InFlight(balancer)
    movable, continued_here, other_model = _Stream(), _Stream(), _Stream()
    inflight.stream(one, movable, MODEL, (one,))
    inflight.stream(one, continued_here, MODEL, (two, one))    # continued from r-2 onto r-1: r-2 is spent
    inflight.stream(one, other_model, "lonely", (one,))         # a model with no endpoint at all
    assert inflight.abandon(one, "r-1 was ejected: no answer") == (0, 1)
    assert isinstance(movable.failed, UpstreamBroken) and "r-1 was ejected" in str(movable.failed)
    assert movable.released
    assert continued_here.failed is None and other_model.failed is None
    assert inflight.streaming(one) == 2
    # Its other replica out of routing too: nothing more is cut.
    balancer.keep_out(two, float("inf"))
    fresh = _Stream()
    inflight.stream(one, fresh, MODEL, (one,))
    assert inflight.abandon(one, "r-1 was ejected: no answer") == (0, 0)
    assert fresh.failed is None

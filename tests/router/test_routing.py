"""Routing under trouble, end to end with real fake engines: disconnects, deaths, slow engines, swaps."""
from __future__ import annotations

import asyncio
import collections
import socket
import threading

import aiohttp
import openai
import pytest
import requests

from llmgwctl.catalog import Model, Profile
from llmgwctl.contracts import Endpoint

from ..procs import free_port
from .harness import catalog, make_router, wait_until

MODEL = "m"


def chat(client: openai.OpenAI, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **kw)


def occupy(engine_url: str, body: dict) -> None:
    """Send a request straight to an engine from a thread and forget it; the engine dies with the test."""
    def send():
        try:
            requests.post(engine_url + "/v1/completions", json=body, timeout=90)
        except requests.RequestException:
            pass
    threading.Thread(target=send, daemon=True).start()


def client_for(rt) -> openai.OpenAI:
    return openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_client_disconnect_mid_stream_frees_the_engine_slot(engines, routers):
    # 5 tokens/s and 1000 tokens: left alone this stream would run for minutes.
    engine = engines(MODEL, "r1", "--tokens-per-second", "5")
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([engine.endpoint()])
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "stream": True}
    with requests.post(rt.url + "/v1/completions", json=body, stream=True, timeout=30) as r:
        # Keep the iterator: dropping it would close the connection right here.
        chunks = r.iter_content(chunk_size=None)
        assert next(chunks)      # the stream is flowing
        assert engine.load().running == 1
        assert rt.call(rt.router.usage_snapshot)["r1"][1] == 1
    # The client is gone: the router cancels upstream and the engine frees the slot.
    wait_until(lambda: engine.load().running == 0, what="the engine's running gauge to drop")
    wait_until(lambda: rt.call(rt.router.usage_snapshot)["r1"][1] == 0, what="the router's in-flight to drop")


def test_client_disconnect_before_the_first_token_also_frees_the_slot(engines, routers):
    # A long time to first token: the engine sends nothing the router could fail to write.
    engine = engines(MODEL, "r1", "--ttft", "60")
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([engine.endpoint()])
    sock = socket.create_connection(("127.0.0.1", int(rt.url.rsplit(":", 1)[1])), timeout=10)
    payload = b'{"model":"m","prompt":"x","max_tokens":5}'
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    wait_until(lambda: engine.load().running == 1, what="the request to reach the engine")
    sock.close()
    wait_until(lambda: engine.load().running == 0, what="the engine's running gauge to drop")


def test_engine_killed_mid_stream_ends_the_stream_with_an_error_and_the_next_requests_succeed(engines, routers):
    a = engines(MODEL, "a", "--tokens-per-second", "20")
    b = engines(MODEL, "b", "--tokens-per-second", "20")
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([a.endpoint(), b.endpoint()])
    client = client_for(rt)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1000, stream=True)
    victim = {"a": a, "b": b}[raw.headers["x-llmgw-replica"]]
    survivor = b if victim is a else a
    stream = raw.parse()
    got = []
    with pytest.raises(openai.APIError, match="stopped mid-stream"):
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                victim.kill()
    assert len(got) >= 3
    # The controller has not withdrawn the dead endpoint; the router must cope on its own.
    for _ in range(10):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.headers["x-llmgw-replica"] == survivor.replica_id
        assert raw.parse().choices[0].message.content


def test_refused_connection_moves_the_request_and_ejects_the_endpoint(engines, routers):
    live = engines(MODEL, "live")
    dead_port = free_port()         # free a moment ago: nothing listens there
    # In a higher tier, so every pick tries it first until it is ejected.
    dead = Endpoint(replica_id="dead", model=MODEL, profile="default", engine="fake",
                    url=f"http://127.0.0.1:{dead_port}", priority=10)
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([dead, live.endpoint()])
    client = client_for(rt)
    for _ in range(20):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
        assert raw.headers["x-llmgw-replica"] == "live"
    state = next(s for s in rt.router.balancer.states() if s.replica_id == "dead")
    assert state.failures >= 1 and state.inflight == 0


def test_an_endpoint_whose_url_cannot_be_used_is_left_out_not_ejected(engines, routers, caplog):
    # A configuration error, not an engine down: sending to it would fail
    # every time (before: a 500 for each request that picked it, since the
    # port did not parse), so it is never picked, and said once in the log.
    live = engines(MODEL, "live")
    bad = [Endpoint(replica_id="bad-port", model=MODEL, profile="default", engine="fake",
                    url="http://127.0.0.1:99999", priority=10),
           Endpoint(replica_id="no-host", model=MODEL, profile="default", engine="fake",
                    url="http://:8000", priority=10)]
    rt = routers(make_router(catalog((MODEL, ()))))
    with caplog.at_level("ERROR", logger="llmgw.router"):
        rt.set_endpoints([*bad, live.endpoint()])
        rt.set_endpoints([*bad, live.endpoint()])      # the same list again: nothing new to say
    said = [r.getMessage() for r in caplog.records if r.name == "llmgw.router"]
    assert len(said) == 2 and any("bad-port" in m and "99999" in m for m in said) \
        and any("no-host" in m and "no host" in m for m in said)
    assert [s.replica_id for s in rt.router.balancer.states()] == ["live"]
    client = client_for(rt)
    for _ in range(5):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
        assert raw.headers["x-llmgw-replica"] == "live"
    # With only the unusable ones, the model has no replica: the router's 503, not a 500 or 502.
    rt.set_endpoints(bad)
    r = requests.post(rt.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_replica"


def test_every_endpoint_refusing_is_a_502_after_bounded_tries(routers):
    ports = [free_port() for _ in range(4)]
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([Endpoint(f"d{i}", MODEL, "default", "fake", f"http://127.0.0.1:{p}") for i, p in enumerate(ports)])
    r = requests.post(rt.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
    assert sum(s.failures for s in rt.router.balancer.states()) == 3    # max_attempts, not every endpoint


def test_slowed_engine_gets_fewer_requests(engines, routers):
    fast = engines(MODEL, "fast")
    slow = engines(MODEL, "slow", "--ttft", "0.3", "--tokens-per-second", "20")
    rt = routers(make_router(catalog((MODEL, ()))))
    rt.set_endpoints([fast.endpoint(), slow.endpoint()])
    served: collections.Counter = collections.Counter()

    async def worker(session: aiohttp.ClientSession, n: int) -> None:
        for _ in range(n):
            async with session.post(rt.url + "/v1/completions",
                                    json={"model": MODEL, "prompt": "x", "max_tokens": 4}) as r:
                assert r.status == 200
                served[r.headers["x-llmgw-replica"]] += 1

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(worker(session, 25) for _ in range(8)))

    asyncio.run(asyncio.wait_for(run(), 120))
    assert sum(served.values()) == 200
    # Round robin would give each 100. Counts, not timings: the slow engine holds
    # each request longer, so the router sees it busier and sends it fewer.
    assert served["slow"] < served["fast"] / 3, served


def test_catalog_swap_during_200_concurrent_requests_fails_none(engines, routers):
    # A 1.5 s first token outlasts the 1 s of arrivals below: all 200 are in flight together.
    a = engines(MODEL, "a", "--ttft", "1.5")
    b = engines(MODEL, "b", "--ttft", "1.5")
    plain = catalog((MODEL, ()))
    aliased = catalog((MODEL, ("alias-added",)))
    rt = routers(make_router(plain))
    rt.set_endpoints([a.endpoint(), b.endpoint()])
    statuses: list[int] = []
    versions: set[str] = set()

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        # Arrivals spread over ~1 s while the catalog flips every ~10 ms: sent all
        # at once, they could all resolve before (or after) the first swap.
        await asyncio.sleep(i * 0.005)
        body = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 3, "stream": i % 2 == 0}
        async with session.post(rt.url + "/v1/completions", json=body) as r:
            await r.read()
            statuses.append(r.status)
            versions.add(r.headers["x-llmgw-catalog-version"])

    async def swapper(stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            # set_catalog runs on the router's loop; wait for it off this one.
            await asyncio.to_thread(rt.set_catalog, aliased if n % 2 == 0 else plain)
            n += 1
            await asyncio.sleep(0.01)

    async def run() -> None:
        stop = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            swap_task = asyncio.create_task(swapper(stop))
            await asyncio.gather(*(one(session, i) for i in range(200)))
            stop.set()
            await swap_task

    asyncio.run(asyncio.wait_for(run(), 120))
    assert len(statuses) == 200 and set(statuses) == {200}
    assert versions == {plain.version, aliased.version}     # the swaps really happened mid-run


def test_poller_reads_engine_load_and_resyncs_on_a_new_list(engines, routers):
    a = engines(MODEL, "a", "--ttft", "60")
    b = engines(MODEL, "b")
    rt = routers(make_router(catalog((MODEL, ())), poll_interval=0.2))
    rt.set_endpoints([a.endpoint()])
    state = lambda rid: next(s for s in rt.router.balancer.states() if s.replica_id == rid)   # noqa: E731
    # Straight to the engine: the router only learns of it from /metrics.
    occupy(a.url, {"model": MODEL, "prompt": "x"})
    wait_until(lambda: state("a").load is not None and state("a").load.running == 1, what="a's running gauge")
    rt.set_endpoints([a.endpoint(), b.endpoint()])
    wait_until(lambda: state("b").load is not None, what="a reading for the new endpoint")
    # a's engine is busy with a request the router never saw; the pick goes to b.
    client = client_for(rt)
    for _ in range(5):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
        assert raw.headers["x-llmgw-replica"] == "b"


def test_lower_priority_profile_spills_over_when_the_best_is_full(engines, routers):
    model = Model(name=MODEL, profiles=(Profile("big", "fake", gpus=0, priority=10),
                                        Profile("small", "fake", gpus=0, priority=1)))
    big = engines(MODEL, "big", "--max-num-seqs", "1", "--ttft", "60")
    small = engines(MODEL, "small")
    rt = routers(make_router(catalog(model), poll_interval=0.2))
    rt.set_endpoints([big.endpoint(profile="big", priority=10), small.endpoint(profile="small", priority=1)])
    client = client_for(rt)
    # Occupy big's only slot and queue one more behind it, straight at the engine.
    for _ in range(2):
        occupy(big.url, {"model": MODEL, "prompt": "x"})
    wait_until(lambda: (s := rt.router.balancer.states()[0]).load is not None and s.load.waiting >= 1,
               what="big to report waiting requests")
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
    assert raw.headers["x-llmgw-replica"] == "small"

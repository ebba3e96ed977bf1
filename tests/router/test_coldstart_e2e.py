"""Cold start end to end: the waker starts a real fake engine after the requests arrive and pushes it."""
from __future__ import annotations

import asyncio
import threading

import aiohttp
import requests

from llmgwctl.catalog import Model, Profile

from .harness import catalog, make_router, wait_until

MODEL = "m"


class StartingWaker:
    """Stands in for the controller: on wake, start an engine in a thread and push its endpoint."""

    def __init__(self, engines, profile: str = "default"):
        self.engines = engines
        self.profile = profile
        self.calls: list[str] = []
        self.rt = None

    def wake(self, model_name: str) -> None:
        self.calls.append(model_name)

        def bring_up():
            engine = self.engines(model_name, "woken")
            ready = [s.endpoint for s in self.rt.router.balancer.states()]
            self.rt.set_endpoints(ready + [engine.endpoint(profile=self.profile, priority=10)])
        threading.Thread(target=bring_up, daemon=True).start()


class SilentWaker:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def wake(self, model_name: str) -> None:
        self.calls.append(model_name)


def post_many(url: str, n: int, body: dict) -> list[tuple[int, dict, dict]]:
    async def one(session):
        async with session.post(url, json=body) as r:
            return r.status, dict(r.headers), await r.json()

    async def run():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session) for _ in range(n)))
    return asyncio.run(asyncio.wait_for(run(), 60))


def test_requests_for_a_cold_model_wait_for_the_woken_replica(engines, routers):
    waker = StartingWaker(engines)
    rt = routers(make_router(catalog((MODEL, ("alias",))), waker=waker, cold_timeout=30))
    waker.rt = rt
    results = post_many(rt.url + "/v1/completions", 20, {"model": "alias", "prompt": "x", "max_tokens": 2})
    assert [status for status, _, _ in results] == [200] * 20
    assert {headers["x-llmgw-replica"] for _, headers, _ in results} == {"woken"}
    assert waker.calls == [MODEL]      # once, however many requests arrived


def test_full_queue_is_429_and_a_timeout_is_503(routers):
    waker = SilentWaker()
    rt = routers(make_router(catalog((MODEL, ())), waker=waker, cold_queue=3, cold_timeout=1.0))
    results = post_many(rt.url + "/v1/completions", 5, {"model": MODEL, "prompt": "x"})
    by_status: dict[int, list] = {}
    for status, headers, body in results:
        by_status.setdefault(status, []).append((headers, body))
    assert sorted(by_status) == [429, 503] and len(by_status[503]) == 3 and len(by_status[429]) == 2
    for headers, body in by_status[429]:
        assert body["error"]["code"] == "cold_start_queue_full" and int(headers["Retry-After"]) > 0
    for headers, body in by_status[503]:
        assert body["error"]["code"] == "cold_start_timeout" and int(headers["Retry-After"]) > 0
    assert waker.calls == [MODEL]


def test_a_lower_priority_replica_serves_while_the_best_profile_is_woken(engines, routers):
    model = Model(name=MODEL, profiles=(Profile("big", "fake", gpus=0, priority=10),
                                        Profile("small", "fake", gpus=0, priority=1)))
    small = engines(MODEL, "small")
    waker = StartingWaker(engines, profile="big")
    rt = routers(make_router(catalog(model), waker=waker))
    waker.rt = rt
    rt.set_endpoints([small.endpoint(profile="small", priority=1)])
    r = requests.post(rt.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200 and r.headers["x-llmgw-replica"] == "small"   # served at once, not queued
    assert waker.calls == [MODEL]
    # Once the best profile is up, it takes the traffic.
    wait_until(lambda: rt.router.balancer.ready_count(MODEL) == 2, timeout=20, what="the woken replica")
    r = requests.post(rt.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30)
    assert r.headers["x-llmgw-replica"] == "woken"
    assert waker.calls == [MODEL]

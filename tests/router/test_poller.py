"""The load poller against a real HTTP metrics page: what it hands the balancer with each reading."""
from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from llmgwctl.contracts import Endpoint
from llmgwctl.router.balancer import Balancer
from llmgwctl.router.poller import LoadPoller

from ..support import local_server

PAGE = "vllm:num_requests_running{model_name=\"m\"} 3\nvllm:num_requests_waiting{model_name=\"m\"} 0\n"


def test_a_poll_subtracts_our_count_as_it_was_when_sent_not_when_answered():
    # The engine counts our 3 requests in its page; by the time the page arrives
    # they have finished. Taken against our count *now* (0), the reading would
    # say 3 requests of other routers are there -- load that does not exist, and
    # that would hold traffic off this replica until the next poll.
    async def run():
        balancer = Balancer()
        state_of: list = []

        async def metrics(_request):
            for _ in range(3):
                balancer.finished(state_of[0])      # our requests end while the poll is in flight
            return web.Response(text=PAGE)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        async with local_server(app) as url:
            balancer.set_endpoints([Endpoint(replica_id="r", model="m", profile="p", engine="vllm",
                                             url=url, metrics_path="/metrics")])
            st = balancer.states()[0]
            state_of.append(st)
            for _ in range(3):
                balancer.started(st)
            async with aiohttp.ClientSession() as session:
                await LoadPoller(balancer, session).poll_once()
            assert st.load is not None and st.load.running == 3, "the page was read"
            assert st.inflight == 0
            assert st.others == 0, "the engine's 3 were ours: no other router's load on it"

    asyncio.run(asyncio.wait_for(run(), 30))


async def _poll_page(handler, **options):
    """One poll of a page served by `handler`; (the endpoint's state, the poller, the codes it refused with).
    Nothing may reach /followed, where the redirect points."""
    balancer = Balancer()
    refused: list[str] = []
    followed: list[str] = []
    app = web.Application()
    app.router.add_get("/metrics", handler)

    async def target(request):
        followed.append(request.path)
        return web.Response(text=PAGE)
    app.router.add_get("/followed", target)
    async with local_server(app) as url:
        balancer.set_endpoints([Endpoint(replica_id="r", model="m", profile="p", engine="vllm", url=url)])
        async with aiohttp.ClientSession() as session:
            poller = LoadPoller(balancer, session, on_refused=refused.append, **options)
            try:
                await poller.poll_once()
            finally:
                poller.close()
    assert not followed
    return balancer.states()[0], poller, refused


def test_a_redirecting_page_is_never_followed_and_says_so():
    async def run():
        async def redirect(request):
            raise web.HTTPFound("/followed")
        st, poller, refused = await _poll_page(redirect)
        assert st.load is None and refused == ["metrics_redirect"]
        assert "302, a redirect" in poller.problems["r"]
    asyncio.run(asyncio.wait_for(run(), 30))


def test_a_page_past_the_cap_is_not_read_by_its_length_or_as_it_arrives():
    async def run():
        big = PAGE + "x 1\n" * 1000

        async def sized(request):
            return web.Response(text=big)

        async def chunked(request):
            resp = web.StreamResponse()
            await resp.prepare(request)
            for _ in range(100):
                await resp.write(b"# padding\n" * 100)
            await resp.write_eof()
            return resp

        for handler in (sized, chunked):
            st, poller, refused = await _poll_page(handler, max_bytes=1000)
            assert st.load is None and refused == ["metrics_too_large"], handler
            assert "larger than the router reads (1000 bytes)" in poller.problems["r"]
        st, poller, refused = await _poll_page(sized, max_bytes=len(big))
        assert st.load is not None and st.load.running == 3 and not refused and not poller.problems
    asyncio.run(asyncio.wait_for(run(), 30))


def test_polls_without_an_answer_eject_and_an_answer_of_any_status_brings_it_back():
    # The poll is the router's health probe: silence (a stopped engine) is a
    # miss, an error status is an answer. `silent` holds /metrics past the
    # probe timeout; a 500 from a live engine must eject nothing.
    from llmgwctl.router.ejection import Ejector
    from llmgwctl.router.outlier import Outliers

    async def run():
        balancer = Balancer()
        ejector = Ejector(balancer)
        outliers = Outliers(balancer, ejector, after=3, base=0.0)
        mode = {"now": "silent"}
        release = asyncio.Event()

        async def metrics(_request):
            if mode["now"] == "silent":
                await release.wait()        # answered only once the test is done with it
            return web.Response(status=500, text="engine error")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        async with local_server(app) as url:
            balancer.set_endpoints([Endpoint("r", "m", "p", "vllm", url)])
            st = balancer.states()[0]
            async with aiohttp.ClientSession() as session:
                poller = LoadPoller(balancer, session, outliers=outliers, probe_timeout=0.1)
                for _ in range(2):
                    await poller.poll_once()
                assert ejector.current() == {}
                await poller.poll_once()
                assert ejector.current()["r"].reason.startswith("no answer to 3 health probes"), ejector.current()
                assert st.ejected_until == float("inf")
                mode["now"] = "error"
                await poller.poll_once()
                assert ejector.current() == {} and st.ejected_until < 0
            release.set()

    asyncio.run(asyncio.wait_for(run(), 30))

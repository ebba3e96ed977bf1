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

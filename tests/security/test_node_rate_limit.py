"""A node's changed reports are rate-limited; heartbeats are not; the agent waits out a 429 and keeps working.

The bucket is tested with a fake clock; the agent's side against a real HTTP
server answering 429 with Retry-After, as the control API does.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from llmgwctl.agent.controller import ControllerClient, _retry_after, report_loop
from llmgwctl.contracts import AgentReport
from llmgwctl.control.reportlimit import REPORT_BYTES_PER_TOKEN, ReportLimiter, retry_after

from ..support import FakeClock


def test_the_bucket_takes_a_burst_then_its_rate_and_big_reports_cost_more():
    clock = FakeClock()
    limit = ReportLimiter(burst=4, rate=2, clock=clock)
    assert [limit.take("n1", 100) for _ in range(4)] == [None] * 4
    wait = limit.take("n1", 100)
    assert wait is not None and 0 < wait <= 0.5
    assert limit.take("n2", 100) is None, "another node has its own bucket"
    clock.now += 0.5
    assert limit.take("n1", 100) is None
    # A report of three tokens' worth waits for three tokens; one bigger than the burst still passes, at its pace.
    clock.now += 10
    assert limit.take("n1", 2 * REPORT_BYTES_PER_TOKEN) is None
    assert limit.take("n1", 2 * REPORT_BYTES_PER_TOKEN) is not None
    clock.now += 10
    assert limit.take("n1", 100 * REPORT_BYTES_PER_TOKEN) is None
    assert retry_after(0.01) == "1" and retry_after(2.2) == "3"


def test_the_agent_reads_retry_after_within_bounds():
    assert _retry_after("2") == 2.0
    assert _retry_after(None) == 1.0 and _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 1.0
    assert _retry_after("0") == 0.1 and _retry_after("86400") == 30.0 and _retry_after("nan") == 1.0


async def test_the_agent_waits_out_a_429_and_then_sends_its_state_as_it_is(caplog):
    received: list[dict] = []
    posts: list[tuple[float, int]] = []      # (when, the answer's status)
    refused = 2

    async def handle(request: web.Request) -> web.Response:
        nonlocal refused
        body = json.loads(await request.read())
        now = asyncio.get_running_loop().time()
        if refused:
            refused -= 1
            posts.append((now, 429))
            return web.json_response({"error": {"message": "slow down", "type": "rate_limit_error", "code": 429}},
                                     status=429, headers={"Retry-After": "1"})
        posts.append((now, 200))
        received.append(body)
        return web.json_response({"ok": True, "refused": ["pool 'h100': the node's token allows pools none"]})

    app = web.Application()
    app.router.add_post("/api/v1/agents/n1/report", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    state = {"pools": ("a",)}
    stop, changed = asyncio.Event(), asyncio.Event()
    try:
        async with aiohttp.ClientSession() as session:
            client = ControllerClient(f"http://127.0.0.1:{port}", "n1", session)
            loop = asyncio.create_task(report_loop(client, lambda: AgentReport(node="n1", pools=state["pools"]),
                                                   changed, stop, heartbeat=0.2))
            # While it is refused, the node's state changes: what is delivered is the state as it is then.
            await asyncio.sleep(0)
            state["pools"] = ("b",)
            changed.set()
            for _ in range(200):
                if received:
                    break
                await asyncio.sleep(0.05)
            assert received and received[0]["pools"] == ["b"], "sent again once the wait was over, as it is now"
            assert not loop.done(), "the loop keeps working"
            for _ in range(200):        # and goes on with its heartbeats
                if len(received) >= 3:
                    break
                await asyncio.sleep(0.05)
            assert len(received) >= 3
            # Each post after a 429 came no sooner than its Retry-After, not at the heartbeat's retry pace.
            gaps = [b[0] - a[0] for a, b in zip(posts, posts[1:]) if a[1] == 429]
            assert len(gaps) == 2 and min(gaps) >= 0.9, posts
            assert "without what its token does not allow: pool 'h100'" in caplog.text
            stop.set()
            await asyncio.wait_for(loop, 10)
    finally:
        await runner.cleanup()

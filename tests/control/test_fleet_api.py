"""The control API's side of fleet scale (issue 19), over real HTTP on loopback.

- A report repeated byte for byte is taken as a heartbeat: heard, no pass
  woken; anything else still goes through every check.
- Watch answers are encoded once per state: every router asking gets the
  same bytes, and a change gives a new answer.
- serve's control API takes its own cap on connections per client address,
  above the router's 256: a fleet behind one NAT address holds two per agent.
"""
from __future__ import annotations

import asyncio
import gc
import json

import aiohttp

from llmgwctl.control.serve import CONTROL_CONNECTIONS_PER_CLIENT, ServeConfig, Server
from llmgwctl.httpserver import MAX_CONNECTIONS_PER_CLIENT

from ..controlplane import ControlPlane
from ..support import until

CATALOG = "apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: a\n    profiles: [{name: p, engine: fake, gpus: 0}]\n"


def body(node="n1", pools=("x",)):
    return json.dumps({"node": node, "instance_id": "i-1", "pools": list(pools),
                       "engines": {"fake": {"available": True, "reason": ""}}, "gpus": [], "replicas": []}).encode()


async def post(session, url, node, data):
    async with session.post(f"{url}/api/v1/agents/{node}/report", data=data,
                            headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.text()


async def test_a_repeated_report_is_a_heartbeat_and_anything_else_is_checked_whole(tmp_path):
    (tmp_path / "c.yaml").write_text(CATALOG)
    plane = ControlPlane(tmp_path)
    plane.controller.load()
    await plane.start()
    c = plane.controller
    try:
        async with aiohttp.ClientSession() as session:
            assert (await post(session, plane.url, "n1", body()))[0] == 200
            assert c.wake_event.is_set()
            c.wake_event.clear()
            for _ in range(3):
                assert (await post(session, plane.url, "n1", body()))[0] == 200
            node = c.inventory.get("n1")
            assert node.reports == 4 and not c.wake_event.is_set(), "heard each time, no pass woken"
            # Different bytes: parsed and checked again, and news.
            assert (await post(session, plane.url, "n1", body(pools=("y",))))[0] == 200
            assert c.wake_event.is_set() and node.pools == frozenset({"y"})
            status, text = await post(session, plane.url, "n1", b'{"node": "n1", "replicas": "no"')
            assert status == 400, text
            # Nested past what the JSON parser recurses: the client's error, not a server bug.
            deep = b'{"node": "n1", "gpus": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            status, text = await post(session, plane.url, "n1", deep)
            assert status == 400 and "nests too deeply" in text, text
            # The same bytes again from a node past its timeout bring it back: a full report, an event.
            c.wake_event.clear()
            plane.clock.advance(c.inventory.unreachable_after + 1)
            c.inventory.check()
            assert (await post(session, plane.url, "n1", body(pools=("y",))))[0] == 200
            assert node.reachable and c.wake_event.is_set()
            assert any(e.kind == "node-back" for e in c.reconciler.events)
    finally:
        await plane.stop()


async def test_watch_answers_are_the_same_bytes_for_every_router_until_something_changes(tmp_path):
    (tmp_path / "c.yaml").write_text(CATALOG)
    plane = ControlPlane(tmp_path)
    plane.controller.load()
    await plane.start()
    try:
        async with aiohttp.ClientSession() as session:
            async def watch(path="/api/v1/watch/endpoints"):
                async with session.get(plane.url + path, params={"after": "0"}) as resp:
                    assert resp.status == 200
                    return await resp.read()
            first = await asyncio.gather(*(watch() for _ in range(5)))
            assert len(set(first)) == 1
            assert (await watch("/api/v1/watch/catalog")) != first[0], "the catalog watch has its own answer"
            plane.controller.watch.bump()
            after = await watch()
            assert json.loads(after)["version"] == json.loads(first[0])["version"] + 1
    finally:
        await plane.stop()


async def connect_many(port: int, n: int) -> list[bytes]:
    """Open n connections to the port and send one request on each; what each got back."""
    async def one():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 30)
        return writer, line
    opened = []
    try:
        for _ in range(n):      # one after another: each is counted before the next arrives
            opened.append(await one())
        return [line for _, line in opened]
    finally:
        for writer, _ in opened:
            writer.close()


async def serve_with(tmp_path, **cfg):
    (tmp_path / "cat").mkdir(parents=True)
    (tmp_path / "cat" / "c.yaml").write_text(CATALOG)
    server = Server(ServeConfig(catalogs=str(tmp_path / "cat"), listen=("127.0.0.1", 0), control=("127.0.0.1", 0),
                                local_agent=False, **cfg))
    await server.start()
    return server


async def test_the_control_api_holds_a_fleet_behind_one_address_and_its_cap_is_configurable(tmp_path):
    assert CONTROL_CONNECTIONS_PER_CLIENT >= 2 * 1000 > MAX_CONNECTIONS_PER_CLIENT, \
        "1,000 agents behind one NAT address hold two connections each"
    server = await serve_with(tmp_path / "default")
    try:
        lines = await connect_many(server.control_port, MAX_CONNECTIONS_PER_CLIENT + 50)
        assert all(line.startswith(b"HTTP/1.1 200") for line in lines)
    finally:
        await server.stop()
    server = await serve_with(tmp_path / "capped", control_connections_per_client=3)
    loop = asyncio.get_running_loop()
    unexpected = []
    loop.set_exception_handler(lambda loop, context: unexpected.append(context))
    try:
        lines = await connect_many(server.control_port, 4)
        assert [line.split()[1] for line in lines] == [b"200", b"200", b"200", b"429"]
        # A refused connection ends cleanly: no handler task left failing (which
        # the loop reports once the task is collected) for each one refused.
        await until(lambda: not server.connections.open, "the first connections to be gone")
        held = [await asyncio.open_connection("127.0.0.1", server.control_port) for _ in range(3)]
        await until(lambda: sum(server.connections.open.values()) == 3, "three connections held")
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.control_port)
            assert (await asyncio.wait_for(reader.read(), 30)).startswith(b"HTTP/1.1 429")
            writer.close()
        for _, writer in held:
            writer.close()
        gc.collect()
        await asyncio.sleep(0)
        assert not [c for c in unexpected if isinstance(c.get("exception"), AssertionError)], unexpected
    finally:
        loop.set_exception_handler(None)
        await server.stop()

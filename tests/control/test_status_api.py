"""`GET /api/v1/status` and the console's status stream over real HTTP (issue 19: rows cached between reads).

The body is the JSON the rows' cached fragments make; these hold it to the
document `Controller.status()` builds the plain way, with `?model=` asking
for one model's part, and the stream sending a change made after a read.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp

from llmgwctl.contracts import Endpoint

from ..controlplane import ControlPlane, report_of

CATALOG = """apiVersion: llmgw/v1
kind: Catalog
models:
  - name: a
    aliases: [first]
    replicas: 2
    profiles: [{name: p, engine: fake, gpus: 0}]
  - name: b
    profiles: [{name: p, engine: fake, gpus: 0}]
"""


def endpoint(rid: str, model: str, port: int) -> Endpoint:
    return Endpoint(replica_id=rid, model=model, profile="p", engine="fake", url=f"http://127.0.0.1:{port}")


async def started(tmp_path) -> ControlPlane:
    (tmp_path / "c.yaml").write_text(CATALOG)
    plane = ControlPlane(tmp_path)
    plane.controller.load()
    await plane.start()
    c = plane.controller
    # Both nodes report before the pass, so it adopts all three and places nothing.
    c.agent_reported("n1", report_of(c.live.current, "n1", [endpoint("a-1", "a", 9001),
                                                            endpoint("a-2", "a", 9002)]).to_dict())
    c.agent_reported("n2", report_of(c.live.current, "n2", [endpoint("b-1", "b", 9003)]).to_dict())
    plane.adopting_pass()
    return plane


async def get(session, url: str) -> tuple[int, dict]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return resp.status, json.loads(await resp.read())


async def test_status_is_the_same_document_as_built_plainly_and_asks_for_one_model(tmp_path):
    plane = await started(tmp_path)
    try:
        async with aiohttp.ClientSession() as session:
            status, doc = await get(session, plane.url + "/api/v1/status")
            assert status == 200 and doc == plane.controller.status()     # the fake clock stands still
            assert [r["id"] for r in doc["replicas"]] == ["a-1", "a-2", "b-1"]
            status, one = await get(session, plane.url + "/api/v1/status?model=first")   # an alias
            assert status == 200
            assert [m["name"] for m in one["models"]] == ["a"]
            assert [r["id"] for r in one["replicas"]] == ["a-1", "a-2"]
            assert [n["name"] for n in one["nodes"]] == ["n1"]
            assert one["catalog"] == doc["catalog"] and one["events"] == doc["events"]
            status, error = await get(session, plane.url + "/api/v1/status?model=nope")
            assert status == 404 and error["error"]["type"] == "not_found_error"
    finally:
        await plane.stop()


async def read_event(resp) -> dict:
    """The next `event: status` of the stream, its data parsed."""
    data = None
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), 10)).decode().rstrip("\n")
        if line.startswith("data: "):
            data = json.loads(line[len("data: "):])
        elif line == "" and data is not None:
            return data


async def test_the_console_stream_sends_a_change_made_after_it_read_the_status(tmp_path):
    plane = await started(tmp_path)
    c = plane.controller
    try:
        async with aiohttp.ClientSession() as session, session.get(plane.url + "/api/v1/watch/status",
                               timeout=aiohttp.ClientTimeout(total=30)) as resp:
            first = await read_event(resp)
            assert first == c.status()
            # a-2's engine fails: its agent says so, a pass takes it in, the stream is woken.
            report = report_of(c.live.current, "n1", [endpoint("a-1", "a", 9001), endpoint("a-2", "a", 9002)])
            body = report.to_dict()
            body["replicas"][1].update(state="failed", url=None, reason="exited with code 1")
            c.agent_reported("n1", body)
            c.reconciler.reconcile_once()
            nxt = await read_event(resp)
            states = {r["id"]: (r["state"], r["reason"]) for r in nxt["replicas"]}
            assert states["a-2"] == ("failed", "exited with code 1") and states["a-1"][0] == "ready"
            assert nxt == c.status()
    finally:
        await plane.stop()

"""The console's read routes over real HTTP: history, request log, GPUs, the console stream; bad queries are 400s.

The stream's first events are the summary and the history's points; a new
point is sent as only itself. A standalone router's reported requests reach
the log through the usage route; a bad record loses only itself.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from llmgwctl.contracts import RequestRecord

from ..controlplane import ControlPlane

CATALOG = """apiVersion: llmgw/v1
kind: Catalog
models:
  - name: a
    aliases: [first]
    profiles: [{name: p, engine: fake, gpus: 0}]
"""


def record(i: int, status: int = 200) -> RequestRecord:
    return RequestRecord(at=time.time(), id=f"rq-{i}", key=None, asked="first", model="a", status=status, ttft=0.02,
                         duration=0.1, tokens_in=1, tokens_out=2, replica="r-1")


async def events(resp: aiohttp.ClientResponse, n: int) -> list[tuple[str, dict]]:
    out, buffer = [], b""
    while len(out) < n:
        buffer += await asyncio.wait_for(resp.content.readany(), 30)
        while b"\n\n" in buffer:
            frame, buffer = buffer.split(b"\n\n", 1)
            lines = frame.decode().splitlines()
            kind = next(x[7:] for x in lines if x.startswith("event: "))
            out.append((kind, json.loads(next(x[6:] for x in lines if x.startswith("data: ")))))
    return out


def test_history_requests_gpus_and_the_console_stream(tmp_path):
    (tmp_path / "c.yaml").write_text(CATALOG)

    async def main():
        plane = ControlPlane(tmp_path)
        c = plane.controller
        c.load()
        await plane.start()
        try:
            async with aiohttp.ClientSession() as s:
                base = plane.url + "/api/v1/"
                c.requests.record(record(1))
                c.requests.record(record(2, 503))
                c.sample_history()
                async with s.get(base + "history", params={"model": "first"}) as r:
                    doc = await r.json()
                    assert r.status == 200 and list(doc["models"]) == ["a"] and len(doc["t"]) == 1
                    assert doc["models"]["a"]["errors"][0] > 0
                for query, status in (({"since": "soon"}, 400), ({"since": "nan"}, 400), ({"model": "zzz"}, 404)):
                    async with s.get(base + "history", params=query) as r:
                        assert r.status == status and (await r.json())["error"]["message"], query
                async with s.get(base + "requests", params={"status": "5xx"}) as r:
                    body = await r.json()
                    assert [x["id"] for x in body["requests"]] == ["rq-2"] and body["total"] == 2
                for query in ({"status": "bad"}, {"limit": "-1"}, {"limit": "many"}):
                    async with s.get(base + "requests", params=query) as r:
                        assert r.status == 400 and "X-Request-Id" in r.headers, query
                async with s.get(base + "gpus", params={"limit": "x"}) as r:
                    assert r.status == 400
                async with s.get(base + "gpus") as r:
                    assert (await r.json()) == {"total": 0, "offset": 0, "nodes": []}

                # A standalone router's records, with its usage: the good one taken, the bad ones dropped.
                usage = {"router": "rt-1", "version": 0, "replicas": {},
                         "requests": [record(3).to_dict(), {"id": 5}, record(4).to_dict() | {"status": "x"}]}
                async with s.post(base + "usage", json=usage) as r:
                    assert r.status == 204
                async with s.get(base + "requests", params={"id": "rq-"}) as r:
                    assert [x["id"] for x in (await r.json())["requests"]] == ["rq-3", "rq-2", "rq-1"]

                async with s.get(base + "watch/console") as r:
                    assert r.headers["Content-Type"] == "text/event-stream"
                    first = await events(r, 2)
                    kinds = dict(first)
                    assert set(kinds) == {"summary", "history"}
                    assert kinds["summary"]["models"][0]["name"] == "a" and kinds["summary"]["replicas_total"] == 0
                    assert len(kinds["history"]["t"]) == 1
                    c.sample_history()
                    (kind, point), = [e for e in await events(r, 1)]
                    assert kind == "history" and len(point["t"]) == 1 and point["t"][0] > kinds["history"]["t"][0]
        finally:
            await plane.stop()

    asyncio.run(main())

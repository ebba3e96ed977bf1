"""A fleet's agents reconnecting at once to a busy control API: the listen backlog's part.

    python3 -m bench.listen_backlog [--clients 3000]

An aiohttp server on 127.0.0.1, its loop blocked for 250 ms out of every
300 (a reconcile pass at fleet size), and `--clients` report-sized POSTs
from another process, all at once, as agents send them after a controller
restart. Run with aiohttp's default backlog (128, the baseline) and with
serve's CONTROL_BACKLOG; prints how long the burst took, its outcomes, and
the kernel's listen-queue overflows (TcpExt ListenOverflows, machine-wide:
run it on a quiet machine).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from aiohttp import web

from llmgwctl.control.serve import CONTROL_BACKLOG

CLIENTS = """
import asyncio, collections, sys, time
import aiohttp
async def one(s, url):
    try:
        async with s.post(url, data=b"x" * 2000, timeout=aiohttp.ClientTimeout(total=10)) as r:
            await r.read()
            return "ok"
    except Exception as exc:
        return type(exc).__name__
async def main(url, n):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t = time.monotonic()
        out = await asyncio.gather(*(one(s, url) for _ in range(n)))
        print(round(time.monotonic() - t, 2), dict(collections.Counter(out)))
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def overflows() -> int:
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for head, values in zip(lines[::2], lines[1::2]):
        names = head.split()
        if "ListenOverflows" in names:
            return int(values.split()[names.index("ListenOverflows")])
    return 0


async def burst(backlog: int, clients: int) -> tuple[float, str, int]:
    async def report(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/report", report)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, backlog=backlog).start()
    port = runner.addresses[0][1]
    before = overflows()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENTS, f"http://127.0.0.1:{port}/report",
                                                str(clients), stdout=asyncio.subprocess.PIPE)
    waiting = asyncio.ensure_future(proc.communicate())
    while not waiting.done():
        await asyncio.sleep(0.05)
        time.sleep(0.25)  # noqa: ASYNC251 -- on purpose: a pass holding the loop, as serve's does at 5,000 nodes
    out = waiting.result()[0].decode().split(maxsplit=1)
    await runner.cleanup()
    return float(out[0]), out[1].strip(), overflows() - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=3000)
    a = p.parse_args()
    results = {}
    for label, backlog in (("aiohttp default", 128), ("serve", CONTROL_BACKLOG)):
        took, outcomes, dropped = asyncio.run(burst(backlog, a.clients))
        results[label] = took
        print(f"backlog {backlog:5d} ({label}): {a.clients} reports in {took:.2f} s, {outcomes}; "
              f"listen overflows {dropped}")
    print(f"serve / default burst time: {results['serve'] / results['aiohttp default']:.2f}x")


if __name__ == "__main__":
    main()

"""What the web console's live updates cost the controller at fleet size (issue 31).

    python3 -m bench.console [--nodes 5000] [--window 60] [--phases 0,1,0,5,0] [--traffic 25] [--toggle 15]
                             [--serve]

By default the controller runs in this process: bench/status.py's fleet
(NODES nodes of 8 GPUs, every replica ready, `big` x 1,000 and the rest over
nodes/5 models) in a real `Controller` with its loops running and the
control API on loopback, and an hour of history in it, as a controller up
that long holds. With `--serve`: a real `llmgwctl serve --no-local-agent`
and bench/fleet.py's simulated agents in this process instead (a machine
that can hold both; bench/README.md says why not the default). Then windows
of WINDOW s, one after another, PHASES pages open in each (0: the baseline).
Through every window alike, from the pages' process:

  - a router's requests: TRAFFIC a second reported as a standalone router
    reports them (POST /api/v1/usage with its `requests`, every 2 s), so the
    request log and the history's points have something in them;
  - a node cordoned and uncordoned every TOGGLE s: a change the summary shows
    (cordoned nodes come first), to time an update from the change to a page.

A console page is what control/console/app.js does, spoken by a child process
(`--client`, so parsing the pages' JSON is not charged to the controller or the simulator):
load the page's files; follow `watch/console`; on a summary whose catalog
version is new, GET `catalog`; on each summary and every 5 s (AGE_REDRAW_MS),
GET `requests?limit=50` and `gpus?limit=50` when the last was 5 s ago or more
(REFRESH_MS). What it prints per window:

  controller   its CPU (utime + stime: this process's, or serve's from /proc) over the window's
               wall time, of one core,
               and over the baseline: the mean of the windows with no page, measured in this run
  per route    bytes per answer or event (mean, max) and how many; latency (p50, p99, max) of
               the GETs; for history events the lag from the point's sample to the page
  update       a cordon or uncordon -> the first summary on each page that shows it (p50, p99, max)
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from bench.fleet import Bench, catalog, cpu_seconds, model_yaml, pct, self_cpu, write
from tests.fleetsim import ENGINE_YAML

from . import REPO

# What app.js waits between reads of the request log and the GPU view, and between redraws.
REFRESH_MS = AGE_REDRAW_MS = 5000
# A standalone router reports every 2 s (router.watch).
REPORT_EVERY = 2.0
TOGGLED = "sim-00007"
TRAFFIC_MODELS = ["big", "m0000", "m0001", "m0002"]       # the node cordoned and uncordoned (not one the summary shows unasked)


# -- the console page, as app.js speaks it (in the --client process) ---------------------------------

class Page:
    """One console page: its stream, its on-demand reads, and what each cost in bytes and time."""

    def __init__(self, url: str, session: aiohttp.ClientSession, log: dict[str, list[Any]]):
        self.url = url
        self.api = url + "/api/v1/"
        self.session = session
        self.log = log                      # route -> [(size, seconds or lag)], shared by the pages
        self.status: dict[str, Any] | None = None
        self.catalog_version: str | None = None
        self.refreshed = {"requests": 0.0, "gpus": 0.0}
        self.summaries: list[tuple[float, bool]] = []   # (arrival, TOGGLED shown cordoned)
        self.tasks: set[asyncio.Task[None]] = set()
        self.histories = 0

    async def get(self, route: str, path: str) -> bytes:
        t = time.monotonic()
        async with self.session.get(path, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            body = await resp.read()
        self.log[route].append((len(body), time.monotonic() - t))
        return body

    async def load(self) -> None:
        """The page's own files, as a browser asks for them once."""
        index = await self.get("page files", self.url + "/ui/")
        for name in re.findall(rb'(?:src|href)="([^"]+)"', index):
            await self.get("page files", self.url + "/ui/" + name.decode())

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def render(self) -> None:
        """app.js render(): the request log and the GPU view read again when REFRESH_MS has passed."""
        if self.status is None:
            return
        now = time.monotonic() * 1000
        for what, path in (("requests", "requests?limit=50"), ("gpus", "gpus?limit=50")):
            if now - self.refreshed[what] >= REFRESH_MS:
                self.refreshed[what] = now
                self.spawn(self.get(what, self.api + path))

    async def on_summary(self, doc: dict[str, Any]) -> None:
        self.status = doc
        self.summaries.append((time.monotonic(), any(
            n["name"] == TOGGLED and n.get("scheduling") not in (None, "schedulable") for n in doc["nodes"])))
        if doc["catalog"]["version"] != self.catalog_version:
            self.catalog_version = doc["catalog"]["version"]
            await self.get("catalog", self.api + "catalog")
        self.render()

    async def follow(self) -> None:
        async with self.session.get(self.api + "watch/console",
                                    timeout=aiohttp.ClientTimeout(total=None, sock_read=60)) as resp:
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    frame, buffer = buffer.split(b"\n\n", 1)
                    event, data = "message", b""
                    for line in frame.split(b"\n"):
                        if line.startswith(b"event:"):
                            event = line[6:].strip().decode()
                        elif line.startswith(b"data:"):
                            data = line[5:].lstrip()
                    doc = json.loads(data)
                    if event == "summary":
                        self.log["summary event"].append((len(frame), None))
                        await self.on_summary(doc)
                    elif event == "history":
                        # How long after its sample the newest point reached the page (not for the first
                        # event, the last hour, whose newest point is as old as the sampling's phase).
                        lag = time.time() - doc["t"][-1] if doc["t"] and self.histories else None
                        self.histories += 1
                        self.log["history event"].append((len(frame), lag))
                    elif event == "history-part":       # more models' series of a big first history
                        self.log["history part"].append((len(frame), None))

    async def redraw(self) -> None:
        while True:
            await asyncio.sleep(AGE_REDRAW_MS / 1000)
            self.render()

    async def run(self) -> None:
        await self.load()
        await asyncio.gather(self.follow(), self.redraw())


async def traffic(session: aiohttp.ClientSession, url: str, rate: float, stop: asyncio.Event) -> None:
    """RATE requests a second on four models, reported as a standalone router reports them (every 2 s)."""
    names = TRAFFIC_MODELS
    sent = 0
    while not stop.is_set():
        now, n = time.time(), int(rate * REPORT_EVERY)
        records = [{"at": now - REPORT_EVERY * (n - i) / n, "id": f"req-{sent + i:08d}", "key": "bench",
                    "asked": names[i % len(names)], "model": names[i % len(names)],
                    "status": 503 if i % 97 == 0 else 200, "path": "/v1/chat/completions", "stream": True,
                    "ttft": 0.05 + (i % 20) / 100, "duration": 1.0, "tokens_in": 30, "tokens_out": 200,
                    "replica": "", "error": None} for i in range(n)]
        sent += n
        try:
            async with session.post(url + "/api/v1/usage", timeout=aiohttp.ClientTimeout(total=30),
                                    json={"router": "bench-console", "version": 0, "replicas": {},
                                          "requests": records}) as r:
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(REPORT_EVERY)


async def toggle(session: aiohttp.ClientSession, url: str, every: float, toggles: list[tuple[float, bool]],
                 stop: asyncio.Event) -> None:
    """TOGGLED cordoned, then uncordoned, every EVERY s: (when the answer came, cordoned now) in `toggles`."""
    cordoned = False
    while not stop.is_set():
        await asyncio.sleep(every)
        verb = "uncordon" if cordoned else "cordon"
        try:
            async with session.post(f"{url}/api/v1/nodes/{TOGGLED}/{verb}", json={},
                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
                await r.read()
                if r.status == 200:
                    cordoned = not cordoned
                    toggles.append((time.monotonic(), cordoned))
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass


async def client(url: str, pages: int, seconds: float, rate: float, every: float) -> None:
    """PAGES pages (none: the baseline), the traffic and the toggles for SECONDS s; prints what they got as JSON."""
    log: dict[str, list[Any]] = collections.defaultdict(list)
    toggles: list[tuple[float, bool]] = []
    stop = asyncio.Event()
    own = aiohttp.ClientSession()
    side = [asyncio.create_task(traffic(own, url, rate, stop)), asyncio.create_task(toggle(own, url, every, toggles, stop))]
    sessions = [aiohttp.ClientSession() for _ in range(pages)]     # a browser tab's connections are its own
    opened = [Page(url, s, log) for s in sessions]
    tasks = [asyncio.create_task(p.run()) for p in opened]
    done, _ = await asyncio.wait(tasks + side, timeout=seconds)
    stop.set()
    for task in tasks + side:
        task.cancel()
    for p in opened:
        for t in list(p.tasks):
            t.cancel()
    await asyncio.gather(*tasks, *side, *(t for p in opened for t in p.tasks), return_exceptions=True)
    for s in [own, *sessions]:
        await s.close()
    failed = [repr(t.exception()) for t in done if t.exception() is not None]
    failed += [f"page {i}: never finished loading" for i, p in enumerate(opened) if p.status is None]
    lags = []
    for page in opened:
        for at, cordoned in toggles:
            if not page.summaries or at < page.summaries[0][0]:       # before the page's first summary
                continue
            shown = next((t for t, c in page.summaries if t >= at and c == cordoned), None)
            if shown is not None:
                lags.append(shown - at)
    print(json.dumps({"log": log, "lags": lags, "toggles": len(toggles), "failed": failed}))


async def window(url: str, args: argparse.Namespace, pages: int, cpu: Callable[[], float]) -> dict[str, Any]:
    """One window: the client process with PAGES pages; `cpu()` is the controller's CPU seconds so far."""
    cpu0, sim0, t0 = cpu(), self_cpu(), time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.console", "--client", url, "--pages", str(pages), "--window", str(args.window),
        "--traffic", str(args.traffic), "--toggle", str(args.toggle), cwd=REPO, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), args.window + 120)
    wall = time.monotonic() - t0
    got: dict[str, Any] = json.loads(out)
    got.update(pages=pages, wall=wall, cpu=(cpu() - cpu0) / wall, sim=(self_cpu() - sim0) / wall)
    print(f"window       {pages} pages: controller {got['cpu']:.3f} of a core over {wall:.0f} s"
          + (f"; failed: {got['failed']}" if got["failed"] else ""), flush=True)
    return got


# -- the bench (this process: serve, the simulator, the traffic, the toggles) ------------------------

class ConsoleBench(Bench):
    """The fleet simulator's serve (`--serve`): bench/fleet.py's harness, its controller's CPU from /proc."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)

    async def main(self) -> None:
        a = self.args
        base = [model_yaml("big", self.big)] + [model_yaml(f"m{i:04d}", self.per_model) for i in range(self.models)]
        write(self.catalogs, "engines.yaml", "apiVersion: llmgw/v1\nkind: Catalog\n" + ENGINE_YAML)
        write(self.catalogs, "base.yaml", catalog(base))
        print(f"fleet: {a.nodes} nodes x 8 GPUs, heartbeat {a.heartbeat:g} s; catalog: big x {self.big} + "
              f"{self.models} models x {self.per_model} = {self.expected} replicas; traffic {a.traffic:g}/s, "
              f"{TOGGLED} cordoned or uncordoned every {a.toggle:g} s")
        stop = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            self.start_serve()
            await self.until("serve up", lambda: self.healthy(session), 60)
            sim = asyncio.create_task(self.fleet.run(stop))
            try:
                took = await self.until("every replica ready", lambda: self.ready_count() == self.expected, a.timeout)
                print(f"converge     {took:.1f} s to every replica ready")
                await asyncio.sleep(a.heartbeat)        # the last reports settle out
                _, status = await self.get(session, "/api/v1/status")
                print(f"status       {len(status) / 1e6:.1f} MB (what a page would pull whole without the summary)")
                results = [await window(self.url, a, pages, lambda: cpu_seconds(self.serve.pid)) for pages in a.phases]
                report(results)
                self.passed = True
            finally:
                stop.set()
                await asyncio.wait({sim}, timeout=15)
                self.serve.send_signal(signal.SIGKILL)
                self.serve.wait()
                if self.passed:
                    shutil.rmtree(self.dir, ignore_errors=True)

def report(results: list[dict[str, Any]]) -> None:
    baselines = [r["cpu"] for r in results if not r["pages"]]
    base = sum(baselines) / len(baselines) if baselines else float("nan")
    print(f"\nbaseline (no page): {base:.3f} of a core (windows: {', '.join(f'{b:.3f}' for b in baselines)})")
    print("| pages | controller, of a core | over the baseline | x baseline |")
    print("| --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['pages']} | {r['cpu']:.3f} | {r['cpu'] - base:+.3f} | {r['cpu'] / base:.2f} |")
    for r in results:
        if not r["pages"]:
            continue
        print(f"\n{r['pages']} pages, {r['wall']:.0f} s:")
        print("| route | n | bytes mean | bytes max | latency p50 / p99 / max |")
        print("| --- | --- | --- | --- | --- |")
        for route, rows in sorted(r["log"].items()):
            sizes = [s for s, _ in rows]
            times = [t for _, t in rows if t is not None]
            lat = f"{pct(times, 0.5) * 1e3:.0f} / {pct(times, 0.99) * 1e3:.0f} / {max(times) * 1e3:.0f} ms" if times else "-"
            if route == "history event" and times:
                lat += " (sample -> page)"
            print(f"| {route} | {len(rows)} | {sum(sizes) / len(sizes) / 1e3:.1f} KB | {max(sizes) / 1e3:.1f} KB | {lat} |")
        lags = r["lags"]
        if lags:
            print(f"update: cordon/uncordon -> summary on the page: p50 {pct(lags, 0.5) * 1e3:.0f} ms, "
                  f"p99 {pct(lags, 0.99) * 1e3:.0f} ms, max {max(lags) * 1e3:.0f} ms (n={len(lags)} of "
                  f"{r['toggles']} toggles x {r['pages']} pages)")


async def in_process(a: argparse.Namespace) -> None:
    """The controller in this process (bench/status.py's fleet, every replica ready, no agent), its API on
    loopback, its loops running: the windows' CPU is this process's, with no simulator beside it."""
    import logging

    from aiohttp import web

    from llmgwctl.contracts import RequestRecord
    from llmgwctl.control.api import ControlAPI
    from llmgwctl.control.history import POINTS, ModelSample
    from tests.procs import free_port

    from .status import build
    logging.disable(logging.INFO)
    t = time.perf_counter()
    # No agent reports after the build: nodes are never taken for lost (unreachable_after).
    c, _ = build(a.nodes, prefix="llmgw-console-", node_timeout=1e9)
    print(f"fleet: {a.nodes} nodes, {len(c.reconciler.replicas)} replicas, {len(c.live.current)} models, "
          f"built in {time.perf_counter() - t:.0f} s, in process; traffic {a.traffic:g}/s, "
          f"{TOGGLED} cordoned or uncordoned every {a.toggle:g} s")
    # An hour of history, as a controller up that long holds it: a new page's first history is its largest.
    fleet, now = c.reconciler.fleet_status(), time.time()
    samples = [ModelSample(m.name, 0, m.desired, m.ready, m.load, m.target) for m in fleet.models]
    for k in range(POINTS):
        for i in range(int(a.traffic * c.history.interval)):
            model = TRAFFIC_MODELS[i % len(TRAFFIC_MODELS)]
            c.history.observe(RequestRecord(at=0, id="h", key=None, asked=model, model=model, status=200,
                                            ttft=0.05 + (i % 20) / 100, tokens_in=30, tokens_out=200, replica="r"))
        c.history.sample(now - (POINTS - k) * c.history.interval, samples)
    port = free_port()
    runner = web.AppRunner(ControlAPI(c).app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    loops = asyncio.create_task(c.run(stop))
    url = f"http://127.0.0.1:{port}"
    try:
        print(f"status       {len(c.status_json()) / 1e6:.1f} MB (what a page would pull whole without the summary)")
        report([await window(url, a, pages, self_cpu) for pages in a.phases])
    finally:
        stop.set()
        await asyncio.wait({loops}, timeout=15)
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--heartbeat", type=float, default=10.0)
    p.add_argument("--window", type=float, default=60.0, help="seconds of each window")
    p.add_argument("--phases", default="0,1,0,5,0", help="pages open in each window, in order (0: the baseline)")
    p.add_argument("--traffic", type=float, default=25.0, help="requests a second reported by a router")
    p.add_argument("--toggle", type=float, default=15.0, help="seconds between a node's cordon and uncordon")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the fleet may take to converge")
    p.add_argument("--serve-arg", action="append", help="an extra argument for serve (repeatable)")
    p.add_argument("--serve", action="store_true",
                   help="a real serve and the fleet simulator's agents (bench/fleet.py), not the controller in process")
    p.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)     # the pages' process
    p.add_argument("--pages", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    from llmgwctl.aio import run
    if a.client:
        run(client(a.client, a.pages, a.window, a.traffic, a.toggle))
        return
    a.phases = [int(x) for x in a.phases.split(",")]
    a.routers, a.routers_in_process = 0, True
    import resource as r
    soft, hard = r.getrlimit(r.RLIMIT_NOFILE)
    r.setrlimit(r.RLIMIT_NOFILE, (hard, hard))
    run(ConsoleBench(a).main() if a.serve else in_process(a))


if __name__ == "__main__":
    main()

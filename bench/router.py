"""Router vs a bare aiohttp reverse proxy vs direct-to-engine, in one run.

    python3 -m bench.router [--requests 3000] [--seconds 5] [--rounds 3] [--prompt-tokens N] [--endpoints N]

Starts, as separate processes on 127.0.0.1 (uvloop in each):
  upstream   an instant OpenAI-shaped server: a fixed chat completion, or a
             fixed short SSE stream when the body asks for one; /metrics with
             vLLM's gauge names so the router's poller has something to read
  bare       the simplest possible aiohttp reverse proxy (read body, POST it
             upstream on one keep-alive session, return the bytes): the floor
             for any Python proxy, written here so it is measured on this machine
  router     `llmgwctl router --endpoints FILE --catalogs DIR`, one endpoint
and measures each path from an aiohttp client in this process:
  - latency p50/p99 at concurrency 1 over one keep-alive connection
  - requests/s at concurrency 32
  - CPU time per request of the proxy process (/proc/PID/stat)
  - streaming time to first byte at concurrency 1
With --prompt-tokens N every request carries a system prompt of about N
tokens (4 characters each) and a row "llmgw router, prefix" is added: a model
whose catalog entry says `routing: prefix`, so the router hashes the prompt
and scores every endpoint's index on each request. --endpoints N lists the
one upstream N times under different replica ids, so the pick has N
candidates to score, as on a real fleet.
Rounds alternate the paths so drift on a shared machine hits all of them alike;
the median round is printed. Added latency is "path minus direct" within a round.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from . import REPO

if TYPE_CHECKING:
    # aiohttp and uvloop load in the processes that use them.
    import aiohttp
    from aiohttp import web

MODEL = "bench-model"
ALIAS = "bench"
PREFIX_MODEL = "bench-prefix"      # the same endpoints, `routing: prefix`
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hello! How are you today?"}], "max_tokens": 16}
REPLY = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "I am fine, thank you for asking!"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18}}).encode()
CHUNK = b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"' + MODEL.encode() + \
    b'","choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
METRICS = ('vllm:num_requests_running{model_name="%s"} 0.0\nvllm:num_requests_waiting{model_name="%s"} 0.0\n'
           'vllm:kv_cache_usage_perc{model_name="%s"} 0.0\n' % (MODEL, MODEL, MODEL)).encode()


# -- the processes under test ------------------------------------------------------

def _serve(app: web.Application, port_line: str) -> None:
    import uvloop
    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(port_line % runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()
    uvloop.run(main())


def upstream() -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream":true' in body or b'"stream": true' in body:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for _ in range(4):
                await resp.write(CHUNK)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.Response(body=REPLY, content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    _serve(app, "listening on http://127.0.0.1:%d")


def bare(target: str) -> None:
    import aiohttp
    from aiohttp import web

    async def startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with request.app["session"].post(target + request.path, data=body,
                                               headers={"Content-Type": "application/json"}) as up:
            if up.content_type == "text/event-stream":
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
            return web.Response(status=up.status, body=await up.read(),
                                headers={"Content-Type": up.headers.get("Content-Type", "application/json")})

    app = web.Application()
    app.on_startup.append(startup)
    app.router.add_post("/{tail:.*}", proxy)
    _serve(app, "listening on http://127.0.0.1:%d")


# -- the driver ----------------------------------------------------------------------

class Proc:
    def __init__(self, argv: list[str]):
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  start_new_session=True, cwd=REPO)
        box: list[str] = []
        out = self.p.stdout
        assert out is not None      # stdout=PIPE
        t = threading.Thread(target=lambda: box.append(out.readline()), daemon=True)
        t.start()
        t.join(20)
        if not box or "http://" not in box[0]:
            self.kill()
            raise SystemExit(f"{' '.join(argv)} did not start")
        self.url = box[0].rsplit(" ", 1)[-1].strip()

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


async def latency(session: aiohttp.ClientSession, url: str, body: bytes, n: int) -> list[float]:
    out: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            assert r.status == 200, r.status
        out.append(time.perf_counter() - t0)
    return out


async def ttfb(session: aiohttp.ClientSession, url: str, body: bytes, n: int) -> list[float]:
    out: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            await r.content.readany()
            out.append(time.perf_counter() - t0)
            await r.read()
    return out


async def throughput(session: aiohttp.ClientSession, url: str, body: bytes, seconds: float, conc: int = 32) -> int:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, r.status
            done += 1
    await asyncio.gather(*(worker() for _ in range(conc)))
    return done


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def system_prompt(tokens: int) -> str:
    """About `tokens` tokens of varied English-like text (4 characters a token)."""
    words = ("the", "gateway", "routes", "requests", "to", "replicas", "whose", "cache", "holds", "prefix")
    out: list[str] = []
    size, i = 0, 0
    while size < tokens * 4:
        w = words[(i * 7 + i // 10) % len(words)]
        out.append(w)
        size += len(w) + 1
        i += 1
    return " ".join(out)


async def measure(paths: dict[str, tuple[str, Proc | None, str]],
                  args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    import aiohttp
    chat = CHAT
    if args.prompt_tokens:
        chat = {**CHAT, "messages": [{"role": "system", "content": system_prompt(args.prompt_tokens)},
                                     *CHAT["messages"]]}
    body = json.dumps(chat).encode()
    alias_body = json.dumps({**chat, "model": ALIAS}).encode()
    prefix_body = json.dumps({**chat, "model": PREFIX_MODEL}).encode()
    stream_body = json.dumps({**chat, "stream": True}).encode()
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, (url, proc, which) in paths.items():
            req_body = {"plain": body, "alias": alias_body, "prefix": prefix_body}[which]
            one = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=one) as s:
                await latency(s, url, req_body, 200)                    # warm-up
                cpu0 = proc.cpu_seconds() if proc else 0.0
                lat = await latency(s, url, req_body, args.requests)
                cpu_c1 = (proc.cpu_seconds() - cpu0) / args.requests if proc else 0.0
                tt = await ttfb(s, url, stream_body, args.requests // 3)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                await throughput(s, url, req_body, 0.5)
                cpu0 = proc.cpu_seconds() if proc else 0.0
                n = await throughput(s, url, req_body, args.seconds)
                cpu = (proc.cpu_seconds() - cpu0) / n if proc else 0.0
            rounds[name].append({"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "rps": n / args.seconds,
                                 "cpu": cpu, "cpu_c1": cpu_c1, "ttfb": pct(tt, 0.5)})
    return rounds


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_upstream":
        return upstream()
    if len(sys.argv) > 1 and sys.argv[1] == "_bare":
        return bare(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000, help="sequential requests per round at concurrency 1")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each concurrency-32 run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="add a system prompt of about this many tokens, and a prefix-routed row")
    ap.add_argument("--endpoints", type=int, default=1, help="list the upstream this many times")
    args = ap.parse_args()

    me = ["-m", __spec__.name]
    procs: list[Proc] = []
    try:
        up = Proc([sys.executable, *me, "_upstream"])
        procs.append(up)
        bare_proxy = Proc([sys.executable, *me, "_bare", up.url])
        procs.append(bare_proxy)
        tmp = tempfile.mkdtemp(prefix="llmgw-bench-")
        os.mkdir(os.path.join(tmp, "cat"))
        with open(os.path.join(tmp, "cat", "bench.yaml"), "w") as f:
            f.write(f"apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n  - name: {MODEL}\n    aliases: [{ALIAS}]\n"
                    f"    source: org/{MODEL}\n    profiles:\n      - {{name: default, engine: fake, gpus: 0}}\n"
                    f"  - name: {PREFIX_MODEL}\n    routing: prefix\n"
                    f"    profiles:\n      - {{name: default, engine: fake, gpus: 0}}\n")
        with open(os.path.join(tmp, "eps.yaml"), "w") as f:
            f.write("endpoints:\n")
            for i in range(args.endpoints):
                for model in (MODEL, PREFIX_MODEL):
                    f.write(f"  - {{model: {model}, url: '{up.url}', id: {model}-{i}}}\n")
        router = Proc([sys.executable, "-m", "llmgwctl", "router", "--listen", "127.0.0.1:0", "--log-level", "warning",
                       "--endpoints", os.path.join(tmp, "eps.yaml"), "--catalogs", os.path.join(tmp, "cat")])
        procs.append(router)
        path = "/v1/chat/completions"
        paths = {"direct": (up.url + path, None, "plain"),
                 "bare proxy": (bare_proxy.url + path, bare_proxy, "plain"),
                 "llmgw router": (router.url + path, router, "plain"),
                 "llmgw router, alias": (router.url + path, router, "alias")}
        if args.prompt_tokens:
            paths["llmgw router, prefix"] = (router.url + path, router, "prefix")
        import uvloop
        rounds = uvloop.run(measure(paths, args))
    finally:
        for p in procs:
            p.kill()

    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    added = {name: {k: statistics.median(r[k] - d[k] for r, d in zip(rs, rounds["direct"])) for k in ("p50", "p99", "ttfb")}
             for name, rs in rounds.items()}
    print(f"{args.rounds} rounds, median shown; {args.requests} sequential requests at c=1, "
          f"{args.seconds:g} s at c=32; {os.cpu_count()} CPUs shared by client, proxy and upstream\n")
    hdr = f"{'path':<22}{'p50 ms':>8}{'p99 ms':>8}{'+p50 ms':>9}{'+p99 ms':>9}{'req/s c32':>11}{'x direct':>9}" \
          f"{'x bare':>8}{'CPU us/req':>11}{'(c=1)':>7}{'x bare':>8}{'+TTFB ms':>10}"
    print(hdr)
    print("-" * len(hdr))
    b = med["bare proxy"]
    for name, m in med.items():
        a = added[name]
        cpu = f"{m['cpu'] * 1e6:>11.0f}{m['cpu_c1'] * 1e6:>7.0f}{m['cpu'] / b['cpu']:>8.2f}" if name != "direct" \
            else f"{'-':>11}{'-':>7}{'-':>8}"
        plus = f"{a['p50'] * 1e3:>9.3f}{a['p99'] * 1e3:>9.3f}" if name != "direct" else f"{'-':>9}{'-':>9}"
        tt = f"{a['ttfb'] * 1e3:>10.3f}" if name != "direct" else f"{'-':>10}"
        print(f"{name:<22}{m['p50'] * 1e3:>8.3f}{m['p99'] * 1e3:>8.3f}{plus}{m['rps']:>11.0f}"
              f"{m['rps'] / med['direct']['rps']:>9.2f}{m['rps'] / b['rps']:>8.2f}{cpu}{tt}")
    r = med["llmgw router"]
    ra = added["llmgw router"]
    if "llmgw router, prefix" in med:
        pr = med["llmgw router, prefix"]
        print(f"\nprefix scoring ({args.prompt_tokens}-token prompts, {args.endpoints} endpoints): "
              f"CPU {pr['cpu'] * 1e6:.0f} us/req at c=32, {(pr['cpu'] - r['cpu']) * 1e6:+.0f} us over least-load "
              f"(target: <= 150 us/req with prefix scoring)")
    print(f"\nrouter vs targets: +p50 {ra['p50'] * 1e3:.3f} ms (<= 0.5), +p99 {ra['p99'] * 1e3:.3f} ms (<= 1.5), "
          f"throughput {r['rps'] / b['rps']:.2f}x bare (>= 0.9), CPU {r['cpu'] * 1e6:.0f} us/req (<= 250)")


if __name__ == "__main__":
    main()

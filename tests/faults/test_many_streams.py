"""Scenario 8: 500 concurrent streams through one router.

A standalone `llmgwctl router`, started under the soft open-file limit most
Linux systems give a process (1,024): every stream holds two sockets there,
so the router must raise its own limit. All 500 streams come from this one
test process, i.e. from one address, which the router's per-address
connection limit (256 by default) exists to cap; it is raised as its
documentation says to for clients that share an address (a load balancer),
since what is measured here is the router carrying 500 streams, not that
guard. Two fake engines with room for every sequence at once; each stream is
a few tokens paced over a couple of seconds, so all 500 are open together.
Every stream must end with `data: [DONE]` and no error event, and none may
stall: a stream silent for STALL seconds counts as failed (the client's read
timeout), and the longest silence of any stream is in the figure.
"""
import asyncio
import contextlib
import resource
import time

import aiohttp

from tests.e2e.fleet import wait_until

from .load import router_inflight

STREAMS = 500
TOKENS = 8
# A stream that sends nothing for this long is stalled: its tokens come every
# 0.25 s when all is well, so this is a hundred times the normal gap and only
# a stuck stream reaches it, however loaded the machine.
STALL = 25.0
# The soft limit on open files many Linux systems start processes with.
USUAL_NOFILE = 1024

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: talk
    replicas: 2
    profiles: [{name: cpu, engine: fake, gpus: 0, args: [--max-num-seqs, "1024", --tokens-per-second, "4"]}]
"""


@contextlib.contextmanager
def soft_nofile(limit: int):
    """Processes spawned inside start with this soft open-file limit, as under a stock login or unit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def one_stream(session: aiohttp.ClientSession, url: str) -> dict:
    started = time.monotonic()
    arrivals = [started]
    body = b""
    try:
        async with session.post(url + "/v1/chat/completions",
                                json={"model": "talk", "stream": True, "max_tokens": TOKENS, "ignore_eos": True,
                                      "messages": [{"role": "user", "content": "together"}]}) as resp:
            headers_at = time.monotonic()
            async for chunk in resp.content.iter_any():
                arrivals.append(time.monotonic())
                body += chunk
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {"ok": False, "why": f"{type(exc).__name__}: {exc}", "gap": max(b - a for a, b in zip(arrivals, arrivals[1:] + [time.monotonic()]))}
    ended = time.monotonic()
    ok = status == 200 and body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body
    return {"ok": ok, "why": "" if ok else f"{status}: {body[-200:]!r}", "open": (headers_at, ended),
            "gap": max(b - a for a, b in zip(arrivals, arrivals[1:])) if len(arrivals) > 1 else ended - started}


async def streams(url: str, n: int) -> list[dict]:
    connector = aiohttp.TCPConnector(limit=0)     # the client's own pool must not be what limits concurrency
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=STALL, sock_read=STALL)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await asyncio.gather(*(one_stream(session, url) for _ in range(n)))


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    peak = open_now = 0
    for _, step in edges:
        open_now += step
        peak = max(peak, open_now)
    return peak


def test_500_concurrent_streams_through_one_router_all_complete(fleet, figure):
    (fleet.catalogs / "models.yaml").write_text(CATALOG)
    with soft_nofile(USUAL_NOFILE):
        fleet.start_controller()
        fleet.start_agent("n1", "none")
        wait_until(lambda: len(fleet.ready("talk")) == 2, "both replicas ready")
        router = fleet.start_router("--max-connections-per-client", str(2 * STREAMS))
    started = time.monotonic()
    results = asyncio.run(streams(router, STREAMS))
    took = time.monotonic() - started
    failed = [r for r in results if not r["ok"]]
    overlap = peak_overlap([r["open"] for r in results if "open" in r])
    figure(f"{STREAMS} concurrent streams in {took:.1f} s: completed {STREAMS - len(failed)}, failed {len(failed)}; "
           f"at most {overlap} open at once; longest silence in a stream {max(r['gap'] for r in results):.2f} s")
    assert failed == [], [r["why"] for r in failed[:5]]
    wait_until(lambda: router_inflight(router) == 0, "the router's in-flight counts back to 0")

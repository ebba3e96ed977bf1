"""How much the fake engine can take: it stands in for a GPU in every e2e test and
benchmark, so it must never be the bottleneck of what those measure.

Starts `llmgwctl engine fake` as a process (as the agent would) and measures,
from an aiohttp client with keep-alive in this process:

  1. requests/s, non-streaming /v1/completions, at concurrency 1 and 32, with
     the same server's GET /health as the baseline in the same run (same
     process, same HTTP stack, no engine logic): the ratio is what the fake's
     own work costs;
  2. concurrent SSE streams (100 and 500) paced at a set token rate: whether
     all complete, the chunk rate achieved against the rate asked, and the
     engine's CPU seconds per 1000 chunks (from /proc).

Bounded: each phase runs for a fixed time or count; the whole run stays under
a minute. Client and server share this machine's cores, so absolute numbers
are the pair's; the ratios are what to compare between runs.

    python3 -m bench.fake_engine [--seconds 4]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import aiohttp

from llmgwctl.engines.fake import spawn

MODEL = "bench-model"


def cpu_seconds(pid: int) -> float:
    # utime + stime of the engine process, in clock ticks (fields 14 and 15).
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def rate(session: aiohttp.ClientSession, method: str, url: str, body: dict[str, Any] | None, concurrency: int,
               seconds: float) -> tuple[float, int]:
    """Requests/s over `seconds`, `concurrency` callers each sending one after another."""
    done = 0
    errors = 0
    deadline = time.monotonic() + seconds

    async def caller() -> None:
        nonlocal done, errors
        while time.monotonic() < deadline:
            async with session.request(method, url, json=body) as r:
                await r.read()
                if r.status == 200:
                    done += 1
                else:
                    errors += 1

    start = time.monotonic()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return done / (time.monotonic() - start), errors


async def streams(session: aiohttp.ClientSession, url: str, n: int, tokens: int) -> tuple[int, int, float]:
    """Open `n` streams of `tokens` tokens at once; (completed, chunks received, wall seconds)."""
    body = {"model": MODEL, "prompt": "stream", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    chunks = 0

    async def one() -> bool:
        nonlocal chunks
        async with session.post(f"{url}/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunks += 1
                elif line.startswith(b"data: [DONE]"):
                    return True
        return False

    start = time.monotonic()
    ok = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    return sum(1 for x in ok if x is True), chunks, time.monotonic() - start


async def main(seconds: float, token_rate: float, tokens: int) -> None:
    rows: list[tuple[str, str, str]] = []
    connector = aiohttp.TCPConnector(limit=0)    # no client-side cap: the server is what we measure
    timeout = aiohttp.ClientTimeout(total=60)
    # Fast engine for request rates: no pacing, a 16-token reply.
    with spawn(MODEL, "--max-num-seqs", "1024") as fast:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            completion = {"model": MODEL, "prompt": "hello there", "max_tokens": 16}
            for concurrency in (1, 32):
                base, _ = await rate(session, "GET", f"{fast.url}/health", None, concurrency, seconds)
                got, errors = await rate(session, "POST", f"{fast.url}/v1/completions", completion, concurrency,
                                         seconds)
                rows.append((f"completions, concurrency {concurrency}", f"{got:,.0f} req/s",
                             f"{got / base:.2f}x of /health ({base:,.0f} req/s){'; ' + str(errors) + ' errors' if errors else ''}"))
    # Paced engine for streams.
    with spawn(MODEL, "--tokens-per-second", str(token_rate), "--max-num-seqs", "1024") as paced:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            for n in (100, 500):
                cpu0 = cpu_seconds(paced.proc.pid)
                completed, chunks, wall = await streams(session, paced.url, n, tokens)
                cpu = cpu_seconds(paced.proc.pid) - cpu0
                asked = n * token_rate
                # The ideal wall time is tokens/rate; achieved rate counts content chunks only.
                achieved = chunks / wall
                rows.append((f"{n} streams x {tokens} tok @ {token_rate:g} tok/s",
                             f"{completed}/{n} complete",
                             f"{achieved:,.0f} chunks/s = {achieved / asked:.2f}x of {asked:,.0f} asked; "
                             f"wall {wall:.1f}s (ideal {tokens / token_rate:.1f}s); "
                             f"engine CPU {1000 * cpu / max(chunks, 1):.2f} s per 1000 chunks"))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{'phase':<{width[0]}}  {'result':<{width[1]}}  ratio")
    for r in rows:
        print(f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 4 s per rate phase: long enough to average out a noisy shared machine, short
    # enough that 4 phases + streams stay under a minute.
    parser.add_argument("--seconds", type=float, default=4.0)
    # 20 tok/s x 60 tokens: a 3 s stream, about a slow GPU's decode rate per request.
    parser.add_argument("--token-rate", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=60)
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.token_rate, args.tokens))

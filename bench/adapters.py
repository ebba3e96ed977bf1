"""LoRA adapters placed by llmgw against a random spread: slot hit rate and latency on fake engines.

    python3 -m bench.adapters [--requests 2000] [--rate 150] [--adapters 50] [--replicas 4] [--slots 4] [--hot 2]
                              [--target 0.5]

Four fake engines (processes) serve one base model with LoRA on: 4 adapter
slots each (vLLM's --max-loras), a request for an adapter not in a slot
swapping it in first (--lora-swap-time 20 ms, one swap at a time per engine,
as the copy onto the GPU is), 16-token replies at 2 ms a token. 50 adapters,
requested with Zipf-like popularity (weight 1/rank), open loop (Poisson
arrivals at --rate), through llmgw's router in this process.

Four placements, the same requests at the same times, one after the other:

  random       every adapter loaded on every replica, the router choosing
               among all four by load alone: vLLM behind a plain balancer
               (the baseline).
  llmgw        each adapter on 1 replica (`replicas: 1`), placed by the
               reconciler's own AdapterPlacer (spread by fewest adapters),
               loaded on that replica only; the router sends an adapter's
               requests only to its holder.
  llmgw+hot    the same, but the --hot most requested adapters on every
               replica (`replicas: all`), as an operator who knows the
               traffic writes it.
  llmgw+load   every adapter `replicas: {min: 1, max: --replicas}` with
               `autoscale: {target: --target}`: the reconciler's own
               AdapterPlacer, fed the router's per-adapter in-flight
               counters once a second as the reconciler's pass is, spreads
               an adapter to more replicas while its own load per holder is
               past the target (and back after a 10 s window); each change
               is loaded on the engines and pushed to the router as the
               agent and the publisher would (an unload a second after its
               replica left the adapter's routing, as the agent's drain).

Two workloads: `uniform` (every adapter as likely) and `zipf` (weight
1/rank: a few tenants carry most of the traffic).

Printed per workload and placement: the engines' slot hit rate
(fake_lora_slot_hits over hits + misses, summed), latency p50 and p99 of
the whole request, and each as a ratio to the random spread.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import aiohttp

from llmgwctl.catalog import Adapter, Autoscale, Catalog, Model, Profile
from llmgwctl.contracts import Endpoint, ReplicaSpec, ReplicaState
from llmgwctl.engines.fake import FakeProcess, spawn
from llmgwctl.reconciler.adapters import AdapterPlacer
from llmgwctl.reconciler.records import Records, Replica
from llmgwctl.router import Router, RouterConfig, start

BASE = "bench-base"
SWAP = 0.02
DECODE = 0.002
TOKENS = 16
# llmgw+load: the reconciler's pass interval (reconciler.TICK), and a window
# short next to a run (a workload's arrivals span 10-20 s).
TICK = 1.0
WINDOW = 10.0


def catalog(adapters: int, replicas: int | None, hot: int = 0, grow_to: int | None = None,
            target: float = 0.5) -> Catalog:
    """The base with `adapters` adapters on `replicas` replicas each (None: all), the first `hot` on all;
    with `grow_to`, each may spread to that many by its load (`target` in flight per holder)."""
    policy = Autoscale(target=target, scale_down_window=WINDOW)
    return Catalog([Model(name=BASE, source=BASE, profiles=(Profile(name="cpu", engine="fake", gpus=0),),
                          adapters=tuple(Adapter(f"tenant-{i:02d}", f"hub/tenant-{i:02d}",
                                                 replicas=None if i < hot else replicas, max_replicas=grow_to,
                                                 autoscale=policy if grow_to else Autoscale())
                                         for i in range(adapters)))])


def replicas_of(cat: Catalog, n: int) -> Records:
    model = cat.models[0]
    records = Records()
    for i in range(n):
        spec = ReplicaSpec.for_profile(f"r{i}", model, model.profiles[0], cat.engines["fake"])
        records[spec.id] = Replica(spec=spec, node="n", created=0.0, state=ReplicaState.READY)
    return records


def held(records: Records, n: int) -> list[list[str]]:
    return [[a.name for a in records[f"r{i}"].spec.adapters] for i in range(n)]


def placement(cat: Catalog, n: int) -> list[list[str]]:
    """Which adapters each of `n` replicas holds, as the reconciler places them."""
    records = replicas_of(cat, n)
    AdapterPlacer(records).place(cat)
    return held(records, n)


async def load_set(session: aiohttp.ClientSession, engine: FakeProcess, names: list[str]) -> None:
    for a in names:
        async with session.post(engine.url + "/v1/load_lora_adapter",
                                json={"lora_name": a, "lora_path": f"hub/{a}"}) as resp:
            assert resp.status == 200, await resp.text()


def endpoints(engines: list[FakeProcess], placed: list[list[str]]) -> list[Endpoint]:
    return [Endpoint(f"r{i}", BASE, "cpu", "fake", e.url, adapters=frozenset(names))
            for i, (e, names) in enumerate(zip(engines, placed))]


async def follow(cat: Catalog, router: Router, engines: list[FakeProcess], session: aiohttp.ClientSession,
                 stop: asyncio.Event) -> int:
    """llmgw+load's control loop, once a TICK: the placer on the router's counters, its changes loaded
    on the engines, then routed; an unload a TICK after routing left it. Returns the loads it made."""
    n = len(engines)
    records = replicas_of(cat, n)
    placer = AdapterPlacer(records, load=router)
    placer.place(cat)
    now = held(records, n)
    leaving: list[tuple[int, str]] = []
    loads = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), TICK)
        except asyncio.TimeoutError:
            pass
        for i, a in leaving:
            await session.post(engines[i].url + "/v1/unload_lora_adapter", json={"lora_name": a})
        leaving = []
        placer.place(cat)
        want = held(records, n)
        if want == now:
            continue
        for i in range(n):
            added = [a for a in want[i] if a not in now[i]]
            await load_set(session, engines[i], added)
            loads += len(added)
            leaving.extend((i, a) for a in now[i] if a not in want[i])
        router.set_endpoints(endpoints(engines, want))
        now = want
    return loads


async def counters(session: aiohttp.ClientSession, engines: list[FakeProcess]) -> tuple[float, float]:
    hits = misses = 0.0
    for e in engines:
        async with session.get(e.url + "/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line.startswith("fake_lora_slot_hits_total"):
                    hits += float(line.split()[-1])
                elif line.startswith("fake_lora_slot_misses_total"):
                    misses += float(line.split()[-1])
    return hits, misses


async def run(placed: list[list[str]] | None, cat: Catalog, engines: list[FakeProcess],
              arrivals: list[tuple[float, str]]) -> dict[str, float]:
    """One placement's run; `placed` None: the placement follows the load (llmgw+load)."""
    async with aiohttp.ClientSession() as session:
        start_with = placed if placed is not None else placement(cat, len(engines))
        for e, names in zip(engines, start_with):
            # Fresh engines' adapter sets: unload what another run left, load this placement's.
            async with session.get(e.url + "/v1/models") as resp:
                left = [c["id"] for c in (await resp.json())["data"] if c.get("parent")]
            for a in left:
                await session.post(e.url + "/v1/unload_lora_adapter", json={"lora_name": a})
            await load_set(session, e, names)
        router = Router(cat, config=RouterConfig())
        runner, port = await start(router, "127.0.0.1", 0)
        router.set_endpoints(endpoints(engines, start_with))
        stop = asyncio.Event()
        follower = asyncio.ensure_future(follow(cat, router, engines, session, stop)) if placed is None else None
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        before = await counters(session, engines)
        latencies: list[float] = []
        failed = 0

        async def one(at: float, adapter: str, t0: float) -> None:
            nonlocal failed
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            sent = time.perf_counter()
            body = {"model": adapter, "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS,
                    "ignore_eos": True}
            async with session.post(url, json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    failed += 1
                    return
            latencies.append(time.perf_counter() - sent)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(at, a, t0) for at, a in arrivals))
        stop.set()
        loads = await follower if follower is not None else 0
        after = await counters(session, engines)
        await runner.cleanup()
    hits, misses = after[0] - before[0], after[1] - before[1]
    latencies.sort()
    return {"hit": hits / max(1.0, hits + misses), "p50": statistics.median(latencies),
            "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], "failed": float(failed),
            "served": float(len(latencies)), "loads": float(loads)}


async def main(args: argparse.Namespace) -> None:
    names = [f"tenant-{i:02d}" for i in range(args.adapters)]
    engines = [spawn(BASE, "--max-loras", str(args.slots), "--lora-swap-time", str(SWAP),
                     "--decode-time-per-token", str(DECODE)) for _ in range(args.replicas)]
    plans = {"random": ([names] * args.replicas, catalog(args.adapters, None)),
             "llmgw": (placement(catalog(args.adapters, 1), args.replicas), catalog(args.adapters, 1)),
             "llmgw+hot": (placement(catalog(args.adapters, 1, args.hot), args.replicas),
                           catalog(args.adapters, 1, args.hot)),
             "llmgw+load": (None, catalog(args.adapters, 1, grow_to=args.replicas, target=args.target))}
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        await asyncio.sleep(1.0)    # listening is not yet healthy; the fake is ready at once after
        for workload in ("uniform", "zipf"):
            rng = random.Random(7)
            weights = [1.0 if workload == "uniform" else 1.0 / (rank + 1) for rank in range(args.adapters)]
            at, arrivals = 0.0, list[tuple[float, str]]()
            for _ in range(args.requests):
                at += rng.expovariate(args.rate)
                arrivals.append((at, rng.choices(names, weights)[0]))
            results[workload] = {name: await run(plan, cat, engines, arrivals) for name, (plan, cat) in plans.items()}
    finally:
        for e in engines:
            e.stop()
    print(f"{args.adapters} adapters over {args.replicas} replicas, {args.slots} slots each, "
          f"{args.requests} requests at {args.rate:g}/s, swap {SWAP * 1000:g} ms, "
          f"{TOKENS} tokens x {DECODE * 1000:g} ms; llmgw+hot: the {args.hot} most requested on all; "
          f"llmgw+load: target {args.target:g} in flight per holder, window {WINDOW:g} s")
    print(f"adapters per replica: llmgw {[len(p) for p in plans['llmgw'][0] or ()]}, "
          f"llmgw+hot {[len(p) for p in plans['llmgw+hot'][0] or ()]}; llmgw+load loaded "
          + ", ".join(f"{w} {rows['llmgw+load']['loads']:.0f}" for w, rows in results.items())
          + " adapters beyond its start as the load spread them")
    print(f"{'workload':<8} {'placement':<11} {'hit rate':>9} {'p50 ms':>8} {'p99 ms':>8} {'failed':>7}  "
          "vs random (hit, p50, p99)")
    for workload, rows in results.items():
        base = rows["random"]
        for name, r in rows.items():
            print(f"{workload:<8} {name:<11} {r['hit']:>9.1%} {r['p50'] * 1000:>8.1f} {r['p99'] * 1000:>8.1f} "
                  f"{r['failed']:>7.0f}  {r['hit'] / max(base['hit'], 1e-9):.2f}x, {r['p50'] / base['p50']:.2f}x, "
                  f"{r['p99'] / base['p99']:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=150.0)
    parser.add_argument("--adapters", type=int, default=50)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--hot", type=int, default=2)
    # Half a request in flight per holder: at the bench's rates an adapter carries about
    # its share of 4-8 requests in flight, so the top of a Zipf tail is past it and the rest is not.
    parser.add_argument("--target", type=float, default=0.5)
    asyncio.run(main(parser.parse_args()))

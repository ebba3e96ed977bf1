"""A reconcile pass on a catalog at its bounds, and the router's /healthz while passes run, against baselines.

Catalogs (each the whole replica budget, 100 models x replicas 1000 = 100,000):

  unplaceable   profiles needing 8 GPUs of a pool no node has: nothing placed,
                99,999 replicas explained every pass (the reason path)
  gpu           1-GPU profiles on the fleet's GPUs: as many placed as fit
  zero-gpu      0-GPU profiles, which fit any node: bounded by the per-node
                replica cap (placement.fleet.MAX_REPLICAS_PER_NODE)

Fleet: 3 simulated nodes of 8 GPUs, reported through the real Inventory. For
each catalog: the first pass (places everything), then the steady pass
(best of 5), and /healthz of a real Router served by aiohttp on the same event
loop, asked back to back while the reconcile loop runs every 50 ms. Baseline:
the same /healthz with an empty-ish catalog (one model) in the same run, so
the ratio is what the passes cost the data plane.

    python3 -m bench.reconcile_bounds
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time

import aiohttp

from llmgwctl.catalog import Catalog, Live, Model, Profile, Replicas
from llmgwctl.inventory import Inventory
from llmgwctl.reconciler import DesiredStore, Reconciler, run
from llmgwctl.router import Router
from llmgwctl.router.server import start

NODES, GPUS = 3, 8
HEALTHZ_SAMPLES = 300


def catalog(kind: str) -> Catalog:
    if kind == "baseline":
        return Catalog([Model(name="m0", profiles=(Profile(name="p", engine="fake", gpus=0),))])
    pool, gpus = {"unplaceable": ("nobody", 8), "gpu": (None, 1), "zero-gpu": (None, 0)}[kind]
    return Catalog([Model(name=f"m{i}", replicas=Replicas(1000, 1000),
                          profiles=(Profile(name="p", engine="fake", pool=pool, gpus=gpus),)) for i in range(100)])


def reconciler(cat: Catalog, router: Router | None = None) -> Reconciler:
    inventory = Inventory()
    for n in range(NODES):
        inventory.report(f"n{n}", {"node": f"n{n}", "pools": [], "engines": {"fake": {"available": True, "reason": ""}},
                                   "gpus": [{"index": i, "uuid": f"n{n}-{i}"} for i in range(GPUS)], "replicas": []})
    return Reconciler(Live(cat), inventory, DesiredStore(), endpoints=router, settle=0)


def passes(cat: Catalog) -> tuple[float, float, int]:
    rec = reconciler(cat)
    t = time.perf_counter()
    rec.reconcile_once()
    first = time.perf_counter() - t
    steady = []
    for _ in range(5):
        t = time.perf_counter()
        rec.reconcile_once()
        steady.append(time.perf_counter() - t)
    return first, min(steady), len(rec.replicas)


async def healthz_under_passes(cat: Catalog) -> tuple[float, float, float]:
    router = Router()
    router.set_catalog(cat)
    runner, port = await start(router, "127.0.0.1", 0)
    rec = reconciler(cat, router)
    stop, wake = asyncio.Event(), asyncio.Event()
    loop_task = asyncio.create_task(run(rec, wake, stop, tick=0.05))
    times = []
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(HEALTHZ_SAMPLES):
                t = time.perf_counter()
                async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                    await resp.read()
                times.append(time.perf_counter() - t)
    finally:
        stop.set()
        await loop_task
        await runner.cleanup()
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99) - 1], times[-1]


def main() -> None:
    logging.disable(logging.INFO)       # 100,000 "unplaceable"/"placed" events are not what is measured
    base = asyncio.run(healthz_under_passes(catalog("baseline")))
    print(f"{'catalog':12} {'records':>8} {'first pass':>11} {'steady pass':>12} "
          f"{'healthz p50':>12} {'p99':>9} {'max':>9}   p99 vs baseline")
    print(f"{'baseline':12} {'-':>8} {'':>11} {'':>12} {base[0] * 1e3:>10.2f}ms {base[1] * 1e3:>7.2f}ms "
          f"{base[2] * 1e3:>7.2f}ms")
    for kind in ("unplaceable", "gpu", "zero-gpu"):
        cat = catalog(kind)
        first, steady, records = passes(cat)
        p50, p99, worst = asyncio.run(healthz_under_passes(cat))
        print(f"{kind:12} {records:>8} {first * 1e3:>9.0f}ms {steady * 1e3:>10.0f}ms {p50 * 1e3:>10.2f}ms "
              f"{p99 * 1e3:>7.2f}ms {worst * 1e3:>7.2f}ms   {p99 / base[1]:.1f}x")


if __name__ == "__main__":
    main()
